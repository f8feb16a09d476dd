"""Tiny random Hugging Face checkpoints, written as `save_pretrained` lays them out."""

from __future__ import annotations

import json
import pathlib
from typing import Any, Literal

import torch
import transformers
from transformers.models.auto import modeling_auto

from .. import _dtypes, _tasks
from . import _media, _tokenizer
from ._families import (
    DEFAULT_TASK,
    KIND_TASKS,
    auto_class_name,
    family_spec,
    tiny_config,
)
from ._tokenizer import MAX_POSITIONS, VOCAB_SIZE
from ._weights import perturb_constant_parameters

Task = _tasks.Task
Pooling = Literal["mean", "cls", "lasttoken"]
DType = Literal["float32", "bfloat16", "float16"]

_POOLINGS: tuple[str, ...] = ("mean", "cls", "lasttoken")
_ID2LABEL = {0: "negative", 1: "positive"}


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
    kind = family_spec(family).kind if family is not None else None
    return _tokenizer.build(kind, family)


# ----------------------------------------------------------------------------- checkpoints


def _tasks_for(family: str, config: transformers.PretrainedConfig) -> list[str]:
    # Tasks that fit the family's kind and for which transformers has a model class.
    spec = family_spec(family)
    kind_tasks = KIND_TASKS[spec.kind] if spec.curated else _tasks.TASKS
    return [task for task in kind_tasks if auto_class_name(_tasks.auto_class(task), config) is not None]


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
    bert_config = {"max_seq_length": MAX_POSITIONS, "do_lower_case": False}
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
        task: a transformers pipeline name choosing the head: "image-text-to-text" (a
            vision-language model of `VISION_LANGUAGE_FAMILIES` and its processor), "text-generation"
            (AutoModelForCausalLM, default for causal families; an encoder's,
            bert's or roberta's, is built with is_decoder=True), "text-classification"
            (AutoModelForSequenceClassification, labels 0 "negative", 1 "positive"),
            "feature-extraction" (AutoModel, default for encoders) or
            "text2text-generation" (AutoModelForSeq2SeqLM, default for t5 and bart).
            A vision or speech task ("image-classification", "zero-shot-image-classification",
            "image-feature-extraction", "automatic-speech-recognition") takes any model_type
            with a model class for it: `MEDIA_FAMILIES` are hand-tuned, with their processors;
            others are shrunk from their config class's defaults (64x64 images, 2 layers),
            with `**config_overrides` applied last, and have no processor.
        seed: torch seed for the random weights.
        dtype: "float32", "bfloat16" or "float16", for the saved weights and config.
        max_shard_size: e.g. "200KB" to write sharded safetensors with
            model.safetensors.index.json; None writes a single model.safetensors.
        sentence_transformers: also write modules.json, 1_Pooling/config.json, a
            2_Normalize module and sentence_bert_config.json, as sentence-transformers
            saves a model. Needs task "feature-extraction" (the default then).
        pooling: "mean" (the default), "cls" or "lasttoken"; only with
            `sentence_transformers=True`.
        **config_overrides: passed to `tiny_config`; for `MEDIA_FAMILIES` and `VISION_LANGUAGE_FAMILIES`,
            set on their hand-tuned config (a dict for a vision-language sub-config updates its fields).

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
    # -- vision and speech families (hfjax.pipeline's tasks) --
    if family in _media.MEDIA_FAMILIES and (task is None or task in _media.MEDIA_FAMILIES[family].tasks):
        return _media.save_media_checkpoint(family, pathlib.Path(path), task=task, seed=seed, **config_overrides)
    if task in _media.MEDIA_TASKS:
        return _media.save_generic_media_checkpoint(
            family, pathlib.Path(path), task=task, seed=seed, **config_overrides
        )
    # -- vision-language families (image-text-to-text) --
    if task == "image-text-to-text":
        from ._vision_language import VISION_LANGUAGE_FAMILIES, save_tiny_vision_language_checkpoint

        if family in VISION_LANGUAGE_FAMILIES:
            return save_tiny_vision_language_checkpoint(family, path, seed=seed, **config_overrides)
        # any other model_type: its config shrunk by field name, no processor (the coverage sweep)
        return _media.save_generic_media_checkpoint(
            family, pathlib.Path(path), task=task, seed=seed, **config_overrides
        )
    spec = family_spec(family)
    if sentence_transformers and task is None:
        task = "feature-extraction"
    task = task or DEFAULT_TASK[spec.kind]
    if task not in _tasks.TASKS:
        raise ValueError(f"Unknown task {task!r}. Use one of: {', '.join(_tasks.TASKS)}.")
    if dtype not in _dtypes.NAMES:
        raise ValueError(f"Unknown dtype {dtype!r}. Use one of: {', '.join(_dtypes.NAMES)}.")
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
    # The causal LM of a bidirectional encoder (one with a masked-LM head: BertLMHeadModel,
    # ReformerModelWithLMHead) masks future tokens only when built as a decoder, as a user builds one.
    encoder = spec.kind != "seq2seq" and family in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    if task == "text-generation" and encoder and "is_decoder" not in config_overrides:
        config_overrides = {"is_decoder": True, **config_overrides}
    config = tiny_config(family, **config_overrides)
    if config.vocab_size < VOCAB_SIZE:
        raise ValueError(
            f"vocab_size should be >= the tiny tokenizer's {VOCAB_SIZE} tokens. Got: vocab_size={config.vocab_size}."
        )
    tasks = _tasks_for(family, config)
    if task not in tasks:
        raise ValueError(
            f"task={task!r} is not available for family {family!r}. Tasks for {family!r}: {', '.join(tasks)}."
        )

    with torch.random.fork_rng(devices=[]):  # leaves the caller's torch RNG state alone
        torch.manual_seed(seed)
        model = _tasks.auto_class(task).from_config(config)
        perturb_constant_parameters(model, std=0.02)
    model = model.to(_dtypes.torch_dtype(dtype)).eval()
    if model.can_generate():
        # pad, bos, eos and decoder start ids come from the config.
        model.generation_config = transformers.GenerationConfig.from_model_config(model.config)
        model.generation_config.update(**spec.generation)

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shard_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **shard_kwargs)
    if type(model.config) is not type(config):
        # A causal LM that transformers builds on a composite config's text part (Emu3, Mllama) is
        # released with the composite config.json, the only one AutoModelForCausalLM loads it from.
        config.architectures = [type(model).__name__]
        config.save_pretrained(path)
    tiny_tokenizer(family).save_pretrained(path)
    if sentence_transformers:
        _write_sentence_transformers_files(path, model.config.get_text_config().hidden_size, pooling)
    return path
