"""The host side of continuous batching: a queue, S slots, and one thread that runs the programs.

The engine thread repeats: admit waiting requests into free slots; run one prefill chunk of the
oldest request still reading its prompt; run one decode chunk of every decoding slot; hand each
request its new tokens, text and log-probabilities; free the slots of requests that finished
(EOS, a stop string, max_tokens) or were cancelled. A running stream therefore waits at most one
prefill chunk between two decode chunks.

While only decoding goes on (nothing waits or reads its prompt), the next decode chunk is sent
before the last one's tokens come back: the slots' last tokens stay on the device between
programs, and each request's position and count of tokens are known on the host, so the host's
work on one chunk overlaps the device's on the next. A chunk runs only the steps its longest
request still needs; one of fewer rows than the slots runs more steps than `decode_steps`, as many
as take about the time of a chunk of every slot (`_chunk_steps`).

Listeners are called on the engine thread and must not block (a server hands each event to its
event loop).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import secrets
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import _buckets, _loading, _precision
from .._errors import GenerationError, ServingError
from ..generation import _programs
from . import _slots
from ._metrics import Metrics
from ._text import TextStream

# Decode chunks attend over windows of the cache's columns, halving max_model_len down to this:
# short requests do not read L columns per token (at L 256, 32 + 32 tokens: 0.75x of
# Model.generate's tokens/s over all 256 columns, 0.92x over 64).
_SMALLEST_WINDOW = 32


class QueueFullError(ServingError):
    """The engine's queue holds max_queue requests already; try again later."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """One request's settings.

    Args:
        max_tokens: the most tokens to generate (>= 1).
        temperature: 0 takes the most likely token (greedy); else sample at this temperature, in (0, 2].
        top_p: sample from the fewest most likely tokens whose probabilities add up to top_p, in (0, 1].
        seed: the sampler's seed (None: a random one); the same seed gives the same tokens.
        stop: strings that end the answer where they first appear (not included in it).
        logprobs: None, or how many most likely alternatives (0..20) to report beside each token's
            log-probability.
        ignore_eos: keep going past the end-of-sequence token.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise GenerationError(f"max_tokens={self.max_tokens!r}: pass a whole number >= 1")
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 2):
            raise GenerationError(f"temperature={self.temperature!r}: pass a number in [0, 2] (0 is greedy)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise GenerationError(f"top_p={self.top_p!r}: pass a number in (0, 1]")
        if self.logprobs is not None and not 0 <= self.logprobs <= _slots.TOP_LOGPROBS:
            raise GenerationError(f"logprobs={self.logprobs!r}: pass a number of alternatives in [0, 20]")


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely (token id, logprob), most likely first


@dataclasses.dataclass
class Event:
    """What a request's listener gets after each chunk: the new tokens and text, and at the end why."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop" (EOS or a stop string), "length" (max_tokens), "cancelled"; None: more comes
    prompt_tokens: int
    completion_tokens: int


class Request:
    """A prompt in the engine: queued, then in a slot, then finished."""

    def __init__(self, prompt: list[int], params: SamplingParams, listener: Callable[[Event], None], stream):
        self.prompt = prompt
        self.params = params
        self.listener = listener
        self.text = stream
        self.arrived = time.perf_counter()
        self.last_token_time: float | None = None
        self.generated = 0
        self.cancelled = False
        self.finished = False
        self.slot: int | None = None
        self.prefilled = 0  # prompt tokens in the slot's cache so far
        self.scheduled = 0  # new tokens that programs run so far will have chosen (delivered or not)

    @property
    def reading(self) -> bool:
        """Its prompt not yet all in its slot's cache."""
        return self.prefilled < len(self.prompt)

    @property
    def decoding(self) -> bool:
        """In a slot, past its prompt, with tokens still to choose."""
        return (
            self.prefilled == len(self.prompt)
            and not (self.finished or self.cancelled)
            and self.scheduled < self.params.max_tokens
        )


@dataclasses.dataclass
class _Chunk:
    """A decode chunk dispatched and not yet delivered: whose tokens it chooses, and how many."""

    requests: dict[int, Request]  # slot -> the request decoding there when it was dispatched
    steps: int
    chosen: tuple[jax.Array, ...]  # token [rows, K], logprob [rows, K], top ids and logprobs [rows, K, 20]


class Engine:
    """Continuous batching of a causal LM over `max_batch` slots of one static KV cache.

    Args:
        model: a `hfjax.Model` of a decoder-only causal LM with a tokenizer.
        max_batch: sequence slots (requests decoded together).
        max_model_len: cache columns per slot: prompt plus new tokens of one request at most.
            Default: the model's context, at most 2048.
        max_queue: requests waiting for a slot beyond which `submit` raises QueueFullError.
        decode_steps: decode steps per program call (a chunk) of every slot; requests join and leave
            between chunks. Fewer steps let a new request in sooner, more cost more host round trips (at
            16 concurrent streams on 2 CPU cores, 4 gave 1.13x the tokens/s of 8 and half its TTFT p99;
            2 gave 0.79x of 4).
        max_decode_steps: the most steps of a chunk of fewer rows, whose steps cost less: while nothing
            waits, reads its prompt or has just left, such a chunk runs as many steps as take about the
            time of decode_steps steps of every slot (`warm_up` times each program), up to this many.
            Default 4 x decode_steps; decode_steps keeps every chunk at decode_steps.
        prefill_chunk: prompt tokens per prefill call; a long prompt takes several, between decode chunks.
        prefill_rows: prompts whose next chunk one prefill call reads together (the oldest first).
        prefix_reuse: start a prompt in the free slot whose cache holds the longest prefix of it (a
            system prompt, earlier turns of a chat), reading only the rest.

    Example:
        >>> engine = Engine(hfjax.load(path), max_batch=8)
        >>> engine.start()
        >>> engine.generate([ids], SamplingParams(max_tokens=16, temperature=0))
    """

    def __init__(
        self,
        model,
        *,
        max_batch: int = 8,
        max_model_len: int | None = None,
        max_queue: int = 256,
        decode_steps: int = 4,
        max_decode_steps: int | None = None,
        prefill_chunk: int = 32,
        prefill_rows: int = 4,
        prefix_reuse: bool = True,
    ):
        context = _loading.context_length(model.module.config.get_text_config(decoder=True))
        if max_model_len is None:
            max_model_len = min(context or 2048, 2048)
        for name, value in (("max_batch", max_batch), ("max_model_len", max_model_len), ("max_queue", max_queue),
                            ("decode_steps", decode_steps), ("prefill_chunk", prefill_chunk),
                            ("prefill_rows", prefill_rows)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ServingError(f"Engine: {name}={value!r}; pass a whole number >= 1")
        if max_decode_steps is None:
            max_decode_steps = 4 * decode_steps
        if (
            isinstance(max_decode_steps, bool)
            or not isinstance(max_decode_steps, int)
            or max_decode_steps < decode_steps
        ):
            raise ServingError(
                f"Engine: max_decode_steps={max_decode_steps!r}; pass a whole number >= decode_steps={decode_steps}"
            )
        if context is not None and max_model_len > context:
            raise ServingError(
                f"Engine: max_model_len={max_model_len} is beyond the model's context of {context} tokens "
                f"(config.max_position_embeddings); pass max_model_len<={context}"
            )
        if model.tokenizer is None:
            raise ServingError(f"Engine: {model.source} has no tokenizer; serve a checkpoint with tokenizer files")
        _slots.check_supported(model, max_model_len)
        self.model = model
        self.tokenizer = model.tokenizer
        self.max_batch, self.max_model_len, self.max_queue = max_batch, max_model_len, max_queue
        self.decode_steps, self.max_decode_steps, self.prefill_chunk = decode_steps, max_decode_steps, prefill_chunk
        self.prefill_rows = min(prefill_rows, max_batch)
        self.prefix_reuse = prefix_reuse
        self.eos = _eos_ids(model)
        self.metrics = Metrics(max_batch)
        self.slot_model = _slots.SlotModel(model, max_batch, max_model_len)
        fingerprint = (
            _programs.model_fingerprint(model.module, model.params, model.aliases)
            if _programs.single_device(model.params)
            else None
        )
        self.programs = _programs.ProgramCache(fingerprint)
        self.precision = _precision.resolve(model.matmul_precision)  # of every program, fixed for the engine's life
        self._cache = None  # [(keys, values)] per layer, [S, heads, L, head_dim]
        self._slots: list[Request | None] = [None] * max_batch
        self._cached: list[list[int]] = [[] for _ in range(max_batch)]  # token ids whose keys each row holds
        # Each slot's last token, not yet in its cache, and that token's position: on the device, where
        # only the programs change them, and the positions on the host too.
        self._tokens = jnp.zeros(max_batch, jnp.int32)
        self._device_positions = jnp.zeros(max_batch, jnp.int32)
        self._positions = np.zeros(max_batch, np.int32)
        self._temperature = np.zeros(max_batch, np.float32)
        self._top_p = np.ones(max_batch, np.float32)
        self._keys = np.zeros((max_batch, 2), np.uint32)
        self._waiting: collections.deque[Request] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self._since_freed = 0  # decode chunks dispatched since a slot was last freed
        self._unclaimed = 0  # slots freed since the last decode chunk, less requests admitted since
        self._sent = _DeviceCopies()
        self._chunk_seconds: dict[tuple[int, int], float] = {}  # (rows, window) -> decode_steps steps, timed

    # -- the caller's side ------------------------------------------------------------

    @property
    def program_counts(self) -> dict[str, int]:
        """Programs prepared per stage ("prefill", "decode"), traced or read from disk."""
        return {stage: self.programs.traced[stage] + self.programs.loaded[stage] for stage in ("prefill", "decode")}

    @property
    def running(self) -> int:
        return sum(request is not None for request in self._slots)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def start(self) -> Engine:
        """Allocates the cache and starts the engine thread (idempotent)."""
        if self._thread is None:
            if self._cache is None:
                self._cache = self.slot_model.empty_cache()
            self._thread = threading.Thread(target=self._run, name="hfjax-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """The prompt counts a prefill chunk is compiled for: powers of two up to prefill_rows."""
        return tuple(
            sorted({_buckets.bucket(n, smallest=1, limit=self.prefill_rows) for n in range(1, self.prefill_rows + 1)})
        )

    @property
    def windows(self) -> tuple[int, ...]:
        """The column counts a decode chunk is compiled for: max_model_len and up to 3 halvings of it,
        down to 32 (a chunk attends over the smallest that holds every decoding row's positions)."""
        windows = [self.max_model_len]
        while len(windows) < 4 and windows[-1] % 2 == 0 and windows[-1] // 2 >= _SMALLEST_WINDOW:
            windows.append(windows[-1] // 2)
        return tuple(sorted(windows))

    @property
    def row_buckets(self) -> tuple[int, ...]:
        """The row counts a decode chunk is compiled for: powers of two up to max_batch, and max_batch."""
        return tuple(
            sorted({_buckets.bucket(n, smallest=1, limit=self.max_batch) for n in range(1, self.max_batch + 1)})
        )

    def warm_up(self) -> None:
        """Prepares every program (a prefill and a decode chunk per row bucket and window) before `start`,
        so that no request waits for a compile and none compiles afterwards."""
        if self._thread is not None:
            raise ServingError("Engine.warm_up: call it before start(), while no request is running")
        if self._cache is None:
            self._cache = self.slot_model.empty_cache()
        probe = Request([min(self.eos, default=0)], SamplingParams(max_tokens=1), lambda event: None, None)
        probe.slot = 0
        for rows in self.prefill_buckets:
            for window in self.windows:
                probe.prefilled = 0
                self._prefill([probe], rows=rows, window=window, deliver=False)
        self._positions[:] = 0
        _key_data(0)  # jax.random's seeding compiles on its first call (~0.1 s): not in the first request
        for rows in self.row_buckets:
            for window in self.windows:
                self._collect(self._dispatch(rows=rows, window=window))
                if self.max_decode_steps > self.decode_steps:  # timed for `_chunk_steps`, best of two
                    times = []
                    for _ in range(2):
                        start = time.perf_counter()
                        self._collect(self._dispatch(rows=rows, window=window))
                        times.append(time.perf_counter() - start)
                    self._chunk_seconds[rows, window] = min(times)
        # The first call above read the cache as allocated, not yet placed by a program; jit's
        # cache tells the two apart, and the first request (a prompt of one chunk, the same
        # program) lowered it again: ~0.2 s of its time to first token.
        probe.prefilled = 0
        self._prefill([probe], rows=self.prefill_buckets[0], window=self.windows[0], deliver=False)

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stops the thread: after finishing every queued and running request (drain), or at once."""
        with self._lock:
            self._stopping = True
            if not drain:
                for request in [*self._waiting, *filter(None, self._slots)]:
                    request.cancelled = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def check_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        """Raises GenerationError when prompt and max_tokens do not fit a slot, naming which."""
        if not prompt:
            raise GenerationError("the prompt is empty; pass at least one token")
        if len(prompt) >= self.max_model_len:
            raise GenerationError(
                f"the prompt has {len(prompt)} tokens, more than max_model_len={self.max_model_len} allows with one "
                "new token; shorten the prompt"
            )
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise GenerationError(
                f"max_tokens={params.max_tokens} with a prompt of {len(prompt)} tokens is beyond max_model_len="
                f"{self.max_model_len}; pass max_tokens<={self.max_model_len - len(prompt)}"
            )

    def submit(self, prompt: list[int], params: SamplingParams, listener: Callable[[Event], None]) -> Request:
        """Queues a prompt (token ids); `listener` gets an Event after each chunk, on the engine thread.

        Raises:
            GenerationError: the prompt and max_tokens do not fit max_model_len.
            QueueFullError: max_queue requests are waiting already.
            ServingError: the engine has stopped, or failed.
        """
        self.check_prompt(prompt, params)
        request = Request(list(prompt), params, listener, TextStream(self.tokenizer, params.stop))
        with self._lock:
            if self._error is not None:
                raise ServingError(f"the engine failed: {self._error!r}") from self._error
            if self._stopping or self._thread is None:
                raise ServingError("the engine is not running (start() it, or it is shutting down)")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(
                    f"{len(self._waiting)} requests are waiting, max_queue={self.max_queue}; try again later"
                )
            self._waiting.append(request)
            self.metrics.queue_depth = len(self._waiting)
            self._wake.notify_all()
        return request

    def cancel(self, request: Request) -> None:
        """Drops a request (its client left): at once from the queue, from a slot at the next chunk boundary."""
        with self._lock:
            request.cancelled = True
            if request in self._waiting:
                self._waiting.remove(request)
                self.metrics.queue_depth = len(self._waiting)
                self._finish(request, "cancelled")
            self._wake.notify_all()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Event]:
        """Runs prompts (token ids) together and waits: one Event per prompt with all of its tokens and text."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ServingError(
                f"Engine.generate: {len(prompts)} prompts and {len(params)} SamplingParams; pass one per prompt"
            )
        results: list[list[Event]] = [[] for _ in prompts]
        done = threading.Semaphore(0)

        def listener(kept: list[Event]):
            def call(event: Event):
                kept.append(event)
                if event.finish_reason is not None:
                    done.release()

            return call

        for prompt, p, kept in zip(prompts, params, results):
            self.submit(prompt, p, listener(kept))
        for _ in prompts:
            while not done.acquire(timeout=1.0):
                if self._error is not None:
                    raise ServingError(f"the engine failed: {self._error!r}") from self._error
        return [_joined(events) for events in results]

    # -- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    self._release_cancelled()
                    self._admit()
                    busy = any(self._slots)
                    if not busy:
                        if self._stopping:
                            return
                        self._wake.wait()
                        continue
                prefilling = [r for r in self._slots if r is not None and r.reading]
                if prefilling:
                    self._prefill(sorted(prefilling, key=lambda r: r.arrived)[: self.prefill_rows])
                chunk = self._dispatch() if any(r is not None and r.decoding for r in self._slots) else None
                while chunk is not None:
                    # The next chunk goes to the device before this one's tokens come back, so the
                    # host's work on them (text, events, the server's sends) overlaps its compute.
                    # Not while a request waits, reads its prompt or left, nor around a slot that
                    # frees: a new request would wait for that chunk too.
                    ahead = self._dispatch() if self._steady(chunk) else None
                    self._collect(chunk)
                    chunk = ahead
        except BaseException as error:  # noqa: BLE001 (handed to every waiting caller)
            self._error = error
            with self._lock:
                for request in [*self._waiting, *filter(None, self._slots)]:
                    self._finish(request, "error")
            raise

    def _steady(self, chunk: _Chunk) -> bool:
        """Whether the next decode chunk can go before `chunk` is delivered (see `_run`)."""
        if not self._only_decoding() or self._stopping or self._since_freed < 2:
            return False  # (a slot freed by the chunk before: its client's next request is likely on its way)
        if any(r is not None and r.cancelled for r in self._slots):
            return False
        if any(r.scheduled >= r.params.max_tokens for r in chunk.requests.values()):
            return False
        return any(r is not None and r.decoding for r in self._slots)

    def _only_decoding(self) -> bool:
        """Nothing waits for a slot and no slot reads its prompt."""
        return not self._waiting and not any(r is not None and r.reading for r in self._slots)

    def _admit(self) -> None:
        while self._waiting and None in self._slots:
            request = self._waiting.popleft()
            if request.cancelled:
                self._finish(request, "cancelled")
                continue
            slot = self._free_slot(request.prompt)
            if self.prefix_reuse:
                # The row already holds the keys and values of the prompt's first tokens: start after
                # them (at least the last prompt token runs, for the logits of the first new token).
                reused = min(_common_prefix(self._cached[slot], request.prompt), len(request.prompt) - 1)
                request.prefilled = reused
                self.metrics.prefix_hit_tokens += reused
            self._cached[slot] = []
            request.slot = slot
            self._slots[slot] = request
            self._unclaimed = max(self._unclaimed - 1, 0)
            params = request.params
            self._temperature[slot] = params.temperature
            self._top_p[slot] = params.top_p
            seed = params.seed if params.seed is not None else secrets.randbits(32)
            self._keys[slot] = _key_data(seed)
        self.metrics.queue_depth = len(self._waiting)
        self.metrics.running = self.running

    def _free_slot(self, prompt: list[int]) -> int:
        """The free slot whose cached tokens share the longest prefix with `prompt`; else the lowest
        free slot (low slots keep decode chunks small)."""
        free = [slot for slot, request in enumerate(self._slots) if request is None]
        if not self.prefix_reuse:
            return free[0]
        return max(free, key=lambda slot: (_common_prefix(self._cached[slot], prompt), -slot))

    def _release_cancelled(self) -> None:
        for request in self._slots:
            if request is not None and request.cancelled:
                self._finish(request, "cancelled")

    def _finish(self, request: Request, reason: str, event: Event | None = None) -> None:
        if request.finished:
            return
        request.finished = True
        if request.slot is not None:
            self._slots[request.slot] = None
            self._since_freed = 0
            self._unclaimed += 1
            # What the row's columns hold for certain: the prompt read so far and every new token fed
            # back (all but the last kept one, which a chunk may or may not have run).
            fed = request.text.ids[:-1] if request.prefilled == len(request.prompt) else []
            self._cached[request.slot] = request.prompt[: request.prefilled] + fed
            self._positions[request.slot] = 0
        self.metrics.running = self.running
        self.metrics.count_finished(reason, len(request.prompt), request.generated)
        if event is None:
            event = Event([], request.text.rest(), None, reason, len(request.prompt), request.generated)
        request.listener(event)

    def _settings(self, requests) -> tuple[jax.Array, ...]:
        want_logprobs = any(r is not None and r.params.logprobs is not None for r in requests)
        return (
            self._sent("temperature", self._temperature),
            self._sent("top_p", self._top_p),
            self._sent("keys", self._keys),
            self._sent("want_logprobs", np.bool_(want_logprobs)),
        )

    def _prefill(
        self, requests: list[Request], *, rows: int | None = None, window: int | None = None, deliver: bool = True
    ) -> None:
        """The next prompt chunk of each request (at most prefill_rows of them) in one program, over
        the fewest compiled columns that hold every chunk."""
        rows = rows or _buckets.bucket(len(requests), smallest=1, limit=self.prefill_rows)
        slots = np.full(rows, self.max_batch, np.int32)  # padding rows: slot S, out of range
        ids = np.zeros((rows, self.prefill_chunk), np.int32)
        start, count = np.zeros(rows, np.int32), np.ones(rows, np.int32)
        for i, request in enumerate(requests):
            chunk = request.prompt[request.prefilled : request.prefilled + self.prefill_chunk]
            slots[i], start[i], count[i] = request.slot, request.prefilled, len(chunk)
            ids[i, self.prefill_chunk - len(chunk) :] = chunk  # the real tokens last: logits at one index
        if window is None:
            window = self._window(int((start + count).max()))
        last = np.zeros(rows, bool)  # rows whose chunk ends their prompt: their next token is chosen
        for i, request in enumerate(requests):
            last[i] = deliver and request.prefilled + count[i] == len(request.prompt)
        args = (
            self.model.params, self._cache, self._tokens, self._device_positions, jnp.asarray(slots),
            jnp.asarray(ids), jnp.asarray(start), jnp.asarray(count), jnp.asarray(last), *self._settings(requests),
        )  # fmt: skip
        program = self.programs.get(
            ("prefill", self.max_batch, self.max_model_len, self.prefill_chunk, rows, window, self.precision),
            _precision.under(self.precision, functools.partial(self._prefill_program, window=window)), args,
            metadata=dict, donate=(1, 2, 3),
        )  # fmt: skip
        self._cache, self._tokens, self._device_positions, chosen = program.run(*args)
        for i, request in enumerate(requests):
            request.prefilled += int(count[i])
            if last[i]:
                self._positions[request.slot] = len(request.prompt)
                request.scheduled = 1
        if not last.any():
            return
        ended = [requests[i] for i in np.flatnonzero(last)]
        chosen = _to_host(chosen, ended, 1)  # [rows, 1] ...
        with self._lock:
            for i in np.flatnonzero(last):
                self._deliver(requests[i], [c if c is None else c[i] for c in chosen], 1)

    def _dispatch(self, *, rows: int | None = None, window: int | None = None) -> _Chunk:
        """Sends the next decode chunk of every decoding slot to the device and returns at once. It
        runs `_chunk_steps` steps, or fewer: as many as the request that needs most still needs."""
        requests = {slot: r for slot, r in enumerate(self._slots) if r is not None and r.decoding}
        active = np.zeros(self.max_batch, bool)
        active[list(requests)] = True
        most = max((r.params.max_tokens - r.scheduled for r in requests.values()), default=self.decode_steps)
        steps = min(self.decode_steps, most)
        end = int(self._positions[active].max(initial=0))  # the last decoding row's position
        if rows is None:  # the fewest compiled rows that hold every decoding slot
            rows = _buckets.bucket(max(requests) + 1, smallest=1, limit=self.max_batch)
            steps = min(self._chunk_steps(rows, self._window(end + steps)), most)
        if window is None:  # every column the chunk writes
            window = self._window(end + steps)
        args = (
            self.model.params, self._cache, self._tokens, self._device_positions, self._sent("active", active),
            self._sent(f"count {steps}", np.int32(steps)), *self._settings(self._slots),
        )  # fmt: skip
        program = self.programs.get(
            ("decode", self.max_batch, self.max_model_len, self.max_decode_steps, rows, window, self.precision),
            _precision.under(
                self.precision,
                functools.partial(self._decode_program, steps=self.max_decode_steps, rows=rows, window=window),
            ),
            args, metadata=dict, donate=(1, 2, 3),
        )  # fmt: skip
        self._cache, self._tokens, self._device_positions, chosen = program.run(*args)
        self._positions = np.where(active, self._positions + steps, self._positions).astype(np.int32)
        for request in requests.values():
            request.scheduled += steps
        self._since_freed += 1
        self._unclaimed = 0
        return _Chunk(requests, steps, chosen)

    def _collect(self, chunk: _Chunk) -> None:
        """Waits for a dispatched chunk and hands its tokens to the requests still in their slots (one
        that finished or left since gets nothing more)."""
        chosen = _to_host(chunk.chosen, chunk.requests.values(), chunk.steps)  # [rows, steps] ...
        with self._lock:
            for slot, request in chunk.requests.items():
                if self._slots[slot] is request and not request.finished and not request.cancelled:
                    self._deliver(request, [c if c is None else c[slot] for c in chosen], chunk.steps)

    def _chunk_steps(self, rows: int, window: int) -> int:
        """decode_steps; or, for a chunk of fewer rows than the slots while nothing waits or reads its
        prompt and no request left in the chunk before without another coming in since (its client's
        next request is likely on its way, and would wait for this chunk), as many steps as take about
        the time of decode_steps steps of every slot, max_decode_steps at most: a newcomer never
        waits longer than under full load. (On 2 CPU cores, 4 steps of 1 row take 12 ms and of 16
        rows 27 ms, and a request alone ran 1.17x faster over HTTP in chunks of 16 steps than of 4:
        each chunk's tokens wake the event loop and the client.)"""
        full = self._chunk_seconds.get((self.row_buckets[-1], window))
        mine = self._chunk_seconds.get((rows, window))
        if full is None or mine is None or self._unclaimed or not self._only_decoding():
            return self.decode_steps
        return max(self.decode_steps, min(self.max_decode_steps, int(self.decode_steps * full / mine)))

    def _window(self, columns: int) -> int:
        """The fewest compiled columns (`windows`) that hold the first `columns` of a row."""
        return next((w for w in self.windows if w >= columns), self.max_model_len)

    def _deliver(self, request: Request, chosen: list[np.ndarray], count: int) -> None:
        """Hands a request its new tokens (chosen: token [T], logprob [T], top ids [T, 20], top logprobs
        [T, 20]; the last three None when no request of the program asked for log-probabilities), cut
        at EOS or max_tokens, and finishes it when one of its stops is met."""
        tokens, logprob, top_token, top_logprob = chosen
        now = time.perf_counter()
        if request.last_token_time is None:
            self.metrics.time_to_first_token.observe(now - request.arrived)
        else:
            self.metrics.inter_token_latency.observe((now - request.last_token_time) / count, count)
        request.last_token_time = now
        reason = None
        kept = []
        for t in range(count):
            token = int(tokens[t])
            if token in self.eos and not request.params.ignore_eos:
                reason = "stop"
                request.generated += 1
                break
            kept.append(t)
            request.generated += 1
            if request.generated >= request.params.max_tokens:
                reason = "length"
                break
        ids = [int(tokens[t]) for t in kept]
        text, stopped = request.text.add(ids)
        if stopped:
            reason = "stop"
        logprobs = None
        if request.params.logprobs is not None:
            alternatives = request.params.logprobs
            logprobs = [
                TokenLogprob(
                    int(tokens[t]), float(logprob[t]),
                    [(int(i), float(v)) for i, v in zip(top_token[t][:alternatives], top_logprob[t][:alternatives])],
                )
                for t in kept
            ]  # fmt: skip
        if reason is not None:
            text += request.text.rest() if not stopped else ""
        event = Event(ids, text, logprobs, reason, len(request.prompt), request.generated)
        if reason is None:
            request.listener(event)
        else:
            self._finish(request, reason, event)

    # -- traced: flat arguments, so that the programs can be kept on disk ------------------

    def _prefill_program(
        self, params, cache, tokens, positions, slots, ids, start, count, last, temperature, top_p, keys,
        want_logprobs, *, window: int,
    ):  # fmt: skip
        self.programs.traced["prefill"] += 1
        settings = _slots.RowSettings(temperature, top_p, keys)
        cache, chosen = self.slot_model.prefill_chunk(
            params, cache, slots, ids, start, count, settings, want_logprobs, window=window
        )
        # The chosen token is the slot's next input where the prompt ended (other rows: slot S, dropped),
        # at the position after the prompt.
        ended = jnp.where(last, slots, self.max_batch)
        tokens = tokens.at[ended].set(chosen.token[:, 0], mode="drop")
        positions = positions.at[ended].set(start + count, mode="drop")
        return cache, tokens, positions, (chosen.token, chosen.logprob, chosen.top_token, chosen.top_logprob)

    def _decode_program(
        self,
        params,
        cache,
        tokens,
        positions,
        active,
        count,
        temperature,
        top_p,
        keys,
        want_logprobs,
        *,
        steps: int,
        rows: int,
        window: int,
    ):
        self.programs.traced["decode"] += 1
        settings = _slots.RowSettings(temperature, top_p, keys)
        cache, chosen, last = self.slot_model.decode_chunk(
            params, cache, tokens, positions, active, settings, want_logprobs, steps=steps, rows=rows, window=window,
            count=count,
        )  # fmt: skip
        # Each decoding slot's next input is the last token the chunk chose for it.
        tokens = tokens.at[:rows].set(jnp.where(active[:rows], last, tokens[:rows]))
        positions = jnp.where(active, positions + count, positions)
        return cache, tokens, positions, (chosen.token, chosen.logprob, chosen.top_token, chosen.top_logprob)


class _DeviceCopies:
    """Device copies of the engine's small host arrays (settings, the decoding slots, ...), each sent
    again only when the host's array has changed since: in a steady decode a chunk sends nothing."""

    def __init__(self):
        self._kept: dict[str, tuple[np.ndarray, jax.Array]] = {}

    def __call__(self, name: str, host: np.ndarray) -> jax.Array:
        kept = self._kept.get(name)
        if kept is None or not np.array_equal(kept[0], host):
            kept = self._kept[name] = (np.array(host), jnp.asarray(host))
        return kept[1]


def _to_host(chosen, requests, steps: int) -> list[np.ndarray | None]:
    """A program's chosen tokens [rows, steps] on the host; their log-probabilities and the top 20
    too when one of `requests` asked for them (else None: one copy from the device, not four)."""
    wanted = any(r.params.logprobs is not None for r in requests)
    return [np.asarray(c)[:, :steps] if wanted or i == 0 else None for i, c in enumerate(chosen)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _key_data(seed: int) -> np.ndarray:
    return np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)


def _eos_ids(model) -> frozenset[int]:
    ids = model.generation_config.eos_token_id
    if ids is None:
        ids = model.tokenizer.eos_token_id
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)


def _joined(events: list[Event]) -> Event:
    logprobs = None if events[0].logprobs is None else [lp for e in events for lp in (e.logprobs or [])]
    last = events[-1]
    return Event(
        [t for e in events for t in e.token_ids],
        "".join(e.text for e in events),
        logprobs,
        last.finish_reason,
        last.prompt_tokens,
        last.completion_tokens,
    )
