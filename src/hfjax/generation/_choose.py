"""Choosing each new token inside the decode loop: transformers' logits processors in its order,
then sampling or a beam search step, and the state moved on by one token."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _beam, _sampling
from ._settings import GenerationSettings
from ._state import DecodeState


def needs_seen(settings: GenerationSettings) -> bool:
    """Whether the state keeps the tokens each row has seen (for the repetition penalty)."""
    return settings.sampling.repetition_penalty != 1.0


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
    """Samples the next token of every row from `logits` [B, V] and appends it to the state."""
    if settings.beam is not None:
        return _choose_beams(state, logits, offset, settings)
    key, draw = jax.random.split(jax.random.wrap_key_data(state.key))
    scores = _sampling.process_logits(
        processed(logits, state, offset + state.step, settings), state.seen, settings.sampling
    )  # [B, V]
    state = _kept(state, logits, scores)
    token = _sampling.pick(scores, draw, settings.sampling).astype(jnp.int32)  # [B]
    token = jnp.where(state.done, settings.pad_token_id, token)
    slot = offset + state.step
    sequence = jax.lax.dynamic_update_slice_in_dim(state.sequence, token[:, None], slot, axis=1)
    done = state.done
    if settings.eos_token_ids:
        done = done | jnp.isin(token, jnp.asarray(settings.eos_token_ids))
    return _advanced(state, sequence, token, slot, state.seen, done=done, key=jax.random.key_data(key))


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
    log_probs = processed(jax.nn.log_softmax(logits, axis=-1), state, end, settings)
    log_probs = _sampling.process_logits(log_probs, state.seen, settings.sampling)
    beams, sequence, parents, keep_going = _beam.step(
        state.beams, log_probs, state.sequence, end, state.step, state.budget, settings.eos_token_ids, settings.beam
    )
    rows = parents.shape[0]

    def follow(leaf):  # the cache's rows are the beams: each takes its parent's
        return leaf[parents] if jnp.ndim(leaf) and leaf.shape[0] == rows else leaf

    token = jax.lax.dynamic_index_in_dim(sequence, end, axis=1, keepdims=False)  # [B*K] each beam's new token
    seen = None if state.seen is None else state.seen[parents]
    return _advanced(
        state, sequence, token, end, seen,
        cache=jax.tree_util.tree_map(follow, state.cache),
        beams=beams,
        done=jnp.broadcast_to(~keep_going, state.done.shape),
    )  # fmt: skip
