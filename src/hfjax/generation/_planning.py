"""Batch planning: how a call's prompts are padded and laid out for the compiled programs.

Pure functions of the host's arrays and the settings: no model, no tracing. Programs are keyed
by the plan's sizes, so prompts whose lengths fall in one bucket, and max_new_tokens values that
round to one buffer length, share their programs.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np

from .._buckets import bucket, round_up
from .._errors import GenerationError
from ._settings import GenerationSettings, SamplingConfig

CACHE_MULTIPLE = 64  # cache and buffer lengths round up to this, so nearby max_new_tokens share programs
MIN_BUCKET = 16  # the shortest padded prompt
STREAM_CHUNK = 8  # decode steps per host round trip when streaming


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """A call's prompts as the programs take them (sizes in rows and tokens)."""

    ids: np.ndarray  # [rows, size] int32: each prompt padded, repeated per_prompt times (or [rows, ...] features)
    mask: np.ndarray  # [rows, size] int32: 1 on the prompt's own tokens
    decoder_prompt: np.ndarray | None  # encoder-decoders: [rows, offset] int32, the decoder's first tokens
    prompts: int  # prompts the caller gave
    padded_prompts: int  # prompts after padding the batch to the "data" devices
    per_prompt: int  # rows per prompt, side by side: its beams, or its samples
    size: int  # the padded prompt length
    offset: int  # where new tokens start in the token buffer
    first_column: int  # where transformers' rows (the caller's input_ids, pads included) start in it
    total: int  # the token buffer's and the cache's length L
    # encoder-decoders with encoder_no_repeat_ngram_size: [rows, size] int32, the encoder's ids as
    # the caller gave them and -1 in the bucket's columns (no n-gram crosses into them); else None
    ngram_source: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return self.padded_prompts * self.per_prompt


