"""Choosing the next token from the last position's logits, the way transformers does, one row at a time.

These are pure-JAX functions the compiled programs call (a decode loop, a server's chunk); nothing
here branches in Python on array values. Each row has settings of its own (`RowSampling`,
`_rows.py`); `SamplingFeatures` (static) says which parts are compiled at all.

transformers builds its processors in `GenerationMixin._get_logits_processor`; for the settings
here the order is

    a constrained row's allowed tokens (a grammar's bitmask) -> single-token biases
    -> (the processors that read the tokens so far: `_choose.py`)
    -> repetition penalty -> presence and frequency penalties (OpenAI's)
    -> temperature -> top-k -> top-p -> min-p

and the last four (the "warpers") apply only to rows that sample. Filtered tokens get -inf, and
every filter keeps at least one token (transformers' min_tokens_to_keep=1). transformers has no
presence or frequency penalty: they follow OpenAI's definition (the logit of a token the answer
holds c times goes down by c * frequency_penalty + presence_penalty), as vLLM applies it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import GenerationError

if TYPE_CHECKING:  # annotations only: _rows builds on these functions' inputs
    from ._rows import RowSampling, SamplingFeatures

__all__ = [
    "process_logits",
    "pick",
    "inverse_cdf",
    "first_argmax",
    "seen_mask",
    "update_seen",
    "sequence_bias",
    "ngram_bans",
]


def process_logits(
    logits: jax.Array,
    rows: RowSampling,
    features: SamplingFeatures,
    *,
    seen: jax.Array | None = None,
    counts: jax.Array | None = None,
) -> jax.Array:
    """The last position's logits after each row's penalties and, for rows that sample, its
    warpers, in transformers' order (the single-token biases and the processors that read the
    tokens so far come first: `_choose.choose_tokens`).

    Args:
        logits: [R, V] scores of the next token.
        rows: each row's settings, arrays [R] (`RowSampling`).
        features: which parts to compile (static; `SamplingFeatures`).
        seen: [R, V] bool, token ids already in the row (prompt and answer, pads excluded; see
            `seen_mask` and `update_seen`); needed when `features.repetition`.
        counts: [R, V] int32, how often the answer holds each token; needed when `features.presence`.

    Returns:
        [R, V] float32; tokens removed by top-k, top-p or min-p are -inf.

    Top-p keeps every token tied with the least likely token it keeps; transformers' result on
    such ties depends on the order torch's unstable sort happens to give them.
    """
    if logits.ndim != 2:
        raise GenerationError(
            f"logits has shape {tuple(logits.shape)}; pass the last position's logits as [batch, vocab], "
            "e.g. logits[:, -1, :]"
        )
    scores = logits.astype(jnp.float32)  # [R, V]
    if features.repetition:
        _check_history(
            "seen", seen, logits, jnp.bool_, "build it with seen_mask(input_ids, attention_mask, vocab_size)"
        )
        penalty = rows.repetition_penalty[:, None]  # [R, 1]
        penalized = jnp.where(scores < 0, scores * penalty, scores / penalty)
        scores = jnp.where(seen & (penalty != 1.0), penalized, scores)
    if features.presence:
        _check_history("counts", counts, logits, jnp.int32, "count the answer's tokens with update_counts")
        held = counts.astype(jnp.float32)
        present = (counts > 0).astype(jnp.float32)
        scores = scores - held * rows.frequency_penalty[:, None] - present * rows.presence_penalty[:, None]
    if not features.sampling:
        return scores
    sampling = (rows.temperature > 0)[:, None]  # [R, 1]: the warpers apply to these rows only
    vocab = scores.shape[-1]

    # Each warper runs under a `lax.cond`, and all of them under one: a batch of greedy rows (or of
    # rows that set no min-p) pays for none of them; min-p's softmax over [R, V] alone was ~60% of
    # a server's token choice for 16 greedy rows on the CPU.
    def warp(scores):
        warped = scores / jnp.where(sampling, rows.temperature[:, None], 1.0)
        if features.top_k or features.top_p:
            k = rows.top_k[:, None]  # [R, 1]
            top_k_on = sampling & (k > 0) & (k < vocab) if features.top_k else jnp.zeros_like(sampling)
            top_p_on = sampling & (rows.top_p[:, None] < 1.0) if features.top_p else jnp.zeros_like(sampling)

            def narrowed(warped):
                # The candidates, a partial sort: a full one of 16 x 32000 scores took 35-70 ms on
                # the CPU, where lax.top_k of 256 took 2.5 ms.
                best = jax.lax.top_k(warped, min(features.candidates, vocab))[0]  # [R, C] descending
                if features.top_k:
                    kth = _kth_largest(warped, best, k, top_k_on)  # [R, 1]
                    warped = jnp.where(top_k_on & (warped < kth), -jnp.inf, warped)
                    best = jnp.where(top_k_on & (best < kth), -jnp.inf, best)
                if features.top_p:
                    warped = jnp.where(top_p_on, top_p_filter(warped, rows.top_p[:, None], best, top_p_on), warped)
                return warped

            warped = jax.lax.cond(jnp.any(top_k_on | top_p_on), narrowed, lambda warped: warped, warped)
        if features.min_p:
            on = sampling & (rows.min_p[:, None] > 0.0)

            def min_p(warped):
                probs = jax.nn.softmax(warped, axis=-1)  # [R, V]
                # The most likely token is never below min_p times itself, so one token always stays.
                floor = rows.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)  # [R, 1]
                return jnp.where(on & (probs < floor), -jnp.inf, warped)

            warped = jax.lax.cond(jnp.any(on), min_p, lambda warped: warped, warped)
        return jnp.where(sampling, warped, scores)

    return jax.lax.cond(jnp.any(sampling), warp, lambda scores: scores, scores)


def _kth_largest(scores: jax.Array, best: jax.Array, k: jax.Array, on: jax.Array) -> jax.Array:
    """[R, 1]: each row's k-th largest score (k [R, 1] >= 1, ties counted), read from its candidates
    `best` [R, C] (descending) where k <= C, else by a radix select over its whole row (only where a
    row that top-k applies to, `on` [R, 1], asks for more than C; other rows' values are not used)."""
    count = best.shape[-1]
    kth = jnp.take_along_axis(best, jnp.clip(k - 1, 0, count - 1), axis=-1)  # [R, 1]
    beyond = on & (k > count)

    def selected():
        keys = _ordered(scores)  # [R, V]
        # The largest key with at least k scores at or above it: a score's, bit by bit from the top.
        largest = _largest_where(lambda key: jnp.sum(keys >= key, axis=-1, keepdims=True) >= k, scores.shape[0])
        return jnp.where(beyond, _from_ordered(largest), kth)

    return jax.lax.cond(jnp.any(beyond), selected, lambda: kth)


def _ordered(scores: jax.Array) -> jax.Array:
    """float32 scores as uint32 keys in the same order (-inf lowest; NaN is not ordered)."""
    bits = jax.lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _from_ordered(keys: jax.Array) -> jax.Array:
    """`_ordered`'s inverse: uint32 keys back to float32 scores."""
    bits = jnp.where(keys >> 31 == 1, keys & jnp.uint32(0x7FFFFFFF), ~keys)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest_where(holds, rows: int) -> jax.Array:
    """[R, 1] uint32: the largest key at which `holds(key [R, 1])` ([R, 1] bool, true up to some key and
    false above it in each row) is true, built bit by bit from the top in 32 passes; 0 where it never is."""

    def bit(i, largest):
        wider = largest | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(holds(wider), wider, largest)

    return jax.lax.fori_loop(0, 32, bit, jnp.zeros((rows, 1), jnp.uint32))


def _check_history(name: str, value, logits, dtype, fix: str) -> None:
    if value is None or value.shape != logits.shape or value.dtype != dtype:
        got = "None" if value is None else f"{value.dtype.name} {tuple(value.shape)}"
        raise GenerationError(
            f"{name} is {got} but the settings need a {jnp.dtype(dtype).name} array of the logits' shape "
            f"{tuple(logits.shape)}; {fix}"
        )


def top_p_filter(scores: jax.Array, top_p, best: jax.Array, on: jax.Array) -> jax.Array:
    """`scores` [R, V] with the tokens outside each row's top-p set to -inf (top_p: a float or [R, 1]).

    transformers removes the tokens of an ascending sort whose cumulative probability is at most
    1 - top_p. The same tokens are the most likely ones while the probability before each is below
    top_p, ties with the least likely kept one included: that is read from the row's candidates
    `best` [R, C] (its C largest scores, descending),
    or, in a row whose kept tokens may lie past them, by a radix select over its whole row (32 passes,
    no sort: a sort of 16 x 32000 scores took 35-70 ms on the CPU). These sum the probabilities in
    another order than transformers' cumulative sum, so the kept tokens can differ only where a
    cumulative probability is within float32 rounding of 1 - top_p. `on` [R, 1]: the rows whose result
    is used (no other row makes the chunk select over its whole row)."""
    count = best.shape[-1]
    total = jax.nn.logsumexp(scores, axis=-1, keepdims=True)  # [R, 1]
    before = jnp.cumsum(jnp.exp(best - total), axis=-1)[:, :-1]  # [R, C - 1]: probability up to each candidate
    kept = 1 + jnp.sum(before < top_p, axis=-1, keepdims=True)  # [R, 1], 1 <= kept <= C
    smallest_kept = jnp.take_along_axis(best, kept - 1, axis=-1)  # [R, 1]
    # Settled where the first C - 1 candidates hold top_p, or no finite score lies below the last one.
    below = jnp.any(jnp.isfinite(scores) & (scores < best[:, -1:]), axis=-1, keepdims=True)  # [R, 1]
    settled = (~below if count < 2 else (before[:, -1:] >= top_p) | ~below) | ~on

    def selected_smallest_kept():
        # The least likely kept score is the smallest score with less than top_p above it: the key
        # after the largest at which at least top_p lies above (0, keeping all, where none is).
        keys, probs = _ordered(scores), jax.nn.softmax(scores, axis=-1)  # [R, V]
        above = lambda key: jnp.sum(jnp.where(keys > key, probs, 0.0), axis=-1, keepdims=True) >= top_p  # noqa: E731
        largest = _largest_where(above, scores.shape[0])
        least = jnp.where(above(jnp.zeros_like(largest)), largest + 1, 0)
        return jnp.where(settled, smallest_kept, _from_ordered(least))

    smallest_kept = jax.lax.cond(jnp.all(settled), lambda: smallest_kept, selected_smallest_kept)
    return jnp.where(scores < smallest_kept, -jnp.inf, scores)


def pick(scores: jax.Array, rows: RowSampling, positions: jax.Array, features: SamplingFeatures) -> jax.Array:
    """The next token of every row from processed scores [R, V] (`process_logits`'s): the argmax
    for rows of temperature 0, else a draw from their softmax with the row's key folded with
    `positions` [R] (the position the new token takes), so a row's tokens depend on its seed and
    position, never on the other rows. Returns [R] int32."""
    if not features.sampling:
        return first_argmax(scores)
    sampling = rows.temperature > 0  # [R]

    def drawn():
        def uniform(key_data, position):
            return jax.random.uniform(jax.random.fold_in(jax.random.wrap_key_data(key_data), position), (), jnp.float32)

        return jnp.where(sampling, inverse_cdf(scores, jax.vmap(uniform)(rows.key, positions)), greedy)

    greedy = first_argmax(scores)
    return jax.lax.cond(jnp.any(sampling), drawn, lambda: greedy)


DRAW_BLOCK = 256  # tokens per block of the draw's two-level cumulative sum


def inverse_cdf(scores: jax.Array, uniform: jax.Array) -> jax.Array:
    """[R] int32: each row's token whose interval of the cumulative softmax of `scores` [R, V] holds
    `uniform` [R] (in [0, 1)): a draw from the softmax with one random number a row. The sum runs in
    two levels, blocks of DRAW_BLOCK tokens, then the chosen block's tokens, so no scan spans the
    vocabulary; a token of probability 0 (-inf) is never chosen, even where rounding puts the
    uniform past the last block's end. The token choice with temperature alone, 16 x 32000 scores on
    the CPU, took 3.3 ms with a Gumbel-max draw (noise for every token), 2.3-2.5 ms with this
    (docs/architecture.md, "One token choice")."""
    count, vocab = scores.shape
    blocks = -(-vocab // DRAW_BLOCK)
    weights = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))  # [R, V], unnormalised; -inf: 0
    weights = jnp.pad(weights, ((0, 0), (0, blocks * DRAW_BLOCK - vocab))).reshape(count, blocks, DRAW_BLOCK)
    block_mass = jnp.sum(weights, axis=-1)  # [R, B]
    block_end = jnp.cumsum(block_mass, axis=-1)  # [R, B]
    target = uniform * block_end[:, -1]  # [R]
    block = _first_passing(block_end, block_mass, target)  # [R]
    rest = target - jnp.take_along_axis(block_end - block_mass, block[:, None], axis=-1)[:, 0]  # [R]
    within = jnp.take_along_axis(weights, block[:, None, None], axis=1)[:, 0]  # [R, DRAW_BLOCK]
    return block * DRAW_BLOCK + _first_passing(jnp.cumsum(within, axis=-1), within, rest)


