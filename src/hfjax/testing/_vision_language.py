"""Tiny vision-language checkpoints (image-text-to-text) with their processors.

A checkpoint directory holds what `save_pretrained` writes for the model and for its
`AutoProcessor`: config.json, model.safetensors, generation_config.json, the tokenizer files
(the tiny BPE of `_tokenizer.py` with the family's image tokens added after its 512 tokens),
preprocessor_config.json, processor_config.json and chat_template.jinja.

Sizes: the language model as the text families (hidden 64, 2 layers), a vision tower of hidden
64 and 2 layers over 32x32 images in 8x8 patches, so an image is 4 to 16 tokens.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import transformers

from . import _tokenizer
from ._tokenizer import BOS_ID, EOS_ID, MAX_POSITIONS, PAD_ID, VOCAB_SIZE
from ._weights import perturb_constant_parameters

_IMAGE_SIZE, _PATCH = 32, 8
_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": MAX_POSITIONS,
    "vocab_size": VOCAB_SIZE + 16,  # the tiny BPE's tokens, then the family's image tokens
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}
_VISION = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": _IMAGE_SIZE,
    "patch_size": _PATCH,
}
_NORMALIZE = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def _chat_template(image: str, *, bos: bool = True) -> str:
    """The tiny chat template (role markers, eos after each turn) with `image` for each image part."""
    return (
        ("{{ bos_token }}" if bos else "") + "{% for message in messages %}<|{{ message['role'] }}|>\n"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{image}{{% elif part['type'] == 'text' %}}{{{{ part['text'] }}}}{{% endif %}}"
        "{% endfor %}{% endif %}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )


@dataclasses.dataclass(frozen=True)
class VisionLanguageFamily:
    """How to build one family's tiny model and processor."""

    # {attribute name on the tokenizer: token}, added after the BPE's tokens, ids 512, 513, ...
    tokens: Mapping[str, str]
    # config keyword arguments, given the ids of `tokens` by attribute name
    config: Callable[[dict[str, int]], dict[str, Any]]
    image_processor: tuple[str, Mapping[str, Any]]  # class name, keyword arguments
    processor: tuple[str, Mapping[str, Any]]
    chat_template: str
    # the processor takes several conversations in one call, padded (left-padded for generation)
    batches: bool = True


def _llava(ids):
    return {
        "text_config": {"model_type": "llama", **_TEXT},
        "vision_config": {"model_type": "clip_vision_model", **_VISION, "projection_dim": 64},
        "image_token_id": ids["image_token"],
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -1,
    }


def _qwen2_vl(ids):
    text = {**_TEXT, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}}
    return {
        "text_config": text,
        "vision_config": {"depth": 2, "embed_dim": 64, "hidden_size": 64, "num_heads": 4, "patch_size": _PATCH},
        "image_token_id": ids["image_token"],
        "video_token_id": ids["video_token"],
        "vision_start_token_id": ids["vision_start_token"],
        "vision_end_token_id": ids["vision_end_token"],
        **{key: _TEXT[key] for key in ("pad_token_id", "bos_token_id", "eos_token_id")},
    }


def _gemma3(ids):
    text = {**_TEXT, "query_pre_attn_scalar": 16, "sliding_window": 64, "sliding_window_pattern": 2}
    return {
        "text_config": {"model_type": "gemma3_text", **text},
        "vision_config": {"model_type": "siglip_vision_model", **_VISION},
        "mm_tokens_per_image": 4,
        "boi_token_index": ids["boi_token"],
        "eoi_token_index": ids["eoi_token"],
        "image_token_index": ids["image_token"],
    }


def _idefics3(ids):
    return {
        "text_config": {"model_type": "llama", **_TEXT},
        "vision_config": {**_VISION},
        "scale_factor": 2,
        "image_token_id": ids["image_token"],
    }


def _paligemma(ids):
    return {
        "text_config": {"model_type": "gemma", **_TEXT},
        "vision_config": {"model_type": "siglip_vision_model", **_VISION, "projection_dim": 64},
        "projection_dim": 64,
        "image_token_id": ids["image_token"],
    }


