"""Chat with images: conversations whose messages hold images, through a vision-language model's
processor (chat template, image processor, tokenizer), then `Model.generate`.

`chat_with_images` is what transformers' image-text-to-text pipeline does for chat input, and
what `hfjax generate --image` and `hfjax chat --image` call.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np

from .._errors import GenerationError

_IMAGE_KEYS = ("image", "url", "path")  # where a message's {"type": "image"} part may hold its image


def chat_with_images(model, messages, *, streamer=None, **generate_kwargs) -> str | list[str]:
    """Generates the assistant's reply to a conversation with images.

    Args:
      model: an `hfjax.Model` loaded for "image-text-to-text" (its checkpoint has a processor).
      messages: one conversation, a list of {"role": ..., "content": ...} messages, or a list of
        conversations (generated as one left-padded batch). A content is a text, or a list of
        parts: {"type": "text", "text": ...} and {"type": "image", "image": X} (also under "url"
        or "path"), X a PIL image, an HxWx3 uint8 array, a file path or a file:// URL.
      streamer: transformers' streamer interface (`put`, `end`), e.g. `TextStreamer`; one
        conversation only.
      **generate_kwargs: as for `Model.generate` (max_new_tokens, do_sample, temperature, ...).

    Returns:
      The reply text (new tokens decoded, special tokens skipped); a list of texts for a list
      of conversations.

    Example:
      >>> model = hfjax.load("path/to/llava")
      >>> chat_with_images(model, [{"role": "user", "content": [
      ...     {"type": "image", "image": "cat.png"}, {"type": "text", "text": "Describe this"}]}],
      ...     max_new_tokens=32)
    """
    check_takes_images(model, caller="chat_with_images")
    single = _is_conversation(messages)
    conversations = [messages] if single else list(messages)
    if not conversations or not all(_is_conversation(c) for c in conversations):
        raise GenerationError(
            "chat_with_images: messages must be a conversation (a list of {'role': ..., 'content': ...} dicts) or a "
            f"list of conversations; got {type(messages).__name__}"
        )
    encoded, length = encode(model, conversations)
    out = np.asarray(model.generate(**encoded, streamer=streamer, **generate_kwargs))
    texts = model.processor.tokenizer.batch_decode(out[:, length:], skip_special_tokens=True)
    return texts[0] if single else texts


def check_takes_images(model, *, caller: str) -> None:
    """A GenerationError unless `model` is a vision-language model with a processor."""
    if not hasattr(model.module, "get_image_features"):
        raise GenerationError(
            f"{caller}: {type(model.module).__name__} (task={model.task!r}) takes no images; load an "
            "image-text-to-text checkpoint (LLaVA, Qwen2-VL, Gemma 3, PaliGemma, ...)"
        )
    if model.processor is None:
        raise GenerationError(
            f"{caller}: {model.source} has no processor (preprocessor_config.json), so images cannot be prepared; "
            "save the model's AutoProcessor beside it"
        )


def encode(model, conversations: list[list[dict]]) -> tuple[dict, int]:
    """The processor's numpy outputs for `conversations` (left-padded), and the prompt length."""
    processor = model.processor
    texts, images = [], []
    for conversation in conversations:
        rendered, found = [], []
        for message in conversation:
            content = message.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if isinstance(part, dict) and part.get("type") == "image":
                        found.append(load_image(next((part[k] for k in _IMAGE_KEYS if k in part), None)))
                        part = {"type": "image"}
                    parts.append(part)
                message = {**message, "content": parts}
            rendered.append(message)
        texts.append(processor.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False))
        images.append(found)
    encoded = processed(processor, texts, images)
    return encoded, encoded["input_ids"].shape[1]


def processed(processor, texts: list[str], images: list[list]) -> dict:
    """The processor's numpy outputs for rendered prompts `texts` (left-padded) and each one's images
    (RGB PIL images): input_ids, attention_mask, pixel_values, ..."""
    processor.tokenizer.padding_side = "left"
    if any(images):
        encoded = processor(text=texts, images=images, padding=True, return_tensors="np")
    else:
        encoded = processor(text=texts, padding=True, return_tensors="np")
    encoded = dict(encoded)
    encoded.pop("labels", None)  # PaliGemma's processor returns training labels too
    return encoded


def load_image(image):
    """An RGB PIL image from a PIL image, an HxWx3 (or HxW) uint8 array, a path or a file:// URL."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as error:
        raise GenerationError("chat_with_images: images need Pillow: pip install 'hfjax[vision]'") from error

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3):
            raise GenerationError(
                f"chat_with_images: an image array must be uint8 of shape [H, W, 3] or [H, W]; got {image.dtype} "
                f"{image.shape}"
            )
        return Image.fromarray(image).convert("RGB")
    if isinstance(image, (str, os.PathLike)):
        text = os.fspath(image)
        if text.startswith(("http://", "https://")):
            raise GenerationError(
                f"chat_with_images: image={text!r}: hfjax does not download images; save it and pass its path"
            )
        path = pathlib.Path(text.removeprefix("file://"))
        if not path.is_file():
            raise GenerationError(f"chat_with_images: image file {text!r} does not exist; pass the path of an image")
        try:
            with Image.open(path) as opened:
                return opened.convert("RGB")
        except (UnidentifiedImageError, OSError) as error:
            raise GenerationError(
                f"chat_with_images: {text!r} is not an image PIL can read ({error}); pass a PNG, JPEG, ..."
            ) from None
    raise GenerationError(
        f"chat_with_images: an image part holds a {type(image).__name__}; pass a PIL image, a uint8 array, a file "
        "path or a file:// URL under its 'image' key"
    )


def _is_conversation(value) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(m, dict) for m in value)