def _first_passing(ends: jax.Array, mass: jax.Array, target: jax.Array) -> jax.Array:
    """[R] int32: per row, the first index of positive `mass` [R, N] whose cumulative end (`ends`
    [R, N]) is above `target` [R], else the last index of positive mass."""
    index = jax.lax.broadcasted_iota(jnp.int32, mass.shape, 1)
    positive = mass > 0
    first = jnp.min(jnp.where(positive & (ends > target[:, None]), index, mass.shape[-1]), axis=-1)
    last = jnp.max(jnp.where(positive, index, 0), axis=-1)
    return jnp.minimum(first, last)


def allowed_only(scores: jax.Array, rows: RowSampling, features: SamplingFeatures) -> jax.Array:
    """`scores` [R, V] at -inf in the tokens a `constrained` row's bitmask (`rows.allowed` [R, ceil(V / 32)]
    int32) does not allow; unchanged where no row is constrained (a `lax.cond`: such chunks expand no mask)."""
    if not features.mask_words:
        return scores

    def masked():
        shifts = jnp.arange(32, dtype=jnp.int32)
        bits = (rows.allowed[:, :, None] >> shifts) & 1  # [R, W, 32]
        allowed = bits.reshape(bits.shape[0], -1)[:, : scores.shape[-1]] == 1  # [R, V]
        return jnp.where(allowed | ~rows.constrained[:, None], scores, -jnp.inf)

    return jax.lax.cond(jnp.any(rows.constrained), masked, lambda: scores)


