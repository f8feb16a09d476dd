"""The whole denoising loop of a diffusers pipeline as one XLA program (`to_jax(pipe, whole_loop=...)`).

The pipeline's own __call__ still runs. Its first step runs per step (denoiser
compiled, classifier-free guidance by the pipeline); at the first scheduler.step
hfjax has seen every input of the loop: the conditioning the denoiser took, how the
pipeline shapes the denoiser's input and timestep, and the scheduler's state. It then
runs all steps as one XLA program (a lax.scan whose body is the denoiser, the guidance
and a lax.switch over the scheduler's per-step arithmetic) and answers the pipeline's
remaining steps from the trajectory, so callbacks, progress bar and decoding are
diffusers' own. The scheduler's Python state (counters, step index, history lists) is
traced once per step index with concrete values; its arrays ride in the scan carry.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch
from torchax.tensor import Tensor as JaxTensor

from .. import bridge
from .._errors import DataDependentError
from ..bridge import JittedModule

logger = logging.getLogger("hfjax")

DENOISERS = ("unet", "transformer", "prior")  # the pipeline attributes a denoiser may sit in


class _NotWholeLoop(Exception):
    """Why a call cannot run as one program; it then runs per step."""


# What a scheduler whose Python branches on array values raises when traced (DataDependentError:
# through hfjax's own lowerings of .item() and nonzero).
_UNTRACEABLE = (
    DataDependentError,
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("hfjax_loop_session", default=None)
_SCHEDULER_METHODS = ("step", "scale_model_input")


@dataclasses.dataclass(frozen=True)
class _Boundary:
    """The scheduler's state between two calls: structure, constants, and carry keys of its arrays."""

    treedef: Any
    spec: tuple  # per leaf: ("const", value) or ("dyn", carry key)


def _scheduler_state(scheduler) -> tuple[_Boundary, dict[str, jax.Array]]:
    state = {k: v for k, v in vars(scheduler).items() if k not in _SCHEDULER_METHODS}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    spec, dynamic = [], {}
    for path, leaf in leaves:
        if isinstance(leaf, JaxTensor) and isinstance(leaf.jax(), jax.core.Tracer):
            key = jax.tree_util.keystr(path)
            spec.append(("dyn", key))
            dynamic[key] = leaf.jax()
        else:
            spec.append(("const", leaf))
    return _Boundary(treedef, tuple(spec)), dynamic


def _restore_scheduler(scheduler, boundary: _Boundary, carry: dict[str, jax.Array]) -> None:
    environment = bridge.env()
    leaves = [JaxTensor(carry[v], environment) if kind == "dyn" else v for kind, v in boundary.spec]
    vars(scheduler).update(jax.tree_util.tree_unflatten(boundary.treedef, leaves))


@contextlib.contextmanager
def _noise_from(scheduler, make: Callable):
    # The scheduler's randn_tensor (Euler ancestral, DDIM with eta > 0) takes its noise
    # from make(shape, kwargs): arrays drawn before the program ran, in the steps' order.
    module = sys.modules[type(scheduler).__module__]
    original = getattr(module, "randn_tensor", None)
    environment = bridge.env()

    def randn_tensor(shape, *args, **kwargs):
        return JaxTensor(make(tuple(shape), kwargs), environment)

    if original is not None:
        module.randn_tensor = randn_tensor
    try:
        yield
    finally:
        if original is not None:
            module.randn_tensor = original


@dataclasses.dataclass(frozen=True)
class _LoopShape:
    """How the pipeline feeds its denoiser, read from the first step; part of the program's cache key."""

    steps: int
    guidance: bool  # classifier-free guidance: the denoiser sees [uncond; cond]
    scale_input: bool  # the pipeline calls scheduler.scale_model_input
    sample_name: str  # the denoiser's argument holding the latents
    timestep_divisor: int  # the denoiser takes t / divisor (Flux: 1000)
    timestep_batched: bool  # the denoiser takes t expanded over the batch
    learned_sigma: bool  # the denoiser also predicts a variance: keep the first half of channels


