"""Parity of one checkpoint: hfjax (eager and jit) against the same model in PyTorch."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import pathlib
import re
import statistics
import tempfile
import time
import traceback

import numpy as np
import torch

from .. import _tasks, tolerances
from .._errors import HfjaxError, UnsupportedOpError
from .._model import load


@dataclasses.dataclass(frozen=True)
class CheckRow:
    output: str  # the output field compared, e.g. "logits"
    path: str  # "eager" or "jit"
    max_abs_diff: float | None
    atol: float
    seconds: float | None  # median time of one forward (jit: after compiling)
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and self.max_abs_diff is not None and self.max_abs_diff <= self.atol


@dataclasses.dataclass(frozen=True)
class CheckReport:
    model: str
    model_type: str
    task: str
    rows: tuple[CheckRow, ...]
    torch_seconds: float | None
    compile_seconds: float | None
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.rows) and all(r.passed for r in self.rows)

    def table(self) -> str:
        lines = [f"{self.model} ({self.model_type}, {self.task})"]
        if self.error:
            lines.append(f"  FAIL  {self.error}")
            return "\n".join(lines)
        lines.append(f"  {'output':<18}{'path':<7}{'max|diff|':>12}{'atol':>10}{'ms':>10}  result")
        if self.torch_seconds is not None:
            lines.append(f"  {'(pytorch)':<18}{'eager':<7}{'':>12}{'':>10}{self.torch_seconds * 1e3:>10.2f}")
        for r in self.rows:
            diff = "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.2e}"
            ms = "-" if r.seconds is None else f"{r.seconds * 1e3:.2f}"
            result = "pass" if r.passed else f"FAIL {r.error or ''}".rstrip()
            lines.append(f"  {r.output:<18}{r.path:<7}{diff:>12}{r.atol:>10.0e}{ms:>10}  {result}")
        if self.compile_seconds is not None:
            lines.append(f"  compile: {self.compile_seconds:.2f} s")
        return "\n".join(lines)


# Media inputs: images are [B, C, H, W] noise at the config's image size (this when it has none,
# as convolutional nets do); audio is long enough for this many frames after a conv feature encoder.
_IMAGE_SIZE, _AUDIO_FRAMES = 64, 16
# Encoders whose feature frames hold several values per mel bin, which no config field says: Granite Speech 5's
# extractor stacks each mel frame with its delta, two frames at a time (4 * num_mel_bins).
_FEATURES_PER_MEL = {"granite_speech5_encoder": 4}
_IMAGE_TASKS = ("image-classification", "image-feature-extraction", "zero-shot-image-classification")
# The output compared per task: the first of these names the output has.
_COMPARED: dict[str, tuple[str, ...]] = {
    "feature-extraction": ("last_hidden_state",),
    "image-feature-extraction": ("last_hidden_state", "pooler_output", "image_embeds"),
    "zero-shot-image-classification": ("logits_per_image",),
}


def _inputs(
    config, task: str, *, batch: int, seq_len: int, seed: int, main_input_name: str = "input_ids"
) -> dict[str, np.ndarray]:
    """Random inputs for one forward of `task`: token ids, pixel values or audio, as the model's
    `main_input_name` (its class attribute: "input_ids", "pixel_values", "input_values", ...) says."""
    rng = np.random.default_rng(seed)
    if task == "zero-shot-image-classification":  # main_input_name is input_ids for most (CLIPModel)
        pixels = main_input_name if main_input_name.startswith("pixel_values") else "pixel_values"
        text = _token_ids(config.get_text_config(), batch, seq_len, rng)
        if getattr(config, "num_query_tokens", None) and isinstance(getattr(config, "image_token_index", None), int):
            # BLIP-2's retrieval model drops the num_query_tokens image tokens its processor puts first.
            image = np.full((batch, config.num_query_tokens), config.image_token_index, dtype=np.int64)
            text = {"input_ids": np.concatenate([image, text["input_ids"]], 1)}
            text["attention_mask"] = np.ones_like(text["input_ids"])
        return {**_image(config, pixels, batch, rng), **text}
    if task in _IMAGE_TASKS and main_input_name != "input_ids":  # not ImageGPT, whose pixels are token ids
        return _image(config, main_input_name, batch, rng)
    if task == "automatic-speech-recognition" and main_input_name != "input_ids":
        inputs = {main_input_name: _audio(config, main_input_name, batch, rng)}
        if getattr(config, "is_encoder_decoder", False):
            text = config.get_text_config(decoder=True)
            ids = _token_ids(text, batch, max(2, seq_len // 2), rng)["input_ids"]
            inputs.update(decoder_input_ids=ids, use_cache=False)
        return inputs
    # The forward's parameter names decide what an image-text-to-text model gets beyond token ids.
    parameters = _forward_parameters(config) if task == "image-text-to-text" else set()
    if task == "image-text-to-text" and _needs_media(parameters, main_input_name):
        return _image_text_inputs(config, parameters, main_input_name, batch, seq_len, rng)
    inputs = _token_ids(config, batch, seq_len, rng)
    eos = _eos_id(config)
    if task == "text-classification" and eos is not None and 0 <= eos < _vocab_size(config):
        inputs["input_ids"][:, -1] = eos  # BART / T5-style heads pool each row's last EOS, and refuse rows without one
    # An audio language model (speech recognition whose main input is input_ids): a text forward,
    # as for image-text-to-text (no audio placeholder tokens).
    speech_text = task == "automatic-speech-recognition"
    # An image-text-to-text model whose forward takes decoder ids gets them too: the encoder-decoders (T5Gemma 2,
    # Florence-2) and DiffusionGemma, whose decoder otherwise refines a canvas drawn at random.
    decoder = speech_text and getattr(config, "is_encoder_decoder", False)
    decoder = decoder or "decoder_input_ids" in parameters
    if task == "text2text-generation" or decoder:
        # Dia's decoder reads audio codes of num_channels codebooks, as its processor gives them: [B, T, channels]
        # (its flat [B * channels, T] form fails for T > 1 in transformers: a .view of a transposed tensor).
        channels = getattr(config.get_text_config(decoder=True), "num_channels", None) if speech_text else None
        length = max(2, seq_len // 2)
        ids = _token_ids(config, batch, length * (channels or 1), rng)["input_ids"]
        inputs["decoder_input_ids"] = ids.reshape(batch, length, channels) if channels else ids
    codes = getattr(config, "codebook_vocab_size", None)
    if speech_text and codes and getattr(config, "num_codebooks", None):
        # Kyutai's speech-to-text reads, per frame, a text token and a code of each codec codebook:
        # input_ids [B, T, 1 + codebooks].
        audio = rng.integers(0, codes - 1, size=(batch, seq_len, config.num_codebooks), dtype=np.int64)
        inputs["input_ids"] = np.concatenate([inputs["input_ids"][..., None], audio], axis=-1)
    per_token = getattr(config, "audio_length_per_tok", None)
    if per_token and (speech_text or task == "text2text-generation"):
        # Voxtral-realtime adds the audio's embedding to every token, and needs it: log-mel frames
        # [B, mels, audio_length_per_tok * S].
        mels = config.audio_config.num_mel_bins
        inputs["input_features"] = rng.standard_normal((batch, mels, per_token * seq_len), dtype=np.float32)
    if "token_type_ids" in parameters:
        # PaliGemma's and Gemma 3's processors always return token_type_ids (0: text). Without them
        # transformers' PaliGemma differs between eager and any trace (docs/architecture.md).
        inputs["token_type_ids"] = np.zeros_like(inputs["input_ids"])
    if task in ("text-generation", "text2text-generation", "image-text-to-text") or speech_text:
        inputs["use_cache"] = False  # one forward; a hybrid model's cache cannot even start without a prefill
    return inputs


# Video models without a frame count in their config (InstructBLIP-Video) get this many frames, as
# their processors sample.
_VIDEO_FRAMES = 4


def _needs_media(parameters: set[str], main_input_name: str) -> bool:
    # Whether an image-text-to-text model cannot run a text forward (most take pixels as an option and
    # keep it): its main input is not the token ids (BLIP's pixels, Pix2Struct's patches, the image
    # encoder of an encoder-decoder, PI0's robot state), or its forward takes per-token boxes (UDOP's
    # relative position bias needs them) or a per-token image mask (IDEFICS cross-attends to the images
    # in every layer and refuses to run without them).
    return main_input_name != "input_ids" or bool({"bbox", "image_attention_mask"} & parameters)


def _forward_parameters(config, task: str = "image-text-to-text") -> set[str]:
    # Parameter names of the forward of the task's model class for `config`.
    try:
        model_class = _tasks.auto_class(task, config)._model_mapping[type(config)]
    except (KeyError, ValueError):
        return set()
    model_class = model_class[0] if isinstance(model_class, tuple) else model_class
    return set(inspect.signature(model_class.forward).parameters)


def _image_text_inputs(
    config, parameters: set[str], main_input_name: str, batch: int, seq_len: int, rng: np.random.Generator
) -> dict:
    """Inputs of an image-text-to-text model that needs more than token ids (see `_needs_media`):
    - an image: pixel_values [B, C, H, W] from the vision tower's config; [B, 1, C, H, W] where the forward
      takes a per-token image mask (IDEFICS: image_attention_mask [B, S, 1], every token sees the image) or
      a per-camera one (PI0: pixel_attention_mask [B, 1]); [B, T, C, H, W] for a video model; Pix2Struct's
      flattened_patches [B, P, 2 + C * p * p] (row and column from 1, then the pixels), attention_mask [B, P];
    - the image's placeholder tokens first in input_ids, as processors put them, where the forward puts
      image features in their place: BLIP-2 / InstructBLIP's num_query_tokens (per frame) image (video)
      tokens, Kosmos-2's latent_query_num positions (marked by image_embeds_position_mask), PI0's one per
      patch; then seq_len random text tokens;
    - qformer_input_ids (InstructBLIP's instruction to its Q-Former), UDOP's bbox [B, S, 4] (a box of the
      unit page per token); PI0's state, noise and timestep (its flow-matching step, else drawn at random);
    - an encoder-decoder reading the image gets the text as decoder_input_ids; UDOP's encoder reads the
      text (and its boxes), its decoder max(2, seq_len // 2) tokens, as text2text-generation.
    `parameters`: the forward's parameter names (`_forward_parameters`)."""
    robot = main_input_name == "state"
    vision = _vision_tower_config(config.vlm_config if robot else config)
    inputs = {}
    if main_input_name == "flattened_patches":
        inputs.update(_flattened_patches(vision, batch, rng))
    elif main_input_name != "input_ids" or "image_attention_mask" in parameters:
        frames = _VIDEO_FRAMES if hasattr(config, "video_token_index") else 1
        pixels = _pixels(vision, batch * frames, rng, video=False)
        if frames > 1 or robot or "image_attention_mask" in parameters:
            pixels = pixels.reshape(batch, frames, *pixels.shape[1:])
        inputs["pixel_values"] = pixels
    if robot:  # PI0: the state, and the action chunk's noise at one flow-matching time
        inputs["state"] = rng.standard_normal((batch, config.max_state_dim), dtype=np.float32)
        inputs["noise"] = rng.standard_normal((batch, config.chunk_size, config.max_action_dim), dtype=np.float32)
        inputs["timestep"] = rng.uniform(0.05, 0.95, size=batch).astype(np.float32)
        inputs["pixel_attention_mask"] = np.ones((batch, 1), dtype=bool)
    text = _token_ids(config, batch, seq_len, rng)
    if getattr(config, "is_encoder_decoder", False) and main_input_name != "input_ids":
        return {**inputs, "decoder_input_ids": text["input_ids"], "use_cache": False}
    slots, token = _image_slots(config, vision, robot=robot)
    if slots:
        low = min(4, _vocab_size(config) - 1)
        if "image_embeds_position_mask" in parameters:  # Kosmos-2 marks the positions; their ids are not read
            token = low
            mask = np.zeros((batch, slots + seq_len), dtype=bool)
            mask[:, :slots] = True
            inputs["image_embeds_position_mask"] = mask
        else:  # no stray placeholder in the text (PI0's sits in a nested config, which _token_ids misses)
            text["input_ids"][text["input_ids"] == token] = low
        text["input_ids"] = np.concatenate([np.full((batch, slots), token, dtype=np.int64), text["input_ids"]], 1)
        text["attention_mask"] = np.ones_like(text["input_ids"])
    inputs.update(text)
    length = text["input_ids"].shape[1]
    if "image_attention_mask" in parameters:
        inputs["image_attention_mask"] = np.ones((batch, length, 1), dtype=np.int64)
    if "qformer_input_ids" in parameters:
        qformer = _token_ids(config.qformer_config, batch, seq_len, rng)
        inputs.update(qformer_input_ids=qformer["input_ids"], qformer_attention_mask=qformer["attention_mask"])
    if "bbox" in parameters:
        corner = rng.uniform(0.0, 0.5, size=(batch, length, 2))
        inputs["bbox"] = np.concatenate([corner, corner + rng.uniform(0.0, 0.5, size=(batch, length, 2))], -1)
        inputs["bbox"] = inputs["bbox"].astype(np.float32)
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = _token_ids(config, batch, max(2, seq_len // 2), rng)["input_ids"]
    if not robot:
        inputs["use_cache"] = False
    return inputs


def _vision_tower_config(config):
    # The image encoder's config: vision_config (BLIP, Kosmos-2, IDEFICS, PaliGemma), a vision
    # encoder-decoder's encoder, else the config itself (UDOP has its patch embedding at the top).
    for name in ("vision_config", "encoder"):
        sub = getattr(config, name, None)
        if sub is not None:
            return sub
    return config


def _image_slots(config, vision, *, robot: bool) -> tuple[int, int | None]:
    # (how many placeholder tokens the image's features replace, their id)
    if getattr(config, "num_query_tokens", None):  # BLIP-2, InstructBLIP: the Q-Former's query outputs
        if hasattr(config, "video_token_index"):  # InstructBLIP-Video: those of each frame
            return config.num_query_tokens * _VIDEO_FRAMES, config.video_token_index
        return config.num_query_tokens, config.image_token_index
    if getattr(config, "latent_query_num", None):  # Kosmos-2: its image-to-text projection's latents
        return config.latent_query_num, None
    if robot:  # PI0: PaliGemma's SigLIP tower, one token per patch
        return (vision.image_size // vision.patch_size) ** 2, config.vlm_config.image_token_id
    return 0, None


def _flattened_patches(vision, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    # Pix2Struct: a 4 x 4 grid of patches, each its row and column (from 1; 0 is padding) then its pixels.
    side = 4
    rows, columns = np.divmod(np.arange(side * side), side)
    position = np.stack([rows + 1, columns + 1], -1).astype(np.float32)
    pixels = rng.standard_normal((batch, side * side, vision.patch_embed_hidden_size), dtype=np.float32)
    patches = np.concatenate([np.broadcast_to(position, (batch, side * side, 2)), pixels], -1)
    return {"flattened_patches": patches, "attention_mask": np.ones((batch, side * side), dtype=np.int64)}


def _vocab_size(config) -> int:
    # The text model's vocabulary: a vision-language config's own vocab_size can be its full-size
    # default (PaliGemma's 257152) where the tiny text model has a few hundred embeddings.
    for source in (config.get_text_config(), config, *_sub_configs(config)):
        if getattr(source, "vocab_size", None):
            return int(source.vocab_size)
    raise ValueError(f"hfjax.check: {type(config).__name__} has no vocab_size, nor has any of its sub-configs")


def _sub_configs(config) -> list:
    # Nested configs, depth first (pi0 keeps its text model in vlm_config.text_config).
    found = []
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if hasattr(sub, "get_text_config"):  # a PretrainedConfig
            found += [sub.get_text_config(), sub, *_sub_configs(sub)]
    return found


# Placeholder tokens that stand for images, video or audio: a text forward must not contain them.
_MEDIA_TOKEN = re.compile(r"(image|video|audio|vision|boi|eoi|boa|eoa)\w*_token_(id|index)$")


def _media_tokens(config) -> set[int]:
    found = set()
    for source in (config, config.get_text_config()):
        for name, value in source.to_dict().items():
            if _MEDIA_TOKEN.search(name) and isinstance(value, int):
                found.add(value)
    return found


def _eos_id(config) -> int | None:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = getattr(config.get_text_config(), "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) else None


def _token_ids(config, batch: int, seq_len: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    # input_ids, attention_mask: [B, S] int64; ids from 4 up, past the tiny tokenizer's special tokens.
    vocab = _vocab_size(config)
    low = min(4, vocab - 1)
    ids = rng.integers(low, vocab, size=(batch, seq_len), dtype=np.int64)
    ids[np.isin(ids, list(_media_tokens(config)))] = low
    return {"input_ids": ids, "attention_mask": np.ones((batch, seq_len), dtype=np.int64)}


def _image(config, name: str, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    vision = _vision_config(config)
    if getattr(vision, "num_patches", None) and not getattr(vision, "image_size", None):
        return _patches(vision, batch, rng)
    inputs = {name: _pixels(vision, batch, rng, video=name.startswith("pixel_values"))}
    if getattr(vision, "mask_ratio", None) is not None and isinstance(getattr(vision, "patch_size", None), int):
        # ViT-MAE hides a random subset of patches, drawn from torch's generator unless `noise` is
        # given: give it, so that PyTorch and hfjax hide the same ones.
        height, width = inputs[name].shape[-2:]
        inputs["noise"] = rng.random((batch, (height // vision.patch_size) * (width // vision.patch_size)))
        inputs["noise"] = inputs["noise"].astype(np.float32)
    return inputs


def _vision_config(config):
    for name in ("vision_config", "backbone_config"):
        sub = getattr(config, name, None)
        if sub is not None and not hasattr(config, "image_size"):
            return sub
    return config


def _pixels(config, batch: int, rng: np.random.Generator, *, video: bool) -> np.ndarray:
    # [B, C, H, W] float32; with `video`, for models with a num_frames field: [B, T, C, H, W].
    size = getattr(config, "image_size", None) or _IMAGE_SIZE
    height, width = (size, size) if isinstance(size, int) else tuple(size)[-2:]
    shape = (getattr(config, "num_channels", None) or 3, height, width)
    frames = getattr(config, "num_frames", None)
    shape = (batch, frames, *shape) if video and isinstance(frames, int) else (batch, *shape)
    return rng.standard_normal(shape, dtype=np.float32)


def _patches(config, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    # Variable-resolution (NaFlex) vision towers take an image as flattened patches of a grid:
    # pixel_values [B, P, C * p * p], pixel_attention_mask [B, P], spatial_shapes [B, 2] (rows, columns).
    side = _IMAGE_SIZE // config.patch_size
    patch = (getattr(config, "num_channels", None) or 3) * config.patch_size**2
    return {
        "pixel_values": rng.standard_normal((batch, side * side, patch), dtype=np.float32),
        "pixel_attention_mask": np.ones((batch, side * side), dtype=np.int64),
        "spatial_shapes": np.full((batch, 2), side, dtype=np.int64),
    }


def _audio(config, main_input_name: str, batch: int, rng: np.random.Generator) -> np.ndarray:
    """input_values (or a speech encoder-decoder's inputs, before a conv feature encoder): raw audio
    [B, samples]; input_features: log-mel frames, [B, mels, frames] for Whisper-style encoders (a
    num_mel_bins and a max_source_positions: frames = 2 * positions), else [B, frames, features]."""
    encoder = next(
        (sub for name in ("encoder_config", "audio_config", "encoder") if (sub := getattr(config, name, None))),
        config,
    )
    if main_input_name == "input_values" or (main_input_name == "inputs" and hasattr(encoder, "conv_kernel")):
        return rng.standard_normal((batch, _samples_for(encoder, _AUDIO_FRAMES)), dtype=np.float32)
    mels, positions = getattr(encoder, "num_mel_bins", None), getattr(encoder, "max_source_positions", None)
    if mels and positions and not hasattr(encoder, "feature_projection_input_dim"):
        return rng.standard_normal((batch, mels, 2 * positions), dtype=np.float32)
    if getattr(encoder, "input_feat_per_channel", None):
        features = encoder.input_feat_per_channel * getattr(encoder, "input_channels", 1)
    else:
        features = getattr(encoder, "feature_projection_input_dim", None) or mels or 80
        features *= _FEATURES_PER_MEL.get(getattr(encoder, "model_type", None), 1)
    return rng.standard_normal((batch, 2 * _AUDIO_FRAMES, features), dtype=np.float32)


def _samples_for(config, frames: int) -> int:
    # Audio samples a strided conv feature encoder (wav2vec2's conv_kernel, conv_stride) turns into `frames`.
    kernels, strides = getattr(config, "conv_kernel", None), getattr(config, "conv_stride", None)
    if not kernels or not strides:
        return 400 * frames
    receptive, hop = 1, 1
    for kernel, stride in zip(kernels, strides, strict=True):
        receptive += (kernel - 1) * hop
        hop *= stride
    return receptive + hop * (frames - 1)


def _outputs_of(out, task: str) -> dict[str, np.ndarray]:
    names = _COMPARED.get(task, ("logits",))
    name = next((n for n in names if getattr(out, n, None) is not None), names[0])
    value = getattr(out, name, None)
    if value is None:
        value = out[0]
    return {name: np.asarray(value.detach() if isinstance(value, torch.Tensor) else value, dtype=np.float32)}


def _timed(fn, repeats: int) -> tuple[object, float]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        _block(out)
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def _block(out) -> None:
    import jax

    jax.block_until_ready([x for x in jax.tree_util.tree_leaves(out) if isinstance(x, jax.Array)])


def check(
    path: str | os.PathLike,
    *,
    task: str | None = None,
    batch: int = 2,
    seq_len: int = 8,
    seed: int = 0,
    repeats: int = 3,
    eager: bool = True,
) -> CheckReport:
    """Runs one checkpoint in PyTorch and in hfjax (eager and jit) and compares outputs.

    Inputs are random, built from the config for the task: token ids [batch, seq_len] for text;
    pixel values [batch, C, H, W] at the config's image size for image tasks (with token ids for
    zero-shot-image-classification); raw audio [batch, samples] or log-mel features for
    automatic-speech-recognition, with decoder token ids for sequence-to-sequence models. Compared:
    `logits`; `last_hidden_state` for (image-)feature-extraction; `logits_per_image` for
    zero-shot-image-classification. Inputs with image or audio tokens in input_ids are laid out per
    family: image-text-to-text models and audio language models (automatic-speech-recognition with
    input_ids as main input) get token ids only, without media placeholder tokens (a text forward);
    image-text-to-text models that cannot run on text alone (BLIP, BLIP-2, InstructBLIP, Kosmos-2,
    IDEFICS, Pix2Struct, vision encoder-decoders, UDOP, PI0) get an image at the vision tower's size, its
    placeholder tokens, and what else their forward requires (Q-Former ids, boxes, robot state).

    Returns:
      A `CheckReport`; `.passed` is True when every output is within
      `hfjax.tolerances.for_family(model_type)`.

    Example:
      >>> report = hfjax.check("./tiny-llama")
      >>> print(report.table())
    """
    path = pathlib.Path(path)
    try:
        model = load(path, task=task, dtype="float32")
    except HfjaxError as error:
        return CheckReport(str(path), "?", task or "?", (), None, None, error=str(error))
    task = model.task
    config = model.config
    atol = tolerances.for_family(config.model_type).atol
    main_input_name = type(model.module).main_input_name
    inputs = _inputs(config, task, batch=batch, seq_len=seq_len, seed=seed, main_input_name=main_input_name)
    torch_inputs = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}

    reference_model = _tasks.auto_class(task, config).from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        reference, torch_seconds = _timed(lambda: reference_model(**torch_inputs), repeats)
    expected = _outputs_of(reference, task)

    rows, compile_seconds = [], None
    paths = (("eager", model.eager), ("jit", model)) if eager else (("jit", model),)
    for name, fn in paths:
        try:
            if name == "jit":
                start = time.perf_counter()
                _block(fn(**inputs))
                compile_seconds = time.perf_counter() - start
            out, seconds = _timed(functools.partial(fn, **inputs), repeats if name == "jit" else 1)
            got = _outputs_of(out, task)
            for field, want in expected.items():
                diff = float(np.max(np.abs(got[field] - want))) if got[field].shape == want.shape else float("inf")
                rows.append(CheckRow(field, name, diff, atol, seconds))
        except UnsupportedOpError as error:
            rows.append(CheckRow("-", name, None, atol, None, error=f"unsupported op {error.op} in {error.caller}"))
        except Exception as error:  # reported per path: the table must show every failure, not stop at the first
            last = traceback.extract_tb(error.__traceback__)[-1]
            rows.append(
                CheckRow(
                    "-",
                    name,
                    None,
                    atol,
                    None,
                    error=f"{type(error).__name__}: {str(error)[:200]} "
                    f"[{pathlib.Path(last.filename).name}:{last.lineno}]",
                )
            )
    return CheckReport(str(path), config.model_type, task, tuple(rows), torch_seconds, compile_seconds)


def check_arch(arch: str, *, task: str | None = None, **kwargs) -> CheckReport:
    """`check` on a tiny random checkpoint of a family (model_type) built by hfjax.testing."""
    from .. import testing

    with tempfile.TemporaryDirectory(prefix=f"hfjax-{arch}-") as directory:
        path = testing.save_tiny_checkpoint(arch, pathlib.Path(directory) / arch, task=task)
        return check(path, task=task, **kwargs)
