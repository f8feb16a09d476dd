"""The stop rule: which tokens end a row's answer (EOS, vLLM's stop_token_ids), held back until the
row has made its least number of new tokens (transformers' min_new_tokens / min_length, vLLM's
min_tokens), and which rows have stopped.

    hold_back(scores, ids, positions, min_position)   the stop tokens at -inf before min_position
    stopped(tokens, ids)                              whether each token is a stop token

`ids` is either a tuple of token ids, the same for every row and known when the program is traced
(Model.generate's EOS tokens: compiled in, only those columns read and written), or for hold_back
an [R, H] int32 array of each row's own (a server's requests: each its EOS tokens and
stop_token_ids), ids past the vocabulary unused. Every program and the host call these two; the
server's stop strings are text, matched on the host (`serving/_text.py`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def hold_back(scores, ids, positions, min_position):
    """`scores` [R, V] with the stop tokens `ids` at -inf in the rows whose new token's position
    (`positions`, [R] or [] int32) is before `min_position` ([R] or [] int32; a row at 0 holds
    nothing back), as transformers' MinNewTokensLengthLogitsProcessor and vLLM's min_tokens.

    ids: a tuple of token ids, every row's (static: only those columns are read and written), or
    [R, H] int32, each row's own (ids past the vocabulary are unused).

    Example:
        >>> scores = hold_back(scores, (2,), step, min_new_tokens)  # Model.generate's EOS, one count for every row
    """
    early = jnp.reshape(positions < min_position, (-1, 1))  # [R, 1] or [1, 1]
    if isinstance(ids, tuple):
        if not ids:
            return scores
        # Only the held-back columns: a select over all [R, V] scores made a batch-1 decode step of an
        # 8-layer Llama on the CPU about 5% slower.
        columns = jnp.asarray(ids, jnp.int32)
        return scores.at[:, columns].set(jnp.where(early, -jnp.inf, scores[:, columns]), mode="drop")
    # Each row's own: a minimum with -inf where early, else with +inf (unchanged).
    index = jnp.broadcast_to(jnp.arange(scores.shape[0])[:, None], ids.shape)
    floor = jnp.broadcast_to(jnp.where(early, -jnp.inf, jnp.inf), ids.shape).astype(scores.dtype)
    return scores.at[index, ids].min(floor, mode="drop")


def stopped(tokens, ids: tuple[int, ...]):
    """Whether each of `tokens` (int, any shape: a jax.Array in a program, a numpy array on the host,
    which then gets a numpy array back) is one of the stop tokens `ids`: bool of the tokens' shape,
    all False where `ids` is empty.

    Example:
        >>> done = done | stopped(token, settings.eos_token_ids)
    """
    each = np.asarray(ids, np.int32).reshape((1,) * tokens.ndim + (len(ids),))  # ranks match: no promotion
    return (tokens[..., None] == each).any(axis=-1)
