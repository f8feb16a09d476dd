"""`hfjax.jit`: a torch module whose methods each run as one compiled XLA program.

Weights are arguments of the program, never captured constants: they live in
`JittedModule.params` ({name: jax.Array}) and are swapped into the module for the
duration of a trace. Array arguments are traced; every other leaf of the arguments
(bools, ints, floats, strings, None, enums, dtypes) is static and part of the cache
key, so `use_cache=True` or `return_dict=False` never meet a tracer.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch
from torch.nn.utils import stateless
from torchax.tensor import OperatorNotFound
from torchax.tensor import Tensor as JaxTensor

from .. import _quiet
from .._errors import DataDependentError, UnsupportedOpError
from . import _data_free, _env, _hook, _precision, _pytrees, _scans, _specialize


def module_state(module: torch.nn.Module) -> tuple[dict[str, jax.Array], dict[str, str]]:
    """Every parameter and buffer of `module` as jax.Arrays, tied tensors once.

    Returns:
        (state, aliases): state maps a canonical name to its array; aliases maps each
        other name of a tied tensor to its canonical name.
    """
    state, aliases, seen = {}, {}, {}
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        if id(tensor) in seen:
            aliases[name] = seen[id(tensor)]
            continue
        seen[id(tensor)] = name
        state[name] = _env.to_jax(tensor)
    return state, aliases


@dataclasses.dataclass(frozen=True)
class Recorded:
    """A program called while `recording()` was active: what `jax.export` needs to export it again."""

    stage: str  # what the program is: "forward", "prefill", "decode", "train step", "whole loop", ...
    jitted: Callable  # the jax.jit function
    args: tuple  # its arguments, arrays as jax.ShapeDtypeStruct (with their shardings)
    kwargs: dict  # its static keyword arguments


_RECORDINGS: list[list[Recorded]] = []


def jit_program(function: Callable, *, stage: str, donate_argnums=(), static_argnames=()) -> Callable:
    """`jax.jit(function)`. Every XLA program hfjax runs is made here, so that `recording()` sees them
    all (but the small probes that find the values a model reads, `_specialize.discover`, and the
    few-op helpers that make the slot core's empty state and its rows' PRNG keys).

    The program is compiled with the active backend hook's options for `stage`
    (`Backend.compiler_options`; the GPU's command buffers for its loops), else XLA's defaults.
    The result has the jitted function's `lower`.
    """
    options = _hook.active().compiler_options(stage)  # the backend's, for this stage (e.g. the GPU's command buffers)
    jitted = jax.jit(function, donate_argnums=donate_argnums, static_argnames=static_argnames, compiler_options=options)

    def call(*args, **kwargs):
        # (a program called inside another's trace is part of that one)
        if _RECORDINGS and not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(args)):
            abstract = jax.tree_util.tree_map(_abstract, args)
            for recording in _RECORDINGS:
                recording.append(Recorded(stage, jitted, abstract, kwargs))
        return jitted(*args, **kwargs)

    call.lower = jitted.lower
    return call


def _abstract(x):
    if isinstance(x, jax.Array):  # an array not committed to its device goes where the others are
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed else None)
    return x


class Compiles(contextlib.AbstractContextManager):
    """Counts, while open, the programs this thread asks XLA for and how many of them JAX's persistent
    compilation cache answers (`hfjax.set_cache_dir`), from JAX's monitoring events, listened to only
    while open. A program this process already holds is neither.

    Example:
      >>> with Compiles() as compiles:
      ...     program.lower(*args).compile()
      >>> compiles.compiled  # False: read from the cache
    """

    _COMPILE = "/jax/core/compile/backend_compile_duration"  # each program asked for, the cache's answers too
    _CACHE_HIT = "/jax/compilation_cache/cache_hits"

    def __init__(self):
        self.requested = self.from_cache = 0
        self._thread = threading.get_ident()

    @property
    def compiled(self) -> bool:
        """Whether XLA compiled a program while open (rather than reading it from the cache)."""
        return self.requested > self.from_cache

    def _duration(self, event: str, seconds: float, **kwargs) -> None:
        self.requested += event == self._COMPILE and threading.get_ident() == self._thread

    def _event(self, event: str, **kwargs) -> None:
        self.from_cache += event == self._CACHE_HIT and threading.get_ident() == self._thread

    def __enter__(self):
        self._thread = threading.get_ident()
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._duration)
        jax.monitoring.unregister_event_listener(self._event)


@contextlib.contextmanager
def recording():
    """Yields a list that gets every program called inside the context, with its arguments' shapes.

    Example:
      >>> with hfjax._compile.recording() as programs:
      ...     model.generate(ids, max_new_tokens=4)
      >>> [p.stage for p in programs]  # ["prefill", "decode"]
    """
    recorded: list[Recorded] = []
    _RECORDINGS.append(recorded)
    try:
        yield recorded
    finally:
        _RECORDINGS.remove(recorded)


@dataclasses.dataclass
class _Program:
    """One compiled variant family: a method, an argument structure and its static values."""

    traced: Callable
    jitted: Callable
    signature: tuple  # (argument treedef, static leaves, number of leaves, precision), to build its variants
    out_treedef: Any = None
    out_statics: tuple = ()
    out_inputs: dict = dataclasses.field(default_factory=dict)  # output field -> index of a stateful input
    # Where the code reads values of its data (hfjax._specialize): the values it was specialised
    # on (None until a trace needs them), and the program built for each, by their key.
    specialized: _specialize.Specializations | None = None
    variants: dict = dataclasses.field(default_factory=dict)


class JittedModule(torch.nn.Module):
    """A drop-in wrapper of a torch module whose listed methods run compiled by XLA.

    Attributes other than the compiled methods are read from the wrapped module, so
    `jm.config`, `jm.generation_config` and submodules work as before.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        methods: Sequence[str] = ("forward",),
        *,
        params: dict[str, jax.Array] | None = None,
        aliases: dict[str, str] | None = None,
        matmul_precision: _precision.Precision | None = None,
    ):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"hfjax.jit expects a torch.nn.Module, got {type(module).__name__}; "
                "for a diffusers pipeline use hfjax.to_jax(pipe)"
            )
        methods = (methods,) if isinstance(methods, str) else tuple(methods)
        for name in methods:
            if not callable(getattr(type(module), name, None)):
                raise ValueError(
                    f"hfjax.jit(methods=...): {type(module).__name__} has no method {name!r}; "
                    f"pass names of its methods, e.g. methods=('forward',)"
                )
        _env.env()  # made before anything is traced or compiled ($HFJAX_CACHE_DIR applies from here)
        _hook.active().prepare()
        if params is None:
            params, aliases = module_state(module)
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "_aliases", dict(aliases or {}))
        object.__setattr__(self, "_methods", methods)
        object.__setattr__(self, "matmul_precision", _precision.check_precision(matmul_precision, caller="hfjax.jit"))
        object.__setattr__(self, "_programs", {})
        object.__setattr__(self, "_trace_counts", collections.Counter())
        object.__setattr__(self, "_module_names", {id(m): n for n, m in module.named_modules()})

    # -- attribute access ------------------------------------------------------

    def __getattr__(self, name: str):
        if name in self.__dict__.get("_methods", ()):
            return lambda *args, **kwargs: self._call(name, args, kwargs, compiled=True)
        return getattr(self.__dict__["module"], name)

    def forward(self, *args, **kwargs):
        if "forward" in self._methods:
            return self._call("forward", args, kwargs, compiled=True)
        return self.module(*args, **kwargs)

    def __repr__(self):
        return f"JittedModule({type(self.module).__name__}, methods={self._methods})"

    @property
    def compile_count(self) -> int:
        """How many XLA programs have been traced so far, over all methods."""
        return sum(self._trace_counts.values())

    def compile_counts(self) -> dict[str, int]:
        """Programs traced so far, per method name."""
        return dict(self._trace_counts)

    def eager(self, method: str = "forward"):
        """The same method run op by op through torchax (no jit), for debugging and parity tests."""
        return lambda *args, **kwargs: self._call(method, args, kwargs, compiled=False)

    def lower(self, method: str, *args, **kwargs) -> jax.stages.Lowered:
        """Lowers `method` for these arguments without running it (to inspect the program)."""
        program, dynamic = self._program(method, args, kwargs)
        return program.jitted.lower(self.params, dynamic, _placed_key(self.params))

    # -- calling ---------------------------------------------------------------

    def _call(self, method: str, args: tuple, kwargs: dict, *, compiled: bool):
        torch_world = any(isinstance(x, JaxTensor) for x in jax.tree_util.tree_leaves((args, kwargs)))
        program, dynamic = self._program(method, args, kwargs)
        with self._explain_errors():
            if not compiled:
                out_arrays, new_inputs, key = program.traced(self.params, dynamic, _env.prng_key())
            else:
                if program.specialized is None:
                    try:
                        out_arrays, new_inputs, key = program.jitted(self.params, dynamic, _placed_key(self.params))
                    except DataDependentError:  # the code reads values of its data: specialise on them
                        program.specialized = _specialize.Specializations()
                if program.specialized is not None:
                    program, (out_arrays, new_inputs, key) = self._run_specialized(method, program, dynamic)
        _env.set_prng_key(key)
        originals = _stateful_inputs(args, kwargs)
        for original, new in zip(originals, _env.to_torch(new_inputs)):
            _pytrees.assign_state(original, new)
        out = merge_outputs(program.out_treedef, out_arrays, program.out_statics)
        for field, index in program.out_inputs.items():
            setattr(out, field, originals[index])
        return _env.to_torch(out) if torch_world else out

    def _program(self, method: str, args: tuple, kwargs: dict, precision: str | None = None) -> tuple[_Program, list]:
        # precision: the caller's, for a program traced inside another (default: the module's, else torch's now)
        _pytrees.register_tree((args, kwargs))
        path_leaves, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
        dynamic, statics = [], []
        for i, (path, leaf) in enumerate(path_leaves):
            if _env.is_array(leaf):
                dynamic.append(leaf)
            else:
                _check_hashable(method, path, leaf)
                statics.append((i, leaf))
        dynamic = _env.to_jax(dynamic)
        precision = precision or _precision.resolve_precision(self.matmul_precision)
        key = (method, treedef, tuple(statics), precision)
        program = self._programs.get(key)
        if program is None:
            program = self._build(method, treedef, tuple(statics), len(path_leaves), precision)
            self._programs[key] = program
        return program, dynamic

    def _build(
        self,
        method: str,
        treedef,
        statics: tuple,
        n_leaves: int,
        precision: str,
        *,
        specialize_on: tuple | None = None,
    ) -> _Program:
        # precision: of float32 products (hfjax._precision); specialize_on: values of the data the
        # code reads (hfjax._specialize): the program then returns the traced values at those
        # points as a fourth output, its guards.
        module = self.module
        function = getattr(type(module), method)
        aliases = self._aliases
        program = _Program(traced=None, jitted=None, signature=(treedef, statics, n_leaves, precision))

        @functools.partial(_precision.under, precision)
        def traced(params, dynamic, prng_key):
            if isinstance(prng_key, jax.core.Tracer):
                self._trace_counts[method] += 1
            leaves = _merge_leaves(n_leaves, dynamic, statics)
            args, kwargs = _env.to_torch(jax.tree_util.tree_unflatten(treedef, leaves))
            with bound(module, params, aliases, prng_key) as environment:
                out = function(module, *args, **kwargs)
                new_key = environment.prng_key
            inputs = _stateful_inputs(args, kwargs)
            program.out_inputs = _replace_input_refs(out, inputs)
            _pytrees.register_tree(out)
            out_leaves, program.out_treedef = jax.tree_util.tree_flatten(_env.to_jax(out))
            arrays = [x for x in out_leaves if _env.is_array(x) or isinstance(x, jax.core.Tracer)]
            program.out_statics = tuple(
                (i, x) for i, x in enumerate(out_leaves) if not (_env.is_array(x) or isinstance(x, jax.core.Tracer))
            )
            return arrays, _env.to_jax(inputs), new_key

        def specialized(params, dynamic, prng_key):
            with _specialize.replaying(specialize_on) as tape:
                result = traced(params, dynamic, prng_key)
            return (*result, tape.observed)

        program.traced = traced
        program.jitted = jit_program(traced if specialize_on is None else specialized, stage=method)
        return program

    def _run_specialized(self, method: str, program: _Program, dynamic: list) -> tuple[_Program, tuple]:
        # The program specialised on this call's values of the data (hfjax._specialize.run).
        # Returns (the program whose outputs these are, its (outputs, new inputs, key)).
        prng_key = _placed_key(self.params)

        def run_with(values):
            key = _specialize.values_key(values)
            if key not in program.variants:
                program.variants[key] = self._build(method, *program.signature, specialize_on=values)
            chosen = program.variants[key]
            *result, observed = chosen.jitted(self.params, dynamic, prng_key)
            return (chosen, tuple(result)), observed

        def eager():
            sites = program.specialized.sites
            _specialize.warn_running_eagerly(f"hfjax.jit: {type(self.module).__name__}.{method}", sites)
            unspecialized = self._build(method, *program.signature)
            return unspecialized, unspecialized.traced(self.params, dynamic, prng_key)

        return _specialize.run_specialized(
            program.specialized,
            run_with,
            lambda known: self._discover(method, program, dynamic, prng_key, known),
            eager,
        )

    def _discover(self, method: str, program: _Program, dynamic: list, prng_key, known: list) -> tuple[tuple, list]:
        # Every value of the data this call's trace needs, in order, starting from `known`.
        traced = self._build(method, *program.signature).traced
        return _specialize.discover_values(traced, (self.params, dynamic, prng_key), known)

    @contextlib.contextmanager
    def _explain_errors(self):
        with explain_errors(self.module, self._module_names):
            yield


