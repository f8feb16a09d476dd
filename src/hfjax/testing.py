"""Tiny random Hugging Face checkpoints for tests, demos and bug reports.

Every factory here writes or returns exactly what a hub checkpoint holds, so code under
test loads it through the same path a real model takes:

    path = save_tiny_checkpoint("llama", tmp_path / "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)

A checkpoint directory holds config.json (with `architectures`), model.safetensors (or
shards plus model.safetensors.index.json), generation_config.json for generative models,
and tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja). The
tokenizer is a byte-level BPE trained in-process on a short embedded English text, so no
network access is needed. Models have 85k to 235k parameters: hidden size 64, 2 layers,
4 attention heads of size 16 (2 key/value heads where the family has GQA).

This module depends on torch, transformers and tokenizers only, not on the rest of hfjax.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import pathlib
from collections.abc import Mapping
from typing import Any, Literal

import tokenizers
import torch
import transformers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

__all__ = ["FAMILIES", "GENERATION_FAMILIES", "PIPELINE_KINDS", "SCHEDULERS", "save_tiny_pipeline", "tiny_config", "tiny_tokenizer", "save_tiny_checkpoint"]

Task = Literal["text-generation", "text-classification", "feature-extraction", "text2text-generation"]
Pooling = Literal["mean", "cls", "lasttoken"]
DType = Literal["float32", "bfloat16", "float16"]
_Kind = Literal["causal", "encoder", "seq2seq"]

_TASK_AUTO_CLASSES: dict[str, type] = {
    "text-generation": transformers.AutoModelForCausalLM,
    "text-classification": transformers.AutoModelForSequenceClassification,
    "feature-extraction": transformers.AutoModel,
    "text2text-generation": transformers.AutoModelForSeq2SeqLM,
}
_DEFAULT_TASK: dict[str, str] = {
    "causal": "text-generation",
    "encoder": "feature-extraction",
    "seq2seq": "text2text-generation",
}
_KIND_TASKS: dict[str, tuple[str, ...]] = {
    "causal": ("text-generation", "text-classification", "feature-extraction"),
    "encoder": ("text-classification", "feature-extraction"),
    "seq2seq": ("text2text-generation", "text-classification", "feature-extraction"),
}
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_POOLINGS: tuple[str, ...] = ("mean", "cls", "lasttoken")
_ID2LABEL = {0: "negative", 1: "positive"}

# ----------------------------------------------------------------------------- tokenizer

_VOCAB_SIZE = 512
_PAD, _BOS, _EOS, _UNK, _MASK = "<pad>", "<s>", "</s>", "<unk>", "<mask>"
_ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Trained first, so their ids are 0..7: pad=0, bos=1, eos=2, unk=3, mask=4.
_SPECIAL_TOKENS = (_PAD, _BOS, _EOS, _UNK, _MASK, *_ROLE_TOKENS)
_PAD_ID, _BOS_ID, _EOS_ID = 0, 1, 2
_MAX_POSITIONS = 256

_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown chat role ' ~ message['role'] ~ '; use system, user or assistant.') }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = """\
The river ran quietly past the old mill, and the children watched the water carry leaves
toward the sea. Every morning the baker opened her shop before the sun was up, and the
smell of fresh bread drifted along the narrow street. People stopped to talk about the
weather, the harvest, and the news from the city.

A small model learns the shape of language from many examples. It reads a sentence one
token at a time and tries to guess what comes next. When the guess is wrong, the weights
change a little, and the next guess is better. After a long time the model can write
simple stories, answer questions, and translate short phrases.

In the library there were books about mountains, oceans, stars and machines. The
librarian kept a list of every book that was borrowed and returned. Students came in the
afternoon to read, to write their reports, and to ask questions about history, science
and music. The clock on the wall struck four, then five, then six.