def add_biases(scores: jax.Array, rows: RowSampling, features: SamplingFeatures) -> jax.Array:
    """`scores` [R, V] plus each row's single-token biases (OpenAI's logit_bias; transformers'
    sequence_bias of one token): [R, V] float32."""
    if not features.bias_slots:
        return scores
    index = jnp.broadcast_to(jnp.arange(scores.shape[0])[:, None], rows.bias_ids.shape)
    return scores.astype(jnp.float32).at[index, rows.bias_ids].add(rows.bias_values, mode="drop")


def first_argmax(scores: jax.Array) -> jax.Array:
    """`jnp.argmax(scores, axis=-1)` as int32, in two vectorised passes over the last axis.

    XLA:CPU lowers jnp.argmax to a reduction over (value, index) pairs that it does not
    vectorise: 1.05 ms for 8 x 32000 logits, against 0.23 ms for a max followed by the
    smallest index that holds it. Ties and NaN resolve as jnp.argmax does: the first
    maximum, or the first NaN when there is one.
    """
    top = jnp.max(scores, axis=-1, keepdims=True)
    hit = (scores == top) | jnp.isnan(scores)
    index = jax.lax.broadcasted_iota(jnp.int32, scores.shape, scores.ndim - 1)
    return jnp.min(jnp.where(hit, index, scores.shape[-1]), axis=-1)


