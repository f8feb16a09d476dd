"""The engine's programs: which are ready, which a chunk wants, and the thread that compiles them.

A chunk of R rows over W columns runs the program compiled for (R, W) when it is ready, else the
smallest ready one that holds it (more rows and columns: the same tokens, only slower), and asks
for its own. Decode programs come in two kinds: "decode" computes no log-probabilities, for chunks
in which no request asks for them (most traffic: no top-20 buffers or `cond` in its loop), and
"decode_logprobs" does, for the others; a "decode" chunk may run either. Before the engine starts,
only the largest prefill and "decode_logprobs" are compiled (every chunk fits them); then a thread
compiles what chunks ask for, and, while none asks, the one-row prefill and "decode" programs of
short windows that a lone client's requests run. No request waits for a compile, the server listens
after two of them, and a grid of many rows and windows (49 decode programs for 64 slots and 2048
columns) is compiled only as far as the traffic needs it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import jax

from .. import generation

logger = logging.getLogger("hfjax")
AHEAD_WINDOW = 512  # columns: the longest window compiled before a chunk asks for it
# The kinds of program whose ready cells a chunk of each kind may run (the first: its own).
RUNS_ON = {"prefill": ("prefill",), "decode": ("decode", "decode_logprobs"), "decode_logprobs": ("decode_logprobs",)}
FALLBACKS = ("prefill", "decode_logprobs")  # compiled before the engine starts: every chunk fits their largest


class Compiler:
    """The slot programs of one engine (`generation.SlotPrograms`) over its grid of (rows, window)."""

    def __init__(
        self,
        programs: generation.SlotPrograms,
        grid: dict[str, list[tuple[int, int]]],
        *,
        progress: Callable[[str], None] | None = None,
        pending: Callable[[int], None] | None = None,
    ):
        self.programs = programs
        self.grid = grid
        self.progress = progress
        self._report_pending = pending or (lambda count: None)
        self._ready: dict[str, set[tuple[int, int]]] = {kind: set() for kind in grid}
        self._wanted: collections.deque[tuple[str, int, int]] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._example: Callable | None = None
        self.seconds = 0.0  # spent compiling, in all
        self.compiled = 0

    @property
    def pending(self) -> int:
        """Programs asked for (by chunks, or ahead for one row) and not compiled yet."""
        with self._lock:
            return len({cell for cell in (*self._wanted, *self._ahead()) if cell[1:] not in self._ready[cell[0]]})

    def prepare_fallbacks(self, example: Callable) -> None:
        """Compiles the largest prefill and "decode_logprobs" now (every chunk fits them)."""
        self._example = example
        self._prepare_now(self._fallbacks())

    def prepare_all(self, example: Callable) -> None:
        """Compiles every program of the grid now."""
        self._example = example
        self._prepare_now([(kind, *cell) for kind, cells in self.grid.items() for cell in cells])

    def _fallbacks(self) -> list[tuple[str, int, int]]:
        return [(kind, *self.grid[kind][-1]) for kind in FALLBACKS]

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hfjax-compiler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()

    def program_for(self, kind: str, rows: int, columns: int) -> tuple[str, int, int]:
        """(kind, rows, window) of the program a chunk of `kind` with `rows` rows whose rows end by
        column `columns` runs: its own where it is ready, else the smallest ready one holding it of a
        kind in RUNS_ON[kind] (its own is asked for)."""
        own = next(cell for cell in self.grid[kind] if cell[0] >= rows and cell[1] >= columns)
        if own in self._ready[kind]:
            return (kind, *own)
        with self._lock:
            if (kind, *own) not in self._wanted:
                self._wanted.append((kind, *own))
                self._wake.notify_all()
        ready = [(other, *cell) for other in RUNS_ON[kind] for cell in self._ready[other]
                 if cell[0] >= own[0] and cell[1] >= own[1]]  # fmt: skip
        return min(ready, key=lambda cell: (cell[1] * cell[2], RUNS_ON[kind].index(cell[0]), cell))

    def _prepare_now(self, cells: list[tuple[str, int, int]]) -> None:
        todo = [cell for cell in cells if cell[1:] not in self._ready[cell[0]]]
        for n, (kind, rows, window) in enumerate(todo, 1):
            seconds, cached = self._compile(kind, rows, window)
            if self.progress is not None:
                done = "loaded" if cached else "compiled"
                where = " from the cache" if cached else ""
                self.progress(
                    f"{done} the {kind} program for {rows} rows x {window} columns{where} ({n}/{len(todo)}): "
                    f"{seconds:.1f} s"
                )

    def _compile(self, kind: str, rows: int, window: int) -> tuple[float, bool]:
        """Compiles one program: (its seconds, whether it was loaded from the compilation cache)."""
        start = time.perf_counter()
        arguments = jax.tree_util.tree_map(_abstract, self._example(kind, rows, window))
        if kind == "prefill":
            cached = self.programs.compile_prefill(*arguments, window=window)
        else:
            cached = self.programs.compile_decode(
                *arguments, decoding_rows=rows, window=window, logprobs=kind == "decode_logprobs"
            )
        seconds = time.perf_counter() - start
        with self._lock:
            self._ready[kind].add((rows, window))
            self.seconds += seconds
            self.compiled += 1
        self._report_pending(self.pending)
        return seconds, cached

    def _ahead(self) -> list[tuple[str, int, int]]:
        """The programs compiled while no chunk asks for one: one row over the windows a short chat
        (without log-probabilities) needs."""
        return [(kind, rows, window) for kind in ("prefill", "decode") for rows, window in self.grid[kind]
                if rows == 1 and window <= AHEAD_WINDOW]  # fmt: skip

    def _next(self) -> tuple[str, int, int] | None:
        """What to compile next (with the lock held): a chunk's wish, else one of `_ahead`, smallest first."""
        while self._wanted:
            kind, rows, window = self._wanted.popleft()
            if (rows, window) not in self._ready[kind]:
                return kind, rows, window
        rest = sorted((window, kind, rows, window) for kind, rows, window in self._ahead()
                      if (rows, window) not in self._ready[kind])  # fmt: skip
        return rest[0][1:] if rest else None

    def _run(self) -> None:
        while True:
            with self._lock:
                cell = self._next()
                while cell is None and not self._stopping:
                    self._wake.wait()
                    cell = self._next()
                if self._stopping:
                    return
            seconds, cached = self._compile(*cell)
            logger.info(
                "hfjax serve: %s the %s program for %d rows x %d columns in %.1f s",
                "loaded" if cached else "compiled",
                *cell,
                seconds,
            )


def _abstract(x):
    """An array's shape, dtype and placement (a committed array's sharding), for lowering without it."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=x.sharding if x.committed else None, weak_type=x.weak_type
        )
    return x