What is the capital of France? The capital of France is Paris. How many days are in a
week? There are seven days in a week. Which planet is the largest? Jupiter is the largest
planet in our solar system. Thank you for your help! You are welcome; I am happy to help.

She opened the window and listened to the birds. The garden was green after the rain,
and the roses were beginning to bloom. Her brother was reading a letter from their
grandmother, who lived far away in a house by the lake. They planned to visit her in the
summer, when the days are long and the evenings are warm.
"""


# transformers 5 loads a qwen2 checkpoint's tokenizer with Qwen2Tokenizer whatever
# tokenizer_config.json names, and that class rebuilds normalisation and pre-tokenisation
# itself (NFC, then this split pattern). Using the same steps for every family makes the
# saved tokenizer reload to the same ids under any model_type.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tokenizer.to_str()


def _post_processor(kind: _Kind | None, family: str | None) -> processors.PostProcessor:
    special = [(_BOS, _BOS_ID), (_EOS, _EOS_ID)]
    if kind == "seq2seq" and family == "t5":
        single, pair = f"$A {_EOS}", f"$A {_EOS} $B:1 {_EOS}:1"
    elif kind == "seq2seq":
        single, pair = f"{_BOS} $A {_EOS}", f"{_BOS} $A {_EOS} {_EOS} $B:1 {_EOS}:1"
    elif kind == "encoder":
        single, pair = f"{_BOS} $A {_EOS}", f"{_BOS} $A {_EOS} $B:1 {_EOS}:1"
    else:
        single, pair = f"{_BOS} $A", f"{_BOS} $A {_BOS}:1 $B:1"
    template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
    return processors.Sequence([processors.ByteLevel(trim_offsets=False), template])


def tiny_tokenizer(family: str | None = None) -> transformers.PreTrainedTokenizerFast:
    """Returns the tiny byte-level BPE tokenizer that every tiny checkpoint uses.

    The BPE is trained once per process on a short embedded English text (cached); each
    call wraps a fresh copy, so callers may change the result freely.

    Args:
        family: a name from `FAMILIES`, to add special tokens the way that family does
            (`<s> text` for causal LMs, `<s> text </s>` for encoders and BART,
            `text </s>` for T5). None gives the causal-LM flavour.

    Returns:
        A `PreTrainedTokenizerFast` with 512 tokens: `<pad>`=0, `<s>`=1 (bos, cls),
        `</s>`=2 (eos, sep), `<unk>`=3, `<mask>`=4, the chat role markers
        `<|system|>`, `<|user|>`, `<|assistant|>`, and a chat template.

    Example:
        >>> tok = tiny_tokenizer()
        >>> ids = tok("The river ran quietly.")["input_ids"]
        >>> tok.decode(ids, skip_special_tokens=True)
        'The river ran quietly.'
    """
    kind = _family(family).kind if family is not None else None
    backend = tokenizers.Tokenizer.from_str(_trained_tokenizer_json())
    backend.post_processor = _post_processor(kind, family)
    input_names = ["input_ids", "attention_mask"]
    if family == "bert":
        input_names.insert(1, "token_type_ids")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=_BOS,
        eos_token=_EOS,
        pad_token=_PAD,
        unk_token=_UNK,
        mask_token=_MASK,
        cls_token=_BOS,
        sep_token=_EOS,
        chat_template=_CHAT_TEMPLATE,
        model_max_length=_MAX_POSITIONS,
        model_input_names=input_names,
    )


# ----------------------------------------------------------------------------- families

_HIDDEN, _HEADS, _KV_HEADS, _HEAD_DIM, _INTERMEDIATE, _LAYERS = 64, 4, 2, 16, 128, 2
_SLIDING_WINDOW = 64
_TOKEN_IDS = {"pad_token_id": _PAD_ID, "bos_token_id": _BOS_ID, "eos_token_id": _EOS_ID}
_MHA = {
    "hidden_size": _HIDDEN,
    "intermediate_size": _INTERMEDIATE,
    "num_hidden_layers": _LAYERS,
    "num_attention_heads": _HEADS,
    "max_position_embeddings": _MAX_POSITIONS,
}
_GQA = {**_MHA, "num_key_value_heads": _KV_HEADS}
_GQA_HEAD_DIM = {**_GQA, "head_dim": _HEAD_DIM}
# GPT-2 and GPT-J name the same sizes differently.
_GPT2_NAMES = {
    "n_embd": _HIDDEN,
    "n_inner": _INTERMEDIATE,
    "n_layer": _LAYERS,
    "n_head": _HEADS,
    "n_positions": _MAX_POSITIONS,
}


@dataclasses.dataclass(frozen=True)
class _Family:
    kind: _Kind
    config: Mapping[str, Any]
    # GenerationConfig fields beyond the token ids (transformers 5 configs drop these).
    generation: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # False for families built by the generic shrinker: they may use any task that
    # transformers has a model class for, whatever their kind.
    curated: bool = True


# One entry per family: the keyword arguments, beyond token ids and vocab size, that make
# its transformers config tiny. Adding a family is adding a line here.
_REGISTRY: dict[str, _Family] = {
    "llama": _Family("causal", _GQA_HEAD_DIM),
    "mistral": _Family("causal", {**_GQA_HEAD_DIM, "sliding_window": _SLIDING_WINDOW}),
    "mixtral": _Family(
        "causal", {**_GQA_HEAD_DIM, "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2}
    ),
    "qwen2": _Family("causal", _GQA),
    "qwen3": _Family("causal", _GQA_HEAD_DIM),
    "qwen3_moe": _Family(
        "causal", {**_GQA_HEAD_DIM, "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2}
    ),
    "gemma": _Family("causal", _GQA_HEAD_DIM),
    # Gemma 2 alternates sliding and global layers; 2 layers give one of each.
    "gemma2": _Family(
        "causal", {**_GQA_HEAD_DIM, "query_pre_attn_scalar": _HEAD_DIM, "sliding_window": _SLIDING_WINDOW}
    ),
    # Gemma 3's default pattern has 5 sliding layers per global one; 2 layers would have
    # no global layer, so alternate them.
    "gemma3_text": _Family(
        "causal",
        {
            **_GQA_HEAD_DIM,
            "query_pre_attn_scalar": _HEAD_DIM,
            "sliding_window": _SLIDING_WINDOW,
            "sliding_window_pattern": 2,
        },
    ),
    "phi": _Family("causal", _GQA),
    "phi3": _Family("causal", {**_GQA, "original_max_position_embeddings": _MAX_POSITIONS}),
    "gpt2": _Family("causal", _GPT2_NAMES),
    "gpt_neox": _Family("causal", _MHA),
    "gptj": _Family("causal", {**_GPT2_NAMES, "rotary_dim": _HEAD_DIM // 2}),
    # Falcon-7B layout (multi-query attention, parallel attention and MLP), the default.
    "falcon": _Family(
        "causal",
        {
            "hidden_size": _HIDDEN,
            "ffn_hidden_size": _INTERMEDIATE,
            "num_hidden_layers": _LAYERS,
            "num_attention_heads": _HEADS,
            "max_position_embeddings": _MAX_POSITIONS,
        },
    ),
    "opt": _Family(
        "causal",
        {
            "hidden_size": _HIDDEN,
            "ffn_dim": _INTERMEDIATE,
            "word_embed_proj_dim": _HIDDEN,
            "num_hidden_layers": _LAYERS,
            "num_attention_heads": _HEADS,
            "max_position_embeddings": _MAX_POSITIONS,
        },
    ),
    "bloom": _Family("causal", {"hidden_size": _HIDDEN, "n_layer": _LAYERS, "n_head": _HEADS}),
    "olmo": _Family("causal", _GQA),
    # Multi-head latent attention (one key/value head per query head); layer 0 is dense
    # and layer 1 mixture-of-experts, with 4 routed experts in 2 groups and 1 shared.
    "deepseek_v3": _Family(
        "causal",
        {
            **_GQA,
            "num_key_value_heads": _HEADS,
            "q_lora_rank": 32,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": _HEAD_DIM,
            "moe_intermediate_size": 32,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
        },
    ),
    "mamba": _Family("causal", {"hidden_size": _HIDDEN, "state_size": 16, "num_hidden_layers": _LAYERS, "expand": 2}),
    # One recurrent block and one local-attention block.
    "recurrent_gemma": _Family(
        "causal",
        {
            "hidden_size": _HIDDEN,
            "intermediate_size": _INTERMEDIATE,
            "num_hidden_layers": _LAYERS,
            "num_attention_heads": _HEADS,
            "num_key_value_heads": _KV_HEADS,
            "lru_width": _HIDDEN,
            "attention_window_size": _SLIDING_WINDOW,
            "block_types": ["recurrent", "attention"],
        },
    ),
    "bert": _Family("encoder", _MHA),
    # RoBERTa numbers positions from pad_token_id + 1, so it needs extra position rows
    # to take 256 tokens (as roberta-base has 514 for 512).
    "roberta": _Family("encoder", {**_MHA, "max_position_embeddings": _MAX_POSITIONS + 2}),
    # Layer 0 global attention, layer 1 local (sliding) attention.
    "modernbert": _Family(
        "encoder", {**_MHA, "local_attention": _SLIDING_WINDOW, "cls_token_id": _BOS_ID, "sep_token_id": _EOS_ID}
    ),
    "t5": _Family(
        "seq2seq",
        {
            "d_model": _HIDDEN,
            "d_kv": _HEAD_DIM,
            "d_ff": _INTERMEDIATE,
            "num_layers": _LAYERS,
            "num_decoder_layers": _LAYERS,
            "num_heads": _HEADS,
            "decoder_start_token_id": _PAD_ID,
        },
    ),
    "bart": _Family(
        "seq2seq",
        {
            "d_model": _HIDDEN,
            "encoder_layers": _LAYERS,
            "decoder_layers": _LAYERS,
            "encoder_attention_heads": _HEADS,
            "decoder_attention_heads": _HEADS,
            "encoder_ffn_dim": _INTERMEDIATE,
            "decoder_ffn_dim": _INTERMEDIATE,
            "max_position_embeddings": _MAX_POSITIONS,
            "decoder_start_token_id": _EOS_ID,
            "forced_eos_token_id": _EOS_ID,
        },
        # As facebook/bart-large: decoding starts with eos, then bos is forced.
        generation={"forced_bos_token_id": _BOS_ID},
    ),
}

FAMILIES: tuple[str, ...] = tuple(_REGISTRY)
"""Model families with a hand-tuned tiny checkpoint, named by their transformers `model_type`.

