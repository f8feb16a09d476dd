"""Tiny vision and speech checkpoints (ViT, CLIP, SigLIP, wav2vec2, Whisper), processors included, for
`hfjax.pipeline`'s tasks. Sizes follow the text families: hidden 64, 2 layers, 4 heads, MLP 128;
images are 32x32 in 8x8 patches; audio is 16 kHz. Whisper hears 1 s windows (its feature extractor's
chunk_length; real checkpoints take 30 s) as 100 frames of 80 mel bins.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import transformers

from .. import _quiet
from . import _tokenizer
from ._weights import perturb_constant_parameters

_IMAGE_SIZE, _PATCH = 32, 8
_ENCODER = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
_VISION = {**_ENCODER, "image_size": _IMAGE_SIZE, "patch_size": _PATCH}
_TEXT = {**_ENCODER, "vocab_size": _tokenizer.VOCAB_SIZE, "max_position_embeddings": 64}
_LABELS = {"id2label": {0: "cat", 1: "dog", 2: "bird"}, "label2id": {"cat": 0, "dog": 1, "bird": 2}}
_TOKEN_IDS = {"pad_token_id": _tokenizer.PAD_ID, "bos_token_id": _tokenizer.BOS_ID, "eos_token_id": _tokenizer.EOS_ID}
# wav2vec2's CTC vocabulary: pad (the CTC blank), specials, the word separator "|", letters.
_CHARACTERS = ["<pad>", "<s>", "</s>", "<unk>", "|", *"ETAOINSHRDLUCMWFGYPBVK'"]
# Whisper's special tokens, after the tiny BPE's vocabulary and in the order real checkpoints have them
# (no timestamp tokens: the tiny model does short-form transcription without timestamps only).
_WHISPER_LANGUAGES = ("en", "fr")
_WHISPER_SPECIALS = (
    "<|endoftext|>",
    "<|startoftranscript|>",
    *(f"<|{code}|>" for code in _WHISPER_LANGUAGES),
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nocaptions|>",
    "<|notimestamps|>",
)
_WHISPER_IDS = {token: _tokenizer.VOCAB_SIZE + i for i, token in enumerate(_WHISPER_SPECIALS)}
_WHISPER_CHUNK_SECONDS, _WHISPER_MELS = 1, 80


@dataclasses.dataclass(frozen=True)
class MediaFamily:
    """A tiny vision or speech family: its config, its tasks (the first is the default) and its processor."""

    config: Callable[[], transformers.PretrainedConfig]
    tasks: tuple[str, ...]
    processor: Callable[[pathlib.Path, transformers.PretrainedConfig], Any]  # (checkpoint directory, its config)


def _vit_config():
    return transformers.ViTConfig(**_VISION, **_LABELS)


def _clip_config():
    return transformers.CLIPConfig(text_config={**_TEXT, **_TOKEN_IDS}, vision_config=_VISION, projection_dim=32)


def _siglip_config():
    return transformers.SiglipConfig(text_config={**_TEXT, **_TOKEN_IDS}, vision_config=_VISION)


def _wav2vec2_config():
    return transformers.Wav2Vec2Config(
        **_ENCODER,
        vocab_size=len(_CHARACTERS),
        pad_token_id=0,
        conv_dim=(32, 32),
        conv_stride=(8, 4),
        conv_kernel=(16, 8),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        ctc_loss_reduction="mean",
    )


def _whisper_config():
    eot = _WHISPER_IDS["<|endoftext|>"]
    frames = _WHISPER_CHUNK_SECONDS * 100  # the feature extractor's hop is 10 ms
    return transformers.WhisperConfig(
        vocab_size=len(_WHISPER_IDS) + _tokenizer.VOCAB_SIZE,
        num_mel_bins=_WHISPER_MELS,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=frames // 2,  # input_features' length is 2 * max_source_positions
        max_target_positions=64,
        init_std=0.2,  # wider than real (0.02), so that the tiny model's tokens depend on its prompt
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=_WHISPER_IDS["<|startoftranscript|>"],
    )


def _whisper_generation_config() -> transformers.GenerationConfig:
    """The fields transformers' Whisper generate reads, as real multilingual checkpoints have them."""
    ids = _WHISPER_IDS
    eot = ids["<|endoftext|>"]
    return transformers.GenerationConfig(
        decoder_start_token_id=ids["<|startoftranscript|>"],
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        max_new_tokens=20,  # transformers' pipeline would add 256, beyond the tiny max_target_positions
        is_multilingual=True,
        lang_to_id={f"<|{code}|>": ids[f"<|{code}|>"] for code in _WHISPER_LANGUAGES},
        task_to_id={"translate": ids["<|translate|>"], "transcribe": ids["<|transcribe|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"],
        prev_sot_token_id=ids["<|startofprev|>"],
        forced_decoder_ids=[[1, None], [2, ids["<|transcribe|>"]]],
        return_timestamps=False,
        # A few ordinary tokens and the task and prompt tokens, as real checkpoints suppress them.
        suppress_tokens=[9, 10, 11, *(ids[t] for t in _WHISPER_SPECIALS[4:9])],
        begin_suppress_tokens=[_tokenizer.space_id(), eot],
    )


def _whisper_processor(path: pathlib.Path, config):
    vocab, merges = _tokenizer.vocab_and_merges()
    vocab.update(_WHISPER_IDS)
    tokenizer = transformers.WhisperTokenizer(
        vocab=vocab,
        merges=merges,
        pad_token="<|endoftext|>",
        model_max_length=config.max_target_positions,
        extra_special_tokens=list(_WHISPER_SPECIALS[1:]),
    )
    # The window the encoder reads: 2 * max_source_positions frames of 10 ms.
    seconds, rest = divmod(2 * config.max_source_positions, 100)
    if rest or not seconds:
        raise ValueError(
            f"max_source_positions should be a multiple of 50 (whole seconds of audio). "
            f"Got: max_source_positions={config.max_source_positions}."
        )
    extractor = transformers.WhisperFeatureExtractor(
        feature_size=config.num_mel_bins, sampling_rate=16000, chunk_length=seconds
    )
    _whisper_generation_config().save_pretrained(path)
    return transformers.WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer)


