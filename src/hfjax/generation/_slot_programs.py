"""The slot programs of one `SlotModel` (`SlotPrograms`): its prefill and decode chunks compiled per
(kind, rows, columns) and kept in a `ProgramCache` (in memory, and on disk as `jax.export` blobs),
with the bytes each compiled program holds (`held_bytes`).
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import jax
import numpy as np
from jax import lax

from .. import bridge
from . import _multimodal, _programs
from ._rows import RowSampling, SamplingFeatures
from ._slots import Chosen, SlotModel, SlotState


def held_bytes(compiled) -> int:
    """Bytes a compiled program holds beside its arguments and results: its scratch space and generated
    code, by XLA's memory analysis (0 where the backend gives none)."""
    analysis = compiled.memory_analysis()
    parts = analysis if isinstance(analysis, (list, tuple)) else [analysis]  # (one per device, on some backends)
    return sum(int(a.temp_size_in_bytes) + int(a.generated_code_size_in_bytes) for a in parts if a is not None)


class SlotPrograms:
    """The slot programs of one `SlotModel`, kept per (kind, rows, columns) in a `ProgramCache` (on
    disk too, where the weights are on one device), built with one float32 precision and one set of
    sampling features for the engine's life.

        prefill(state, rows, which, ids, start, count, last, fresh, want_logprobs, window=W) -> (state, Chosen)
            (with `choose_apart`, two programs: the chunk's run, then `choose`)
        decode(state, rows, active, count, want_logprobs, decoding_rows=R, window=W, logprobs=True)
            -> (state, Chosen)
        swap(state, a, b) -> state: slots a and b trade what they hold (a server's cached prefixes)

    `state` is donated: the programs update the cache in place. `stop_tokens`: the decode ends when
    every active row has stopped at one (`Model.generate`'s EOS, a stopped row running on
    `pad_token` until then; a server stops on the host). `kept`: "scores" and / or "logits", each new
    token's processed scores and raw logits the programs return (`Model.generate`'s output_scores
    and output_logits).
    A decode with `logprobs=False` is a program of its own that computes and returns no
    log-probabilities (`Model.generate`'s, and a server's chunks in which no request asks for them).
    `cache`: the `ProgramCache` to keep the programs in (`Model.generate` shares `Generator`'s).
    `choose_apart`: a prefill is two programs, the chunk's run per (rows, window) and the choice of
    the next token per rows (`choose`, `SlotModel.choose_prefilled`), instead of one: a server
    compiles the choice once per row count instead of once per window (the choice was about half of
    each prefill program's compile). `Model.generate`, which compiles a prefill program for each
    shape it meets, keeps them one.
    A `SpeculativeSlotModel` makes the decode speculative (each call makes up to `steps` tokens per row,
    `Chosen.made` of them): its `weights()` are the programs' first argument, its `program_key()` part
    of their key.
    """

    def __init__(
        self,
        slot_model: SlotModel,
        *,
        prefill_chunk: int,
        steps: int,
        features: SamplingFeatures,
        stop_tokens: tuple[int, ...] = (),
        pad_token: int = 0,
        kept: tuple[str, ...] = (),
        cache: _programs.ProgramCache | None = None,
        choose_apart: bool = False,
    ):
        model = slot_model.model
        self.slot_model = slot_model
        self.choose_apart = choose_apart
        self.prefill_chunk, self.steps, self.features = prefill_chunk, steps, features
        self.stop_tokens, self.pad_token, self.kept = stop_tokens, pad_token, kept
        if cache is None:
            fingerprint = (
                _programs.model_fingerprint(model.module, model.params, model.aliases)
                if _programs.single_device(model.params)
                else None
            )
            cache = _programs.ProgramCache(fingerprint)
        self.cache = cache
        self.precision = bridge.resolve_precision(model.matmul_precision)  # fixed for the programs' life
        self.params = slot_model.weights()
        self._lock = threading.Lock()
        # Threads compiling programs at once (`serving.Compiler`) trace them one at a time: a trace runs
        # the torch model, and a slot model holds a call's state while it runs (an encoder-decoder's
        # rows' cross keys, `EncoderDecoderSlotModel.attending`). XLA's compiles still overlap.
        self._tracing = threading.Lock()

    @property
    def counts(self) -> dict[str, int]:
        """Programs prepared per kind in this process, traced or read from disk."""
        kinds = ("prefill", "decode", "swap", "choose")
        counts = {kind: self.cache.traced[kind] + self.cache.loaded[kind] for kind in kinds}
        return {kind: n for kind, n in counts.items() if n or kind in ("prefill", "decode")}

    def key(self, kind: str, rows: int, window: int, logprobs: bool = True, *, width: int | None = None) -> tuple:
        """The program cache's key of a program; `width`: a prefill's prompt tokens per row (its ids'
        columns), where it is not `prefill_chunk`."""
        model = self.slot_model
        # (a recurrent model's prefill chunk is a whole prompt as wide as the window)
        extent = (window if model.recurrent else width or self.prefill_chunk) if kind == "prefill" else self.steps
        # The decode's own settings (the prefill's program does not depend on them).
        stops = (self.stop_tokens, self.pad_token) if kind == "decode" and self.stop_tokens else ()
        logprobs = logprobs or kind != "decode"
        apart = ("apart",) if kind == "prefill" and self.choose_apart else ()
        return (
            kind, model.slots, model.length, extent, rows, window, self.precision, self.features, stops, logprobs,
            self.kept, *model.program_key(), *apart,
        )  # fmt: skip

    def prefill(
        self,
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
        window,
        inputs: dict | None = None,
    ):
        program, args = self._prefill(
            state, rows, which, ids, start, count, last, fresh, want_logprobs, window=window, inputs=inputs
        )
        if not self.choose_apart:
            leaves, chosen = program.run(*args)
            return SlotState(*leaves), Chosen(*chosen)
        leaves, logits = program.run(*args)
        return self.choose(SlotState(*leaves), rows, which, logits, start, count, last, want_logprobs)

    def choose(self, state: SlotState, rows: RowSampling, which, logits, start, count, last, want_logprobs):
        """The token after each row's prefilled chunk (`SlotModel.choose_prefilled`; with `choose_apart`,
        the prefill's second program): logits [P, V] as the prefill's first program made them, the rest
        as `prefill`'s. Returns (state, Chosen [P, 1])."""
        program, args = self._choose(state, rows, which, logits, start, count, last, want_logprobs)
        leaves, chosen = program.run(*args)
        return SlotState(*leaves), Chosen(*chosen)

    def decode(
        self, state: SlotState, rows: RowSampling, active, count, want_logprobs, *, decoding_rows, window, logprobs=True
    ):
        program, args = self._decode(
            state, rows, active, count, want_logprobs, decoding_rows=decoding_rows, window=window, logprobs=logprobs
        )
        leaves, chosen = program.run(*args)
        return SlotState(*leaves), Chosen(*chosen)

    def swap(self, state: SlotState, a, b) -> SlotState:
        """The state with slots `a` and `b` (int32 scalars) trading what they hold, every array of the
        state being per slot (the model's keys and values, a draft model's, the rows' tokens so far):
        a server moves a cached prefix next to the rows it decodes, and one it keeps out of their way
        (`serving.SlotTable.assign`)."""
        program, args = self._swap(state, a, b)
        return SlotState(*program.run(*args))

    def compile_prefill(self, *arguments, window: int, inputs: dict | None = None) -> tuple[bool, int]:
        """Compiles the prefill program for these arguments (arrays or their shapes; `inputs` as
        `prefill`'s, its static inputs as values) without running it. Returns (whether it was loaded
        from the compilation cache, XLA compiling nothing; the bytes it holds, `held_bytes`)."""
        return self._compiled(lambda: self._prefill(*arguments, window=window, inputs=inputs))

    def compile_decode(self, *arguments, decoding_rows: int, window: int, logprobs: bool = True) -> tuple[bool, int]:
        """Compiles the decode program for these arguments (arrays or their shapes) without running it.
        Returns (whether it was loaded from the compilation cache, XLA compiling nothing; the bytes it
        holds, `held_bytes`)."""
        return self._compiled(
            lambda: self._decode(*arguments, decoding_rows=decoding_rows, window=window, logprobs=logprobs)
        )

    def compile_choose(self, state, rows, which, want_logprobs) -> tuple[bool, int]:
        """Compiles the choice program (`choose`) for prefill rows `which` [P] (arrays or their shapes)
        without running it. Returns (whether it was loaded from the compilation cache, the bytes it
        holds, `held_bytes`)."""
        p = which.shape[0]
        # On one device the logits come out of the prefill program placed there, as the state's arrays
        # are (without the placement, the program compiled here was not the one the first call ran,
        # which compiled again). Over several devices (a state split over "data") they are left
        # unplaced: P rows need not divide over the mesh.
        placed = getattr(state.tokens, "sharding", None)
        placed = placed if placed is not None and len(placed.device_set) == 1 else None
        logits = jax.ShapeDtypeStruct((p, self.slot_model.shapes()[1]), self.slot_model.logits_dtype(), sharding=placed)
        column = jax.ShapeDtypeStruct((p,), np.int32)
        last = jax.ShapeDtypeStruct((p,), np.bool_)
        return self._compiled(lambda: self._choose(state, rows, which, logits, column, column, last, want_logprobs))

    def compile_swap(self, *arguments) -> tuple[bool, int]:
        """Compiles the swap program for `swap`'s arguments (arrays or their shapes) without running it.
        Returns (whether it was loaded from the compilation cache, the bytes it holds, `held_bytes`)."""
        return self._compiled(lambda: self._swap(*arguments))

    def _compiled(self, make) -> tuple[bool, int]:
        """Compiles the program `make()` gives with its arguments, (program, args), traced one at a time.
        Returns (whether it was loaded from the compilation cache, the bytes it holds, `held_bytes`)."""
        with bridge.Compiles() as compiles:
            with self._tracing:
                program, args = make()
                lowered = program.run.lower(*args)
            compiled = lowered.compile()
        return not compiles.compiled, held_bytes(compiled)

    def _prefill(self, state, rows, which, ids, start, count, last, fresh, want_logprobs, *, window, inputs=None):
        args = (self.params, state.leaves(), rows.leaves(), which, ids, start, count, last, fresh, want_logprobs)
        key = self.key("prefill", which.shape[0], window, width=ids.shape[1])
        static = ()
        if inputs:  # the arrays are arguments; the static inputs' values, constants of the program
            static = tuple(
                (name, _multimodal.frozen(np.asarray(value).tolist()))
                for name, value in sorted(inputs.items())
                if name in _multimodal.STATIC_INPUTS
            )
            arrays = {name: value for name, value in inputs.items() if name not in _multimodal.STATIC_INPUTS}
            args = (*args, arrays)
            shapes = tuple((name, tuple(a.shape), str(a.dtype)) for name, a in sorted(arrays.items()))
            key = (*key, "inputs", ids.shape[1], shapes, static)
        function = functools.partial(self._prefill_program, window=window, static=static)
        return self._program(key, function, args), args

    def _decode(self, state, rows, active, count, want_logprobs, *, decoding_rows, window, logprobs):
        args = (self.params, state.leaves(), rows.leaves(), active, count, want_logprobs)
        function = functools.partial(
            self._decode_program, decoding_rows=decoding_rows, window=window, logprobs=logprobs
        )
        return self._program(self.key("decode", decoding_rows, window, logprobs), function, args), args

    def _choose(self, state, rows, which, logits, start, count, last, want_logprobs):
        args = (state.leaves(), rows.leaves(), which, logits, start, count, last, want_logprobs)
        model = self.slot_model
        key = ("choose", model.slots, model.length, which.shape[0], self.precision, self.features, self.kept)
        return self._program((*key, *model.program_key()), self._choose_program, args, donate=(0,)), args

    def _swap(self, state, a, b):
        args = (state.leaves(), a, b)
        model = self.slot_model
        key = ("swap", model.slots, model.length, self.features, *model.program_key())
        return self._program(key, self._swap_program, args, donate=(0,)), args

    def _program(self, key: tuple, function, args, donate=(1,)):
        with self._lock:  # the engine's thread and the threads compiling its programs may ask at once
            return self.cache.get(key, bridge.under(self.precision, function), args, metadata=dict, donate=donate)

    # -- traced: plain containers in and out, so that the programs can be kept on disk -------

    def _prefill_program(
        self, params, leaves, rows, which, ids, start, count, last, fresh, want_logprobs, arrays=None, *, window, static
    ):
        self.cache.traced["prefill"] += 1
        inputs = None if arrays is None else {**arrays, **dict(static)}
        state, chosen = self.slot_model.prefill_chunk(
            params, SlotState(*leaves), RowSampling(*rows), which, ids, start, count, last, fresh, want_logprobs,
            window=window, features=self.features, kept=self.kept, inputs=inputs, choose=not self.choose_apart,
        )  # fmt: skip
        return state.leaves(), chosen if self.choose_apart else _fields(chosen)

    def _choose_program(self, leaves, rows, which, logits, start, count, last, want_logprobs):
        self.cache.traced["choose"] += 1
        state, chosen = self.slot_model.choose_prefilled(
            SlotState(*leaves), RowSampling(*rows), which, logits, start + count, last, want_logprobs,
            features=self.features, kept=self.kept,
        )  # fmt: skip
        return state.leaves(), _fields(chosen)

    def _decode_program(self, params, leaves, rows, active, count, want_logprobs, *, decoding_rows, window, logprobs):
        self.cache.traced["decode"] += 1
        state, chosen = self.slot_model.decode_chunk(
            params, SlotState(*leaves), RowSampling(*rows), active, count, want_logprobs,
            steps=self.steps, decoding_rows=decoding_rows, window=window, features=self.features,
            stop_tokens=self.stop_tokens, pad_token=self.pad_token, logprobs=logprobs, kept=self.kept,
        )  # fmt: skip
        return state.leaves(), _fields(chosen)

    def _swap_program(self, leaves, a, b):
        self.cache.traced["swap"] += 1

        def swapped(x):  # [S, ...]: rows a and b trade places, in place (the state is donated)
            row_a, row_b = lax.dynamic_slice_in_dim(x, a, 1), lax.dynamic_slice_in_dim(x, b, 1)
            # Both rows read before either is written: without the barrier XLA copied the whole
            # array (1.6-2.7 s for a 4.3 GB cache of 32 slots x 8192 columns, against 0.10-0.12 s)
            row_a, row_b, x = lax.optimization_barrier((row_a, row_b, x))
            return lax.dynamic_update_slice_in_dim(lax.dynamic_update_slice_in_dim(x, row_b, a, 0), row_a, b, 0)

        # Every array of the state is per slot (SlotState): the keys and values, a draft model's, and
        # the rows' tokens so far, which a speculative decode drafts from, move together.
        return jax.tree.map(swapped, leaves)


def _fields(chosen: Chosen) -> tuple:
    return tuple(getattr(chosen, field.name) for field in dataclasses.fields(chosen))
