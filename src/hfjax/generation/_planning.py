"""Batch planning: how a call's prompts are padded and laid out for the compiled programs.

Pure functions of the host's arrays and the settings: no model, no tracing. Programs are keyed
by the plan's sizes, so prompts whose lengths fall in one bucket, and token budgets that round
to one buffer length, share their programs.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .._buckets import bucket, round_up
from .._errors import GenerationError
from ._settings import GenerationSettings

CACHE_MULTIPLE = 64  # cache and buffer lengths round up to this, so nearby budgets share programs
MIN_BUCKET = 16  # the shortest padded prompt


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """A call's prompts as the programs take them (sizes in rows and tokens)."""

    ids: np.ndarray  # [rows, size] int32: each prompt padded, repeated per_prompt times
    mask: np.ndarray  # [rows, size] int32: 1 on the prompt's own tokens
    prompts: int  # prompts the caller gave
    padded_prompts: int  # prompts after padding the batch to the "data" devices
    per_prompt: int  # rows per prompt, side by side: its beams, or its samples
    size: int  # the padded prompt length
    offset: int  # where new tokens start in the token buffer
    first_column: int  # where transformers' rows (the caller's input_ids, pads included) start in it
    total: int  # the token buffer's and the cache's length L

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
) -> BatchPlan:
    """Lays out prompts ids, mask [B, S] int32 (left-padded by the caller) for `settings`.

    Decoders' prompts are padded on the left to a bucket (their positions come from the mask);
    encoders' on the right (their positions may not). `pad_to_bucket=False` keeps the caller's
    length (a model without a cache may read left pads: recurrent_gemma's recurrence does). On a
    mesh, prompts that do not divide over the "data" devices are padded with copies of the last.
    """
    prompts, length = ids.shape
    per_prompt = settings.beam.num_beams if settings.beam is not None else settings.num_return_sequences
    padded_prompts = round_up(prompts, data_devices // math.gcd(data_devices, per_prompt))
    size = bucket(length, smallest=MIN_BUCKET) if pad_to_bucket else length
    rows = padded_prompts * per_prompt
    padded_ids = np.full((rows, size), settings.pad_token_id, np.int32)
    padded_mask = np.zeros((rows, size), np.int32)
    columns = slice(0, length) if encoder_decoder else slice(size - length, size)
    for target, source in ((padded_ids, ids), (padded_mask, mask)):
        source = np.concatenate([source, np.repeat(source[-1:], padded_prompts - prompts, axis=0)])
        target[:, columns] = np.repeat(source, per_prompt, axis=0)
    # The buffer holds the decoder's prompt (the padded prompt, or an encoder-decoder's decoder
    # start token) and then the new tokens.
    offset = 1 if encoder_decoder else size
    return BatchPlan(
        ids=padded_ids,
        mask=padded_mask,
        prompts=prompts,
        padded_prompts=padded_prompts,
        per_prompt=per_prompt,
        size=size,
        offset=offset,
        first_column=0 if encoder_decoder else size - length,
        total=round_up(offset + settings.max_new_tokens, CACHE_MULTIPLE),
    )


def program_settings(settings: GenerationSettings, plan: BatchPlan) -> GenerationSettings:
    """The settings a program is compiled for: the budget as the whole buffer (this call's budget and
    minimum are arguments), one row per plan row."""
    return dataclasses.replace(
        settings, max_new_tokens=plan.total - plan.offset, min_new_tokens=0, num_return_sequences=1
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