def seen_mask(input_ids: jax.Array, attention_mask: jax.Array | None, vocab_size: int) -> jax.Array:
    """Which token ids occur in each row of `input_ids`, pads (attention_mask == 0) excluded.

    Args:
        input_ids: [B, S] integer token ids.
        attention_mask: [B, S], nonzero for real tokens; None counts every position.
        vocab_size: V, the width of the logits.

    Returns:
        [B, V] bool.

    Raises ValueError for an id outside [0, vocab_size) at an attended position when the ids
    are concrete; under tracing such ids cannot be checked and are left out.

    Example:
        >>> seen_mask(jnp.array([[0, 5, 5]]), jnp.array([[0, 1, 1]]), 8)[0]
        Array([False, False, False, False, False,  True, False, False], dtype=bool)
    """
    if input_ids.ndim != 2:
        raise GenerationError(f"input_ids has shape {tuple(input_ids.shape)}; pass [batch, sequence] token ids")
    if attention_mask is None:
        attended = jnp.ones(input_ids.shape, bool)  # [B, S]
    elif attention_mask.shape != input_ids.shape:
        raise GenerationError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has {tuple(input_ids.shape)}; "
            "pass the mask of these ids, or None if there are no pads"
        )
    else:
        attended = attention_mask != 0  # [B, S]
    in_range = (input_ids >= 0) & (input_ids < vocab_size)  # [B, S]
    if not isinstance(input_ids, jax.core.Tracer) and not isinstance(attended, jax.core.Tracer):
        outside = np.asarray(attended & ~in_range)
        if outside.any():
            row, position = np.argwhere(outside)[0]
            raise GenerationError(
                f"input_ids[{row}, {position}]={int(input_ids[row, position])} is outside [0, vocab_size={vocab_size}); "
                "pass the vocab_size of the model's logits, or mark that position as a pad in attention_mask"
            )
    rows = jnp.broadcast_to(jnp.arange(input_ids.shape[0])[:, None], input_ids.shape)  # [B, S]
    columns = jnp.where(attended & in_range, input_ids, vocab_size)  # [B, S]; vocab_size is dropped
    return jnp.zeros((input_ids.shape[0], vocab_size), bool).at[rows, columns].set(True, mode="drop")


