"""Tests for hfjax.testing: every tiny checkpoint loads and runs in PyTorch transformers."""

from __future__ import annotations

import doctest
import importlib
import json

import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

from hfjax.tasks import _check
from hfjax.testing import FAMILIES, _families, _media, save_tiny_checkpoint, tiny_config, tiny_tokenizer

PROMPT = "The capital of France is"
# Exercises byte fallback, digits, contractions, repeated spaces and newlines.
TRICKY_TEXT = "Hello,  wörld! It's 2024.\n\nnaïve café — 你好 (don't)\ttab"

_AUTO_CLASS = {
    "text-generation": transformers.AutoModelForCausalLM,
    "text-classification": transformers.AutoModelForSequenceClassification,
    "feature-extraction": transformers.AutoModel,
    "text2text-generation": transformers.AutoModelForSeq2SeqLM,
}


def _kind(family: str) -> str:
    return _families.REGISTRY[family].kind


def _default_task(family: str) -> str:
    defaults = {"causal": "text-generation", "encoder": "feature-extraction", "seq2seq": "text2text-generation"}
    return defaults[_kind(family)]


def _forward(model, inputs: dict, config) -> torch.Tensor:
    with torch.no_grad():
        if config.is_encoder_decoder:
            start = config.decoder_start_token_id
            decoder_input_ids = torch.tensor([[start, 300, 301, 302]])  # [1, 4]
            return model(**inputs, decoder_input_ids=decoder_input_ids).logits
        output = model(**inputs)
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


@pytest.mark.parametrize("family", FAMILIES)
def test_default_checkpoint_loads_runs_and_generates(family, tmp_path):
    path = save_tiny_checkpoint(family, tmp_path / family)
    task = _default_task(family)

    config = json.loads((path / "config.json").read_text())
    model = _AUTO_CLASS[task].from_pretrained(path).eval()
    assert config["architectures"] == [type(model).__name__]
    assert (path / "model.safetensors").is_file()
    assert (path / "generation_config.json").is_file() == (task != "feature-extraction")

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size >= len(tokenizer) == len(tiny_tokenizer())
    assert tokenizer.pad_token_id == model.config.pad_token_id
    assert tokenizer.eos_token_id == model.config.eos_token_id

    inputs = tokenizer(PROMPT, return_tensors="pt")
    out = _forward(model, inputs, model.config)  # [1, S, vocab] or [1, S, hidden]
    assert torch.isfinite(out).all()
    assert (out.std(dim=-1) > 1e-3).all(), "outputs are constant across the last axis"
    assert not torch.allclose(out[0, 0], out[0, -1]), "outputs do not depend on the token"

    if task != "feature-extraction":  # an encoder has no generate
        generated = model.generate(**inputs, max_new_tokens=5, do_sample=False)  # [1, prompt + new]
        offset = 1 if model.config.is_encoder_decoder else inputs["input_ids"].shape[1]
        new_tokens = generated[0, offset:]
        assert 1 <= len(new_tokens) <= 5
        if not model.config.is_encoder_decoder:
            assert new_tokens[0] == out[0, -1].argmax()


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_tokenizer_reloads_to_the_same_ids(family, tmp_path):
    reference = tiny_tokenizer(family)
    reference.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(tiny_config(family).to_json_string())

    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)

    assert len(reloaded) == len(reference)
    ids = reloaded(TRICKY_TEXT)["input_ids"]
    assert ids == reference(TRICKY_TEXT)["input_ids"]
    assert reloaded.decode(ids, skip_special_tokens=True) == TRICKY_TEXT