Any other `model_type` with a causal-LM, seq2seq-LM or sequence-classification model class
also works: `tiny_config` then shrinks the config class's defaults by field name."""

GENERATION_FAMILIES: tuple[str, ...] = tuple(name for name, spec in _REGISTRY.items() if spec.kind != "encoder")
"""The families that generate text: causal LMs and encoder-decoders."""


# Generic shrinking: a config field with one of these names, where the model_type's config
# class has it, gets this value. Names are those the config stores, not attribute aliases.
_GENERIC_SIZES: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim"), _HIDDEN),
    **dict.fromkeys(
        ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers"),
        _LAYERS,
    ),
    **dict.fromkeys(
        ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads"),
        _HEADS,
    ),
    **dict.fromkeys(("head_dim", "d_kv"), _HEAD_DIM),
    **dict.fromkeys(
        ("intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim"), _INTERMEDIATE
    ),
    "vocab_size": _VOCAB_SIZE,
    **dict.fromkeys(("max_position_embeddings", "n_positions"), _MAX_POSITIONS),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), 4),
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
}


def _generic_overrides(defaults: Mapping[str, Any]) -> dict[str, Any]:
    # `defaults` is a config's to_dict(); nested configs (text_config, vision_config, ...)
    # are shrunk the same way and passed back as dicts carrying their model_type.
    overrides: dict[str, Any] = {key: value for key, value in _GENERIC_SIZES.items() if key in defaults}
    heads, kv_heads = defaults.get("num_attention_heads"), defaults.get("num_key_value_heads")
    if kv_heads is not None:
        # Keep multi-head attention where the default is MHA; otherwise 2 groups of 2.
        overrides["num_key_value_heads"] = _HEADS if kv_heads == heads else _KV_HEADS
    for key, value in defaults.items():
        if isinstance(value, dict) and "model_type" in value:
            overrides[key] = {"model_type": value["model_type"], **_generic_overrides(value)}
    if "text_config" in overrides:
        overrides["text_config"].update(_TOKEN_IDS)
    return overrides