class _LoopSession:
    """One call of a pipeline: per-step, or whole-loop once the first step has shown its inputs."""

    def __init__(self, pipe, call_kwargs: dict):
        self.pipe = pipe
        self.enabled = bool(getattr(pipe, "hfjax_whole_loop", False))
        self.call_kwargs = call_kwargs
        self.path, self.reason = "per-step", None if self.enabled else "whole_loop=False"
        self.first_call = None  # (bound denoiser arguments, output) of the first step
        self.scaled = False
        self.trajectory: list | None = None
        self.position = 0

    def describe(self) -> str:
        return self.path if self.reason is None else f"{self.path} ({self.reason})"

    def fall_back(self, reason: str) -> None:
        self.enabled, self.reason = False, reason
        message = "hfjax: %s runs per step: %s"
        (logger.warning if self.pipe.hfjax_whole_loop is True else logger.info)(
            message, type(self.pipe).__name__, reason
        )

    # -- the pipeline's calls, intercepted ----------------------------------------

    def denoise(self, denoiser: _LoopDenoiser, args, kwargs):
        if self.trajectory is not None:
            return self.first_call[1]  # unused: scheduler.step answers from the trajectory
        out = JittedModule.forward(denoiser, *args, **kwargs)
        if self.enabled and self.first_call is None:
            bound = inspect.signature(type(denoiser.module).forward).bind(denoiser.module, *args, **kwargs)
            arguments = dict(bound.arguments)
            arguments.pop("self", None)
            self.first_call = (arguments, out)
        return out

    def scale_model_input(self, scheduler, sample, timestep, *args, **kwargs):
        if self.trajectory is not None:
            return sample
        self.scaled = self.scaled or self.first_call is None
        return type(scheduler).scale_model_input(scheduler, sample, timestep, *args, **kwargs)

    def step(self, scheduler, model_output, timestep, sample, *args, **kwargs):
        if self.trajectory is None and self.enabled:
            try:
                self.trajectory = _run_whole_loop(self, scheduler, model_output, timestep, sample, args, kwargs)
                self.path = "whole-loop"
            except _NotWholeLoop as error:
                self.fall_back(str(error))
        if self.trajectory is None:
            return type(scheduler).step(scheduler, model_output, timestep, sample, *args, **kwargs)
        latents = self.trajectory[self.position]
        self.position += 1
        return (latents,)


@contextlib.contextmanager
def session(pipe, call_kwargs: dict):
    session = _LoopSession(pipe, call_kwargs)
    schedulers = [c for c in pipe.components.values() if c is not None and not isinstance(c, torch.nn.Module)]
    for component in schedulers:
        bridge.move_tensors(component)  # a scheduler swapped in after to_jax holds CPU tensors
    patched = []
    if session.enabled:
        for component in schedulers:
            if callable(getattr(component, "step", None)):
                for name in _SCHEDULER_METHODS:
                    if callable(getattr(type(component), name, None)):
                        setattr(
                            component, name, _intercept(getattr(component, name), getattr(session, name), component)
                        )
                        patched.append((component, name))
    token = _ACTIVE.set(session)
    try:
        yield session
    finally:
        _ACTIVE.reset(token)
        for component, name in patched:
            vars(component).pop(name, None)


def _intercept(original, handler, scheduler):
    # Keeps the original's signature: pipelines pass `generator` and `eta` only to a
    # step() whose signature names them.
    @functools.wraps(original)
    def method(*args, **kwargs):
        return handler(scheduler, *args, **kwargs)

    return method


class _LoopDenoiser(JittedModule):
    """The compiled denoiser, which a whole-loop session may answer for."""

    def forward(self, *args, **kwargs):
        session = _ACTIVE.get()
        if session is None or not (session.enabled or session.trajectory is not None):
            return super().forward(*args, **kwargs)
        return session.denoise(self, args, kwargs)


@functools.cache
def _looping(cls: type) -> type:
    # The denoiser's own JittedModule class (placement on a mesh, say) under _LoopDenoiser.
    return _LoopDenoiser if cls is JittedModule else type(f"_Looping{cls.__name__}", (_LoopDenoiser, cls), {})


def install(pipe) -> None:
    for name in DENOISERS:
        denoiser = getattr(pipe, name, None)
        if isinstance(denoiser, JittedModule):
            looped = _looping(type(denoiser))(
                denoiser.module, ("forward",), params=denoiser.params, aliases=denoiser._aliases,
                matmul_precision=denoiser.matmul_precision,
            )  # fmt: skip
            for attribute, value in vars(denoiser).items():  # what was set after construction (a mesh)
                vars(looped).setdefault(attribute, value)
            object.__setattr__(pipe, name, looped)
            return


