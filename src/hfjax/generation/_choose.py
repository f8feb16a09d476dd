"""Choosing each new token: transformers' logits processors in its order, then each row's pick.

`choose_tokens` is the one token choice every program makes (generate's decode loop, a server's
prefill and decode chunks): each row's single-token biases, the processors that read the tokens
so far (static settings; only `Model.generate` sets them), each row's penalties and warpers, then
the argmax or a draw. `choose` moves generate's decode state on by one token (or one beam step)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _beam, _sampling
from ._rows import RowSampling, SamplingFeatures
from ._settings import GenerationSettings
from ._state import DecodeState


def choose_tokens(
    logits,
    rows: RowSampling,
    features: SamplingFeatures,
    positions,
    *,
    seen=None,
    counts=None,
    history=None,
):
    """Each row's next token from `logits` [R, V]: (token [R] int32, processed scores [R, V] float32).

    rows, features: each row's settings and what is compiled (`_rows.py`); positions: [R] int32, the
    position each new token takes (a sampling row's draw is keyed by its seed and this); seen, counts:
    [R, V] the rows' tokens so far, where the penalties need them; history: a function of the scores
    applying the processors that read the tokens so far (generate's static settings), or None.
    """
    scores = _sampling.add_biases(logits.astype(jnp.float32), rows, features)
    if history is not None:
        scores = history(scores)
    scores = _sampling.hold_back(scores, rows, features, positions)
    scores = _sampling.process_logits(scores, rows, features, seen=seen, counts=counts)
    return _sampling.pick(scores, rows, positions, features), scores


def processed(logits, state: DecodeState, end, settings: GenerationSettings):
    """`logits` [B, V] after transformers' processors that come before repetition penalty and
    sampling, in its order. The rows so far are `state.sequence`'s columns [first_column, end)."""
    step, vocab_size = state.step, logits.shape[-1]
    vocab = jnp.arange(vocab_size)
    sequence, first = state.sequence, state.first_column
    if settings.sequence_bias:  # transformers' first processor; bad_words_ids are -inf biases
        logits = logits + _sampling.sequence_bias(sequence, first, end, settings.sequence_bias, vocab_size)
    if settings.no_repeat_ngram_size:
        banned = _sampling.ngram_bans(sequence, first, end, settings.no_repeat_ngram_size, vocab_size)
        logits = jnp.where(banned, -jnp.inf, logits)
    if settings.encoder_no_repeat_ngram_size:
        # The encoder's ids; a decoder's "encoder input" is its prompt, in the buffer before the new tokens.
        if state.encoder_ids is not None:
            source, source_start, source_end = state.encoder_ids, 0, state.encoder_ids.shape[1]
        else:
            source, source_start, source_end = sequence, first, end - step
        banned = _sampling.encoder_ngram_bans(
            source, source_start, source_end, sequence, first, end, settings.encoder_no_repeat_ngram_size, vocab_size
        )
        logits = jnp.where(banned, -jnp.inf, logits)
    if settings.eos_token_ids:  # min_new_tokens and min_length
        held = jnp.isin(vocab, jnp.asarray(settings.eos_token_ids)) & (step < state.least)
        logits = jnp.where(held[None, :], -jnp.inf, logits)
    # As transformers' forced-token processors: the forced token scores 0 and every other -inf,
    # whatever the processors before had done to them.
    if settings.forced_bos_token_id is not None:  # where the row holds one token (a decoder's start), as transformers
        forced = jnp.where(vocab == settings.forced_bos_token_id, 0.0, -jnp.inf)
        logits = jnp.where(end - first == 1, forced[None, :], logits)
    if settings.forced_eos_token_ids:
        forced = jnp.where(jnp.isin(vocab, jnp.asarray(settings.forced_eos_token_ids)), 0.0, -jnp.inf)
        logits = jnp.where(step == state.budget - 1, forced[None, :], logits)
    if settings.suppress_tokens:
        logits = jnp.where(jnp.isin(vocab, jnp.asarray(settings.suppress_tokens))[None, :], -jnp.inf, logits)
    if settings.begin_suppress_tokens:
        at_begin = (step == settings.begin_suppress_step) & jnp.isin(vocab, jnp.asarray(settings.begin_suppress_tokens))
        logits = jnp.where(at_begin[None, :], -jnp.inf, logits)
    return logits


def _kept(state: DecodeState, logits, scores) -> DecodeState:
    """`state` with this step's raw logits and processed scores [B, V] written into the [B, T, V]
    buffers that return_dict_in_generate asked for (None where it did not)."""
    kept = {}
    for name, values in (("logits", logits), ("scores", scores)):
        buffer = getattr(state, name)
        if buffer is not None:
            kept[name] = jax.lax.dynamic_update_slice_in_dim(buffer, values[:, None, :], state.step, axis=1)
    return state.replace(**kept)


def choose(state: DecodeState, logits, offset: int, settings: GenerationSettings) -> DecodeState:
    """Picks the next token of every row from `logits` [B, V] and appends it to the state."""
    if settings.beam is not None:
        return _choose_beams(state, logits, offset, settings)
    end = offset + state.step
    token, scores = choose_tokens(
        logits, state.rows, settings.features, state.next_position, seen=state.seen, counts=state.counts,
        history=lambda scores: processed(scores, state, end, settings),
    )  # fmt: skip
    state = _kept(state, logits, scores)
    token = jnp.where(state.done, settings.pad_token_id, token)
    slot = offset + state.step
    sequence = jax.lax.dynamic_update_slice_in_dim(state.sequence, token[:, None], slot, axis=1)
    done = state.done
    if settings.eos_token_ids:
        done = done | jnp.isin(token, jnp.asarray(settings.eos_token_ids))
    counts = None if state.counts is None else _sampling.update_counts(state.counts, token, ~state.done)
    return _advanced(state, sequence, token, slot, state.seen, done=done, counts=counts)


def _advanced(state: DecodeState, sequence, token, slot, seen, **changes) -> DecodeState:
    """`state` once `token` [B] sits at column `slot` of `sequence` [B, L]: attended to, at the
    next position, in the rows' `seen` tokens [B, V] (or None), one step on; plus `changes`."""
    mask = jax.lax.dynamic_update_slice_in_dim(state.mask, jnp.ones_like(token)[:, None], slot, axis=1)
    return state.replace(
        **changes,
        sequence=sequence,
        mask=mask,
        next_position=state.next_position + 1,
        seen=None if seen is None else _sampling.update_seen(seen, token),
        step=state.step + 1,
    )


def _choose_beams(state: DecodeState, logits, offset: int, settings: GenerationSettings) -> DecodeState:
    """One beam search step from `logits` [B*K, V]; the cache and `seen` follow the new beams' parents."""
    end = offset + state.step
    # transformers' beam search processes log-probabilities, not logits.
    log_probs = _sampling.add_biases(jax.nn.log_softmax(logits, axis=-1), state.rows, settings.features)
    log_probs = processed(log_probs, state, end, settings)
    log_probs = _sampling.process_logits(log_probs, state.rows, settings.features, seen=state.seen, counts=state.counts)
    beams, sequence, parents, keep_going = _beam.step(
        state.beams, log_probs, state.sequence, end, state.step, state.budget, settings.eos_token_ids, settings.beam
    )
    rows = parents.shape[0]

    def follow(leaf):  # the cache's rows are the beams: each takes its parent's
        return leaf[parents] if jnp.ndim(leaf) and leaf.shape[0] == rows else leaf

    token = jax.lax.dynamic_index_in_dim(sequence, end, axis=1, keepdims=False)  # [B*K] each beam's new token
    seen = None if state.seen is None else state.seen[parents]
    counts = None if state.counts is None else _sampling.update_counts(state.counts[parents], token)
    return _advanced(
        state, sequence, token, end, seen,
        cache=jax.tree_util.tree_map(follow, state.cache),
        beams=beams,
        counts=counts,
        done=jnp.broadcast_to(~keep_going, state.done.shape),
    )  # fmt: skip
