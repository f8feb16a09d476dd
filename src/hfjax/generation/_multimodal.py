"""Prefill-only model inputs: what a vision-language model reads with the prompt and never again.

`Model.generate(ids, mask, pixel_values=..., image_grid_thw=..., ...)` hands such inputs (any
array argument that the model's forward takes) to the engine. They go to the prefill program as
`PrefillInputs`; the decode loop runs on the cache and text tokens alone, as transformers' own
generate drops them after the first step.

Inputs laid out along the prompt (token_type_ids, mm_token_type_ids: [B, S]) are left-padded to
the prompt's bucket with zeros; others (pixel_values, pixel_attention_mask, ...) pass as they
are, but for the image grids that a model reads as Python numbers to size its patches
(`STATIC_INPUTS`): those are part of the program's key and constants in its trace. A model with multimodal rope (its inner model has `get_rope_index`, as
Qwen2-VL's) gets its prefill positions [3, B, S] computed on the host, where their
data-dependent layout can be, and the decode loop's positions are shifted by its rope deltas.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable

import jax
import numpy as np

from .._errors import GenerationError
from ._planning import BatchPlan

# Arguments of a forward that are not prefill inputs: the engine sets them, or they are not inputs.
_ENGINE_ARGUMENTS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "position_ids",
        "past_key_values",
        "cache",
        "cache_params",
        "inputs_embeds",
        "cache_position",
        "use_cache",
        "labels",
        "logits_to_keep",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "kwargs",
    }
)


# Integer inputs that models read with .tolist() to shape their vision tower's work.
STATIC_INPUTS = frozenset({"image_grid_thw", "video_grid_thw", "image_sizes"})

# Models whose image encoder has data-dependent shapes, which no program can trace: it runs op by
# op through torchax before the prefill, and the prefill takes its output (`mm_encoder_outputs`).
# {class name: why}
EAGER_IMAGE_ENCODERS = {
    name: "get_image_features drops all-padding images by a boolean index and splits the features per "
    "row with .tolist()"
    for name in ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
} | {
    "Gemma4ForConditionalGeneration": "get_image_features splits the features per image with .tolist() of "
    "the count of each image's real patches"
}
_IMAGE_FEATURES = "image_features"  # PrefillInputs.model_inputs key of an eager encoder's output [N, H]


@dataclasses.dataclass
class PrefillInputs:
    """The prefill program's extra inputs (B rows, padded prompt length P). Programs take the first
    two fields as a plain (dict, array) pair, which jax.export can keep; `static` is in their key."""

    model_inputs: dict  # {forward argument: array}, e.g. pixel_values [B, 3, H, W], token_type_ids [B, P]
    position_shift: jax.Array | None  # [B] int32: added to every decode position (rope deltas); else None
    static: tuple = ()  # ((name, nested tuple of ints), ...): STATIC_INPUTS, known when tracing

    def arguments(self) -> dict:
        """The forward's keyword arguments: the arrays, the static inputs as constant arrays, and an
        eager image encoder's output as transformers' `mm_encoder_outputs`."""
        import jax.numpy as jnp

        arguments = dict(self.model_inputs)
        if _IMAGE_FEATURES in arguments:
            from transformers.modeling_outputs import BaseModelOutputWithPooling

            from .. import bridge

            features = bridge.to_torch(arguments.pop(_IMAGE_FEATURES))
            arguments["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=(features,))}
        constants = {name: jnp.asarray(np.array(values, np.int32)) for name, values in self.static}
        return {**arguments, **constants}


def _image_runs(token_type_ids, image_types=(1,)):
    # Gemma 3: each run of image tokens (type 1) is a block of its own, numbered from 0; text is -1.
    import jax.numpy as jnp

    image = jnp.isin(token_type_ids, jnp.asarray(image_types))
    starts = image & ~jnp.pad(image, ((0, 0), (1, 0)))[:, :-1]
    return jnp.where(image, jnp.cumsum(starts.astype(jnp.int32), axis=1) - 1, -1)


def _vision_runs(mm_token_type_ids):
    # Gemma 4: each run of image or video tokens (types 1 and 2) is a block of its own.
    return _image_runs(mm_token_type_ids, image_types=(1, 2))


def _prefix(token_type_ids):
    # PaliGemma: the prefix (type 0: the image and the prompt) is one block; the answer (type 1) is -1.
    import jax.numpy as jnp

    return jnp.where(token_type_ids == 0, 0, -1)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """How one family's prefill mask lets blocks of tokens attend to each other both ways."""

    source: str  # the forward argument transformers builds the blocks from ([B, C] token types)
    rule: Callable  # that argument [B, C] -> block ids [B, C] int32, -1 outside any block
    kinds: tuple[str, ...] | None = None  # the attention kinds whose masks have them; None: every kind
    when: Callable = lambda config: True  # whether a checkpoint's config asks for them


