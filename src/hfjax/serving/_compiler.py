"""The engine's programs: a set fixed when the engine is built, all compiled before it starts.

A vision-language model's set also holds, where its processor gives every image the same shapes
(LLaVA's, Gemma 3's, PaliGemma's fixed image size), the one-row prefill of a prompt with one image
at each window that holds one ("image"); a prompt with other shapes (more images, Qwen2-VL's grids,
which follow each image's size) compiles its prefill at its first request.

A chunk of R rows whose rows end by column W runs the smallest program of its kind that holds it
(rows >= R, window >= W; more rows and columns give the same tokens, only slower). The set is a
few row counts and windows, each 4x the last (`geometric`), so that a chunk pays for at most 4x the
rows and columns it needs while the set stays small enough to compile before the server says it is
ready: no request waits for a compile, and the traffic never causes one. A decode program computes
the log-probabilities only where a request of its chunk asks (a `cond` in its loop), so one decode
program serves chunks with log-probabilities and without.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable

import jax

from .. import generation

COMPILE_THREADS = 4  # at most, and no more than the cores: XLA compiles and loads without the GIL, tracing takes turns
GROWTH = 4  # each row count and window of the set is this many times the last
PREFILLS = ("prefill", "short", "image")  # the kinds of the set whose programs are prefill programs


def geometric(smallest: int, limit: int) -> list[int]:
    """smallest, 4x smallest, 16x ... while twice the value is within `limit`, then `limit`: at most
    4x (and never less than smallest) what a chunk of n <= limit asks for, `limit` itself the last."""
    values, value = [], smallest
    while 2 * value <= limit:
        values.append(value)
        value *= GROWTH
    return [*values, limit]


SMALLEST_WINDOW = 128  # columns of the smallest window a chunk attends over
WIDTH_GROWTH = 4  # a prefill chunk reads at most this many times --prefill-chunk tokens a row
# Prompt tokens a row of the "short" prefill programs read: the whole rest of a short prompt, where
# --prefill-chunk is wider (a prefill's cost follows its width, not its real tokens).
SHORT_WIDTH = 32


def prefill_width(window: int, chunk: int) -> int:
    """Prompt tokens per row of the prefill program over `window` columns, for --prefill-chunk `chunk`:
    an eighth of the window, at least `chunk` and at most 4x it. A prefill call gathers its rows'
    whole window of keys and values whatever its width, so over a long window each call takes more
    tokens and a long prompt fewer calls; over a short one a wider chunk would be padding
    (docs/architecture.md, "Long prompts")."""
    return max(chunk, min(window // 8, WIDTH_GROWTH * chunk))


def engine_grid(
    max_model_len: int,
    slots: int,
    prefill_rows: int,
    *,
    attends: bool = True,
    in_place: bool = False,
    short: bool = False,
) -> dict[str, list[tuple[int, int]]]:
    """Every (rows, window) an engine's prefill and decode chunks may run, smallest first, over windows
    of 128, 512, 2048, ... columns up to max_model_len. A decode chunk runs once per token: it has row
    counts 1, 4, 16, ... up to the slots at every window. A prefill chunk runs once per chunk of a
    prompt (`prefill_width` tokens, wider at long windows): it has one row and prefill_rows rows at
    every window, one row first (`CoreCalls.prefill` takes the first that holds its chunks). A lone
    prompt's chunks run on one row: in a call of prefill_rows rows the others would be padding that
    costs as much as a prompt (a lone 4000-token prompt's first token after 2.1-3.0 s on one row, 7.1-9.3
    s on four: docs/architecture.md, "One row for a lone prompt").

    A model with recurrent layers prefills a whole prompt in a chunk as wide as the window (so the
    prefill's windows bound its prompts: the last is max_model_len). One whose layers keep no keys and
    values at all (Mamba: `attends=False`) has the decode's row counts over one window, max_model_len,
    as a state has no columns to cut.

    A decode that reads its rows of the cache in place (`in_place`: `SlotModel.reads_cache_in_place`)
    runs over max_model_len alone: there a window only sizes the mask, and attention stops at each
    row's position, so the whole cache cost 16 rows of 32-token prompts 2% more a step than 128
    columns at 2048, 3% at 8192 (docs/architecture.md, "One decode window"), for a third (at 2048)
    or a quarter (8192) of the decode programs to compile before the server is ready.

    `short`: the prefill's row counts also have a program of SHORT_WIDTH tokens a row over the
    smallest window ("short"), for chunks that are the whole rest of each row's prompt: a prompt of a
    few words, or what follows a cached prefix in a short chat. A prefill's cost follows its width:
    the 20m Llama's first token of a lone 32-token prompt after 16.7 ms in a chunk of 32 tokens
    against 23.4 ms in one of 64, and 16 clients' 32-token completions got 1.12x the tokens/s
    (docs/architecture.md, "Short prefill programs")."""
    windows = geometric(SMALLEST_WINDOW, max_model_len)
    decode_rows = geometric(1, slots)
    prefill_row_counts = sorted({1, prefill_rows})
    prefill = [(rows, w) for rows in prefill_row_counts for w in windows]
    decode_windows = windows if attends and not in_place else [max_model_len]
    grid = {"prefill": prefill, "decode": [(r, w) for w in decode_windows for r in decode_rows]}
    if short:
        grid["short"] = [(rows, windows[0]) for rows in prefill_row_counts]
    return grid


class Compiler:
    """The slot programs of one engine (`generation.SlotPrograms`) for its set of (rows, window) per
    kind ("prefill", "decode", "image"; "short", prefills of SHORT_WIDTH tokens a row; "swap", one
    program of two rows over every column, where the engine moves cached prefixes between slots;
    "choose", the token after a prefill's rows, per row count with the window 0, where the programs
    make it apart: `SlotPrograms.choose_apart`), each
    list smallest first.

    Attributes:
      held: programs compiled (or read from the compilation cache) so far.
      memory: bytes they hold beside their arguments and results (XLA's memory analysis: scratch
        space and generated code).
      seconds: spent compiling, in all.
    """

    def __init__(
        self,
        programs: generation.SlotPrograms,
        grid: dict[str, list[tuple[int, int]]],
        *,
        progress: Callable[[str], None] | None = None,
    ):
        self.programs = programs
        self.grid = grid
        self.progress = progress
        self.held = self.memory = 0
        self.seconds = 0.0
        self._ready = False
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return sum(len(cells) for cells in self.grid.values())

    def prepare(self, example: Callable) -> None:
        """Compiles every program of the set now, on up to COMPILE_THREADS threads (one per core: on 2
        cores, a second thread made the server ready 12-17% sooner from an empty cache and 0.4 s
        sooner from a warm one), a progress line each; `example(kind, rows, window)` gives arguments
        like those the engine passes (idempotent)."""
        if self._ready:
            return
        todo = [(kind, rows, window) for kind, cells in self.grid.items() for rows, window in cells]
        threads = max(1, min(COMPILE_THREADS, os.cpu_count() or 1, len(todo)))
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="hfjax-compile") as pool:
            futures = [pool.submit(self._compile, example, *cell) for cell in todo]
            for n, future in enumerate(concurrent.futures.as_completed(futures), 1):
                (kind, rows, window), seconds, loaded = future.result()
                if self.progress is not None:
                    done = "loaded the" if loaded else "compiled the"
                    where = " from the cache" if loaded else ""
                    size = f"{rows} rows" if kind == "choose" else f"{rows} rows x {window} columns"
                    name = "short prefill" if kind == "short" else kind
                    self.progress(f"{done} {name} program for {size}{where} ({n}/{len(todo)}): {seconds:.1f} s")
        self._ready = True
        if self.progress is not None:
            self.progress(f"{len(todo)} programs ready in {time.perf_counter() - start:.1f} s")

    def program_for(self, kind: str, rows: int, columns: int) -> tuple[str, int, int]:
        """(kind, rows, window) of the smallest program of `kind` that holds a chunk of `rows` rows whose
        rows end by column `columns`."""
        return (kind, *next(cell for cell in self.grid[kind] if cell[0] >= rows and cell[1] >= columns))

    def _compile(self, example: Callable, kind: str, rows: int, window: int) -> tuple[tuple, float, bool]:
        """Compiles one program: ((kind, rows, window), its seconds, whether it was read from the
        compilation cache)."""
        start = time.perf_counter()
        arguments = example(kind, rows, window)
        inputs = None
        if kind in PREFILLS:  # the chunk's model inputs last (images' static ones as values), or None
            *arguments, inputs = arguments
        arguments = jax.tree_util.tree_map(_abstract, tuple(arguments))
        if kind in PREFILLS:
            loaded, memory = self.programs.compile_prefill(*arguments, window=window, inputs=inputs)
        elif kind == "swap":
            loaded, memory = self.programs.compile_swap(*arguments)
        elif kind == "choose":
            loaded, memory = self.programs.compile_choose(*arguments)
        else:
            loaded, memory = self.programs.compile_decode(*arguments, decoding_rows=rows, window=window)
        seconds = time.perf_counter() - start
        with self._lock:
            self.held += 1
            self.memory += memory
            self.seconds += seconds
        return (kind, rows, window), seconds, loaded


def _abstract(x):
    """An array's shape, dtype and placement (a committed array's sharding), for lowering without it."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=x.sharding if x.committed else None, weak_type=x.weak_type
        )
    return x
