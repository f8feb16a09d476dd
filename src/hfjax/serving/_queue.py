"""The engine's queue and admission: requests waiting for a slot, admitted into free slots oldest
first, cancelled, and finished (their slot freed, their last event sent); the lock and condition
the engine thread and its callers share, and the events held back until that lock is released."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

from .._errors import ServingError
from ._metrics import Metrics
from ._requests import Event, QueueFullError, Request
from ._table import SlotTable


class RequestQueue:
    """Requests waiting for a slot of `table` (at most `max_queue`), their admission and their end.

    `lock` guards the queue and the table's requests; `wake` wakes the engine thread when a request
    comes, is cancelled, or the engine stops. Take the lock through `held()`: listeners get their
    events after it is released, so a slow listener never holds up `put` or `cancel` on another
    thread. `since_freed` and `unclaimed` count the slots' turnover, which the engine's chunk sizes
    read."""

    def __init__(self, table: SlotTable, metrics: Metrics, max_queue: int):
        self.table, self.metrics, self.max_queue = table, metrics, max_queue
        self.waiting: collections.deque[Request] = collections.deque()
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.stopping = False
        self.error: BaseException | None = None
        self.since_freed = 0  # decode chunks dispatched since a slot was last freed
        self.unclaimed = 0  # slots freed since the last decode chunk, less requests admitted since
        self._outbox: list[tuple[Request, Event]] = []  # events to hand over once the lock is released

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The lock, held for the block; then, released, the events `send` kept since the lock was last
        released go to their listeners, in order, on this thread (the block raising too: none is lost)."""
        outbox: list[tuple[Request, Event]] = []
        try:
            with self.lock:
                try:
                    yield
                finally:
                    outbox, self._outbox = self._outbox, []
        finally:
            _deliver(outbox)

    def idle(self) -> None:
        """In a `held` block, where the engine thread has nothing to run: hands the events `send` kept to
        their listeners (the lock released meanwhile: a request the thread just finished gets its last
        event before the thread sleeps), else waits for `wake`. The caller looks again either way."""
        outbox, self._outbox = self._outbox, []
        if not outbox:
            self.wake.wait()
            return
        self.lock.release()
        try:
            _deliver(outbox)
        finally:
            self.lock.acquire()

    def send(self, request: Request, event: Event) -> None:
        """Hands `event` to the request's listener when the lock (held by the caller) is released."""
        self._outbox.append((request, event))

    def check_failed(self) -> None:
        """Raises ServingError, from the engine thread's error, where that thread failed."""
        if self.error is not None:
            raise ServingError(f"the engine failed: {self.error!r}") from self.error

    def put(self, request: Request, *, started: bool) -> None:
        """Queues `request` and wakes the engine thread (`started`: whether that thread runs).

        Raises:
            QueueFullError: max_queue requests are waiting already.
            ServingError: the engine has not started, is stopping, or failed.
        """
        with self.held():
            self.check_failed()
            if self.stopping or not started:
                raise ServingError("the engine is not running (start() it, or it is shutting down)")
            if len(self.waiting) >= self.max_queue:
                raise QueueFullError(
                    f"{len(self.waiting)} requests are waiting, max_queue={self.max_queue}; try again later"
                )
            self.waiting.append(request)
            self.metrics.queue_depth = len(self.waiting)
            self.wake.notify_all()

    def cancel(self, request: Request) -> None:
        """Drops a request: at once from the queue, from a slot at the next chunk boundary."""
        with self.held():
            request.cancelled = True
            if request in self.waiting:
                self.waiting.remove(request)
                self.metrics.queue_depth = len(self.waiting)
                self.finish(request, "cancelled")
            self.wake.notify_all()

    def stop(self, *, drain: bool) -> None:
        """Marks the engine stopping; without `drain`, every queued and running request cancelled."""
        with self.held():
            self.stopping = True
            if not drain:
                for request in [*self.waiting, *filter(None, self.table.requests)]:
                    request.cancelled = True
            self.wake.notify_all()

    def fail(self, error: BaseException) -> None:
        """Keeps the engine thread's `error` and finishes every queued and running request with "error"."""
        self.error = error
        with self.held():
            for request in [*self.waiting, *filter(None, self.table.requests)]:
                self.finish(request, "error")

    def admit(self) -> None:
        """Moves waiting requests, oldest first, into free slots (a cancelled one finishes instead)."""
        while self.waiting and self.table.free():
            request = self.waiting.popleft()
            if request.cancelled:
                self.finish(request, "cancelled")
                continue
            self.table.assign(request)
            self.metrics.prefix_hit_tokens += request.prefilled
            self.unclaimed = max(self.unclaimed - 1, 0)
        self.metrics.queue_depth = len(self.waiting)
        self.metrics.running = self.table.occupied

    def release_cancelled(self) -> None:
        """Finishes the cancelled requests that hold a slot."""
        for request in self.table.requests:
            if request is not None and request.cancelled:
                self.finish(request, "cancelled")

    def finish(self, request: Request, reason: str, event: Event | None = None) -> None:
        """Ends a request (once, under the lock): frees its slot, counts it, and sends its listener
        `event`, else an event of no tokens with the text held back."""
        if request.finished:
            return
        request.finished = True
        if request.slot is not None:
            self.table.release(request)
            self.since_freed = 0
            self.unclaimed += 1
        self.metrics.running = self.table.occupied
        self.metrics.count_finished(reason, request.prompt_tokens, request.generated)
        if event is None:
            event = Event([], [], None, reason, request.prompt_tokens, request.generated, request.text.rest())
        self.send(request, event)


def _deliver(outbox: list) -> None:
    """Hands each kept (request, event) to the request's listener, in order (the lock not held)."""
    for request, event in outbox:
        request.listener(event)
