"""The one torchax environment hfjax runs torch code in, and conversions to and from it."""

from __future__ import annotations

import functools

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
    _pytrees.register_all()
    return environment


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
