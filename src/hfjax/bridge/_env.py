"""hfjax's own torchax environment, and conversions between torch tensors and jax.Arrays.

torchax runs torch ops through an `Environment` (its op table, PRNG key and settings). hfjax
keeps one of its own, made on first use, so that its op lowerings never change torchax's default
environment, which other code in the process may use.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
import torch
import torchax
from torchax.tensor import Tensor as JaxTensor
from torchax.tensor import View as JaxView

from .. import _compilation_cache
from . import _hook, _ops, _pytrees


@functools.cache
def env() -> torchax.tensor.Environment:
    """hfjax's torchax environment: torchax's lowerings, then hfjax's overrides for this backend."""
    environment = torchax.tensor.Environment()
    _ops.install(environment, backend=_hook.active().name)
    environment.j2t_copy = _to_cpu_tensors
    environment._to_copy = functools.partial(_to_copy_numbers, environment._to_copy, environment)
    if os.environ.get(_compilation_cache.VARIABLE):
        _compilation_cache.set_cache_dir(os.environ[_compilation_cache.VARIABLE])
    return environment


def use_hook(hook: _hook.Backend) -> None:
    """Makes `hook` the active backend hook (`hfjax._backend.active()` picks it), its op lowerings
    installed in hfjax's environment, now or when it is made."""
    _hook.set_active(hook)
    if env.cache_info().currsize:
        _ops.install(env(), backend=hook.name)


def prng_key() -> jax.Array:
    """The environment's current PRNG key, as a concrete array even when asked inside a trace
    (torchax makes each thread's first key lazily, which inside a trace would be a tracer)."""
    with jax.ensure_compile_time_eval():
        return env().prng_key


def set_prng_key(key: jax.Array) -> None:
    """Keeps `key` as the environment's PRNG key, unless it is a tracer (a call inside a trace)."""
    if not isinstance(key, jax.core.Tracer):
        env().prng_key = key


def _to_cpu_tensors(tree):
    # `.to("cpu")` and `.cpu()` of a torchax tensor: a CPU tensor with memory of its own.
    # torchax's own conversion wraps JAX's read-only host buffer, so torch code writing into
    # the result (schedulers keep such tensors) would write into an immutable jax.Array.
    def convert(x: jax.Array) -> torch.Tensor:
        if x.dtype == jax.numpy.bfloat16:  # numpy's bfloat16 has no torch counterpart
            return torch.from_numpy(np.array(x.astype(jax.numpy.float32))).to(torch.bfloat16)
        return torch.from_numpy(np.array(x))

    return torch.utils._pytree.tree_map_only(jax.Array, convert, tree)


def _to_copy_numbers(to_copy, environment, value, dtype, device):
    # torch.vmap (transformers' masks with an and/or overlay: Gemma 3's image blocks on sliding
    # layers) casts Python numbers with `.to(dtype)`; torchax's `_to_copy` takes only tensors.
    if isinstance(value, (bool, int, float)):
        from torchax.ops import mappings

        return JaxTensor(
            jax.numpy.asarray(value, dtype=None if dtype is None else mappings.t2j_dtype(dtype)), environment
        )
    return to_copy(value, dtype, device)


def is_array(x) -> bool:
    return isinstance(x, (jax.Array, torch.Tensor, np.ndarray))


def to_jax(tree):
    """Maps torch tensors (torchax or CPU) and numpy arrays in `tree` to jax.Arrays."""
    _pytrees.register_tree(tree)

    def convert(x):
        if isinstance(x, (JaxTensor, JaxView)):
            return x.jax()
        if isinstance(x, torch.Tensor):
            return torch_to_jax(x)
        if isinstance(x, np.ndarray):
            return jax.numpy.asarray(x)
        return x

    return jax.tree_util.tree_map(convert, tree)


def to_torch(tree):
    """Wraps every jax.Array (or tracer) in `tree` as a torchax tensor of hfjax's environment."""
    environment = env()
    return jax.tree_util.tree_map(
        lambda x: JaxTensor(x, environment) if isinstance(x, (jax.Array, jax.core.Tracer)) else x, tree
    )


def move_tensors(component) -> list[str]:
    """Moves the tensor attributes of a plain object (a scheduler) into hfjax's environment;
    returns their names."""
    environment = env()
    moved = []
    for name, value in vars(component).items():
        if isinstance(value, torch.Tensor) and not isinstance(value, JaxTensor):
            setattr(component, name, JaxTensor(to_jax(value), environment))
            moved.append(name)
    return moved


def torch_to_jax(t: torch.Tensor) -> jax.Array:
    """A CPU (or meta: an error) torch tensor's values as a jax.Array of the same dtype."""
    t = t.detach()
    if t.device.type == "meta":
        raise ValueError(
            f"a tensor of shape {tuple(t.shape)} is on the meta device and holds no data; "
            "load the weights first (hfjax.load) or pass real tensors"
        )
    if t.dtype == torch.bfloat16:
        return jax.numpy.asarray(t.float().numpy()).astype(jax.numpy.bfloat16)
    if t.dtype == torch.float8_e4m3fn:  # numpy has no float8: its bytes, seen as ml_dtypes' type
        return jax.numpy.asarray(t.cpu().contiguous().view(torch.uint8).numpy().view(jax.numpy.float8_e4m3fn))
    return jax.numpy.asarray(t.cpu().contiguous().numpy())