# Models whose prefill lets blocks of tokens attend to each other both ways, as transformers builds
# their masks from token types: {config.model_type: Blocks}. The slot core builds its masks itself,
# so it adds these blocks. Gemma 4 has them only where its text config's use_bidirectional_attention
# is "vision", and only in its sliding-window layers (`create_masks_for_vision_model`).
BIDIRECTIONAL_BLOCKS = {
    "gemma3": Blocks("token_type_ids", _image_runs),
    "paligemma": Blocks("token_type_ids", _prefix),
    "gemma4": Blocks(
        "mm_token_type_ids",
        _vision_runs,
        kinds=("sliding_attention",),
        when=lambda config: getattr(config.get_text_config(), "use_bidirectional_attention", None) == "vision",
    ),
}

# The forward arguments from which some model builds bidirectional blocks; a model that reads one
# and is not in BIDIRECTIONAL_BLOCKS keeps its images off the slot core (`_on_slots.takes_images`).
BLOCK_SOURCES = frozenset({"token_type_ids"})


def blocks_of(module) -> Blocks | None:
    """`module`'s bidirectional blocks (`BIDIRECTIONAL_BLOCKS`), where its config asks for them; else None."""
    blocks = BIDIRECTIONAL_BLOCKS.get(module.config.model_type)
    return blocks if blocks is not None and blocks.when(module.config) else None


def block_ids(module, inputs: dict):
    """The prefill's bidirectional block ids [B, C] int32 (-1: causal) from `inputs`' token types,
    where `module`'s mask has such blocks (`blocks_of`); else None."""
    blocks = blocks_of(module)
    if blocks is None or blocks.source not in inputs:
        return None
    return blocks.rule(inputs[blocks.source]).astype("int32")


def split_model_inputs(module, arguments: dict) -> tuple[dict, dict]:
    """(prefill inputs, the rest) of `Model.generate`'s keyword arguments: the array-valued ones
    that `module.forward` takes, as numpy arrays. An array the forward does not take (pixel_values
    given to a text-only model) is a GenerationError."""
    accepted = inspect.signature(module.forward).parameters
    inputs, rest = {}, {}
    for name, value in arguments.items():
        if name in accepted and name not in _ENGINE_ARGUMENTS and _is_array(value):
            inputs[name] = np.asarray(value.cpu() if hasattr(value, "cpu") else value)
        elif _is_array(value) and name not in accepted:
            images = " (it takes no images)" if not hasattr(module, "get_image_features") else ""
            raise GenerationError(
                f"Model.generate: {name}= is an array, but {type(module).__name__}.forward has no argument {name!r}"
                f"{images}; pass only the inputs this model takes (input_ids, attention_mask, ...)"
            )
        else:
            rest[name] = value
    return inputs, rest


def prefill_inputs(module, plan: BatchPlan, inputs: dict[str, np.ndarray], prompt_length: int) -> PrefillInputs:
    """`inputs` laid out for `plan` (host arrays); `prompt_length` is the caller's S."""
    if plan.padded_prompts != plan.prompts:
        raise GenerationError(
            f"Model.generate: image inputs ({', '.join(inputs)}) with a batch of {plan.prompts} that does not divide "
            "over the mesh's data devices: hfjax does not repeat image inputs for the padding rows; pass a batch "
            "that divides over them"
        )
    if plan.per_prompt != 1:  # each prompt's rows (beams, samples) side by side, each with its images
        inputs = repeated(module, plan.ids[:: plan.per_prompt, -prompt_length:], inputs, plan.per_prompt)
    laid_out = _left_padded(inputs, plan.rows, prompt_length, plan.rows, plan.size)
    shift = None
    rope_index = getattr(getattr(module, "model", None), "get_rope_index", None)
    if rope_index is not None:
        positions, deltas = _rope_positions(rope_index, plan.ids, plan.mask, laid_out)
        laid_out["position_ids"] = positions
        shift = deltas
    static = tuple((name, laid_out.pop(name).tolist()) for name in sorted(STATIC_INPUTS & laid_out.keys()))
    return PrefillInputs(model_inputs=laid_out, position_shift=shift, static=frozen(static))