@contextlib.contextmanager
def explain_errors(module: torch.nn.Module, module_names: dict[int, str] | None = None):
    """Turns torchax's missing-lowering error into an UnsupportedOpError naming the op and the submodule."""
    try:
        yield
    except OperatorNotFound as error:
        op = str(error).removeprefix("Operator with name ").removesuffix(" has no lowering")
        names = module_names if module_names is not None else {id(m): n for n, m in module.named_modules()}
        caller = _innermost_module(sys.exc_info()[2], names)
        raise UnsupportedOpError(op, type(module).__name__, caller) from None


def _placed_key(params: dict):
    """torchax's PRNG key where a program over `params` takes it: a key that a program on one device left
    there (committed to it), moved beside weights split over a mesh."""
    key = _env.prng_key()
    weights = next(iter(params.values()), None)
    sharding = getattr(weights, "sharding", None)
    if (
        isinstance(sharding, jax.sharding.NamedSharding)
        and key.committed
        and key.sharding.device_set != sharding.device_set
    ):
        key = jax.device_put(key, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))
    return key


@contextlib.contextmanager
def bound(module: torch.nn.Module, params: dict, aliases: dict[str, str], prng_key):
    """Runs torch code on `module` with `params` (jax.Arrays or tracers) as its weights, inside torchax.

    Usable inside any JAX trace (jit, while_loop bodies): the weights stay arguments.
    Yields the torchax environment, whose `prng_key` holds the key after the torch code ran.
    One thread at a time runs torch code this way (a server compiles in a thread of its own while
    another calls programs): swapping a module's weights is not safe from two threads at once.
    """
    environment = _env.env()
    # torchax keeps its settings per thread, made on a thread's first use: made here inside a trace
    # (a thread's first torch code is a traced train step where the loader's threads made the
    # environment), its PRNG key would be a tracer, kept after the trace and leaked into later calls.
    _env.prng_key()
    own, extended = _split_extensions(params)
    state = with_aliases(_env.to_torch(own), aliases)
    with _TORCH_CODE, _quiet.torch_code(), environment, environment.override_property(prng=prng_key):
        with (
            stateless._reparametrize_module(module, state, tie_weights=False, strict=False),
            _data_free.data_free(module),
            _scans.scans(module),
            contextlib.ExitStack() as stack,
        ):
            for prefix, arrays in extended.items():
                stack.enter_context(_EXTENSIONS[prefix](module, _env.to_torch(arrays)))
            yield environment


