"""Beam search over the slot core's KV cache: the program family of its own that issue 37 allows,
on the cache, the prefill and the token processors that greedy decoding and sampling use.

    SlotBeams.search(state, rows, carry, lengths, count, window=W) -> (state, carry)

Each prompt's K beams are K slots (rows b * K + k), each prefilled with the whole prompt by the
slot prefill, which returns the first position's raw logits (`BeamCarry.logits`). Every step of the
search then scores those logits as transformers' `_beam_search` does (log-softmax, then the
processors `choose_tokens` applies), takes one `_beam.step`, and moves each slot's past to its new
beam's parent: the cache rows, the recurrent states (Mamba's, a hybrid's), the tokens so far
(`seen`, `counts`, `history`). Then the model runs the new tokens, writing their keys and values at
each row's next column (and moving the states on), for the next step's logits.
A program runs up to `count` steps over the first W columns of the cache; the host calls it once per
window of `_planning.windows`, until `BeamCarry.going` is false (no beam can change the answer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp

from .. import _backend, bridge
from . import _beam, _programs, _sampling
from ._beam import BeamSettings, BeamState
from ._choose import process_scores
from ._rows import RowSampling, SamplingFeatures
from ._slots import SlotModel, SlotState, history_rules, written_back


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BeamCarry:
    """What beam search keeps between its programs, beside the slots' `SlotState` (R = B * K rows)."""

    beams: BeamState  # the running beams' scores and the finished sequences (`_beam.py`)
    sequence: jax.Array  # [R, W] int32: each running beam's new tokens, `fill_token_id` after them
    logits: jax.Array  # [R, V] float32: the model's logits of each beam's next token
    step: jax.Array  # [] int32: the new tokens chosen so far
    max_new_tokens: jax.Array  # [] int32: the call's max_new_tokens
    going: jax.Array  # [] bool: whether a beam may still change the answer

    @classmethod
    def first(cls, logits, max_new_tokens, *, width: int, settings: BeamSettings) -> BeamCarry:
        """The carry after the prefill: logits [R, V] of each beam's first new token; max_new_tokens: [] int32,
        at most `width`."""
        sequence = jnp.full((logits.shape[0], width), settings.fill_token_id, jnp.int32)
        return cls(
            beams=_beam.initial(logits.shape[0] // settings.num_beams, settings, sequence),
            sequence=sequence,
            logits=logits.astype(jnp.float32),
            step=jnp.int32(0),
            max_new_tokens=jnp.asarray(max_new_tokens, jnp.int32),
            going=jnp.bool_(True),
        )

    def leaves(self) -> tuple:
        """Plain containers (which `jax.export` keeps); `BeamCarry.of(leaves)` rebuilds it."""
        beams = tuple(getattr(self.beams, field.name) for field in dataclasses.fields(BeamState))
        return beams, self.sequence, self.logits, self.step, self.max_new_tokens, self.going

    @classmethod
    def of(cls, leaves) -> BeamCarry:
        beams, *rest = leaves
        return cls(BeamState(*beams), *rest)


def search_steps(
    slot_model: SlotModel,
    params,
    state: SlotState,
    rows: RowSampling,
    carry: BeamCarry,
    lengths,
    count,
    *,
    window: int,
    features: SamplingFeatures,
    settings: BeamSettings,
    eos: tuple[int, ...],
) -> tuple[SlotState, BeamCarry]:
    """Up to `count` ([] int32) beam search steps of every slot over the cache's first `window`
    columns; lengths: [R] int32, each row's prompt tokens (its first new token's position). Every
    row's next column must lie inside the window for the steps asked (the host's windows see to it).
    Returns the state and carry after the steps run (`carry.step` counts them)."""
    backend = _backend.active()
    whole = state.cache
    carried, restore = backend.loop_carry([tuple(a[:, :, :window] for a in pair) for pair in whole])
    every = jnp.arange(lengths.shape[0])

    def running(loop):
        i, *_, carry = loop
        return (i < count) & carry.going

    def step(loop):
        i, cache, states, seen, counts, history, carry = loop
        at = lengths + carry.step  # [R]: the new token's position, and its column
        # transformers' beam search processes log-probabilities, not logits.
        scores = process_scores(
            jax.nn.log_softmax(carry.logits, axis=-1), rows, features, at, seen=seen, counts=counts,
            history=history_rules(features, rows, history, at, encoder_ids=state.encoder_ids),
        )  # fmt: skip
        beams, sequence, parents, going = _beam.step(
            carry.beams, scores, carry.sequence, carry.step, carry.step, carry.max_new_tokens, eos, settings
        )
        token = jax.lax.dynamic_index_in_dim(sequence, carry.step, axis=1, keepdims=False)  # [R]
        # Each slot takes its new beam's past: its parent's cache row and tokens so far.
        cache = [tuple(a[parents] for a in pair) for pair in restore(cache)]
        if states is not None:  # the recurrent layers' states, as the keys and values
            states = [tuple(a[parents] for a in layer) for layer in states]
        if seen is not None:
            seen = _sampling.update_seen(seen[parents], token)
        if counts is not None:
            counts = _sampling.update_counts(counts[parents], token)
        if history is not None:
            history = history[parents].at[every, rows.pads + at].set(token, mode="drop")
        with slot_model.bound(params), _cross_attending(slot_model, state):
            written = jnp.where(at < window, at, window)  # past the window: nowhere
            # Multimodal rope: the row's rope position is its column shifted by the row's delta.
            rope = {"position_ids": (at + rows.rope_delta)[:, None]} if slot_model.rope_shift else None
            if states is None:
                logits, cache = slot_model.run(
                    params, cache, token[:, None], at[:, None], written[:, None], lora=rows.lora, inputs=rope,
                    shift=rows.pads,
                )  # fmt: skip
            else:
                logits, cache, new = slot_model.run_states(
                    params, cache, states, token[:, None], at[:, None], written[:, None], None, carried=True,
                    lora=rows.lora,
                )  # fmt: skip
                states = [tuple(n.astype(a.dtype) for a, n in zip(old, now)) for old, now in zip(states, new)]
        carry = BeamCarry(
            beams=beams, sequence=sequence, logits=logits[:, 0], step=carry.step + 1,
            max_new_tokens=carry.max_new_tokens, going=going,
        )  # fmt: skip
        return i + 1, backend.loop_carry(cache)[0], states, seen, counts, history, carry

    _, carried, states, seen, counts, history, carry = jax.lax.while_loop(
        running, step, (jnp.int32(0), carried, state.recurrent, state.seen, state.counts, state.history, carry)
    )
    state = dataclasses.replace(
        state, cache=written_back(whole, restore(carried)), recurrent=states, seen=seen, counts=counts,
        history=history,
    )  # fmt: skip
    return state, carry


def _cross_attending(slot_model: SlotModel, state: SlotState):
    """An encoder-decoder's decoder runs over the slots' cross keys and values and encoder mask; a
    decoder-only model's, nothing. A slot keeps them whichever beam it takes: a beam's parent is
    one of its own prompt's beams, whose slots hold the same encoder output."""
    if state.cross is None:
        return contextlib.nullcontext()
    return slot_model.attending(state.cross, state.encoder_mask)


class SlotBeams:
    """The beam search programs over one `SlotModel`'s cache, one per window, kept in a `ProgramCache`
    (with the prefill and decode programs of `Model.generate`'s other calls).

        search(state, rows, carry, lengths, count, window=W) -> (state, carry)

    `state` and `carry` are donated: the cache is updated in place."""

    def __init__(
        self,
        slot_model: SlotModel,
        *,
        features: SamplingFeatures,
        settings: BeamSettings,
        eos: tuple[int, ...],
        cache: _programs.ProgramCache,
    ):
        self.slot_model, self.features, self.settings, self.eos, self.cache = slot_model, features, settings, eos, cache
        self.precision = bridge.resolve_precision(slot_model.model.matmul_precision)
        self.params = slot_model.model.params

    def search(self, state: SlotState, rows: RowSampling, carry: BeamCarry, lengths, count, *, window: int):
        model = self.slot_model
        key = (
            "decode", "beams", model.slots, model.length, window, self.precision, self.features, self.settings,
            self.eos,
        )  # fmt: skip
        args = (self.params, state.leaves(), rows.leaves(), carry.leaves(), lengths, count)
        function = bridge.under(self.precision, functools.partial(self._program, window=window))
        program = self.cache.get(key, function, args, metadata=dict, donate=(1, 3))
        leaves, carry = program.run(*args)
        return SlotState(*leaves), BeamCarry.of(carry)

    def _program(self, params, leaves, rows, carry, lengths, count, *, window):
        self.cache.traced["decode"] += 1
        state, carry = search_steps(
            self.slot_model, params, SlotState(*leaves), RowSampling(*rows), BeamCarry.of(carry), lengths, count,
            window=window, features=self.features, settings=self.settings, eos=self.eos,
        )  # fmt: skip
        return state.leaves(), carry.leaves()