def _text_model_types() -> dict[str, _Kind]:
    # model_type -> kind, for model types with a text head; seq2seq wins over causal
    # (bart has both), causal over classification-only encoders.
    from transformers.models.auto import modeling_auto

    kinds: dict[str, _Kind] = dict.fromkeys(modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, "encoder")
    kinds.update(dict.fromkeys(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "causal"))
    kinds.update(dict.fromkeys(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, "seq2seq"))
    return kinds


@functools.lru_cache(maxsize=None)
def _generic_family(model_type: str) -> _Family | None:
    kind = _text_model_types().get(model_type)
    if kind is None or model_type not in transformers.CONFIG_MAPPING:
        return None
    defaults = transformers.CONFIG_MAPPING[model_type]().to_dict()
    return _Family(kind, _generic_overrides(defaults), curated=False)


def _family(family: str) -> _Family:
    if family in _REGISTRY:
        return _REGISTRY[family]
    generic = _generic_family(family) if isinstance(family, str) else None
    if generic is not None:
        return generic
    if isinstance(family, str) and family in transformers.CONFIG_MAPPING:
        raise ValueError(
            f"Unknown model family {family!r}: it is a transformers model_type, but has no text-generation, "
            "text2text-generation or text-classification model class, so it has no tiny text checkpoint."
        )
    close = difflib.get_close_matches(str(family), FAMILIES, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"Unknown model family {family!r}.{hint} Use a transformers model_type; hand-tuned families: "
        f"{', '.join(FAMILIES)}."
    )


