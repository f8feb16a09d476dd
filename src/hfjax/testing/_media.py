"""Tiny vision and speech checkpoints (ViT, CLIP, SigLIP, wav2vec2), processors included, for
`hfjax.pipeline`'s tasks. Sizes follow the text families: hidden 64, 2 layers, 4 heads, MLP 128;
images are 32x32 in 8x8 patches; audio is 16 kHz.
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

from . import _tokenizer

_IMAGE_SIZE, _PATCH = 32, 8
_ENCODER = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
_VISION = {**_ENCODER, "image_size": _IMAGE_SIZE, "patch_size": _PATCH}
_TEXT = {**_ENCODER, "vocab_size": _tokenizer.VOCAB_SIZE, "max_position_embeddings": 64}
_LABELS = {"id2label": {0: "cat", 1: "dog", 2: "bird"}, "label2id": {"cat": 0, "dog": 1, "bird": 2}}
_TOKEN_IDS = {"pad_token_id": _tokenizer.PAD_ID, "bos_token_id": _tokenizer.BOS_ID, "eos_token_id": _tokenizer.EOS_ID}
# wav2vec2's CTC vocabulary: pad (the CTC blank), specials, the word separator "|", letters.
_CHARACTERS = ["<pad>", "<s>", "</s>", "<unk>", "|", *"ETAOINSHRDLUCMWFGYPBVK'"]


@dataclasses.dataclass(frozen=True)
class MediaFamily:
    """A tiny vision or speech family: its config, its tasks (the first is the default) and its processor."""

    config: Callable[[], transformers.PretrainedConfig]
    tasks: tuple[str, ...]
    processor: Callable[[pathlib.Path], Any]


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


def _image_processor(kind):
    size = {"height": _IMAGE_SIZE, "width": _IMAGE_SIZE}
    return kind(size=size, crop_size=size) if kind is not transformers.ViTImageProcessor else kind(size=size)


def _vit_processor(path: pathlib.Path):
    return _image_processor(transformers.ViTImageProcessor)


def _text_image_processor(image_kind, processor_kind):
    def make(path: pathlib.Path):
        tokenizer = _tokenizer.build("encoder", None)
        tokenizer.model_max_length = _TEXT["max_position_embeddings"]
        return processor_kind(image_processor=_image_processor(image_kind), tokenizer=tokenizer)

    return make


def _wav2vec2_processor(path: pathlib.Path):
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
        _text_image_processor(transformers.CLIPImageProcessor, transformers.CLIPProcessor),
    ),
    "siglip": MediaFamily(
        _siglip_config,
        ("zero-shot-image-classification",),
        _text_image_processor(transformers.SiglipImageProcessor, transformers.SiglipProcessor),
    ),
    "wav2vec2": MediaFamily(_wav2vec2_config, ("automatic-speech-recognition",), _wav2vec2_processor),
}


def save_media_checkpoint(family: str, path: pathlib.Path, *, task: str | None, seed: int) -> pathlib.Path:
    """A tiny random checkpoint of a vision or speech family with its processor, as save_pretrained writes them."""
    from .. import _tasks
    from ._checkpoints import perturb_constant_parameters

    spec = MEDIA_FAMILIES[family]
    task = task or spec.tasks[0]
    if task not in spec.tasks:
        raise ValueError(f"task={task!r} is not available for family {family!r}. Tasks: {', '.join(spec.tasks)}.")
    config = spec.config()
    auto = _tasks.auto_class(task, config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config)
        perturb_constant_parameters(model, std=0.02)
    model.config.architectures = [type(model).__name__]
    path.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(path)
    spec.processor(path).save_pretrained(path)
    return path