def _loop_shape(session: _LoopSession, scheduler, model_output, timestep, sample, kwargs) -> _LoopShape:
    pipe = session.pipe
    steps = getattr(pipe, "_num_timesteps", None) or len(scheduler.timesteps)
    if not isinstance(steps, int) or steps < 2:
        raise _NotWholeLoop(f"the pipeline runs {steps} steps; the whole loop needs 2 or more")
    if kwargs.get("return_dict", True):
        raise _NotWholeLoop("the pipeline reads scheduler.step's output as a dict")
    if float(getattr(pipe, "_guidance_rescale", 0.0) or 0.0) > 0:
        raise _NotWholeLoop("guidance_rescale > 0")
    if session.first_call is None:
        raise _NotWholeLoop("the denoiser was not called before scheduler.step")
    arguments, out = session.first_call
    sample_name = next((n for n in ("sample", "hidden_states") if n in arguments), None)
    t_arg = arguments.get("timestep")
    if sample_name is None or not isinstance(t_arg, torch.Tensor):
        raise _NotWholeLoop(f"the denoiser {type(pipe).__name__} calls takes no sample/hidden_states and timestep")
    x = arguments[sample_name]
    batch = sample.shape[0]
    if x.shape[0] not in (batch, 2 * batch) or tuple(x.shape[1:]) != tuple(sample.shape[1:]):
        raise _NotWholeLoop("the denoiser's input is not the latents (or two copies of them)")
    t0, given = float(timestep), float(t_arg.reshape(-1)[0])
    divisor = 1 if given == t0 else (round(t0 / given) if given else 0)
    if divisor < 1 or abs(t0 / divisor - given) > 1e-6 * max(1.0, abs(given)):
        raise _NotWholeLoop(f"the denoiser takes timestep {given} at t={t0}, not t or t / k")
    prediction = out[0]
    learned_sigma = prediction.ndim == 4 and prediction.shape[1] == 2 * sample.shape[1]
    return _LoopShape(
        steps=steps,
        guidance=x.shape[0] == 2 * batch,
        scale_input=session.scaled,
        sample_name=sample_name,
        timestep_divisor=divisor,
        timestep_batched=t_arg.ndim > 0,
        learned_sigma=learned_sigma,
    )


def _guidance_scale(session: _LoopSession) -> float:
    pipe = session.pipe
    if hasattr(pipe, "_guidance_scale"):
        return float(pipe._guidance_scale)
    if "guidance_scale" in session.call_kwargs:
        return float(session.call_kwargs["guidance_scale"])
    return float(inspect.signature(type(pipe).__call__).parameters["guidance_scale"].default)


def _split_static(tree) -> tuple[list[jax.Array], Callable, tuple]:
    # Arrays of `tree` become program arguments; the rest is part of the cache key.
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [bridge.to_jax(x) for x in leaves if isinstance(x, torch.Tensor)]
    statics = tuple((i, x) for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor))
    environment = bridge.env()

    def rebuild(array_args):
        it = iter(array_args)
        static_at = dict(statics)
        merged = [static_at[i] if i in static_at else JaxTensor(next(it), environment) for i in range(len(leaves))]
        return jax.tree_util.tree_unflatten(treedef, merged)

    key = (treedef, tuple((i, x if _hashable(x) else id(x)) for i, x in statics))
    return arrays, rebuild, key


def _hashable(x) -> bool:
    try:
        hash(x)
        return True
    except TypeError:
        return False


def _run_whole_loop(session, scheduler, model_output, timestep, sample, args, kwargs) -> list:
    shape = _loop_shape(session, scheduler, model_output, timestep, sample, kwargs)
    pipe = session.pipe
    denoiser = next(getattr(pipe, n) for n in DENOISERS if isinstance(getattr(pipe, n, None), _LoopDenoiser))
    timesteps = scheduler.timesteps[-shape.steps :]
    if float(timesteps[0]) != float(timestep):
        raise _NotWholeLoop("the loop's timesteps are not the scheduler's last ones")
    arguments = dict(session.first_call[0])
    arguments.pop(shape.sample_name), arguments.pop("timestep")
    cond_arrays, rebuild_cond, cond_key = _split_static(arguments)
    step_arrays, rebuild_step, step_key = _split_static(
        (args, {k: v for k, v in kwargs.items() if k not in ("generator", "return_dict")})
    )
    generator = kwargs.get("generator")
    statics = tuple(
        sorted((k, v) for k, v in vars(scheduler).items() if isinstance(v, (int, float, str, bool, type(None))))
    )
    precision = bridge.resolve_precision(denoiser.matmul_precision)  # the denoiser's program, traced inside, has it too
    key = (
        shape,
        precision,
        cond_key,
        step_key,
        type(scheduler),
        statics,
        tuple(float(t) for t in timesteps),
        tuple(sample.shape),
        str(sample.dtype),
        tuple(a.shape for a in cond_arrays),
    )
    programs = pipe.__dict__.setdefault("_hfjax_loops", {})
    if key not in programs:
        programs[key] = _build_loop(
            _LoopParts(
                shape=shape, denoiser=denoiser, scheduler=scheduler, timesteps=timesteps, rebuild_cond=rebuild_cond,
                rebuild_step=rebuild_step, sample=sample, model_output=model_output, step_arrays=step_arrays,
                precision=precision,
            )
        )  # fmt: skip
    program = programs[key]
    noise = [_draw(shape_, kwargs_, generator) for shape_, kwargs_ in program.draws]
    trajectory = program.jitted(
        denoiser.params,
        bridge.to_jax(model_output),
        bridge.to_jax(sample),
        cond_arrays,
        step_arrays,
        jnp.float32(_guidance_scale(session)),
        noise,
    )
    environment = bridge.env()
    return [JaxTensor(trajectory[i], environment) for i in range(shape.steps)]