def repeated(module, ids: np.ndarray, inputs: dict[str, np.ndarray], times: int) -> dict[str, np.ndarray]:
    """`inputs` of the prompts `ids` [B, S] for each prompt repeated `times` times side by side, as
    transformers expands them for beams and samples: arrays along the prompts ([B, ...]) row by row;
    arrays along the images (pixels, grids, an eager encoder's features) each prompt's group of images
    whole, found by counting its image placeholder tokens. A GenerationError where the images'
    tokens cannot be told apart."""
    prompts = ids.shape[0]
    config = module.config
    token = image_token(config)
    placeholders = (ids == token).sum(axis=1) if token is not None else np.zeros(prompts, np.int64)
    grids = inputs.get("image_grid_thw")
    if _IMAGE_FEATURES in inputs:  # one feature row per placeholder token
        images, tokens = int(placeholders.sum()), np.ones(int(placeholders.sum()), np.int64)
        rows = {_IMAGE_FEATURES: tokens}
    elif grids is not None:  # Qwen2-VL: each image's patches in pixel_values, merged into its tokens
        patches = np.prod(grids, axis=1).astype(np.int64)
        merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", 1)
        images, tokens = len(grids), patches // merge**2
        rows = {"image_grid_thw": np.ones(images, np.int64), "pixel_values": patches}
    else:
        pixels = inputs.get("pixel_values")
        images = 0 if pixels is None or pixels.ndim != 4 else pixels.shape[0]  # [images, channels, H, W]
        tokens = np.full(images, placeholders.sum() // max(images, 1), np.int64)
        rows = {"pixel_values": np.ones(images, np.int64)} if images else {}
    # Each prompt's images: the run of images whose tokens add up to its placeholders.
    ends = np.searchsorted(np.cumsum(tokens), np.cumsum(placeholders), side="right")
    if images and (int(tokens.sum()) != int(placeholders.sum()) or ends[-1] != images):
        raise GenerationError(
            f"Model.generate: image inputs ({', '.join(inputs)}) hold {int(tokens.sum())} image tokens and the "
            f"prompts {int(placeholders.sum())} placeholders, so hfjax cannot give each of a prompt's {times} rows "
            "(num_beams / num_return_sequences) its images; pass the processor's outputs for these prompts"
        )
    starts = np.concatenate([[0], ends[:-1]])
    out = {}
    for name, value in inputs.items():
        if name in rows:  # each prompt's images, whole, `times` times
            bounds = np.concatenate([[0], np.cumsum(rows[name])])
            parts = [value[bounds[first] : bounds[last]] for first, last in zip(starts, ends)]
            out[name] = np.concatenate([part for part in parts for _ in range(times)])
        elif value.shape[:1] == (prompts,):
            out[name] = np.repeat(value, times, axis=0)
        else:
            raise GenerationError(
                f"Model.generate: image input {name} [{', '.join(map(str, value.shape))}] is laid out neither along "
                f"the prompts nor along the images, so hfjax cannot repeat it for each prompt's {times} rows; use "
                "num_beams=1, num_return_sequences=1"
            )
    return out


def chunk_inputs(module, ids: np.ndarray, inputs: dict[str, np.ndarray], width: int) -> tuple[dict, int]:
    """One prompt's prefill inputs for a one-row slot prefill chunk of `width` columns, its tokens
    last: `ids` [S] int, `inputs` the processor's other outputs for it ([1, ...] host arrays, without
    input_ids and attention_mask). Returns ({name: host array}, multimodal rope positions [3, 1, width]
    among them, the `STATIC_INPUTS` as int arrays; the row's rope delta, 0 without a multimodal rope)."""
    length = len(ids)
    padded = np.zeros((1, width), np.int32)
    padded[0, width - length :] = ids
    mask = (np.arange(width) >= width - length).astype(np.int32)[None, :]
    laid_out = _left_padded(inputs, 1, length, 1, width)
    rope_index = getattr(getattr(module, "model", None), "get_rope_index", None)
    if rope_index is None:
        return laid_out, 0
    positions, deltas = _rope_positions(rope_index, padded, mask, laid_out)
    return {**laid_out, "position_ids": positions}, int(deltas[0])


def _left_padded(inputs: dict, prompts: int, prompt_length: int, rows: int, size: int) -> dict:
    # Inputs laid out along the prompts ([prompts, prompt_length]) left-padded with zeros to [rows, size].
    laid_out = {}
    for name, value in inputs.items():
        if value.shape[:2] == (prompts, prompt_length) and value.ndim == 2:
            padded = np.zeros((rows, size), value.dtype)
            padded[:prompts, size - prompt_length :] = value
            value = padded
        laid_out[name] = value
    return laid_out


def encode_images_eagerly(module, inputs: dict, ids: np.ndarray) -> dict:
    """`inputs` with pixel_values (and pixel_attention_mask, image_position_ids) replaced by the image
    encoder's output, run op by op through torchax (the weights bound by the caller), for
    EAGER_IMAGE_ENCODERS whose forward takes transformers' `mm_encoder_outputs`. `ids` [..., S]: the
    prompts, whose image placeholders must be as many as the features' rows (a GenerationError else)."""
    from .. import bridge

    if type(module).__name__ not in EAGER_IMAGE_ENCODERS or "pixel_values" not in inputs:
        return inputs
    if "mm_encoder_outputs" not in inspect.signature(module.forward).parameters:
        return inputs  # (transformers before 5.24's Gemma 4: the prefill's trace runs the encoder)
    rest = dict(inputs)
    pixels = {
        name: bridge.to_torch(jax.numpy.asarray(rest.pop(name)))
        for name in ("pixel_values", "pixel_attention_mask", "image_position_ids")
        if name in rest
    }
    out = module.model.get_image_features(**pixels, return_dict=True)
    features = out.pooler_output
    if isinstance(features, (list, tuple)):
        import torch

        features = torch.cat(list(features), dim=0)
    rest[_IMAGE_FEATURES] = np.asarray(bridge.to_jax(features))  # [N image tokens, H]
    placeholders = int((np.asarray(ids) == image_token(module.config)).sum())
    if placeholders != rest[_IMAGE_FEATURES].shape[0]:
        raise GenerationError(
            f"Model.generate: the images make {rest[_IMAGE_FEATURES].shape[0]} image tokens, and the prompts hold "
            f"{placeholders} image placeholders; pass the input_ids the processor made with these images"
        )
    return rest


def image_token(config) -> int | None:
    """The id of the placeholder token that an image's features replace in the prompt, where the config names one."""
    token = getattr(config, "image_token_id", None)
    return getattr(config, "image_token_index", None) if token is None else token


# Values of the data that a model's prefill reads where an eager encoder ran, known from the shape of
# its features [N, H] (the host checked N against the placeholders, `encode_images_eagerly`): {class
# name: features' shape -> the values in the order the trace reads them}. Gemma 4 checks its
# placeholders' size against the features' with `inputs_embeds[image_mask].numel()`, a boolean index.
KNOWN_IMAGE_READS = {"Gemma4ForConditionalGeneration": lambda shape: (shape[0] * shape[1],)}


def known_reads(module, inputs: dict):
    """A block within which the prefill's trace of `module` with `inputs` (its arrays) gets the values
    it reads (`KNOWN_IMAGE_READS`); a block that does nothing for other models and inputs."""
    from .. import bridge

    known = KNOWN_IMAGE_READS.get(type(module).__name__)
    if known is None or _IMAGE_FEATURES not in inputs:
        return contextlib.nullcontext()
    return bridge.replaying([np.asarray(value) for value in known(inputs[_IMAGE_FEATURES].shape)])


def signature(inputs: PrefillInputs | None) -> tuple:
    """What of `inputs` shapes a program: names, shapes and dtypes."""
    if inputs is None:
        return ()
    arrays = {**inputs.model_inputs, "position_shift": inputs.position_shift}
    shapes = tuple((name, tuple(a.shape), str(a.dtype)) for name, a in sorted(arrays.items()) if a is not None)
    return shapes + inputs.static


def _rope_positions(rope_index, ids: np.ndarray, mask: np.ndarray, inputs: dict) -> tuple[np.ndarray, np.ndarray]:
    # Multimodal rope: positions [3, B, P] of (time, height, width), and per row the delta between
    # the next position and the count of prompt tokens. Run in PyTorch on the host: the image
    # layout decides them, which a traced program cannot read.
    import torch

    wanted = inspect.signature(rope_index).parameters
    arguments = {name: torch.as_tensor(inputs[name]) for name in wanted if name in inputs}
    ids, mask = torch.as_tensor(ids.astype(np.int64)), torch.as_tensor(mask.astype(np.int64))
    if "mm_token_type_ids" in wanted and "mm_token_type_ids" not in arguments:
        raise GenerationError(
            "Model.generate: this model's multimodal rope needs mm_token_type_ids (the processor returns it with "
            "input_ids); pass it with the processor's other outputs"
        )
    with torch.no_grad():
        positions, deltas = rope_index(ids, attention_mask=mask, **arguments)
    return positions.numpy().astype(np.int32), deltas.reshape(-1).numpy().astype(np.int32)


def frozen(value):
    """`value` (nested lists) as nested tuples, hashable."""
    return tuple(frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def _is_array(value) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")