def test_tokenizer_chat_template_renders_roles_and_generation_prompt(tmp_path):
    tiny_tokenizer().save_pretrained(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]

    with_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)

    assert without_prompt == (
        "<s><|system|>\nBe brief.</s>\n<|user|>\nWhat is the capital of France?</s>\n"
        "<|assistant|>\nParis.</s>\n<|user|>\nAnd of Italy?</s>\n"
    )
    assert with_prompt == without_prompt + "<|assistant|>\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.convert_tokens_to_ids("<|assistant|>") == ids[-2]
    with pytest.raises(Exception, match="Unknown chat role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_tiny_tokenizer_returns_independent_copies():
    first = tiny_tokenizer()
    first.add_tokens(["<extra>"])
    assert len(tiny_tokenizer()) == len(first) - 1


def test_sharded_checkpoint_has_index_and_identical_weights(tmp_path):
    single = save_tiny_checkpoint("llama", tmp_path / "single", seed=3)
    sharded = save_tiny_checkpoint("llama", tmp_path / "sharded", seed=3, max_shard_size="100KB")

    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 1
    assert not (sharded / "model.safetensors").exists()

    expected = safetensors.torch.load_file(single / "model.safetensors")
    got = {}
    for name in shard_files:
        got.update(safetensors.torch.load_file(sharded / name))
    assert got.keys() == expected.keys() == index["weight_map"].keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(sharded)
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)


def test_seed_controls_weights_and_caller_rng_is_untouched(tmp_path):
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    first = safetensors.torch.load_file(save_tiny_checkpoint("gpt2", tmp_path / "a", seed=0) / "model.safetensors")
    torch.testing.assert_close(torch.rand(3), expected_draw, rtol=0, atol=0)
    again = safetensors.torch.load_file(save_tiny_checkpoint("gpt2", tmp_path / "b", seed=0) / "model.safetensors")
    other = safetensors.torch.load_file(save_tiny_checkpoint("gpt2", tmp_path / "c", seed=1) / "model.safetensors")

    for name, tensor in first.items():
        torch.testing.assert_close(again[name], tensor, rtol=0, atol=0)
    assert not torch.equal(other["transformer.wte.weight"], first["transformer.wte.weight"])


def test_constant_initialised_parameters_are_perturbed(tmp_path):
    weights = safetensors.torch.load_file(save_tiny_checkpoint("bert", tmp_path) / "model.safetensors")

    for name, tensor in weights.items():
        if tensor.is_floating_point() and tensor.numel() > 1:
            assert tensor.std() > 0, f"{name} is constant"


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "roberta", "modernbert", "bart"])
def test_text_classification_checkpoint(family, tmp_path):
    path = save_tiny_checkpoint(family, tmp_path, task="text-classification")

    model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    inputs = tokenizer([PROMPT, "Paris."], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**inputs).logits  # [2, 2]

    assert model.config.id2label == {0: "negative", 1: "positive"}
    assert logits.shape == (2, 2)
    assert torch.isfinite(logits).all()
    assert not torch.allclose(logits[0], logits[1])


def test_bfloat16_checkpoint(tmp_path):
    path = save_tiny_checkpoint("qwen3", tmp_path, dtype="bfloat16")

    weights = safetensors.torch.load_file(path / "model.safetensors")
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize(
    ("family", "pooling", "model_class"),
    [("bert", "mean", "BertModel"), ("modernbert", "cls", "ModernBertModel"), ("qwen3", "lasttoken", "Qwen3Model")],
)
def test_sentence_transformers_layout(family, pooling, model_class, tmp_path):
    path = save_tiny_checkpoint(family, tmp_path, sentence_transformers=True, pooling=pooling)

    modules = json.loads((path / "modules.json").read_text())
    assert [(m["path"], m["type"].rsplit(".", 1)[1]) for m in modules] == [
        ("", "Transformer"),
        ("1_Pooling", "Pooling"),
        ("2_Normalize", "Normalize"),
    ]
    assert (path / "2_Normalize").is_dir()
    pooling_config = json.loads((path / "1_Pooling" / "config.json").read_text())
    assert pooling_config["word_embedding_dimension"] == tiny_config(family).hidden_size
    enabled = [key for key, value in pooling_config.items() if key.startswith("pooling_mode_") and value]
    expected_mode = {"mean": "mean_tokens", "cls": "cls_token", "lasttoken": "lasttoken"}[pooling]
    assert enabled == [f"pooling_mode_{expected_mode}"]
    assert json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"] == 256
    assert type(transformers.AutoModel.from_pretrained(path)).__name__ == model_class