def _draw(shape: tuple, kwargs: dict, generator):
    from diffusers.utils.torch_utils import randn_tensor

    return bridge.to_jax(
        randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=kwargs.get("dtype"))
    )


@dataclasses.dataclass
class _LoopProgram:
    jitted: Callable
    draws: list  # (shape, randn_tensor kwargs) of each noise draw, in order


@dataclasses.dataclass(frozen=True)
class _LoopParts:
    """What the first denoiser call of a session tells about the loop to build."""

    shape: _LoopShape
    denoiser: Any  # the pipeline's compiled denoiser (a `_LoopDenoiser`)
    scheduler: Any  # the pipeline's scheduler, as set for this call
    timesteps: Any  # the loop's timesteps (torchax tensors)
    rebuild_cond: Callable  # the denoiser's conditioning arguments from their arrays
    rebuild_step: Callable  # the scheduler step's other arguments from their arrays
    sample: Any  # the first latents
    model_output: Any  # the first denoiser output
    step_arrays: Any  # the scheduler step's other array arguments
    precision: str  # of float32 products (hfjax.bridge's precision)


def _build_loop(parts: _LoopParts) -> _LoopProgram:
    shape, denoiser, scheduler, timesteps = parts.shape, parts.denoiser, parts.scheduler, parts.timesteps
    rebuild_cond, rebuild_step, sample, model_output = (
        parts.rebuild_cond,
        parts.rebuild_step,
        parts.sample,
        parts.model_output,
    )
    step_arrays, precision = parts.step_arrays, parts.precision
    environment = bridge.env()
    template = copy.copy(scheduler)
    vars(template).pop("step", None), vars(template).pop("scale_model_input", None)
    t_values = [JaxTensor(t.jax(), environment) for t in timesteps]
    n = shape.steps

    # Discovery: run every scheduler call once, in order, with stand-in arrays, to learn
    # its state between calls, the arrays it carries, and the noise it draws.
    calls = [("step", 0)] + [
        c for i in range(1, n) for c in ((("scale", i),) if shape.scale_input else ()) + (("step", i),)
    ]
    boundaries, carried, draws, draw_counts = [], {}, [], []

    def stand_in(shape_, kwargs_):
        draws.append((shape_, {k: v for k, v in kwargs_.items() if k == "dtype"}))
        return jnp.zeros(shape_, bridge.to_jax(sample).dtype) * probe_zero[0]

    probe_zero = [None]

    def discover(latents, eps, step_args):
        probe_zero[0] = latents.reshape(-1)[0] * 0
        worker = copy.copy(template)
        boundary, _ = _scheduler_state(worker)
        boundaries.append(boundary)
        _restore_scheduler(worker, boundary, {})  # fresh lists and dicts, not the template's
        x = JaxTensor(latents, environment)
        with environment, jax.ensure_compile_time_eval(), _noise_from(worker, stand_in):
            for kind, i in calls:
                before = len(draws)
                if kind == "scale":
                    type(worker).scale_model_input(worker, x, t_values[i])
                else:
                    x = _scheduler_step(worker, JaxTensor(eps, environment), t_values[i], x, rebuild_step(step_args))
                draw_counts.append(len(draws) - before)
                boundary, dynamic = _scheduler_state(worker)
                boundaries.append(boundary)
                for k, v in dynamic.items():
                    if k in carried and (carried[k].shape, carried[k].dtype) != (v.shape, v.dtype):
                        raise _NotWholeLoop(f"the scheduler's {k} changes shape between steps")
                    carried[k] = jax.ShapeDtypeStruct(v.shape, v.dtype)
        return x.jax()

    try:
        jax.eval_shape(discover, bridge.to_jax(sample), bridge.to_jax(model_output), step_arrays)
    except _UNTRACEABLE as error:
        raise _NotWholeLoop(
            f"{type(scheduler).__name__}'s arithmetic cannot be traced ({type(error).__name__})"
        ) from None
    per_step = draw_counts[1 + (1 if shape.scale_input else 0) :: (2 if shape.scale_input else 1)]
    scale_counts = draw_counts[1::2] if shape.scale_input else []
    if any(scale_counts) or len(set(per_step)) > 1:
        raise _NotWholeLoop("the scheduler draws noise unevenly over the steps")
    draws_first, draws_per_step = draw_counts[0], (per_step[0] if per_step else 0)

    # The program: scheduler call k runs in branch k of a lax.switch, from boundary k.
    def scheduler_call(k: int):
        kind, i = calls[k]

        def run(carry, x, eps, step_args, noise):
            worker = copy.copy(template)
            noise = list(noise)
            with environment, jax.ensure_compile_time_eval(), _noise_from(worker, lambda shape_, kwargs_: noise.pop(0)):
                _restore_scheduler(worker, boundaries[k], carry)
                if kind == "scale":
                    out = type(worker).scale_model_input(worker, JaxTensor(x, environment), t_values[i])
                else:
                    out = _scheduler_step(
                        worker,
                        JaxTensor(eps, environment),
                        t_values[i],
                        JaxTensor(x, environment),
                        rebuild_step(step_args),
                    )
                _, dynamic = _scheduler_state(worker)
            new = dict(carry)
            new.update({k_: v.astype(carried[k_].dtype) for k_, v in dynamic.items()})
            return new, out.jax()

        return run

    def switch(ks: list[int], index, *operands):
        branches = [scheduler_call(k) for k in ks]
        return jax.lax.switch(index, branches, *operands) if len(branches) > 1 else branches[0](*operands)

    step_calls = [k for k, (kind, i) in enumerate(calls) if kind == "step" and i > 0]
    scale_calls = [k for k, (kind, _) in enumerate(calls) if kind == "scale"]

    def whole(params, eps0, latents0, cond_arrays, step_args, guidance, noise):
        cond = rebuild_cond(cond_arrays)
        carry = {k: jnp.zeros(v.shape, v.dtype) for k, v in carried.items()}
        carry, latents = scheduler_call(0)(carry, latents0, eps0, step_args, noise[:draws_first])
        rest = noise[draws_first:]
        stacked = jnp.stack(rest).reshape(n - 1, draws_per_step, *latents0.shape) if rest else jnp.zeros((n - 1, 0))
        t_all = jnp.stack([t.jax() for t in t_values])

        def body(state, xs):
            latents, carry = state
            i, step_noise = xs
            x = jnp.concatenate([latents, latents]) if shape.guidance else latents
            if shape.scale_input:
                carry, x = switch(scale_calls, i - 1, carry, x, x, step_args, ())
            t = t_all[i]
            t = t.astype(jnp.float32) / shape.timestep_divisor if shape.timestep_divisor != 1 else t
            if shape.timestep_batched:
                t = jnp.broadcast_to(t, (x.shape[0],))
            with environment:
                out = _call_denoiser(
                    denoiser,
                    params,
                    {**cond, shape.sample_name: JaxTensor(x, environment), "timestep": JaxTensor(t, environment)},
                    precision,
                )
            eps = out[0].jax()
            if shape.guidance:
                uncond, text = jnp.split(eps, 2)
                eps = uncond + guidance.astype(eps.dtype) * (text - uncond)
            if shape.learned_sigma:
                eps = jnp.split(eps, 2, axis=1)[0]
            step_noise = [step_noise[j] for j in range(draws_per_step)]
            carry, latents = switch(step_calls, i - 1, carry, latents, eps, step_args, step_noise)
            return (latents, carry), latents

        _, rest_latents = jax.lax.scan(body, (latents, carry), (jnp.arange(1, n), stacked))
        return jnp.concatenate([latents[None], rest_latents])

    return _LoopProgram(bridge.jit_program(bridge.under(precision, whole), stage="whole loop"), list(draws))


def _scheduler_step(scheduler, eps, t, x, step_args):
    args, kwargs = step_args
    return type(scheduler).step(scheduler, eps, t, x, *args, return_dict=False, **kwargs)[0]


def _call_denoiser(denoiser: JittedModule, params, kwargs: dict, precision: str):
    # The denoiser's program, called with the weights the whole loop was given, so they
    # stay arguments of the outer program rather than constants folded into it; and with its
    # precision, whenever the loop is traced.
    program, dynamic = denoiser._program("forward", (), kwargs, precision)
    out_arrays, _, _ = program.jitted(params, dynamic, bridge.prng_key())
    return bridge.to_torch(bridge.merge_outputs(program.out_treedef, out_arrays, program.out_statics))
