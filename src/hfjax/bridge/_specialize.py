"""Values of the data that model code needs as Python values, and programs specialised on them.

Some model code reads its inputs' values into Python: `if not mask.any():`, `assert
lengths.max().item() <= n`, `torch.nonzero(mask)` or `hidden[eos_mask]` (whose result's size
is the number of hits), `torch.unique_consecutive(x)`. Inside a jit trace those values are not
known, and JAX raises. torch.compile meets the same problem and answers it with guards; so does
hfjax:

1. The op lowerings that need such a value (`hfjax._ops`: `.item()`, `nonzero`, boolean-mask
   indexing, `masked_select`, `unique_consecutive`, tensor slice bounds) ask `concrete(x, what)`.
   Outside a trace that is `x`'s value. Inside a plain trace it raises `DataDependentError`.
2. `hfjax.jit` (`_compile.JittedModule`) catches that error once per program and *discovers* the
   values: it traces the method again with a tape that hands out the values found so far and
   stops at the next point, returning the traced value there as the output of a small program
   (XLA keeps only what that value needs), which it runs. The points are met in the same order
   as in the real trace, so transformers' own `is_tracing` branches are taken as in the program.
3. It then compiles the method *specialised* on those values: each `concrete()` hands back its
   value and keeps the traced one as a guard output. Every call compares the guards with the
   values. If one differs, the values up to it are right, discovery goes on from there, and the
   call gets (or compiles) the program for its values: the answer is always PyTorch's. Past
   `MAX_SPECIALIZATIONS` programs of one method and structure, inputs whose values change the
   program run op by op, with one warning.

`Model.generate` does the same per stage (`hfjax.generation._engine`): the prefill like a
method; the decode loop's step is probed once, outside any loop, from the state the loop starts
in, and the `while_loop` checks the guards after every token. A token whose guards do not hold is
thrown away and the loop stops there; the host discovers the values from that state and goes on
with the program for them.

Where no values can be discovered (a plain `lower()`), the error says which line of the model
needed which value.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torchax

from .._errors import DataDependentError

MAX_SPECIALIZATIONS = 8  # programs per method and argument structure before running op by op

_TAPE: contextvars.ContextVar[_Tape | None] = contextvars.ContextVar("hfjax_specialize_tape", default=None)
# Frames in these are not the model's line: jax, numpy, torch, torchax and hfjax itself.
_LIBRARY_DIRS = tuple(
    os.path.dirname(path) + os.sep for path in (jax.__file__, np.__file__, torch.__file__, torchax.__file__)
) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


@dataclasses.dataclass
class _Tape:
    values: list  # np.ndarray per point, in the order the code asks for them
    probing: bool  # past the last value: stop at the next point (else it is an error)
    observed: list = dataclasses.field(default_factory=list)  # the traced value at each point
    sites: list = dataclasses.field(default_factory=list)  # "file:line (what)" per point met


class Reached(Exception):
    """A probing trace got to a point past its known values; `value` is the traced value there."""

    def __init__(self, value):
        super().__init__("a value of the data is needed")
        self.value = value


def concrete(value, what: str) -> np.ndarray:
    """`value` (a jax.Array or tracer) as a numpy array, for a lowering that needs it in Python.

    `what` names the need for messages, e.g. "torch.nonzero's size".
    """
    tape = _TAPE.get()
    traced = isinstance(value, jax.core.Tracer)
    if tape is None:
        if traced:
            raise DataDependentError(what, _model_site())
        return np.asarray(value)
    index = len(tape.observed)
    tape.sites.append(f"{_model_site()} ({what})")
    if index == len(tape.values):
        if not traced:  # known without running anything
            tape.values.append(np.asarray(value))
        elif tape.probing:
            raise Reached(value)
        else:
            raise DataDependentError(what, _model_site(), detail="the trace asked for more values than were found")
    known = tape.values[index]
    if np.shape(value) != known.shape:
        raise DataDependentError(what, _model_site(), detail=f"shape {np.shape(value)} where {known.shape} was found")
    tape.observed.append(value)
    return known


@contextlib.contextmanager
def replaying(values, *, probing: bool = False):
    """Traces code that gets `values` from `concrete()`, in order; yields the tape, whose
    `observed` holds the traced value at each point (the guards). With `probing`, a point past
    `values` raises `Reached` (values known in Python are appended on the way); without it, the
    code must ask for exactly `values`."""
    tape = _Tape(values=list(values), probing=probing)
    token = _TAPE.set(tape)
    try:
        yield tape
    finally:
        _TAPE.reset(token)
    if not probing and len(tape.observed) != len(tape.values):
        raise DataDependentError(
            "values of the data",
            None,
            detail=f"the trace asked for {len(tape.observed)} values where {len(tape.values)} were found",
        )


def discover_values(function, args: tuple, known=()) -> tuple[tuple, list[str]]:
    """Every value of the data that tracing `function(*args)` needs, in order, starting from the
    values `known` to be right: one small program per value that is not known in Python (its
    output is the traced value at the next point; XLA keeps only what that value needs).
    Returns (values, "file:line (what)" per point)."""
    values = [np.asarray(value) for value in known]
    while True:
        tapes = []
        reached = jax.jit(functools.partial(_probe, function, values, tapes))(*args)
        values = tapes[-1].values  # with any values known in Python on the way
        if reached is None:
            return tuple(values), tapes[-1].sites
        values.append(np.asarray(reached))


def _probe(function, values: list, tapes: list, *args):
    # The traced value at the first point past `values`, or None where there is none.
    try:
        with replaying(values, probing=True) as tape:
            tapes.append(tape)
            function(*args)
    except Reached as reached:
        return reached.value
    return None


def holds(observed, values) -> jax.Array:
    """Inside a trace: a bool scalar, whether every guard output equals the value it was built on."""
    held = jnp.bool_(True)
    for seen, value in zip(observed, values, strict=True):
        held = held & jnp.array_equal(seen, value)
    return held


@dataclasses.dataclass
class Specializations:
    """The values of the data one program family was specialised on so far, by `key`, and
    which of them the last run used."""

    last: tuple | None = None
    built: dict = dataclasses.field(default_factory=dict)  # key -> values
    sites: list = dataclasses.field(default_factory=list)  # "file:line (what)" of the last discovery
    short_runs: int = 0  # decode loops (Model.generate) that stopped one token after they started

    @property
    def full(self) -> bool:
        """Whether another program would be one too many: MAX_SPECIALIZATIONS are built, or twice
        a decode loop's values held for one token only (they change with every token, and a
        program per token does not pay)."""
        return len(self.built) >= MAX_SPECIALIZATIONS or self.short_runs >= 2

    def add(self, discovered: tuple[tuple, list]) -> tuple:
        """Records values found by `discover` as the ones to run with; returns them."""
        self.last, self.sites = discovered
        self.built[values_key(self.last)] = self.last
        return self.last

    def matching(self, known, excluded: set) -> tuple | None:
        """The values of a program built earlier that begin with `known` (values found right for
        this call), leaving out the keys in `excluded`; None where none does."""
        for built_key, values in self.built.items():
            if built_key not in excluded and len(values) >= len(known) > 0:
                if all(np.array_equal(np.asarray(a), b) for a, b in zip(known, values)):
                    return values
        return None


def run_specialized(specializations: Specializations, run_with, discover_from, eager):
    """The result of the program specialised on this call's values of the data: the one that ran
    last if its guards hold, else one built earlier whose values begin with those found right,
    else the one for the values discovered for this call; past `full`, `eager()`.

    run_with(values) -> (result, guard outputs) runs (building if new) the program for `values`;
    discover_from(known) -> `discover`'s (values, sites) starting from the values known right.
    """
    known, failed = (), set()  # values found right for this call; keys of values that are not
    values = specializations.last
    while values is not None:
        result, observed = run_with(values)
        wrong = first_difference(observed, values)
        if wrong is None:
            specializations.last = values
            return result
        known = [np.asarray(value) for value in observed[: wrong + 1]]
        failed.add(values_key(values))
        values = specializations.matching(known, failed)
    if specializations.full:
        return eager()
    values = specializations.add(discover_from(known))
    result, observed = run_with(values)
    if first_difference(observed, values) is not None:
        raise DataDependentError(
            "values of the data", None, detail="a program's guards disagreed with the values found"
        )
    return result


def values_key(values: list[np.ndarray] | tuple[np.ndarray, ...]) -> tuple:
    """A hashable key of recorded values."""
    return tuple((v.dtype.str, v.shape, v.tobytes()) for v in values)


def first_difference(observed, values) -> int | None:
    """The first point where a specialised program's guard outputs differ from the values it was
    built on, or None where all hold."""
    for index, (seen, value) in enumerate(zip(observed, values, strict=True)):
        if not np.array_equal(np.asarray(seen), value):
            return index
    return None


_WARNED_EAGER: set = set()


def warn_running_eagerly(what: str, sites: list[str]) -> None:
    """Once per `what` (e.g. "hfjax.jit: DbrxModel.forward"): its values of the data change too
    often to compile a program for each, so it now runs op by op."""
    if what in _WARNED_EAGER:
        return
    _WARNED_EAGER.add(what)
    warnings.warn(
        f"{what} reads values of its data that change from call to call "
        f"({'; '.join(dict.fromkeys(sites)) or 'unknown lines'}); after {MAX_SPECIALIZATIONS} "
        "programs specialised on them, inputs with new values run op by op (correct, but not compiled).",
        stacklevel=4,
    )


def _model_site() -> str | None:
    # The innermost frame outside jax, numpy, torch, torchax and hfjax: the model's own line.
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_LIBRARY_DIRS):
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return None