_TORCH_CODE = threading.RLock()  # see `bound`
# {prefix of params names: context(module, {rest of each name: torch tensor})}, see `extension`
_EXTENSIONS: dict[str, Callable] = {}


def extension(prefix: str):
    """Registers a context manager `context(module, arrays)` that `bound` enters around the torch code where
    the params given hold names starting with `prefix`: arrays beside the module's own weights (a LoRA
    adapter's factors), handed to the context by the rest of their names as torch tensors, so that they
    stay arguments of the program. A decorator; one context per prefix."""

    def register(context):
        if prefix in _EXTENSIONS and _EXTENSIONS[prefix] is not context:
            raise ValueError(f"bridge.extension({prefix!r}) is registered twice; use one prefix per extension")
        _EXTENSIONS[prefix] = context
        return context

    return register


def _split_extensions(params) -> tuple[dict, dict[str, dict]]:
    """(the module's own weights, {extension prefix: {rest of name: array}})."""
    if not any(name.startswith(prefix) for name in params for prefix in _EXTENSIONS):
        return dict(params), {}
    own, extended = {}, {}
    for name, array in params.items():
        prefix = next((p for p in _EXTENSIONS if name.startswith(p)), None)
        if prefix is None:
            own[name] = array
        else:
            extended.setdefault(prefix, {})[name[len(prefix) :]] = array
    return own, extended