def update_seen(seen: jax.Array, tokens: jax.Array) -> jax.Array:
    """`seen` [B, V] bool with each row's new token `tokens` [B] marked; returns [B, V] bool.

    Example:
        >>> seen = update_seen(seen, token)
    """
    return seen.at[jnp.arange(seen.shape[0]), tokens].set(True)


def update_counts(counts: jax.Array, tokens: jax.Array, counted: jax.Array | None = None) -> jax.Array:
    """`counts` [R, V] int32 with each row's new token `tokens` [R] counted once more (where
    `counted` [R] bool, when given); returns [R, V] int32."""
    one = jnp.ones_like(tokens) if counted is None else counted.astype(counts.dtype)
    return counts.at[jnp.arange(counts.shape[0]), tokens].add(one)


# -- processors that read the tokens so far ------------------------------------------
#
# The token buffer `sequence` [B, L] holds each row as transformers' input_ids would: the
# columns [start, end) of every row, with start and end traced int32 scalars.


def sequence_bias(
    sequence: jax.Array,
    start: jax.Array,
    end: jax.Array,
    biases: tuple[tuple[tuple[int, ...], float], ...],
    vocab_size: int,
) -> jax.Array:
    """What transformers' sequence_bias (and bad_words_ids, as biases of -inf) add to the scores.

    Args:
        sequence, start, end: the tokens so far (see above).
        biases: ((token ids, bias), ...); the bias goes to the last id when the row ends
            with the others. Static.
        vocab_size: V.

    Returns:
        [B, V] float32 to add to the scores.

    Example:
        >>> scores = scores + sequence_bias(sequence, start, end, (((5,), -jnp.inf), ((3, 4), 2.0)), vocab)
    """
    batch = sequence.shape[0]
    single = np.zeros(vocab_size, np.float32)
    by_length: dict[int, list] = {}
    for ids, value in biases:
        if len(ids) == 1:
            single[ids[0]] += value
        else:
            by_length.setdefault(len(ids) - 1, []).append((ids, value))
    bias = jnp.broadcast_to(jnp.asarray(single), (batch, vocab_size))  # [B, V]
    for length, group in by_length.items():
        prefixes = jnp.asarray([ids[:-1] for ids, _ in group], sequence.dtype)  # [G, length]
        tail = jax.lax.dynamic_slice_in_dim(sequence, end - length, length, axis=1)  # [B, length]
        hit = jnp.all(tail[:, None, :] == prefixes[None], axis=-1) & (end - start >= length)  # [B, G]
        values = jnp.asarray([value for _, value in group], jnp.float32)  # [G]
        last = np.asarray([ids[-1] for ids, _ in group])  # [G]
        bias = bias.at[:, last].add(jnp.where(hit, values, 0.0))
    return bias