def _auto_class_name(auto_class: type, config: transformers.PretrainedConfig) -> str | None:
    mapping = auto_class._model_mapping
    return mapping[type(config)].__name__ if type(config) in mapping else None


def tiny_config(family: str, **overrides: Any) -> transformers.PretrainedConfig:
    """Builds a tiny transformers config for a model family.

    Sizes: hidden 64, 2 layers, 4 attention heads of dimension 16, 2 key/value heads where
    the family has grouped-query attention, MLP width 128, 256 positions, and the tiny
    tokenizer's 512-token vocabulary with pad=0, bos=1, eos=2. Word-embedding tying and
    everything else keep the family's defaults. `architectures` names the class for the
    family's default task (causal LM, encoder model, or seq2seq LM).

    Args:
        family: a transformers `model_type`. Names in `FAMILIES` use hand-tuned sizes;
            any other model_type with a text head starts from its config class's defaults
            with the usual size fields (hidden size, layers, heads, MLP width, experts,
            vocabulary, positions, and those of nested configs) set to the sizes above.
        **overrides: config fields to set instead of the tiny defaults, for example
            `num_hidden_layers=4` or `tie_word_embeddings=False`.

    Returns:
        The config, of the family's config class.

    Raises:
        ValueError: if `family` is not a transformers model_type with a causal-LM,
            seq2seq-LM or sequence-classification model class.

    Example:
        >>> config = tiny_config("llama", num_hidden_layers=3)
        >>> config.hidden_size, config.num_hidden_layers, config.architectures
        (64, 3, ['LlamaForCausalLM'])
    """
    spec = _family(family)
    # A deep copy, as config classes may change nested dicts and lists they are given.
    kwargs = {"vocab_size": _VOCAB_SIZE, **_TOKEN_IDS, **copy.deepcopy(dict(spec.config)), **overrides}
    config = transformers.AutoConfig.for_model(family, **kwargs)
    if "architectures" not in overrides:
        name = _auto_class_name(_TASK_AUTO_CLASSES[_DEFAULT_TASK[spec.kind]], config)
        config.architectures = [name]
    return config