def plan_batch(
    ids: np.ndarray,
    mask: np.ndarray,
    settings: GenerationSettings,
    *,
    encoder_decoder: bool,
    pad_to_bucket: bool,
    data_devices: int = 1,
    decoder_prompt: np.ndarray | None = None,
) -> BatchPlan:
    """Lays out prompts ids, mask [B, S] int32 (left-padded by the caller) for `settings`.

    Decoders' prompts are padded on the left to a bucket (their positions come from the mask);
    encoders' on the right (their positions may not). `pad_to_bucket=False` keeps the caller's
    length (a model without a cache may read left pads: recurrent_gemma's recurrence does). On a
    mesh, prompts that do not divide over the "data" devices are padded with copies of the last.

    An encoder whose input is not token ids (speech features [B, ...], float) takes `ids` as they
    are, padded in rows only, with `mask` [B, S] its mask. `decoder_prompt` [B, D] int32: an
    encoder-decoder's first decoder tokens (default: the decoder start token).
    """
    prompts, length = mask.shape
    per_prompt = settings.beam.num_beams if settings.beam is not None else settings.num_return_sequences
    padded_prompts = round_up(prompts, data_devices // math.gcd(data_devices, per_prompt))
    size = bucket(length, smallest=MIN_BUCKET) if pad_to_bucket else length
    rows = padded_prompts * per_prompt

    def rows_of(source: np.ndarray) -> np.ndarray:
        source = np.concatenate([source, np.repeat(source[-1:], padded_prompts - prompts, axis=0)])
        return np.repeat(source, per_prompt, axis=0)

    tokens = ids.shape == mask.shape
    padded_ids = np.full((rows, size), settings.pad_token_id, np.int32) if tokens else rows_of(ids)
    padded_mask = np.zeros((rows, size), np.int32)
    columns = slice(0, length) if encoder_decoder else slice(size - length, size)
    for target, source in ((padded_ids, ids), (padded_mask, mask))[0 if tokens else 1 :]:
        target[:, columns] = rows_of(source)
    if encoder_decoder and decoder_prompt is None:
        if settings.decoder_start_token_id is None:
            raise GenerationError(
                "Model.generate: the model's config and generation_config set neither decoder_start_token_id nor "
                "bos_token_id, so the decoder has no first token; pass decoder_start_token_id=ID or "
                "decoder_input_ids=[[ID]]"
            )
        decoder_prompt = np.full((prompts, 1), settings.decoder_start_token_id, np.int32)
    # The buffer holds the decoder's prompt (the padded prompt, or an encoder-decoder's decoder
    # prompt) and then the new tokens.
    offset = decoder_prompt.shape[1] if encoder_decoder else size
    # A decoder's n-grams to avoid are its prompt's, read from the buffer. An encoder's input that
    # is not token ids (speech features) has none: transformers then warns and bans nothing.
    ngram_source = None
    if encoder_decoder and settings.encoder_no_repeat_ngram_size:
        if np.issubdtype(ids.dtype, np.integer):
            ngram_source = np.full((rows, size), -1, np.int32)
            ngram_source[:, columns] = rows_of(ids)
        else:
            warnings.warn(
                f"encoder_no_repeat_ngram_size={settings.encoder_no_repeat_ngram_size}: the encoder's input is not "
                "token ids, so there are no n-grams to avoid; it is ignored, as transformers ignores it",
                UserWarning,
                stacklevel=4,
            )
    return BatchPlan(
        ids=padded_ids,
        mask=padded_mask,
        decoder_prompt=rows_of(decoder_prompt.astype(np.int32)) if encoder_decoder else None,
        prompts=prompts,
        padded_prompts=padded_prompts,
        per_prompt=per_prompt,
        size=size,
        offset=offset,
        first_column=0 if encoder_decoder else size - length,
        total=round_up(offset + settings.max_new_tokens, CACHE_MULTIPLE),
        ngram_source=ngram_source,
    )


def program_settings(settings: GenerationSettings, plan: BatchPlan) -> GenerationSettings:
    """The settings a program is compiled for: the plan's token buffer (`buffer_tokens`; this call's
    max_new_tokens and min_new_tokens are arguments), one row per plan row, the sampling values and
    single-token biases as per-row arrays (`GenerationSettings.row_sampling`) and only what they use
    compiled (`features`)."""
    # encoder_no_repeat_ngram_size holds where there are n-grams to read: a decoder's prompt, an encoder's ids.
    readable = plan.decoder_prompt is None or plan.ngram_source is not None
    return dataclasses.replace(
        settings,
        max_new_tokens=None,
        buffer_tokens=plan.total - plan.offset,
        min_new_tokens=0,
        num_return_sequences=1,
        encoder_no_repeat_ngram_size=settings.encoder_no_repeat_ngram_size if readable else 0,
        sampling=SamplingConfig(),
        sequence_bias=tuple(bias for bias in settings.sequence_bias if len(bias[0]) > 1),
        features=settings.program_features(),
    )


def windows(offset: int, total: int) -> tuple[int, ...]:
    """The cache lengths that the decode loop attends over in turn: a quarter and a half of the
    cache (in whole CACHE_MULTIPLEs) where they hold more than the prompt, then all of it.

    Attention reads every slot of the cache it is given, filled or not; with windows, early tokens
    attend over a short cache. Each window is a loop of its own in the one program, which costs
    compile time once per shape, so there are at most three (benchmarks/README.md).
    """
    parts = {round_up(total // share, CACHE_MULTIPLE) for share in (4, 2)}
    return (*sorted(window for window in parts if offset < window < total), total)


def infer_mask(ids: np.ndarray, settings) -> np.ndarray | None:
    """The attention mask [B, S] transformers infers when generate gets none: `ids != pad` where a
    pad token was set, appears in the prompts and is not an EOS token; else None (all ones)."""
    pad = settings.pad_token_id
    if not settings.pad_token_given or pad in settings.eos_token_ids or not (ids == pad).any():
        return None
    return (ids != pad).astype(np.int32)


def warn_if_right_padded(ids: np.ndarray, attention_mask, settings) -> None:
    """transformers' warning for decoder-only prompts padded on the right (checked before a mask is
    inferred: on the given mask's last column, else on the last token being the pad token)."""
    if ids.shape[0] < 2 or not (settings.pad_token_given or settings.eos_token_ids):
        return
    last = np.asarray(attention_mask)[:, -1] == 0 if attention_mask is not None else ids[:, -1] == settings.pad_token_id
    if last.any():
        warnings.warn(
            "A decoder-only architecture is being used, but right-padding was detected! For correct generation "
            "results, please set `padding_side='left'` when initializing the tokenizer.",
            stacklevel=3,
        )


def prompt_arrays(input_ids, attention_mask) -> tuple[np.ndarray, np.ndarray]:
    """int32 [B, S] token ids and mask from numpy, jax, torch or nested lists, checked."""
    if input_ids is None:
        raise GenerationError("Model.generate: input_ids is required (int token ids of shape [batch, length])")
    ids = np.asarray(input_ids.cpu() if hasattr(input_ids, "cpu") else input_ids)
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise GenerationError(
            f"Model.generate: input_ids must be integer token ids of shape [batch, length], got {ids.dtype} {ids.shape}"
        )
    if ids.shape[1] == 0:
        raise GenerationError(
            "Model.generate: input_ids is empty (length 0); every prompt needs at least one token, e.g. the BOS token"
        )
    if attention_mask is None:
        mask = np.ones_like(ids)
    else:
        mask = np.asarray(attention_mask.cpu() if hasattr(attention_mask, "cpu") else attention_mask)
        mask = mask[None, :] if mask.ndim == 1 else mask
        if mask.shape != ids.shape:
            raise GenerationError(
                f"Model.generate: attention_mask has shape {mask.shape}, input_ids {ids.shape}; they must match"
            )
    empty = np.flatnonzero(mask.sum(axis=1) == 0)
    if empty.size:
        raise GenerationError(
            f"Model.generate: prompt {int(empty[0])} is empty (its attention_mask has no 1s); "
            "every prompt needs at least one token"
        )
    return ids.astype(np.int32), mask.astype(np.int32)


def feature_arrays(name: str, features, attention_mask) -> tuple[np.ndarray, np.ndarray]:
    """float32 [B, ...] encoder features (e.g. Whisper's input_features [B, mels, frames]) and an int32
    mask [B, F] over their last axis (all ones where none is given), from numpy, jax or torch."""
    if features is None:
        raise GenerationError(f"Model.generate: {name} is required (the encoder's input, float [batch, ...])")
    array = np.asarray(features.float().cpu() if hasattr(features, "cpu") else features)
    if array.ndim < 2 or not np.issubdtype(array.dtype, np.floating):
        raise GenerationError(
            f"Model.generate: {name} must be float features of shape [batch, ...], got {array.dtype} {array.shape}"
        )
    if attention_mask is None:
        mask = np.ones((array.shape[0], array.shape[-1]), np.int32)
    else:
        mask = np.asarray(attention_mask.cpu() if hasattr(attention_mask, "cpu") else attention_mask)
        if mask.ndim != 2 or mask.shape[0] != array.shape[0]:
            raise GenerationError(
                f"Model.generate: attention_mask has shape {mask.shape}, {name} {array.shape}; "
                f"pass one row per {name} row, or none"
            )
    return array.astype(np.float32), mask.astype(np.int32)


def decoder_prompt_array(decoder_input_ids, rows: int) -> np.ndarray:
    """int32 [rows, D] decoder prompt from int ids [D], [1, D] (the same for every row) or [rows, D]."""
    ids = np.asarray(decoder_input_ids.cpu() if hasattr(decoder_input_ids, "cpu") else decoder_input_ids)
    ids = ids[None, :] if ids.ndim == 1 else ids
    if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer) or ids.shape[0] not in (1, rows):
        raise GenerationError(
            f"Model.generate: decoder_input_ids must be integer token ids of shape [{rows}, length] or [length], "
            f"got {ids.dtype} {ids.shape}"
        )
    return np.broadcast_to(ids, (rows, ids.shape[1])).astype(np.int32)
