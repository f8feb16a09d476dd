"""The engine's calls into generation's slot core: each program's arguments built from the slots'
row state, prefill and decode chunks run, the cache state carried from one call to the next, and
the rows' progress (prompt tokens read, positions, steps scheduled) kept as the device has it."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from .. import generation
from ._compiler import PREFILLS, SHORT_WIDTH, SMALLEST_WINDOW, Compiler, geometric, prefill_width
from ._metrics import Metrics
from ._requests import Request
from ._table import SlotTable


@dataclasses.dataclass
class Chunk:
    """A decode chunk dispatched and not yet delivered: whose tokens it chooses, and how many."""

    requests: dict[int, Request]  # slot -> the request decoding there when it was dispatched
    steps: int
    chosen: generation.Chosen  # token [rows, K], logprob [rows, K], top ids and logprobs [rows, K, 20]
    host: list[np.ndarray | None] | None = None  # `chosen` on the host, where `Delivery.advance` waited for it


def constrained(requests: dict[int, Request]) -> bool:
    """Whether one of the {slot: request} is constrained (its next mask needs its last token)."""
    return any(r.matcher is not None for r in requests.values())


class CoreCalls:
    """The prefill and decode calls of `compiler`'s programs over the slots of `table`.

    Args:
        slot_model: the slot core the programs run (`generation.slot_model`).
        compiler: the engine's programs (`compiler.programs`, looked up at each call).
        table: the slots' row state: their settings are each call's rows, their positions advance.
        metrics: counts the prompt tokens read.
        features: the programs' sampling features (`generation.SamplingFeatures`).
        max_model_len: cache columns per slot, the widest window.
        prefill_chunk: prompt tokens per prefill call (`prefill_width`).
        encoder_decoder: each prefill row carries its request's encoder inputs.
        image_example: a prompt with images and its processor's outputs, for compiling the image
            prefill programs ahead (`fixed_image_example`), or None.
    """

    def __init__(
        self,
        slot_model,
        compiler: Compiler,
        table: SlotTable,
        metrics: Metrics,
        *,
        features: generation.SamplingFeatures,
        max_model_len: int,
        prefill_chunk: int,
        encoder_decoder: bool,
        image_example: tuple | None,
    ):
        self.slot_model, self.compiler, self.table, self.metrics = slot_model, compiler, table, metrics
        self.features, self.prefill_chunk, self.encoder_decoder = features, prefill_chunk, encoder_decoder
        self.max_model_len = max_model_len
        self.recurrent = slot_model.recurrent
        self.slots = table.slots
        self.image_example = image_example
        self.image_inputs: dict[int, dict] = {}  # per window: the example's prefill inputs (`warm_up`)
        self.state: generation.SlotState | None = None

    def warm_up(self) -> None:
        """Allocates the cache and compiles (or reads from the compilation cache) every program of the set."""
        if self.state is None:
            self.state = self.slot_model.empty_state(self.features)
        if self.image_example is not None:  # (here, not on the compile threads: an eager encoder binds weights)
            ids, processed = self.image_example
            self.image_inputs = {
                window: self.slot_model.prompt_inputs(np.asarray(ids, np.int32), processed, window)[0]
                for _, window in self.compiler.grid["image"]
            }
        self.compiler.prepare(self.example_args)
        self._run_once()

    def _run_once(self) -> None:
        """Runs each program of the set once, on rows that hold no request (a prefill's padding rows,
        a decode's inactive slots, a swap of two empty slots), while no slot holds anything: a
        program's first run costs more than the ones after it, and without this the first requests
        paid for it (16 prompts of 32 tokens sent at once, the first after start: time to the last first
        token 0.40-0.47 s, against 0.13-0.21 s for the same load sent again; 0.20-0.24 s after this,
        which took 0.83-0.85 s: 20m Llama, 64 slots x 2048, 11 programs, 2-core AMD EPYC)."""
        start = time.perf_counter()
        programs = self.compiler.programs
        for kind, cells in self.compiler.grid.items():
            for rows, window in cells:
                args = self.example_args(kind, rows, window)
                if kind in PREFILLS:
                    *args, inputs = args
                    self.state, _ = programs.prefill(*args, window=window, inputs=inputs)
                elif kind == "swap":
                    self.state = programs.swap(*args)
                elif kind == "choose":
                    continue  # (each prefill above ran it)
                else:
                    self.state, _ = programs.decode(*args, decoding_rows=rows, window=window)
        jax.block_until_ready(self.state.leaves())
        if self.compiler.progress is not None:
            self.compiler.progress(
                f"ran the {len(self.compiler)} programs once (a first run costs more): {time.perf_counter() - start:.1f} s"
            )

    def example_args(self, kind: str, rows: int, window: int) -> tuple:
        """Arguments like those the engine passes, for compiling a program ahead of its first call; a
        prefill's end with its chunk's model inputs (an encoder-decoder's encoder inputs,
        `EncoderDecoderSlotModel.encoder_inputs`; a prompt's images), or None."""
        if kind in ("prefill", "short"):
            inputs = self.encoder_zeros(rows) if self.encoder_decoder else None
            chunk = SHORT_WIDTH if kind == "short" else self.prefill_width(window)
            args = self.prefill_args(
                np.full(rows, self.slots, np.int32), np.zeros((rows, chunk), np.int32),
                np.zeros(rows, np.int32), np.ones(rows, np.int32), np.zeros(rows, bool), np.zeros(rows, bool), False,
            )  # fmt: skip
            return (*args, on_device(inputs))
        if kind == "image":
            ids, inputs = self.image_example[0], self.image_inputs[window]
            one = np.ones(1, np.int32)
            args = self.prefill_args(
                one * self.slots, np.zeros((1, window), np.int32), one * 0, one * len(ids), one > 0, one > 0,
                False,
            )  # fmt: skip
            return (*args, inputs)
        if kind == "swap":
            return self.state, jnp.zeros((), jnp.int32), jnp.ones((), jnp.int32)
        if kind == "choose":  # (the rows' logits, start, count and last: `compile_choose`)
            want = self.table.copies("want", np.bool_(False))
            return self.state, self.table.sampling(), jnp.full(rows, self.slots, jnp.int32), want
        return self.decode_args(np.zeros(self.slots, bool), 1, False)

    def prefill_args(self, which, ids, start, count, last, fresh, want_logprobs) -> tuple:
        """A prefill program's arguments but its inputs: the state, the rows' settings, then which [P],
        ids [P, C], start [P], count [P], last [P], fresh [P] and want (whether to report logprobs)."""
        return (
            self.state, self.table.sampling(), jnp.asarray(which), jnp.asarray(ids), jnp.asarray(start),
            jnp.asarray(count), jnp.asarray(last), jnp.asarray(fresh), self.table.copies("want", np.bool_(want_logprobs)),
        )  # fmt: skip

    def decode_args(self, active, steps: int, want_logprobs) -> tuple:
        """A decode program's arguments: the state, the rows' settings, active [S], the steps and want."""
        copies = self.table.copies
        return (
            self.state, self.table.sampling(), copies("active", active), copies(f"count {steps}", np.int32(steps)),
            copies("want", np.bool_(want_logprobs)),
        )  # fmt: skip

    def encoder_zeros(self, rows: int) -> dict[str, np.ndarray]:
        """Host zeros of an encoder-decoder's prefill inputs for `rows` rows (as requests' come: the
        placing of host arrays of each shape is compiled at the start too)."""
        examples = self.slot_model.encoder_inputs(rows)
        return {name: np.zeros(example.shape, example.dtype) for name, example in examples.items()}

    def prefill_width(self, window: int) -> int:
        """Prompt tokens per row of the prefill program over `window` columns (`prefill_width`; a
        recurrent model's: a whole prompt, as wide as the window)."""
        return window if self.recurrent else prefill_width(window, self.prefill_chunk)

    def _holds(self, window: int, request: Request) -> bool:
        """Whether the prefill program over `window` columns holds `request`'s next chunk (at that
        program's width); a recurrent model's only where the chunk is the rest of the prompt, which it
        scans whole."""
        end = request.prefilled + min(self.prefill_width(window), len(request.prompt) - request.prefilled)
        return end <= window and (not self.recurrent or end == len(request.prompt))

    def image_width(self, length: int) -> int:
        """The columns of the one-chunk prefill of a prompt of `length` tokens with images: the smallest
        of the engine's windows (128, 512, 2048, ..., max_model_len) that holds it."""
        return next(w for w in geometric(SMALLEST_WINDOW, self.max_model_len) if w >= length)

    def _short(self, requests: list[Request]) -> tuple[int, int] | None:
        """The (rows, window) of the "short" prefill program that reads the whole rest of every one of
        `requests`' prompts (SHORT_WIDTH tokens a row at most), or None."""
        return next(
            (
                (rows, window)
                for rows, window in self.compiler.grid.get("short", ())
                if rows >= len(requests)
                and all(len(r.prompt) - r.prefilled <= SHORT_WIDTH and len(r.prompt) <= window for r in requests)
            ),
            None,
        )

    def prefill(self, requests: list[Request]) -> tuple[np.ndarray, generation.Chosen]:
        """The next prompt chunk of each request in one program: a "short" one where that reads every
        row's whole rest (`_short`), else the smallest that holds every row's next chunk, as wide as
        that program takes (`prefill_width`). Returns last [rows] and chosen (`_prefilled`)."""
        short = self._short(requests)
        rows, window = short or next(
            (rows, window)
            for rows, window in self.compiler.grid["prefill"]
            if rows >= len(requests) and all(self._holds(window, r) for r in requests)
        )
        chunk_size = SHORT_WIDTH if short else self.prefill_width(window)
        which = np.full(rows, self.slots, np.int32)  # padding rows: slot S, out of range
        ids = np.zeros((rows, chunk_size), np.int32)
        start, count = np.zeros(rows, np.int32), np.ones(rows, np.int32)
        last, fresh = np.zeros(rows, bool), np.zeros(rows, bool)
        for i, request in enumerate(requests):
            chunk = request.prompt[request.prefilled : request.prefilled + chunk_size]
            which[i], start[i], count[i] = request.slot, request.prefilled, len(chunk)
            ids[i, chunk_size - len(chunk) :] = chunk  # the real tokens last: logits at one index
            last[i] = request.prefilled + len(chunk) == len(request.prompt)
            fresh[i] = request.prefilled == request.started
        want = any(r.params.logprobs is not None for r in requests)
        inputs = None
        if self.encoder_decoder:  # each row's encoder inputs (its whole prompt is this chunk); padding rows: zeros
            inputs = self.encoder_zeros(rows)
            for i, request in enumerate(requests):
                for name, value in request.inputs.items():
                    inputs[name][i] = value
        args = self.prefill_args(which, ids, start, count, last, fresh, want)
        self.state, chosen = self.compiler.programs.prefill(*args, window=window, inputs=on_device(inputs))
        return self._prefilled(requests, count, last, chosen)

    def prefill_images(self, request: Request) -> tuple[np.ndarray, generation.Chosen]:
        """A prompt with images, whole, in one chunk of one row (the images' tokens attend to each other,
        and a multimodal rope's positions are the whole prompt's), as wide as the smallest window that
        holds it (`image_width`). Returns last [1] and chosen (`_prefilled`)."""
        width = self.image_width(len(request.prompt))
        inputs, delta = self.slot_model.prompt_inputs(np.asarray(request.prompt, np.int32), request.images, width)
        self.table.rows.rope_delta[request.slot] = delta
        ids = np.zeros((1, width), np.int32)
        ids[0, width - len(request.prompt) :] = request.prompt
        count, last = np.full(1, len(request.prompt), np.int32), np.ones(1, bool)
        args = self.prefill_args(
            np.full(1, request.slot, np.int32), ids, np.zeros(1, np.int32), count, last, last,
            request.params.logprobs is not None,
        )  # fmt: skip
        self.state, chosen = self.compiler.programs.prefill(*args, window=width, inputs=inputs)
        return self._prefilled([request], count, last, chosen)

    def _prefilled(self, requests: list[Request], count, last, chosen) -> tuple[np.ndarray, generation.Chosen]:
        """After a prefill call: each request's `count` tokens read; those whose prompt it ended (`last`)
        decode next. Returns `last` [rows] and `chosen`, whose rows of `last` hold their first new token."""
        self.metrics.prompt_tokens_read += int(count[: len(requests)].sum())
        for i, request in enumerate(requests):
            request.prefilled += int(count[i])
            if last[i]:
                self.table.positions[request.slot] = len(request.prompt)
                request.scheduled = 1
        return last, chosen

    def swap(self, moves: list[tuple[int, int]]) -> None:
        """Slots trade what they hold (`SlotPrograms.swap`), pair by pair, as the table's `moves` say
        (`SlotTable.assign`), before any call reads them."""
        for a, b in moves:
            self.state = self.compiler.programs.swap(self.state, jnp.int32(a), jnp.int32(b))

    def decode(self, requests: dict[int, Request], rows: int, steps: int) -> Chunk:
        """Sends a decode chunk of `steps` steps of the {slot: request} decoding, over `rows` rows, to the
        device and returns at once; their positions and steps scheduled advance by `steps`."""
        active = np.zeros(self.slots, bool)
        active[list(requests)] = True
        # Every column the chunk writes, up to max_model_len: a row's columns past it are steps after
        # its last token (a row beside it needs more), which the program drops.
        end = min(int(self.table.positions[active].max(initial=0)) + steps, self.max_model_len)
        want = any(r.params.logprobs is not None for r in requests.values())
        _, rows, window = self.compiler.program_for("decode", rows, end)
        args = self.decode_args(active, steps, want)
        self.state, chosen = self.compiler.programs.decode(*args, decoding_rows=rows, window=window)
        self.table.positions = np.where(active, self.table.positions + steps, self.table.positions).astype(np.int32)
        for request in requests.values():
            request.scheduled += steps
        return Chunk(requests, steps, chosen)


def on_device(inputs: dict | None) -> dict | None:
    """A prefill's model inputs (host arrays) on the device, as the programs take them."""
    return None if inputs is None else {name: jnp.asarray(value) for name, value in inputs.items()}