# ----------------------------------------------------------------------------- checkpoints


def _tasks_for(family: str, config: transformers.PretrainedConfig) -> list[str]:
    # Tasks that fit the family's kind and for which transformers has a model class.
    spec = _family(family)
    kind_tasks = _KIND_TASKS[spec.kind] if spec.curated else tuple(_TASK_AUTO_CLASSES)
    return [task for task in kind_tasks if _auto_class_name(_TASK_AUTO_CLASSES[task], config) is not None]


@torch.no_grad()
def _perturb_constant_parameters(model: torch.nn.Module, std: float) -> None:
    # Families initialise biases to 0 and norm scales (and Mamba's D) to 0 or 1. Adding
    # N(0, std) noise to every such constant tensor lets each parameter change the logits,
    # so a parity test fails if a bias is dropped or a norm offset is mishandled. Tensors
    # the family initialised randomly (including special ones like Mamba's A_log) are kept.
    for param in model.parameters():
        if param.is_floating_point() and param.numel() > 1 and bool((param == param.flatten()[0]).all()):
            param.add_(torch.randn_like(param) * std)


def _write_sentence_transformers_files(path: pathlib.Path, hidden_size: int, pooling: str) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    pooling_config = {
        "word_embedding_dimension": hidden_size,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": pooling == "lasttoken",
        "include_prompt": True,
    }
    st_config = {"prompts": {}, "default_prompt_name": None, "similarity_fn_name": "cosine"}
    bert_config = {"max_seq_length": _MAX_POSITIONS, "do_lower_case": False}
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "2_Normalize").mkdir(exist_ok=True)
    for name, content in [
        ("modules.json", modules),
        ("1_Pooling/config.json", pooling_config),
        ("config_sentence_transformers.json", st_config),
        ("sentence_bert_config.json", bert_config),
    ]:
        (path / name).write_text(json.dumps(content, indent=2) + "\n")


