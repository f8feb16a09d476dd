"""Speculative decoding on the slot core: `SpeculativeSlotModel`, a `SlotModel` whose decode runs in
rounds that draft k tokens per row and verify them with one forward of the model, inside the
decode program's `while_loop` (no host round trip per round).

    SpeculativeSlotModel(model, slots, length, speculation, draft=None)
        .empty_state(features)   the slots' state, with each row's tokens (the drafter reads them)
                                 and a draft model's own cache beside the model's
        .prefill_chunk(...)      `SlotModel.prefill_chunk`, the draft model's cache filled too
        .decode_chunk(...)       rounds (below); `Chosen.made` says how many tokens each row made

`SlotPrograms(SpeculativeSlotModel(...), ...)` compiles its programs (the speculation and the draft's
fingerprint are part of their key; its weights and the draft's are their first argument, a pair).
The parts a round uses (the setting, the prompt-lookup drafter, how many tokens a row keeps,
speculative sampling's rule) are in `_speculative`.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp

from .. import _backend
from .._errors import GenerationError
from . import _programs, _sampling, _stops
from ._choose import choose_tokens, process_scores
from ._rows import RowSampling, SamplingFeatures
from ._slots import (
    PER_TOKEN,
    STOPPED,
    TOP_LOGPROBS,
    Chosen,
    SlotModel,
    SlotState,
    history_rules,
    kept_values,
    with_logprobs,
    written_back,
)
from ._speculative import (
    DRAFT,
    Speculation,
    accepted_count,
    backoff,
    kept_count,
    lookup_drafts,
    purpose_keys,
    sampled_round,
)


class SpeculativeSlotModel(SlotModel):
    """A `SlotModel` whose decode drafts and verifies in rounds (`speculation`); `draft`: the draft
    model (an hfjax Model of the same vocabulary) where `speculation.method` is "draft_model"."""

    def __init__(self, model, slots: int, length: int, speculation: Speculation, draft=None):
        super().__init__(model, slots, length)
        if (speculation.method == "draft_model") != (draft is not None):
            raise GenerationError(
                f"Speculation(method={speculation.method!r}) {'needs' if draft is None else 'takes no'} draft model; "
                "pass draft= for method='draft_model' only"
            )
        self.speculation = speculation
        self.draft = None if draft is None else SlotModel(draft, slots, length)
        self._draft_key = ()
        if draft is not None:  # the draft's weights are part of what the programs were made for
            fingerprint = _programs.model_fingerprint(draft.module, draft.params, draft.aliases)
            self._draft_key = (json.dumps(fingerprint, sort_keys=True, default=repr),)

    def weights(self):
        return self.model.params if self.draft is None else (self.model.params, self.draft.model.params)

    def program_key(self) -> tuple:
        return (self.speculation, *self._draft_key)

    def _split(self, params) -> tuple:
        """(the model's weights, (the draft's `SlotModel`, its weights) or None) of a program's `params`."""
        return (params, None) if self.draft is None else (params[0], (self.draft, params[1]))

    def empty_state(self, features: SamplingFeatures, *, history: bool = True) -> SlotState:
        """`SlotModel.empty_state` with each row's tokens (`history`, whatever is asked) and the draft
        model's cache (`SlotState.draft`)."""
        state = super().empty_state(features, history=True)
        if self.draft is not None:
            state = dataclasses.replace(state, draft=self.draft.empty_state(SamplingFeatures()).cache)
        return state

    def prefill_chunk(
        self,
        params,
        state: SlotState,
        rows: RowSampling,
        which,
        ids,
        start,
        count,
        last,
        fresh,
        want_logprobs,
        *,
        window: int,
        features: SamplingFeatures,
        kept: tuple[str, ...] = (),
        inputs: dict | None = None,
        choose: bool = True,
    ):
        """`SlotModel.prefill_chunk`, whose chunk the draft model's cache takes too (its logits unused;
        `inputs` are the target's alone: Model.generate and the server draft no prompt with images)."""
        params, draft = self._split(params)
        drafted = state.draft
        state, chosen = super().prefill_chunk(
            params,
            state,
            rows,
            which,
            ids,
            start,
            count,
            last,
            fresh,
            want_logprobs,
            window=window,
            features=features,
            kept=kept,
            inputs=inputs,
            choose=choose,
        )
        if draft is None:
            return state, chosen
        model, weights = draft
        _, drafted, _ = model.run_chunk(weights, drafted, which, ids, start, count, window=window)
        return dataclasses.replace(state, draft=drafted), chosen

    def reads_cache_in_place(self, cache=None) -> bool:
        return False  # its rounds read their rows' window sliced out, the draft model's too

    def decode_chunk(
        self,
        params,
        state: SlotState,
        rows: RowSampling,
        active,
        count,
        want_logprobs,
        *,
        steps: int,
        decoding_rows: int,
        window: int,
        features: SamplingFeatures,
        stop_tokens: tuple[int, ...] = (),
        pad_token: int = 0,
        logprobs: bool = True,
        kept: tuple[str, ...] = (),
    ) -> tuple[SlotState, Chosen]:
        """`SlotModel.decode_chunk`'s work in speculative rounds: a `while_loop` until every active row
        has made `count` tokens or stopped. A round: each going row's last token joins its `history`;
        k tokens are drafted (`lookup_drafts`, or k + 1 one-token steps of the draft model over its
        own cache, the last only to put the last draft in it) for the rows not backing off after
        rejected drafts (`backoff`; where no row drafts, the draft model runs nothing, and `catch_up`
        gives its cache the tokens of those rounds when a row drafts again);
        ONE forward of the model runs the last
        token and the drafts ([R, k + 1] at the row's positions, keys and values written at their
        columns; where no row has a draft, a `cond` runs the last token alone); the token choice runs
        at each of the k + 1 positions in order (each with the drafts before it in `seen`, `counts` and
        `history`); a row keeps its drafts while they equal the chosen tokens (a draft model's sampling
        rows: speculative sampling's rule, `sampled_round`), then the token after them (`kept_count`:
        never past `count`, nothing after a stop token), in its next columns of Chosen. The keys and
        values of rejected drafts stay past the row's position, where no query reads them, until the
        next round overwrites them. A row that has stopped makes nothing more (it does not run on
        `pad_token`; its later scores are zeros). Returns as `SlotModel.decode_chunk`, with Chosen's
        `made`, `drafted`, `accepted`, `rounds`, `proposed` and `accepted_at`."""
        if state.history is None or (self.draft is not None and state.draft is None):
            raise GenerationError(
                "a speculative decode reads each row's tokens (and a draft model's cache); make the state with "
                "SpeculativeSlotModel.empty_state"
            )
        speculation = self.speculation
        params, draft = self._split(params)
        by_model = draft is not None
        r, k = decoding_rows, speculation.num_speculative_tokens
        width = k + 1
        whole = state.cache
        cache = [tuple(a[:r, :, :window] for a in pair) for pair in whole]
        tokens, positions, on = state.tokens[:r], state.positions[:r], active[:r]
        mine = jax.tree_util.tree_map(lambda a: a[:r], rows)
        seen = None if state.seen is None else state.seen[:r]
        counts = None if state.counts is None else state.counts[:r]
        history = state.history[:r]
        encoder_ids = None if state.encoder_ids is None else state.encoder_ids[:r]  # (an encoder-decoder's)
        vocab = self.shapes()[1]
        backend = _backend.active()
        carried, restore = backend.loop_carry(cache)
        drafts_carried = restore_draft = None
        if by_model:
            drafts_carried, restore_draft = backend.loop_carry(
                [tuple(a[:r, :, :window] for a in p) for p in state.draft]
            )
        each = jnp.arange(r, dtype=jnp.int32)[:, None]  # [R, 1]
        offsets = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, k + 1]

        def going(tokens, made):  # [R] bool: the rows with tokens left to make (not at a stop token)
            left = on & (made < count)
            return left & ~_stops.stopped(tokens, stop_tokens) & (tokens != STOPPED) if stop_tokens else left

        def running(carry):
            _, _, _, tokens, made, *_ = carry
            return jnp.any(going(tokens, made))

        def catch_up(drafted, at, now, history):
            """The draft model's cache given the keys and values of each row's `backoff_rounds` tokens before
            its last (one forward over them, from `history`): the last tokens of the rounds it paused in
            (`backoff`), which it ran no step for. The ones it holds already are written again, the same."""
            model, weights = draft
            behind = speculation.backoff_rounds
            where = at[:, None] - behind + jnp.arange(behind, dtype=jnp.int32)[None, :]  # [R, behind]
            ids = jnp.take_along_axis(history, jnp.clip(mine.pads[:, None] + where, 0, history.shape[1] - 1), axis=1)
            column = jnp.where(now[:, None] & (where >= 0) & (where < window), where, window)
            with model.bound(weights):
                _, drafted = model.run(
                    weights, restore_draft(drafted), ids, jnp.clip(where, 0, window - 1), column
                )  # fmt: skip
            return backend.loop_carry(drafted)[0]

        def by_draft_model(drafted, tokens, at, now, seen, counts, history):
            """k + 1 one-token steps of the draft model from each row's last token (the last step only
            puts the last draft in its cache), after `catch_up` where rows may have paused: (its cache,
            drafts [R, k], their processed scores [R, k, V], history)."""
            model, weights = draft
            draw = dataclasses.replace(mine, key=purpose_keys(mine.key, DRAFT))
            if speculation.backoff_rounds:
                drafted = catch_up(drafted, at, now, history)

            def step(carry, j):
                drafted, token, seen, counts, history = carry
                where = at + j
                column = jnp.where(now & (where < window), where, window)
                with model.bound(weights):
                    logits, drafted = model.run(
                        weights, restore_draft(drafted), token[:, None], jnp.minimum(where, window - 1)[:, None],
                        column[:, None],
                    )  # fmt: skip
                scores = process_scores(
                    logits[:, 0], mine, features, where + 1, seen=seen, counts=counts,
                    history=history_rules(features, mine, history, where + 1, encoder_ids=encoder_ids),
                )  # fmt: skip
                token = _sampling.pick(scores, draw, where + 1, features)
                history = history.at[each[:, 0], jnp.where(now, mine.pads + where + 1, history.shape[1])].set(
                    token, mode="drop"
                )
                seen = None if seen is None else _sampling.update_seen(seen, token)
                counts = None if counts is None else _sampling.update_counts(counts, token)
                return (backend.loop_carry(drafted)[0], token, seen, counts, history), (token, scores)

            (drafted, _, _, _, history), (proposed, scores) = jax.lax.scan(
                step, (drafted, tokens, seen, counts, history), jnp.arange(width, dtype=jnp.int32)
            )
            return drafted, proposed[:k].T, jnp.swapaxes(scores[:k], 0, 1), history

        def no_drafts(drafted, tokens, at, now, seen, counts, history):
            """No row drafts this round: the draft model runs nothing (`catch_up` gives its cache the
            tokens of such rounds when a row drafts again); no drafts (zeros)."""
            nothing = jnp.zeros((r, k), jnp.int32), jnp.zeros((r, k, vocab), jnp.float32)
            return drafted, *nothing, history

        def round_(carry):
            rounds, cache, drafted, tokens, made, seen, counts, history, chosen, pause, wait = carry
            now = going(tokens, made)
            drafting = now & (pause == 0)  # the rows that draft this round (`backoff`)
            at = positions + made  # [R]: the last token's position
            history = history.at[each[:, 0], jnp.where(now, mine.pads + at, history.shape[1])].set(tokens, mode="drop")
            room = jnp.where(now, count - made, 0)
            if by_model:
                drafted, drafts, draft_scores, history = jax.lax.cond(
                    jnp.any(drafting), by_draft_model, no_drafts, drafted, tokens, at, now, seen, counts, history
                )
                offered = jnp.full((r,), k, jnp.int32)
            else:
                drafts, offered = lookup_drafts(history, mine.pads, mine.pads + at + 1, speculation)
            offered = jnp.where(drafting, jnp.minimum(offered, room - 1), 0)  # none past the count this call makes
            ids = jnp.concatenate([tokens[:, None], drafts], axis=1)  # [R, k + 1]
            where = at[:, None] + offsets  # [R, k + 1]
            columns = jnp.where(now[:, None] & (where < window), where, window)
            at_most = jnp.minimum(where, window - 1)

            # Multimodal rope: a row's rope positions are its columns shifted by the row's delta.
            rope = (at_most + mine.rope_delta[:, None]) if self.rope_shift else None

            def verify(cache):  # the last token and the drafts: [R, k + 1] logits
                shifted = None if rope is None else {"position_ids": rope}
                return self.run(
                    params, restore(cache), ids, at_most, columns, lora=mine.lora, inputs=shifted, shift=mine.pads
                )

            def plain(cache):  # no row has a draft: the last token alone (the other positions' logits zeros)
                shifted = None if rope is None else {"position_ids": rope[:, :1]}
                logits, cache = self.run(
                    params, restore(cache), ids[:, :1], at_most[:, :1], columns[:, :1], lora=mine.lora, inputs=shifted,
                    shift=mine.pads,
                )  # fmt: skip
                return jnp.pad(logits, ((0, 0), (0, width - 1), (0, 0))), cache

            with self.bound(params):
                logits, cache = jax.lax.cond(jnp.any(offered > 0), verify, plain, cache)
            # The drafts join the history the rules at later positions read (past the row's end: dropped).
            drafted_columns = jnp.where(now[:, None], mine.pads[:, None] + where[:, 1:], history.shape[1])
            history = history.at[each, drafted_columns].set(drafts, mode="drop")

            def choose_at(carry, position):  # the token choice at one of the k + 1 positions, in order
                seen, counts = carry
                logits_j, draft_j, j = position
                token, processed = choose_tokens(
                    logits_j, mine, features, at + j + 1, seen=seen, counts=counts,
                    history=history_rules(features, mine, history, at + j + 1, encoder_ids=encoder_ids),
                )  # fmt: skip
                # The next position's choice sees this draft among the row's tokens.
                seen = None if seen is None else _sampling.update_seen(seen, draft_j)
                counts = None if counts is None else _sampling.update_counts(counts, draft_j)
                return (seen, counts), (token, processed)

            padded = jnp.concatenate([drafts, jnp.zeros((r, 1), jnp.int32)], axis=1)  # [R, k + 1]
            _, (targets, scores) = jax.lax.scan(
                choose_at, (seen, counts), (jnp.swapaxes(logits, 0, 1), padded.T, jnp.arange(width, dtype=jnp.int32))
            )
            targets, scores = targets.T, jnp.swapaxes(scores, 0, 1)  # [R, k + 1], [R, k + 1, V]
            if by_model and features.sampling:  # a draft drawn from the draft's distribution
                made_tokens, agreed = sampled_round(targets, scores, draft_scores, drafts, offered, mine, at)
            else:  # a draft is kept where it is the token the target chooses there
                made_tokens, agreed = targets, accepted_count(drafts == targets[:, :k], offered)
            made_now, accepted_now = kept_count(made_tokens, agreed, room, stop_tokens)
            kept_now = offsets < made_now[:, None]  # [R, k + 1]
            column = jnp.where(kept_now, made[:, None] + offsets, steps)  # Chosen's columns (steps: dropped)
            values = {"token": made_tokens}
            if logprobs:
                picked = with_logprobs(logits.reshape(r * width, -1), made_tokens.reshape(-1), want_logprobs)
                values.update(
                    {f: getattr(picked, f).reshape(r, width, *getattr(picked, f).shape[1:]) for f in PER_TOKEN}
                )
            values.update(kept_values(kept, scores=scores, logits=logits))
            chosen = dataclasses.replace(
                chosen,
                **{f: getattr(chosen, f).at[each, column].set(v, mode="drop") for f, v in values.items()},
                drafted=chosen.drafted + offered,
                accepted=chosen.accepted + accepted_now,
                proposed=chosen.proposed + (offered > 0).astype(jnp.int32),
                accepted_at=chosen.accepted_at + (offsets[:, :k] < accepted_now[:, None]).astype(jnp.int32),
            )
            appended = jnp.where(kept_now, made_tokens, vocab)  # the kept tokens join seen and counts (vocab: none)
            if seen is not None:
                seen = seen.at[each, appended].set(True, mode="drop")
            if counts is not None:
                counts = counts.at[each, appended].add(1, mode="drop")
            last = jnp.take_along_axis(made_tokens, jnp.maximum(made_now - 1, 0)[:, None], axis=1)[:, 0]
            tokens = jnp.where(made_now > 0, last, tokens)
            cache = backend.loop_carry(cache)[0]
            pause, wait = backoff(pause, wait, offered, accepted_now, now, speculation.backoff_rounds)
            return rounds + 1, cache, drafted, tokens, made + made_now, seen, counts, history, chosen, pause, wait

        reported = steps if logprobs else 0
        chosen = Chosen(
            token=jnp.zeros((r, steps), jnp.int32),
            logprob=jnp.zeros((r, reported), jnp.float32),
            top_token=jnp.zeros((r, reported, TOP_LOGPROBS), jnp.int32),
            top_logprob=jnp.zeros((r, reported, TOP_LOGPROBS), jnp.float32),
            ran=jnp.int32(0),
            **{f: jnp.zeros((r, steps, vocab), jnp.float32) for f in kept},
            drafted=jnp.zeros(r, jnp.int32),
            accepted=jnp.zeros(r, jnp.int32),
            proposed=jnp.zeros(r, jnp.int32),
            accepted_at=jnp.zeros((r, k), jnp.int32),
        )
        made = jnp.zeros(r, jnp.int32)
        pause, wait = jnp.zeros(r, jnp.int32), jnp.ones(r, jnp.int32)  # each row's backoff (`backoff`)
        start = (jnp.int32(0), carried, drafts_carried, tokens, made, seen, counts, history, chosen, pause, wait)
        rounds, carried, drafts_carried, tokens, made, seen, counts, history, chosen, *_ = jax.lax.while_loop(
            running, round_, start
        )
        state = SlotState(
            cache=written_back(whole, restore(carried)),
            tokens=state.tokens.at[:r].set(tokens),
            positions=state.positions.at[:r].set(jnp.where(on, positions + made, positions)),
            seen=None if seen is None else state.seen.at[:r].set(seen),
            counts=None if counts is None else state.counts.at[:r].set(counts),
            history=state.history.at[:r].set(history),
            draft=state.draft if not by_model else written_back(state.draft, restore_draft(drafts_carried)),
            cross=state.cross,
            encoder_mask=state.encoder_mask,
            encoder_ids=state.encoder_ids,
        )
        return state, dataclasses.replace(chosen, ran=jnp.max(made), made=made, rounds=rounds)