def _image_processor(kind):
    size = {"height": _IMAGE_SIZE, "width": _IMAGE_SIZE}
    return kind(size=size, crop_size=size) if kind is not transformers.ViTImageProcessor else kind(size=size)


def _vit_processor(path: pathlib.Path, config):
    return _image_processor(transformers.ViTImageProcessor)


def _text_image_processor(image_kind: str, processor_kind: str):
    # By name: touching transformers' image processor classes imports their backends (~1.5 s, and
    # a warning without torchvision), which importing hfjax.testing should not cost.
    def make(path: pathlib.Path, config):
        tokenizer = _tokenizer.build("encoder", None)
        tokenizer.model_max_length = _TEXT["max_position_embeddings"]
        image_processor = _image_processor(getattr(transformers, image_kind))
        return getattr(transformers, processor_kind)(image_processor=image_processor, tokenizer=tokenizer)

    return make


def _wav2vec2_processor(path: pathlib.Path, config):
    with tempfile.TemporaryDirectory() as scratch:
        vocab = pathlib.Path(scratch) / "vocab.json"
        vocab.write_text(json.dumps({c: i for i, c in enumerate(_CHARACTERS)}))
        tokenizer = transformers.Wav2Vec2CTCTokenizer(str(vocab), word_delimiter_token="|")
    extractor = transformers.Wav2Vec2FeatureExtractor(sampling_rate=16000, return_attention_mask=True)
    return transformers.Wav2Vec2Processor(feature_extractor=extractor, tokenizer=tokenizer)