def test_unknown_family_error_names_value_and_lists_families():
    with pytest.raises(ValueError, match=r"Unknown model family 'llamma'\. Did you mean 'llama'\?") as info:
        tiny_config("llamma")
    assert all(family in str(info.value) for family in FAMILIES)
    with pytest.raises(ValueError, match="Unknown model family 'detr'"):
        save_tiny_checkpoint("detr", "unused")


def test_generic_family_shrinks_config_defaults(tmp_path):
    assert "olmo2" not in FAMILIES
    config = tiny_config("olmo2")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (64, 2, 4)
    assert (config.intermediate_size, config.vocab_size, config.max_position_embeddings) == (128, 512, 256)
    assert config.architectures == ["Olmo2ForCausalLM"]
    assert tiny_config("olmo2", num_hidden_layers=3).num_hidden_layers == 3

    path = save_tiny_checkpoint("olmo2", tmp_path, task="text-classification")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        logits = model(**tokenizer([PROMPT], return_tensors="pt")).logits  # [1, 2]
    assert logits.shape == (1, 2)
    assert sum(p.numel() for p in model.parameters()) < 300_000


def test_generic_family_shrinks_nested_text_config():
    text_config = tiny_config("gemma3").get_text_config()
    assert (text_config.hidden_size, text_config.num_hidden_layers, text_config.vocab_size) == (64, 2, 512)