def save_tiny_checkpoint(
    family: str,
    path: str | pathlib.Path,
    *,
    task: Task | None = None,
    seed: int = 0,
    dtype: DType = "float32",
    max_shard_size: str | None = None,
    sentence_transformers: bool = False,
    pooling: Pooling | None = None,
    **config_overrides: Any,
) -> pathlib.Path:
    """Writes a tiny random checkpoint of a model family, as `save_pretrained` lays it out.

    The model is built from `tiny_config(family, **config_overrides)` under
    `torch.manual_seed(seed)`, so equal calls write equal weights. Parameters that the
    family initialises to a constant (biases, norm scales) get N(0, 0.02) noise added.

    Args:
        family: a transformers `model_type`, as for `tiny_config`.
        path: directory to write; created if missing, files in it are overwritten.
        task: a transformers pipeline name choosing the head: "text-generation"
            (AutoModelForCausalLM, default for causal families), "text-classification"
            (AutoModelForSequenceClassification, labels 0 "negative", 1 "positive"),
            "feature-extraction" (AutoModel, default for encoders) or
            "text2text-generation" (AutoModelForSeq2SeqLM, default for t5 and bart).
        seed: torch seed for the random weights.
        dtype: "float32", "bfloat16" or "float16", for the saved weights and config.
        max_shard_size: e.g. "200KB" to write sharded safetensors with
            model.safetensors.index.json; None writes a single model.safetensors.
        sentence_transformers: also write modules.json, 1_Pooling/config.json, a
            2_Normalize module and sentence_bert_config.json, as sentence-transformers
            saves a model. Needs task "feature-extraction" (the default then).
        pooling: "mean" (the default), "cls" or "lasttoken"; only with
            `sentence_transformers=True`.
        **config_overrides: passed to `tiny_config`.

    Returns:
        `path` as a `pathlib.Path`.

    Raises:
        ValueError: for an unknown family, a task the family has no head for, or a
            dtype, pooling or vocab_size that cannot work.

    Example:
        >>> import tempfile
        >>> path = save_tiny_checkpoint("qwen3", tempfile.mkdtemp())
        >>> model = transformers.AutoModelForCausalLM.from_pretrained(path)
        >>> tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        >>> prompt = tokenizer("The river ran", return_tensors="pt")
        >>> out = model.generate(**prompt, max_new_tokens=5, do_sample=False)  # [1, prompt + 5]
        >>> out.shape[1] - prompt["input_ids"].shape[1]
        5
    """
    spec = _family(family)
    if sentence_transformers and task is None:
        task = "feature-extraction"
    task = task or _DEFAULT_TASK[spec.kind]
    if task not in _TASK_AUTO_CLASSES:
        raise ValueError(f"Unknown task {task!r}. Use one of: {', '.join(_TASK_AUTO_CLASSES)}.")
    if dtype not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}. Use one of: {', '.join(_DTYPES)}.")
    if sentence_transformers and task != "feature-extraction":
        raise ValueError(
            f"sentence_transformers=True needs task='feature-extraction'. Got: task={task!r}. "
            "Leave task unset or pass task='feature-extraction'."
        )
    if pooling is not None and not sentence_transformers:
        raise ValueError(f"pooling={pooling!r} only applies with sentence_transformers=True.")
    pooling = pooling or "mean"
    if pooling not in _POOLINGS:
        raise ValueError(f"Unknown pooling {pooling!r}. Use one of: {', '.join(_POOLINGS)}.")

    if task == "text-classification" and not {"num_labels", "id2label", "label2id"} & config_overrides.keys():
        config_overrides = {"id2label": _ID2LABEL, "label2id": {v: k for k, v in _ID2LABEL.items()}, **config_overrides}
    config = tiny_config(family, **config_overrides)
    if config.vocab_size < _VOCAB_SIZE:
        raise ValueError(
            f"vocab_size should be >= the tiny tokenizer's {_VOCAB_SIZE} tokens. Got: vocab_size={config.vocab_size}."
        )
    tasks = _tasks_for(family, config)
    if task not in tasks:
        raise ValueError(
            f"task={task!r} is not available for family {family!r}. Tasks for {family!r}: {', '.join(tasks)}."
        )

    with torch.random.fork_rng(devices=[]):  # leaves the caller's torch RNG state alone
        torch.manual_seed(seed)
        model = _TASK_AUTO_CLASSES[task].from_config(config)
        _perturb_constant_parameters(model, std=0.02)
    model = model.to(_DTYPES[dtype]).eval()
    if model.can_generate():
        # pad, bos, eos and decoder start ids come from the config.
        model.generation_config = transformers.GenerationConfig.from_model_config(model.config)
        model.generation_config.update(**spec.generation)

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shard_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **shard_kwargs)
    tiny_tokenizer(family).save_pretrained(path)
    if sentence_transformers:
        _write_sentence_transformers_files(path, model.config.get_text_config().hidden_size, pooling)
    return path


from ._tiny_pipelines import PIPELINE_KINDS, SCHEDULERS, save_tiny_pipeline  # noqa: E402  (it builds on this module)