def ngram_bans(sequence: jax.Array, start: jax.Array, end: jax.Array, size: int, vocab_size: int) -> jax.Array:
    """The tokens that would repeat an n-gram of the row, as transformers' no_repeat_ngram_size bans.

    A window of `size` tokens inside [start, end) whose first size - 1 tokens equal the
    row's last size - 1 tokens bans its last token.

    Returns:
        [B, V] bool, True for banned tokens.

    Example:
        >>> scores = jnp.where(ngram_bans(sequence, start, end, 3, vocab), -jnp.inf, scores)
    """
    if sequence.shape[1] < size:  # no window fits
        return jnp.zeros((sequence.shape[0], vocab_size), bool)
    return _window_bans(sequence, start, end, _suffix(sequence, end, size), vocab_size)


def encoder_ngram_bans(
    source: jax.Array,
    source_start,
    source_end,
    sequence: jax.Array,
    start: jax.Array,
    end: jax.Array,
    size: int,
    vocab_size: int,
) -> jax.Array:
    """The tokens that would repeat an n-gram of the encoder's input, as transformers'
    encoder_no_repeat_ngram_size bans: a window of `size` tokens of `source` [B, S] inside
    [source_start, source_end) whose first size - 1 tokens equal the last size - 1 tokens of the
    row [start, end) of `sequence` bans its last token. A row shorter than size - 1 bans nothing.

    Returns:
        [B, V] bool, True for banned tokens.
    """
    if sequence.shape[1] < size - 1:  # no row holds size - 1 tokens
        return jnp.zeros((sequence.shape[0], vocab_size), bool)
    banned = _window_bans(source, source_start, source_end, _suffix(sequence, end, size), vocab_size)
    return banned & (end - start >= size - 1)


def _suffix(sequence: jax.Array, end, size: int) -> jax.Array:
    """[B, size - 1]: the row's last size - 1 tokens before column `end`."""
    return jax.lax.dynamic_slice_in_dim(sequence, end - (size - 1), size - 1, axis=1)


def _window_bans(source: jax.Array, start, end, suffix: jax.Array, vocab_size: int) -> jax.Array:
    """[B, V] bool: the last token of each window of len(suffix) + 1 tokens of `source` inside
    [start, end) whose other tokens equal `suffix` [B, size - 1]."""
    batch, length = source.shape
    size = suffix.shape[1] + 1
    windows = length - size + 1
    if windows < 1:
        return jnp.zeros((batch, vocab_size), bool)
    first = jnp.arange(windows)  # [W] each window's first column
    match = jnp.broadcast_to((first >= start) & (first + size <= end), (batch, windows))  # [B, W]
    for i in range(size - 1):
        match = match & (source[:, i : i + windows] == suffix[:, i : i + 1])
    last = source[:, size - 1 :]  # [B, W]
    # Unmatched windows (and ids past the logits, or -1 marking no token) mark a spare column, dropped at the end.
    banned = jnp.where(match & (last >= 0) & (last < vocab_size), last, vocab_size)
    rows = jnp.arange(batch)[:, None]
    return jnp.zeros((batch, vocab_size + 1), bool).at[rows, banned].set(True)[:, :vocab_size]