def test_model_type_without_text_head_or_unknown_raises():
    with pytest.raises(ValueError, match=r"'vit': it is a transformers model_type, but has no text-generation"):
        tiny_config("vit")
    with pytest.raises(ValueError, match=r"Unknown model family 'not_a_model'\. Use a transformers model_type"):
        tiny_config("not_a_model")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"family": "mamba", "task": "text-classification"}, r"Tasks for 'mamba': text-generation, feature-extraction"),
        (
            {"family": "modernbert", "task": "text-generation"},
            r"task='text-generation' is not available for family 'modernbert'\. "
            r"Tasks for 'modernbert': text-classification, feature-extraction\.",
        ),
        ({"family": "llama", "task": "summarize"}, r"Unknown task 'summarize'"),
        ({"family": "llama", "dtype": "fp8"}, r"Unknown dtype 'fp8'"),
        ({"family": "bert", "pooling": "cls"}, r"only applies with sentence_transformers=True"),
        ({"family": "bert", "sentence_transformers": True, "pooling": "max"}, r"Unknown pooling 'max'"),
        (
            {"family": "bert", "sentence_transformers": True, "task": "text-classification"},
            r"needs task='feature-extraction'",
        ),
        ({"family": "llama", "vocab_size": 100}, r"vocab_size should be >= .* Got: vocab_size=100"),
    ],
)
def test_invalid_arguments_raise(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        save_tiny_checkpoint(path=tmp_path, **kwargs)


def test_tiny_config_overrides_and_layer_types():
    assert tiny_config("llama", num_hidden_layers=3).num_hidden_layers == 3
    assert tiny_config("gemma2").layer_types == ["sliding_attention", "full_attention"]
    assert tiny_config("gemma3_text").layer_types == ["sliding_attention", "full_attention"]
    assert tiny_config("gemma3_text", num_hidden_layers=4).layer_types == ["sliding_attention", "full_attention"] * 2
    assert tiny_config("bert").architectures == ["BertModel"]
    assert tiny_config("t5").architectures == ["T5ForConditionalGeneration"]


@pytest.mark.parametrize("module", ["_checkpoints", "_families"])
def test_docstring_examples_run(module, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    result = doctest.testmod(importlib.import_module(f"hfjax.testing.{module}"), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0


def test_generic_vision_checkpoint_runs_in_pytorch_on_check_inputs(tmp_path):
    # Swin: per-stage head lists, a base embed_dim and a window that must fit the last stage.
    path = save_tiny_checkpoint("swin", tmp_path, task="image-classification")
    model = transformers.AutoModelForImageClassification.from_pretrained(path).eval()
    assert (model.config.image_size, model.config.embed_dim, model.config.window_size) == (64, 12, 2)
    inputs = _check._inputs(
        model.config, "image-classification", batch=2, seq_len=8, seed=0, main_input_name="pixel_values"
    )
    assert inputs["pixel_values"].shape == (2, 3, 64, 64)
    with torch.no_grad():
        assert model(pixel_values=torch.from_numpy(inputs["pixel_values"])).logits.shape == (2, 3)
    assert sum(p.numel() for p in model.parameters()) < 500_000


@pytest.mark.parametrize(
    ("model_type", "name", "shape"),
    [
        ("whisper", "input_features", (2, 80, 64)),  # [B, mels, 2 * max_source_positions]
        ("speech_to_text", "input_features", (2, 32, 80)),  # [B, frames, input_feat_per_channel]
        ("wav2vec2", "input_values", (2, 5200)),  # 16 frames of a 400-sample window, hop 320
    ],
)
def test_check_builds_speech_inputs_from_the_config(model_type, name, shape):
    overrides = _families._generic_overrides(transformers.CONFIG_MAPPING[model_type]().to_dict())
    config = transformers.AutoConfig.for_model(model_type, **overrides)
    inputs = _check._inputs(config, "automatic-speech-recognition", batch=2, seq_len=8, seed=0, main_input_name=name)
    assert inputs[name].shape == shape
    assert ("decoder_input_ids" in inputs) == config.is_encoder_decoder


def test_check_gives_audio_language_models_a_text_forward_without_audio_tokens():
    config = transformers.CONFIG_MAPPING["voxtral"](text_config={"vocab_size": 64}, audio_token_id=7)
    inputs = _check._inputs(
        config, "automatic-speech-recognition", batch=4, seq_len=32, seed=0, main_input_name="input_ids"
    )
    assert set(inputs) == {"input_ids", "attention_mask", "use_cache"}
    assert inputs["input_ids"].max() < 64 and not (inputs["input_ids"] == 7).any()


def _image_text_config(model_type):
    # The generic shrinker's config (with its fixes) and the image-text-to-text class's main input.
    config = _media.generic_media_config(model_type, task="image-text-to-text")
    names = transformers.models.auto.modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    return config, getattr(transformers, names[model_type]).main_input_name


@pytest.mark.parametrize(
    ("model_type", "shapes"),
    [
        # LLaVA-style models take pixels as an option: a text forward, as before.
        ("llava", {"input_ids": (2, 8), "attention_mask": (2, 8)}),
        # 8 query tokens (image token 511) before the text; the Q-Former's instruction
        ("instructblip", {"pixel_values": (2, 3, 64, 64), "input_ids": (2, 16), "qformer_input_ids": (2, 8)}),
        ("kosmos-2", {"pixel_values": (2, 3, 64, 64), "input_ids": (2, 24), "image_embeds_position_mask": (2, 24)}),
        ("idefics", {"pixel_values": (2, 1, 3, 64, 64), "image_attention_mask": (2, 8, 1)}),
        ("pix2struct", {"flattened_patches": (2, 16, 770), "attention_mask": (2, 16), "decoder_input_ids": (2, 8)}),
        ("vision-encoder-decoder", {"pixel_values": (2, 3, 64, 64), "decoder_input_ids": (2, 8)}),
        ("udop", {"input_ids": (2, 8), "bbox": (2, 8, 4), "decoder_input_ids": (2, 4)}),
        ("pi0", {"state": (2, 32), "noise": (2, 50, 32), "pixel_values": (2, 1, 3, 64, 64), "input_ids": (2, 72)}),
    ],
)
def test_check_gives_image_text_models_what_their_forward_requires(model_type, shapes):
    config, name = _image_text_config(model_type)
    inputs = _check._inputs(config, "image-text-to-text", batch=2, seq_len=8, seed=0, main_input_name=name)
    arrays = {key: value.shape for key, value in inputs.items() if hasattr(value, "shape")}
    assert arrays == {**arrays, **shapes}
    if model_type == "llava":
        assert set(inputs) == {"input_ids", "attention_mask", "use_cache"}
    if model_type == "instructblip":
        assert (inputs["input_ids"][:, :8] == 511).all() and not (inputs["input_ids"][:, 8:] == 511).any()
    if model_type in ("pix2struct", "vision-encoder-decoder"):
        assert "input_ids" not in inputs  # the encoder reads the image, the decoder the text


@pytest.mark.parametrize("model_type", ["instructblipvideo", "pi0"])
def test_image_text_checkpoint_runs_in_pytorch_on_check_inputs(model_type, tmp_path):
    path = save_tiny_checkpoint(model_type, tmp_path, task="image-text-to-text")
    model = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    inputs = _check._inputs(
        model.config, "image-text-to-text", batch=2, seq_len=8, seed=0, main_input_name=model.main_input_name
    )
    with torch.no_grad():
        logits = model(**{k: torch.from_numpy(v) if hasattr(v, "shape") else v for k, v in inputs.items()}).logits
    assert logits.shape == ((2, 50, 32) if model_type == "pi0" else (2, 4 * 8 + 8, 512))


@pytest.mark.parametrize(
    ("model_type", "what"),
    [
        ("youtu", "MLA: rotary and non-rotary query/key widths, values and ranks sized with the 16-wide heads"),
        ("qwen3_next", "a 2-layer hybrid gets one linear-attention and one attention layer"),
        ("jamba", "a _GENERIC_FIXES entry: attention in the second of 2 layers"),
    ],
)
def test_generic_shrinker_configs_run_in_pytorch(model_type, what):
    config = tiny_config(model_type)
    if model_type == "qwen3_next":
        assert config.layer_types == ["linear_attention", "full_attention"], what
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert model(ids, use_cache=True).logits.shape == (2, 8, config.vocab_size), what


def test_media_and_vision_language_checkpoints_take_config_overrides(tmp_path):
    # Whisper: a 2 s window (max_source_positions 100), which its feature extractor then produces.
    path = save_tiny_checkpoint("whisper", tmp_path / "whisper", d_model=96, max_source_positions=100)
    model = transformers.WhisperForConditionalGeneration.from_pretrained(path).eval()
    extractor = transformers.AutoFeatureExtractor.from_pretrained(path)
    features = extractor(np.zeros(8000, np.float32), sampling_rate=16000, return_tensors="pt")["input_features"]
    assert (model.config.d_model, features.shape) == (96, (1, 80, 200))
    with torch.no_grad():
        assert model.get_encoder()(features).last_hidden_state.shape == (1, 100, 96)
    with pytest.raises(ValueError, match="max_source_positions=75"):
        save_tiny_checkpoint("whisper", tmp_path / "odd", max_source_positions=75)
    # LLaVA: a text_config dict updates the tiny text model's fields, keeping its token ids.
    path = save_tiny_checkpoint(
        "llava", tmp_path / "llava", task="image-text-to-text", text_config={"hidden_size": 96, "vocab_size": 1000}
    )
    text = transformers.AutoConfig.from_pretrained(path).text_config
    assert (text.hidden_size, text.vocab_size, text.num_hidden_layers, text.eos_token_id) == (96, 1000, 2, 2)
