"""The decode loop's state: one dataclass with named fields, registered as a JAX pytree.

Programs take and return the state as a flat list of its leaves (so that `jax.export` can keep
them on disk without knowing transformers' cache classes). `field_slices` says where each named
field lies in that list, from the dataclass structure alone, so that the host reads `sequence`
or `beams.finished` by name, also from a program read back from disk.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ._beam import BeamState
from ._rows import RowSampling


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """What the decode loop carries from one token to the next (B rows, buffer length L, vocabulary V)."""

    cache: Any  # the cache adapter's past (a transformers Cache, or the model's own), or None
    encoder: Any  # encoder-decoders: (hidden [B, P, H], mask [B, P] int32 or None); else None
    sequence: jax.Array  # [B, L] int32: the decoder's prompt, then the new tokens from column `offset`
    mask: jax.Array  # [B, L] int32: 1 where a column is attended to
    next_position: jax.Array  # [B] int32: the position of the next token
    seen: jax.Array | None  # [B, V] bool: tokens so far, for the repetition penalty; else None
    counts: jax.Array | None  # [B, V] int32: the answer's tokens, for presence / frequency penalties; else None
    done: jax.Array  # [B] bool: rows that have produced EOS
    step: jax.Array  # [] int32: new tokens so far
    rows: RowSampling  # each row's sampling settings and PRNG key
    max_new_tokens: jax.Array  # [] int32: this call's max_new_tokens
    least: jax.Array  # [] int32: this call's min_new_tokens
    first_column: jax.Array  # [] int32: where transformers' rows start in `sequence`
    encoder_ids: jax.Array | None  # encoder_no_repeat_ngram_size on an encoder-decoder: `BatchPlan.ngram_source`
    logits: jax.Array | None  # [B, T, V] float32: raw logits of each new token (output_logits); else None
    scores: jax.Array | None  # [B, T, V] float32: processed scores (output_scores); else None
    beams: BeamState | None  # beam search's state; else None

    def replace(self, **changes) -> DecodeState:
        return dataclasses.replace(self, **changes)


def field_slices(state, prefix: str = "") -> dict[str, tuple[int, int]]:
    """{field name: (first leaf, leaf count)} in the state's flat list of leaves; nested dataclass
    fields as "beams.finished"."""
    slices, start = {}, 0
    for field in dataclasses.fields(state):
        value = getattr(state, field.name)
        count = len(jax.tree_util.tree_leaves(value))
        slices[prefix + field.name] = (start, count)
        if dataclasses.is_dataclass(value):
            for name, (first, inner) in field_slices(value, prefix + field.name + ".").items():
                slices[name] = (start + first, inner)
        start += count
    return slices


def read(leaves: list, slices: dict[str, tuple[int, int]], name: str):
    """The one array of field `name` in a flat list of state leaves (None where the field is None)."""
    first, count = slices[name]
    if count == 0:
        return None
    if count != 1:
        raise ValueError(f"DecodeState field {name!r} holds {count} arrays; read one array field")
    return leaves[first]