MEDIA_FAMILIES: dict[str, MediaFamily] = {
    "vit": MediaFamily(_vit_config, ("image-classification", "image-feature-extraction"), _vit_processor),
    "clip": MediaFamily(
        _clip_config,
        ("zero-shot-image-classification",),
        _text_image_processor("CLIPImageProcessor", "CLIPProcessor"),
    ),
    "siglip": MediaFamily(
        _siglip_config,
        ("zero-shot-image-classification",),
        _text_image_processor("SiglipImageProcessor", "SiglipProcessor"),
    ),
    "wav2vec2": MediaFamily(_wav2vec2_config, ("automatic-speech-recognition",), _wav2vec2_processor),
    "whisper": MediaFamily(_whisper_config, ("automatic-speech-recognition",), _whisper_processor),
}


MEDIA_TASKS: tuple[str, ...] = (
    "image-classification",
    "zero-shot-image-classification",
    "image-feature-extraction",
    "automatic-speech-recognition",
)
"""The vision and speech tasks that `save_tiny_checkpoint` builds for any model_type with a model class for them."""


def save_media_checkpoint(
    family: str, path: pathlib.Path, *, task: str | None, seed: int, **config_overrides: Any
) -> pathlib.Path:
    """A tiny random checkpoint of a vision or speech family with its processor, as save_pretrained writes them;
    `config_overrides` set the config's fields (Whisper's feature extractor follows its
    max_source_positions and num_mel_bins)."""
    spec = MEDIA_FAMILIES[family]
    task = task or spec.tasks[0]
    if task not in spec.tasks:
        raise ValueError(f"task={task!r} is not available for family {family!r}. Tasks: {', '.join(spec.tasks)}.")
    config = spec.config()
    config.update(config_overrides)
    _save(config, path, task=task, seed=seed)
    with _quiet.no_torchvision_note():  # the image processors' PIL versions are what it writes
        spec.processor(path, config).save_pretrained(path)
    return path


def save_generic_media_checkpoint(
    model_type: str, path: pathlib.Path, *, task: str, seed: int, **config_overrides: Any
) -> pathlib.Path:
    """A tiny random checkpoint of any model_type with a model class for a vision or speech `task`
    (or image-text-to-text), its config shrunk from the config class's defaults by field name; no
    processor."""
    _save(generic_media_config(model_type, task=task, **config_overrides), path, task=task, seed=seed)
    return path


def generic_media_config(model_type: str, *, task: str, **config_overrides: Any) -> transformers.PretrainedConfig:
    """The tiny config `save_generic_media_checkpoint` writes: the model_type's defaults shrunk by field
    name, with its `_GENERIC_FIXES`, labels for image classification, then `config_overrides`."""
    from ._families import _generic_overrides, _with_fixes, default_config

    if task not in (*MEDIA_TASKS, "image-text-to-text"):
        raise ValueError(f"Unknown media task {task!r}. Use one of: {', '.join(MEDIA_TASKS)}, image-text-to-text.")
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(f"Unknown model family {model_type!r}: not a transformers model_type.")
    defaults = default_config(model_type).to_dict()
    overrides = _with_fixes(model_type, _generic_overrides(defaults))
    if task == "image-classification":
        overrides.update(_LABELS)
    overrides.update(config_overrides)
    return transformers.AutoConfig.for_model(model_type, **overrides)


def _save(config: transformers.PretrainedConfig, path: pathlib.Path, *, task: str, seed: int) -> None:
    from .. import _tasks
    from ._families import auto_class_name

    auto = _tasks.auto_class(task, config)
    name = auto_class_name(auto, config)
    if name is None:
        raise ValueError(f"task={task!r} has no model class for model_type {config.model_type!r}.")
    config.architectures = [name]  # transformers picks the first of several classes only by name
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config)
        perturb_constant_parameters(model, std=0.02)
    model.config.architectures = [type(model).__name__]
    path.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(path)
