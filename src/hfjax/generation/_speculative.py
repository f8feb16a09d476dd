"""Speculative decoding's parts that the rounds of `SpeculativeSlotModel.decode_chunk` use: the static
setting (`Speculation`), the prompt-lookup drafter, how many tokens a round keeps, and speculative
sampling's rule for a draft model's proposals.

A round drafts k tokens per row, runs the target once over the row's last token and its drafts
(k + 1 positions), and keeps the drafts that agree with the target, then the target's token after
them. With prompt lookup (a one-token proposal: p_draft one-hot) a draft agrees where it is the
token `pick` chooses there without speculation (the argmax, or the draw keyed by the
row's seed and the position): a kept token is the plain decode's, greedy and sampled alike, and
that is speculative sampling's rule (d accepted with probability p_target(d); on a rejection a
draw from p_target without d). A draft model's sampling rows take the general rule (`sampled_round`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from .._errors import GenerationError
from . import _stops

METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Speculation:
    """How a decode drafts tokens (static: part of a decode program's key).

    Args:
        method: "ngram", prompt lookup (transformers' prompt_lookup_num_tokens, vLLM's "ngram"); or
            "draft_model", a smaller model of the same vocabulary drafting one token at a time
            (transformers' assistant_model; `SlotPrograms(draft=...)`).
        num_speculative_tokens: k, the tokens drafted per row and round.
        prompt_lookup_max, prompt_lookup_min: the longest and shortest suffix of a row's tokens
            searched for in its tokens so far (transformers' max_matching_ngram_size and 1).
        backoff_rounds: the most rounds a row drafts nothing after a round whose drafts were all
            rejected (`backoff`: 1, then 2, 4, ... up to this, until a draft is kept again); 0: a row
            drafts in every round. Its rounds without drafts cost a plain step (and one step of a
            draft model, to keep its cache), so drafts that are never kept cost little. It changes no
            token: a row that drafts nothing keeps the token the target chooses, as without speculation.

    Example:
        >>> Speculation(method="ngram", num_speculative_tokens=3)
    """

    method: Literal["ngram", "draft_model"] = "ngram"
    num_speculative_tokens: int
    prompt_lookup_max: int = 2
    prompt_lookup_min: int = 1
    backoff_rounds: int = 8

    def __post_init__(self):
        if self.method not in METHODS:
            raise GenerationError(f"speculation method={self.method!r} is not one of {METHODS}; pass one of them")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GenerationError(f"{name}={value!r} must be an integer >= 1, e.g. {name}=3")
        if isinstance(self.backoff_rounds, bool) or not isinstance(self.backoff_rounds, int) or self.backoff_rounds < 0:
            raise GenerationError(
                f"backoff_rounds={self.backoff_rounds!r} must be an integer >= 0, e.g. backoff_rounds=8 (0: always draft)"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise GenerationError(
                f"prompt_lookup_min={self.prompt_lookup_min} is above prompt_lookup_max={self.prompt_lookup_max}; "
                "pass a minimum no larger than the maximum"
            )


def lookup_drafts(history, start, end, speculation: Speculation):
    """Prompt lookup: each row's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`,
    the longest that matches) found earlier among its tokens so far, the most recent match winning;
    the k tokens after that match are the draft.

    history: [R, L] int32, each row's tokens so far in its columns [start, end) ([R] int32 each).
    Returns (drafts [R, k] int32; their count [R] int32: fewer than k where the match ends near the
    row's last token, 0 where no suffix matches)."""
    rows, length = history.shape
    k = speculation.num_speculative_tokens
    found = jnp.zeros(rows, bool)
    after = jnp.zeros(rows, jnp.int32)  # the column after the match: the draft's first
    for n in range(speculation.prompt_lookup_max, speculation.prompt_lookup_min - 1, -1):
        windows = length - n  # a match at column s leaves column s + n for the draft's first token
        if windows < 1:
            continue
        tail = jnp.clip(end[:, None] - n + jnp.arange(n, dtype=jnp.int32)[None, :], 0, length - 1)
        suffix = jnp.take_along_axis(history, tail, axis=1)  # [R, n]
        first = jnp.arange(windows, dtype=jnp.int32)[None, :]  # [1, W]
        match = (first >= start[:, None]) & (first + n < end[:, None])  # [R, W]: inside the row, before its suffix
        for i in range(n):
            match &= history[:, i : i + windows] == suffix[:, i : i + 1]
        latest = jnp.max(jnp.where(match, first, -1), axis=1)  # [R]
        new = ~found & (latest >= 0)
        after = jnp.where(new, latest + n, after)
        found |= new
    columns = jnp.clip(after[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :], 0, length - 1)
    drafts = jnp.take_along_axis(history, columns, axis=1)
    return drafts, jnp.where(found, jnp.clip(end - after, 0, k), 0).astype(jnp.int32)


def backoff(pause, wait, offered, accepted, going, longest: int):
    """Each row's rounds without drafts after this round: a row whose drafts were all rejected
    (`offered` [R] > 0, `accepted` [R] 0) pauses for `wait` rounds and its next pause doubles, up to
    `longest`; a row that kept a draft pauses 1 round after its next rejection; a paused row that ran
    this round (`going` [R] bool) has one round less to wait. pause, wait: [R] int32. Returns the new
    (pause, wait)."""
    rejected = (offered > 0) & (accepted == 0)
    pause = jnp.where(rejected, jnp.minimum(wait, longest), jnp.where(going, jnp.maximum(pause - 1, 0), pause))
    wait = jnp.where(rejected, jnp.minimum(2 * wait, longest), jnp.where(accepted > 0, 1, wait))
    return pause.astype(jnp.int32), wait.astype(jnp.int32)


def accepted_count(agree, offered):
    """[R] int32: how many leading drafts each row keeps, given whether each agrees with the target
    (`agree` [R, k] bool) and how many it offered (`offered` [R])."""
    k = agree.shape[1]
    agree = agree & (jnp.arange(k)[None, :] < offered[:, None])
    return jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def kept_count(tokens, accepted, room, stops):
    """How many of a round's tokens `tokens` [R, k + 1] (its accepted drafts, then the target's token
    after them) each row keeps: `accepted` [R] + 1, at most `room` [R] (what the row may still make in
    this chunk; 0: nothing), and nothing after a stop token (`stops`, a tuple of ids). Returns
    (kept [R], the drafts among them [R]) int32."""
    kept = jnp.minimum(accepted + 1, room)
    if stops:
        stopping = _stops.stopped(tokens, stops)  # [R, k + 1]
        first_stop = jnp.where(jnp.any(stopping, axis=1), jnp.argmax(stopping, axis=1), tokens.shape[1])
        kept = jnp.minimum(kept, first_stop + 1)
    kept = kept.astype(jnp.int32)
    return kept, jnp.clip(jnp.minimum(accepted, kept - 1), 0).astype(jnp.int32)


# What each of a sampling row's keys draws, beside `pick`'s target draw (its key folded with the position).
DRAFT, ACCEPT, RESIDUAL = 1, 2, 3


def purpose_keys(keys, purpose: int):
    """[R, 2] uint32: each row's key data `keys` with `purpose` folded in (a draw of its own)."""
    return jax.vmap(lambda key: jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(key), purpose)))(keys)


def sampled_round(targets, target_scores, draft_scores, drafts, offered, rows, positions):
    """Speculative sampling's tokens for a draft model's proposals: a sampling row (temperature > 0)
    accepts its draft d at index j with probability min(1, p(d) / q(d)) (p: the target's processed
    distribution there, `target_scores` [R, k + 1, V]; q: the draft's, `draft_scores` [R, k, V], from
    which d was drawn), and at its first rejection takes a draw from norm(max(p - q, 0)); a greedy row
    accepts a draft equal to the target's token. Draws are keyed by the row's key, a purpose and the
    position (`positions` [R]: the first new token's). Returns (tokens [R, k + 1]: the accepted drafts,
    then the token after them; accepted [R])."""
    k = drafts.shape[1]
    sampling = (rows.temperature > 0)[:, None]  # [R, 1]
    p = jax.nn.softmax(target_scores[:, :k], axis=-1)  # [R, k, V]
    q = jax.nn.softmax(draft_scores, axis=-1)
    p_d = jnp.take_along_axis(p, drafts[:, :, None], axis=-1)[:, :, 0]  # [R, k]
    q_d = jnp.take_along_axis(q, drafts[:, :, None], axis=-1)[:, :, 0]
    at = positions[:, None] + jnp.arange(1, k + 1, dtype=jnp.int32)[None, :]  # [R, k]: the drafts' positions

    def draws(purpose, shape):  # [R, k, *shape] float32 noise per row, position and purpose
        def one(key, position):
            key = jax.random.fold_in(jax.random.wrap_key_data(key), position)
            return jax.random.uniform(key, shape) if not shape else jax.random.gumbel(key, shape)

        keys = purpose_keys(rows.key, purpose)
        return jax.vmap(lambda key, where: jax.vmap(lambda w: one(key, w))(where))(keys, at)

    agree = jnp.where(sampling, draws(ACCEPT, ()) * q_d < p_d, drafts == targets[:, :k])
    accepted = accepted_count(agree, offered)
    residual = jnp.maximum(p - q, 0.0)  # [R, k, V]
    redrawn = jnp.argmax(jnp.log(residual) + draws(RESIDUAL, (p.shape[-1],)), axis=-1).astype(jnp.int32)
    rejected = jnp.any(residual > 0, axis=-1) & sampling & (jnp.arange(k)[None, :] < offered[:, None])
    correction = jnp.where(rejected, redrawn, targets[:, :k])  # [R, k]
    index = jnp.arange(k)[None, :]
    tokens = jnp.where(index < accepted[:, None], drafts, correction)
    return jnp.concatenate([tokens, targets[:, k:]], axis=1), accepted