_TOKENS_PER_IMAGE = (_IMAGE_SIZE // _PATCH) ** 2  # 16 patches

REGISTRY: dict[str, VisionLanguageFamily] = {
    "llava": VisionLanguageFamily(
        tokens={"image_token": "<image>"},
        config=_llava,
        image_processor=(
            "CLIPImageProcessorPil",
            {"size": {"shortest_edge": _IMAGE_SIZE}, "crop_size": {"height": _IMAGE_SIZE, "width": _IMAGE_SIZE}},
        ),
        processor=(
            "LlavaProcessor",
            {"patch_size": _PATCH, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1},
        ),
        chat_template=_chat_template("<image>"),
    ),
    "qwen2_vl": VisionLanguageFamily(
        tokens={
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_start_token": "<|vision_start|>",
            "vision_end_token": "<|vision_end|>",
        },
        config=_qwen2_vl,
        image_processor=(
            "Qwen2VLImageProcessorPil",
            {"patch_size": _PATCH, "merge_size": 2, "min_pixels": 16 * 16, "max_pixels": 48 * 48, **_NORMALIZE},
        ),
        processor=("Qwen2VLProcessor", {}),
        chat_template=_chat_template("<|vision_start|><|image_pad|><|vision_end|>"),
    ),
    "gemma3": VisionLanguageFamily(
        tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
        config=_gemma3,
        image_processor=("Gemma3ImageProcessorPil", {"size": {"height": _IMAGE_SIZE, "width": _IMAGE_SIZE}}),
        processor=("Gemma3Processor", {"image_seq_length": 4}),
        chat_template=_chat_template("<start_of_image>"),
    ),
    "idefics3": VisionLanguageFamily(
        tokens={
            "image_token": "<image>",
            "fake_image_token": "<fake_token_around_image>",
            "end_of_utterance_token": "<end_of_utterance>",
            "global_image_token": "<global-img>",
        },
        config=_idefics3,
        image_processor=(
            "Idefics3ImageProcessorPil",
            {
                "size": {"longest_edge": 2 * _IMAGE_SIZE},
                "max_image_size": {"longest_edge": _IMAGE_SIZE},
                "do_image_splitting": True,
                **_NORMALIZE,
            },
        ),
        processor=("Idefics3Processor", {"image_seq_len": _TOKENS_PER_IMAGE // 4}),
        chat_template=_chat_template("<image>"),
    ),
    "paligemma": VisionLanguageFamily(
        tokens={"image_token": "<image>"},
        config=_paligemma,
        image_processor=(
            "SiglipImageProcessorPil",
            {"size": {"height": _IMAGE_SIZE, "width": _IMAGE_SIZE}, "image_seq_length": _TOKENS_PER_IMAGE},
        ),
        processor=("PaliGemmaProcessor", {}),
        # PaliGemma's processor puts the image tokens and BOS before the text itself.
        chat_template=_chat_template("", bos=False),
    ),
}

VISION_LANGUAGE_FAMILIES: tuple[str, ...] = tuple(REGISTRY)
"""The image-text-to-text families of `save_tiny_vision_language_checkpoint`, by model_type."""


def tiny_processor(family: str):
    """The family's processor: an image processor for 32x32 images, the tiny tokenizer with the
    family's image tokens, and a chat template that takes image parts."""
    spec = _spec(family)
    tokenizer = _tokenizer.build("causal", family, dict(spec.tokens))
    image_processor = _image_processor(spec)
    processor_class, processor_kwargs = spec.processor
    if processor_class == "Qwen2VLProcessor" and not transformers.utils.is_torchvision_available():
        raise ImportError(
            "Qwen2VLProcessor needs torchvision (its video processor does); without it, use tiny_processor_parts"
        )
    return getattr(transformers, processor_class)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=spec.chat_template, **processor_kwargs
    )


def tiny_processor_parts(family: str):
    """(tokenizer, image processor) of `tiny_processor(family)`, for where the processor cannot be built."""
    spec = _spec(family)
    tokenizer = _tokenizer.build("causal", family, dict(spec.tokens))
    tokenizer.chat_template = spec.chat_template
    return tokenizer, _image_processor(spec)


def _image_processor(spec):
    name, kwargs = spec.image_processor
    try:
        return getattr(transformers, name)(**kwargs)
    except ImportError:
        # transformers 5.17's lazy table marks some PIL image processors (Idefics3's) as needing
        # torchvision; their own module imports without it.
        import importlib
        import pkgutil

        folded = name.lower()
        family = max(
            (
                m.name
                for m in pkgutil.iter_modules(transformers.models.__path__)
                if folded.startswith(m.name.replace("_", ""))
            ),
            key=len,
        )
        module = importlib.import_module(f"transformers.models.{family}.image_processing_pil_{family}")
        return getattr(module, name)(**kwargs)


def tiny_vision_language_config(family: str, **overrides: Any) -> transformers.PretrainedConfig:
    """The family's tiny config, its image token ids those of `tiny_processor(family)`; a dict in
    `overrides` for a sub-config (text_config={"hidden_size": 256}) updates that sub-config's fields."""
    spec = _spec(family)
    ids = {name: VOCAB_SIZE + i for i, name in enumerate(spec.tokens)}
    fields = spec.config(ids)
    for name, value in overrides.items():
        fields[name] = {**fields[name], **value} if isinstance(fields.get(name), dict) else value
    config = transformers.AutoConfig.for_model(family, **fields)
    config.architectures = [transformers.AutoModelForImageTextToText._model_mapping[type(config)].__name__]
    return config


def save_tiny_vision_language_checkpoint(
    family: str, path: str | pathlib.Path, *, seed: int = 0, **config_overrides: Any
) -> pathlib.Path:
    """Writes a tiny random image-text-to-text checkpoint and its processor, as `save_pretrained` does.

    Args:
        family: one of `VISION_LANGUAGE_FAMILIES` ("llava", "qwen2_vl", "gemma3", "idefics3",
            "paligemma").
        path: directory to write; created if missing.
        seed: torch seed for the random weights.
        **config_overrides: passed to `tiny_vision_language_config`.

    Returns:
        `path` as a `pathlib.Path`.

    Example:
        >>> path = save_tiny_vision_language_checkpoint("llava", tempfile.mkdtemp())
        >>> model = transformers.AutoModelForImageTextToText.from_pretrained(path)
        >>> processor = transformers.AutoProcessor.from_pretrained(path)
    """

    config = tiny_vision_language_config(family, **config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForImageTextToText.from_config(config)
        perturb_constant_parameters(model, std=0.02)
    model = model.eval()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    try:
        tiny_processor(family).save_pretrained(path)
    except ImportError:  # Qwen2-VL without torchvision: the processor's parts, as it would save them
        tokenizer, image_processor = tiny_processor_parts(family)
        tokenizer.save_pretrained(path)
        image_processor.save_pretrained(path)
    return path


def _spec(family: str) -> VisionLanguageFamily:
    if family not in REGISTRY:
        raise ValueError(
            f"Unknown vision-language family {family!r}. Use one of: {', '.join(VISION_LANGUAGE_FAMILIES)}."
        )
    return REGISTRY[family]