def with_aliases(state: dict, aliases: dict[str, str]) -> dict:
    """`state` plus every tied name, holding the same value as its canonical name."""
    return {**state, **{alias: state[canonical] for alias, canonical in aliases.items()}}


def _check_hashable(method: str, path, leaf) -> None:
    try:
        hash(leaf)
    except TypeError:
        where = jax.tree_util.keystr(path)
        raise TypeError(
            f"hfjax.jit: argument {where} of {method}() is a {type(leaf).__name__}, which is neither an array "
            "nor hashable; non-array arguments are compile-time constants and must be hashable "
            "(pass a tuple instead of a list, or an array)"
        ) from None


def _merge_leaves(n: int, dynamic: list, statics: tuple) -> list:
    leaves = [None] * n
    static_at = dict(statics)
    it = iter(dynamic)
    for i in range(n):
        leaves[i] = static_at[i] if i in static_at else next(it)
    return leaves


def merge_outputs(treedef, arrays: list, statics: tuple):
    return jax.tree_util.tree_unflatten(treedef, _merge_leaves(treedef.num_leaves, arrays, statics))


def _stateful_inputs(args: tuple, kwargs: dict) -> list:
    values = list(args) + [kwargs[k] for k in sorted(kwargs)]
    return [v for v in values if _pytrees._is_stateful(type(v))]


def _replace_input_refs(out, inputs: list) -> dict[str, int]:
    # An output field holding a cache that was passed in (past_key_values) is not
    # returned twice: the caller gets its own, updated, object back.
    refs = {}
    if not dataclasses.is_dataclass(out):
        return refs
    for field in dataclasses.fields(out):
        value = getattr(out, field.name)
        for index, obj in enumerate(inputs):
            if value is obj:
                refs[field.name] = index
                setattr(out, field.name, None)
    return refs


def _innermost_module(tb, names: dict[int, str]) -> str | None:
    found = None
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, torch.nn.Module) and id(candidate) in names:
            found = f"{names[id(candidate)] or '<root>'} ({type(candidate).__name__})"
        tb = tb.tb_next
    return found
