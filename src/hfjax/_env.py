"""The one torchax environment hfjax runs torch code in, and conversions to and from it."""

from __future__ import annotations

import functools
import os
import pathlib

import jax
import numpy as np
import torch
import torchax
from torchax.tensor import Tensor as JaxTensor
from torchax.tensor import View as JaxView

from . import _ops, _pytrees


@functools.cache
def env() -> torchax.tensor.Environment:
    """The torchax environment, with hfjax's op overrides installed and pytrees registered."""
    environment = torchax.default_env()
    _ops.install(environment)
    environment.j2t_copy = _to_cpu_tensors
    _pytrees.register_all()
    set_cache_dir(os.environ.get("HFJAX_CACHE_DIR", _DEFAULT_CACHE_DIR))
    return environment


def _to_cpu_tensors(tree):
    # `.to("cpu")` and `.cpu()` of a torchax tensor: a CPU tensor with memory of its own.
    # torchax's own conversion wraps JAX's read-only host buffer, so torch code writing into
    # the result (schedulers keep such tensors) would write into an immutable jax.Array.
    def convert(x: jax.Array) -> torch.Tensor:
        if x.dtype == jax.numpy.bfloat16:  # numpy's bfloat16 has no torch counterpart
            return torch.from_numpy(np.array(x.astype(jax.numpy.float32))).to(torch.bfloat16)
        return torch.from_numpy(np.array(x))

    return torch.utils._pytree.tree_map_only(jax.Array, convert, tree)


_DEFAULT_CACHE_DIR = str(pathlib.Path("~/.cache/hfjax/xla").expanduser())
_OFF = ("", "0", "off", "none")


def set_cache_dir(path: str | os.PathLike | None) -> pathlib.Path | None:
    """Keeps compiled XLA programs on disk under `path`, so a later process skips compiling.

    hfjax turns this on at import, under $HFJAX_CACHE_DIR (default ~/.cache/hfjax/xla;
    HFJAX_CACHE_DIR=off turns it off). Pass None to turn it off in this process.

    Returns:
      The cache directory, or None when off.
    """
    if path is None or str(path).lower() in _OFF:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    directory = pathlib.Path(path).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # Every program counts: a 0.2 s compile repeated at each start is what we want to skip.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


def is_array(x) -> bool:
    return isinstance(x, (jax.Array, torch.Tensor, np.ndarray))


def to_jax(tree):
    """Maps torch tensors (torchax or CPU) and numpy arrays in `tree` to jax.Arrays."""
    _pytrees.register_tree(tree)

    def convert(x):
        if isinstance(x, (JaxTensor, JaxView)):
            return x.jax()
        if isinstance(x, torch.Tensor):
            return _torch_to_jax(x)
        if isinstance(x, np.ndarray):
            return jax.numpy.asarray(x)
        return x

    return jax.tree_util.tree_map(convert, tree)


def to_torch(tree):
    """Wraps every jax.Array (or tracer) in `tree` as a torchax tensor."""
    environment = env()
    return jax.tree_util.tree_map(
        lambda x: JaxTensor(x, environment) if isinstance(x, (jax.Array, jax.core.Tracer)) else x, tree
    )


def move_tensors(component) -> list[str]:
    """Moves the tensor attributes of a plain object (a scheduler) into the torchax environment;
    returns their names."""
    environment = env()
    moved = []
    for name, value in vars(component).items():
        if isinstance(value, torch.Tensor) and not isinstance(value, JaxTensor):
            setattr(component, name, JaxTensor(to_jax(value), environment))
            moved.append(name)
    return moved


def _torch_to_jax(t: torch.Tensor) -> jax.Array:
    t = t.detach()
    if t.device.type == "meta":
        raise ValueError(
            f"a tensor of shape {tuple(t.shape)} is on the meta device and holds no data; "
            "load the weights first (hfjax.load) or pass real tensors"
        )
    if t.dtype == torch.bfloat16:
        return jax.numpy.asarray(t.float().numpy()).astype(jax.numpy.bfloat16)
    return jax.numpy.asarray(t.cpu().contiguous().numpy())
