"""Beam search inside the compiled decode loop, step for step as transformers' `_beam_search`.

Each prompt b has K beams, rows b * K + k of the model's batch. Every step scores the K x V
continuations by summed log-probabilities, keeps the best 2K or more candidates (so that K
of them are still running when some end), moves the best K that end (EOS or the
max_new_tokens-th token) into a per-prompt list of finished sequences, scored with the length penalty, and
runs on with the best K that do not end. The KV cache follows its beams: its rows are
gathered by each new beam's parent every step.

The decode state's `sequence` [B*K, L] holds the running beams; `BeamState` the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from . import _stops

EMPTY = -1.0e9  # the score of an empty slot or of a beam that must not be chosen, as transformers uses


@dataclasses.dataclass(frozen=True, kw_only=True)
class BeamSettings:
    """How beam search runs; hashable, part of the generation program's static settings.

    Args:
        num_beams: K, beams per prompt.
        length_penalty: finished scores are divided by (new tokens) ** length_penalty.
        early_stopping: True stops a prompt once K sequences are finished; False and "never"
            keep going while transformers' heuristic says a running beam may still win.
        fill_token_id: what transformers writes after a finished sequence's end.
    """

    num_beams: int
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    fill_token_id: int = 0

    def candidates(self, eos_count: int) -> int:
        """How many continuations each step keeps, so that K keep running whichever end."""
        return max(2, 1 + eos_count) * self.num_beams

    def denominators(self, steps: int) -> np.ndarray:
        """[steps] float32: (t + 1) ** length_penalty, computed in float64 and rounded as
        transformers' Python scalar is when it divides a float32 tensor."""
        return np.asarray([(t + 1) ** self.length_penalty for t in range(steps)], np.float64).astype(np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BeamState:
    """Beam search's part of the decode state (B prompts of K beams)."""

    scores: jax.Array  # [B, K] float32: summed log-probabilities of the running beams, best first
    finished: jax.Array  # [B*K, L] int32: the best finished sequences so far, best first
    finished_scores: jax.Array  # [B, K] float32: their length-penalised scores; EMPTY for an empty slot
    finished_length: jax.Array  # [B, K] int32: their new tokens, EOS included
    is_finished: jax.Array  # [B, K] bool: which slots hold a finished sequence
    improvable: jax.Array  # [B, 1] bool: whether a running beam may still beat a finished one


def initial(batch: int, settings: BeamSettings, sequence: jax.Array) -> BeamState:
    """The beam state before the first step; sequence: [B*K, L] the running buffer."""
    k = settings.num_beams
    # Only the first beam is live at first, so the K beams do not all pick the same tokens.
    scores = jnp.where(jnp.arange(k) == 0, 0.0, EMPTY).astype(jnp.float32)
    return BeamState(
        scores=jnp.broadcast_to(scores, (batch, k)),
        finished=jnp.full_like(sequence, settings.fill_token_id),
        finished_scores=jnp.full((batch, k), EMPTY, jnp.float32),
        finished_length=jnp.zeros((batch, k), jnp.int32),
        is_finished=jnp.zeros((batch, k), bool),
        improvable=jnp.ones((batch, 1), bool),
    )


def step(
    beams: BeamState, log_probs, sequence, end, step_index, max_new_tokens, eos: tuple[int, ...], settings: BeamSettings
):
    """One beam search step.

    Args:
        beams: the beam state before this step.
        log_probs: [B*K, V] float32 processed log-probabilities of the next token.
        sequence: [B*K, L] int32 running beams; their new token goes to column `end`.
        end, step_index, max_new_tokens: int32 scalars: the column, the new token's index (0 for the
            first new token) and the call's max_new_tokens.
        eos: the EOS token ids (static).

    Returns:
        (beams, sequence [B*K, L], parents [B*K] int32: each new beam's row before this step,
        keep_going: bool scalar).
    """
    k = settings.num_beams
    rows, vocab = log_probs.shape
    batch = rows // k
    length = sequence.shape[1]
    keep = settings.candidates(len(eos))
    denominators = jnp.asarray(settings.denominators(length))

    total = log_probs.reshape(batch, k, vocab) + beams.scores[:, :, None]  # [B, K, V]
    top, index = jax.lax.top_k(total.reshape(batch, k * vocab), keep)  # [B, C]
    parent = jnp.arange(batch)[:, None] * k + index // vocab  # [B, C] rows of the running buffer
    token = (index % vocab).astype(jnp.int32)  # [B, C]
    candidates = jax.lax.dynamic_update_slice_in_dim(
        sequence[parent.reshape(-1)], token.reshape(-1, 1), end, axis=1
    ).reshape(batch, keep, length)  # [B, C, L]
    ends = _stops.stopped(token, eos) | (step_index + 1 >= max_new_tokens)  # [B, C]

    # The best K candidates that go on running.
    running = top + ends.astype(jnp.float32) * EMPTY
    chosen = jax.lax.top_k(running, k)[1]  # [B, K]
    scores = jnp.take_along_axis(running, chosen, axis=1)
    parents = jnp.take_along_axis(parent, chosen, axis=1).reshape(-1)  # [B*K]
    sequence = jnp.take_along_axis(candidates, chosen[:, :, None], axis=1).reshape(rows, length)

    # Candidates among the best K that end join the finished ones, if they beat them.
    ended = ends & (jnp.arange(keep) < k)[None, :]
    early = settings.early_stopping is True
    was_improvable = beams.improvable
    penalised = top / denominators[step_index]
    penalised = penalised + (jnp.all(beams.is_finished, axis=-1, keepdims=True) & early).astype(jnp.float32) * EMPTY
    penalised = penalised + (~was_improvable).astype(jnp.float32) * EMPTY
    penalised = penalised + (~ended).astype(jnp.float32) * EMPTY
    merged_scores = jnp.concatenate([beams.finished_scores, penalised], axis=1)  # [B, K + C]
    best = jax.lax.top_k(merged_scores, k)[1]  # [B, K]
    merged_sequences = jnp.concatenate([beams.finished.reshape(batch, k, length), candidates], axis=1)
    new_lengths = jnp.full((batch, keep), step_index + 1, jnp.int32)
    finished_scores = jnp.take_along_axis(merged_scores, best, axis=1)
    is_finished = jnp.take_along_axis(jnp.concatenate([beams.is_finished, ended], axis=1), best, axis=1)
    finished = jnp.take_along_axis(merged_sequences, best[:, :, None], axis=1).reshape(rows, length)
    finished_length = jnp.take_along_axis(jnp.concatenate([beams.finished_length, new_lengths], axis=1), best, axis=1)

    # Whether the best running beam could still beat the worst finished one (transformers' heuristic).
    if settings.early_stopping == "never" and settings.length_penalty > 0:
        hoped = denominators[max_new_tokens - 1]
    else:
        hoped = denominators[step_index]
    worst = jnp.where(is_finished, jnp.min(finished_scores, axis=1, keepdims=True), EMPTY)  # [B, K]
    improvable = was_improvable & jnp.any(scores[:, :1] / hoped > worst, axis=-1, keepdims=True)  # [B, 1]
    beams = BeamState(
        scores=scores,
        finished=finished,
        finished_scores=finished_scores,
        finished_length=finished_length,
        is_finished=is_finished,
        improvable=improvable,
    )
    keep_going = jnp.any(improvable) & ~(jnp.all(is_finished) & early) & ~jnp.all(ends)
    return beams, sequence, parents, keep_going
