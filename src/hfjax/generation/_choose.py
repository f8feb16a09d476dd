"""Choosing each new token: transformers' logits processors in its order, then each row's pick.

`choose_tokens` is the one token choice every program makes (generate's decode loop, a server's
prefill and decode chunks): each row's single-token biases, the processors that read the tokens
so far (static settings; only `Model.generate` sets them), each row's penalties and warpers, then
the argmax or a draw. `choose` moves generate's decode state on by one token (or one beam step)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _beam, _sampling, _stops
from ._rows import HistoryRules, RowSampling, SamplingFeatures
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
    A constrained row chooses among the tokens its bitmask allows (`_sampling.allowed_only`).

    rows, features: each row's settings and what is compiled (`_rows.py`); positions: [R] int32, the
    position each new token takes (a sampling row's draw is keyed by its seed and this); seen, counts:
    [R, V] the rows' tokens so far, where the penalties need them; history: a function of the scores
    applying the processors that read the tokens so far (generate's static settings), or None.
    """
    scores = process_scores(logits, rows, features, positions, seen=seen, counts=counts, history=history)
    return _sampling.pick(scores, rows, positions, features), scores


def process_scores(
    logits, rows: RowSampling, features: SamplingFeatures, positions, *, seen=None, counts=None, history=None
):
    """`logits` [R, V] after every processor and warper `choose_tokens` applies, in transformers' order
    (its arguments): [R, V] float32. Beam search on the slot core scores its log-probabilities with it."""
    # A constrained row's grammar comes first: nothing after it can bring a disallowed token back.
    scores = _sampling.allowed_only(logits.astype(jnp.float32), rows, features)
    scores = _sampling.add_biases(scores, rows, features)
    # transformers holds EOS back after the biases and n-gram bans, before the forced tokens: a ban
    # commutes with those biases and bans, and the forced tokens override it.
    scores = _stops.hold_back(scores, features.held_ids(rows), positions, rows.min_position)
    if history is not None:
        scores = history(scores)
    return _sampling.process_logits(scores, rows, features, seen=seen, counts=counts)


def processed(logits, state: DecodeState, end, settings: GenerationSettings):
    """`logits` [B, V] after transformers' processors that come before repetition penalty and
    sampling, in its order. The rows so far are `state.sequence`'s columns [first_column, end)."""
    step = state.step
    # min_new_tokens and min_length: every row's EOS tokens, until the call's least new tokens (bans
    # commute with the biases and bans before them).
    logits = _stops.hold_back(logits, settings.eos_token_ids, step, state.least)
    rules = settings.history_rules()
    if rules is None:
        return logits
    # The encoder's ids; a decoder's "encoder input" is its prompt, in the buffer before the new tokens.
    if state.encoder_ids is not None:
        source = (state.encoder_ids, 0, state.encoder_ids.shape[1])
    else:
        source = (state.sequence, state.first_column, end - step)
    return apply_rules(
        logits, rules, state.sequence, state.first_column, end, step=step, last_step=state.max_new_tokens - 1,
        source=source,
    )  # fmt: skip


def apply_rules(scores, rules: HistoryRules, sequence, start, end, *, step, last_step, source):
    """`scores` [B, V] after `rules` (generate's processors that read the tokens so far), in
    transformers' order.

    Args:
        sequence: [B, L] int32, each row's tokens so far (transformers' input_ids, pads included) in
            its columns [start, end); start and end are [] (every row's) or [B] int32.
        step, last_step: the new token's index in the answer and that of the max_new_tokens-th, [] or [B].
        source: (ids [B, S], start, end), the n-grams `prompt_ngram_size` bans: a decoder's prompt,
            an encoder's ids.
    """
    vocab_size = scores.shape[-1]
    vocab = jnp.arange(vocab_size)
    if rules.sequence_bias:  # transformers' first processor; bad_words_ids are -inf biases
        scores = scores + _each_row(
            lambda tokens, first, last: _sampling.sequence_bias(tokens, first, last, rules.sequence_bias, vocab_size),
            sequence, start, end,
        )  # fmt: skip
    if rules.no_repeat_ngram_size:
        banned = _each_row(
            lambda tokens, first, last: _sampling.ngram_bans(tokens, first, last, rules.no_repeat_ngram_size, vocab_size),
            sequence, start, end,
        )  # fmt: skip
        scores = jnp.where(banned, -jnp.inf, scores)
    if rules.prompt_ngram_size:
        ids, first_id, end_id = source

        def bans(tokens, first, last, ids, first_id, end_id):
            return _sampling.encoder_ngram_bans(
                ids, first_id, end_id, tokens, first, last, rules.prompt_ngram_size, vocab_size
            )

        if all(jnp.ndim(x) == 0 for x in (start, end, first_id, end_id)):
            banned = bans(sequence, start, end, ids, first_id, end_id)
        else:
            rows = sequence.shape[0]
            each = [jnp.broadcast_to(x, (rows,)) for x in (start, end, first_id, end_id)]
            banned = jax.vmap(
                lambda tokens, first, last, row_ids, first_id, end_id: bans(
                    tokens[None], first, last, row_ids[None], first_id, end_id
                )[0]
            )(sequence, each[0], each[1], ids, each[2], each[3])
        scores = jnp.where(banned, -jnp.inf, scores)
    # As transformers' forced-token processors: the forced token scores 0 and every other -inf,
    # whatever the processors before had done to them.
    if rules.forced_bos_token_id is not None:  # where the row holds one token (a decoder's start), as transformers
        forced = jnp.where(vocab == rules.forced_bos_token_id, 0.0, -jnp.inf)
        scores = jnp.where(_column(end - start == 1), forced[None, :], scores)
    if rules.forced_eos_token_ids:
        forced = jnp.where(jnp.isin(vocab, jnp.asarray(rules.forced_eos_token_ids)), 0.0, -jnp.inf)
        scores = jnp.where(_column(step == last_step), forced[None, :], scores)
    if rules.suppress_tokens:
        scores = jnp.where(jnp.isin(vocab, jnp.asarray(rules.suppress_tokens))[None, :], -jnp.inf, scores)
    if rules.begin_suppress_tokens:
        at_begin = _column(step == rules.begin_suppress_step) & jnp.isin(
            vocab, jnp.asarray(rules.begin_suppress_tokens)
        )
        scores = jnp.where(at_begin, -jnp.inf, scores)
    return scores


def _each_row(function, sequence, start, end):
    """function(sequence [B, L], start, end) -> [B, V] with start and end [] for every row, or [B]:
    then each row's own (a vmap over rows)."""
    if jnp.ndim(start) == 0 and jnp.ndim(end) == 0:
        return function(sequence, start, end)
    rows = sequence.shape[0]
    start, end = jnp.broadcast_to(start, (rows,)), jnp.broadcast_to(end, (rows,))
    return jax.vmap(lambda tokens, first, last: function(tokens[None], first, last)[0])(sequence, start, end)


def _column(condition):
    """A condition [] or [B] as one that broadcasts over [B, V]."""
    return condition[:, None] if jnp.ndim(condition) == 1 else condition


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
    done = state.done | _stops.stopped(token, settings.eos_token_ids)
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
        state.beams, log_probs, state.sequence, end, state.step, state.max_new_tokens, settings.eos_token_ids,
        settings.beam,
    )  # fmt: skip
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
