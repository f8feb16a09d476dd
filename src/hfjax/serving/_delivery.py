"""The engine's delivery: the tokens a prefill or decode chunk chose, brought to the host and handed
to their requests as events (token ids, text, log-probabilities), cut and finished at each request's
stops (EOS, a stop token or string, max_tokens, a complete grammar); a constrained request's matcher
takes each token in and fills its slot's mask for the next."""

from __future__ import annotations

import time

import numpy as np

from .. import generation
from .._errors import ServingError
from ._calls import Chunk
from ._metrics import Metrics
from ._queue import RequestQueue
from ._requests import Event, Request, TokenLogprob
from ._table import SlotTable


class Delivery:
    """Hands the requests of `table`'s slots their chosen tokens; finishes them through `queue` (under
    its lock, their listeners called once it is released); counts tokens, latencies and drafts into `metrics`."""

    def __init__(self, table: SlotTable, metrics: Metrics, queue: RequestQueue):
        self.table, self.metrics, self.queue = table, metrics, queue

    def first_tokens(self, requests: list[Request], last: np.ndarray, chosen: generation.Chosen) -> None:
        """After a prefill call of `requests` (a row each): those whose prompt it ended (`last` [rows])
        get the first new token of `chosen`."""
        if not last.any():
            return
        ended = [requests[i] for i in np.flatnonzero(last)]
        chosen = _to_host(chosen, ended, 1)  # [rows, 1] ...
        with self.queue.held():
            for i in np.flatnonzero(last):
                self._deliver(requests[i], [c if c is None else c[i] for c in chosen], 1)

    def advance(self, chunk: Chunk) -> None:
        """Waits for a one-step chunk of constrained rows and has each constrained request's matcher
        take in its token and fill the slot's mask for the next one, before the next chunk goes; its
        text and events follow in `collect`, while the device runs that chunk. A token that ends the
        answer (EOS, a stop token) is left to `_deliver`."""
        chunk.host = _to_host(chunk.chosen, chunk.requests.values(), chunk.steps)
        tokens = chunk.host[0]
        for slot, request in chunk.requests.items():
            if request.matcher is None or request.finished or request.cancelled:
                continue
            eos, _ = request.stops(tokens[slot, :1])
            if eos[0]:
                continue
            request.advanced = request.matcher.consume(int(tokens[slot, 0]))
            if request.advanced and not request.matcher.stopped:
                self.table.constrain(request)

    def collect(self, chunk: Chunk) -> None:
        """Waits for a dispatched chunk and hands its tokens to the requests still in their slots (one
        that finished or left since gets nothing more)."""
        chosen = chunk.host or _to_host(chunk.chosen, chunk.requests.values(), chunk.steps)  # [rows, steps] ...
        made = self._speculated(chunk)
        with self.queue.held():
            for slot, request in chunk.requests.items():
                if self.table.requests[slot] is request and not request.finished and not request.cancelled:
                    count = chunk.steps if made is None else int(made[slot])
                    self._deliver(request, [c if c is None else c[slot] for c in chosen], count)

    def _speculated(self, chunk: Chunk) -> np.ndarray | None:
        """A speculative chunk's tokens made per row [rows] (its drafts counted into the metrics), or None
        for a plain chunk. Each decoding row makes all of the chunk's steps (the engine's decode has no
        stop tokens, it stops requests here), as the host's positions have it."""
        chosen = chunk.chosen
        if chosen.made is None:
            return None
        made = np.asarray(chosen.made)
        self.metrics.count_drafts(
            *(np.asarray(a).sum(axis=0) for a in (chosen.proposed, chosen.drafted, chosen.accepted_at))
        )
        short = [slot for slot in chunk.requests if made[slot] != chunk.steps]
        if short:
            raise ServingError(
                f"a speculative decode chunk of {chunk.steps} steps made {int(made[short[0]])} tokens in slot "
                f"{short[0]}; each decoding row makes every step"
            )
        return made

    def _deliver(self, request: Request, chosen: list[np.ndarray], count: int) -> None:
        """Hands a request its new tokens (chosen: token [T], logprob [T], top ids [T, 20], top logprobs
        [T, 20]; the last three None when no request of the program asked for log-probabilities), each
        with the text it releases, cut at EOS, max_tokens, a stop token or the token whose text completes
        a stop string, and finishes it when one of its stops is met. A constrained request's matcher
        takes each kept token in; the answer ends where its grammar is complete, else the matcher fills
        the slot's mask for the next token."""
        tokens, logprob, top_token, top_logprob = chosen
        now = time.perf_counter()
        if request.last_token_time is None:
            self.metrics.time_to_first_token.observe(now - request.arrived)
        else:
            self.metrics.inter_token_latency.observe((now - request.last_token_time) / count, count)
        request.last_token_time = now
        reason, eos, advanced = None, None, None
        kept, pieces = [], []
        before = request.generated
        eos_at, last_at = request.stops(tokens[:count])  # [count] bool each
        for t in range(count):  # token by token: the answer ends at the token where a stop string ends
            token = int(tokens[t])
            request.generated += 1
            if eos_at[t]:
                reason, eos = "stop", t
                break
            kept.append(t)
            advanced, request.advanced = request.advanced, None
            if request.matcher is not None and not (request.matcher.consume(token) if advanced is None else advanced):
                reason = "error"  # the mask allowed it: the grammar and the mask disagree
                break
            piece, stopped = request.text.add([token])
            pieces.append(piece)
            if stopped or last_at[t] or (request.matcher is not None and request.matcher.stopped):
                reason = "stop"
                break
            if request.generated >= request.settings.max_new_tokens:
                reason = "length"
                break
        self.metrics.tokens_generated += request.generated - before
        ids = [int(tokens[t]) for t in kept]
        logprobs = None
        if request.params.logprobs is not None:
            alternatives = request.params.logprobs
            logprobs = [
                TokenLogprob(
                    int(tokens[t]), float(logprob[t]),
                    [(int(i), float(v)) for i, v in zip(top_token[t][:alternatives], top_logprob[t][:alternatives])],
                )
                for t in kept + ([] if eos is None else [eos])
            ]  # fmt: skip
        if reason is None and request.matcher is not None and advanced is None:
            self.table.constrain(request)
        tail = request.text.rest() if reason is not None else ""
        event = Event(ids, pieces, logprobs, reason, request.prompt_tokens, request.generated, tail, eos is not None)
        if reason is None:
            self.queue.send(request, event)
        else:
            self.queue.finish(request, reason, event)


def _to_host(chosen: generation.Chosen, requests, steps: int) -> list[np.ndarray | None]:
    """A program's chosen tokens [rows, steps] on the host; their log-probabilities and the top 20
    too when one of `requests` asked for them (else None: one copy from the device, not four)."""
    wanted = any(r.params.logprobs is not None for r in requests)
    fields = (chosen.token, chosen.logprob, chosen.top_token, chosen.top_logprob)
    return [np.asarray(c)[:, :steps] if wanted or i == 0 else None for i, c in enumerate(fields)]
