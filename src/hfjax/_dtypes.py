"""The one table of weight dtypes, and the one check of a `dtype=` argument."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from ._errors import LoadError

# Floating dtypes weights can be loaded in: name -> (jax dtype, torch dtype).
WEIGHT_DTYPES: dict[str, tuple[type, torch.dtype]] = {
    "float32": (jnp.float32, torch.float32),
    "bfloat16": (jnp.bfloat16, torch.bfloat16),
    "float16": (jnp.float16, torch.float16),
}
NAMES: tuple[str, ...] = tuple(WEIGHT_DTYPES)
# safetensors' dtype codes -> dtype names.
SAFETENSORS = {
    "F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


def resolve(dtype, *, caller: str) -> str | None:
    """The name of a weight dtype given as "auto"/None (the checkpoint's: None), a name, a torch
    dtype, or a numpy / jax dtype.

    Raises:
      LoadError: naming `caller`, the value and the dtypes allowed.
    """
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return None
    if isinstance(dtype, str):
        name = dtype
    elif isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        try:
            name = jnp.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    if name not in WEIGHT_DTYPES:
        raise LoadError(
            f"{caller}: dtype={dtype!r} is not supported; use one of {NAMES} (as a name, a torch dtype or a jnp dtype), "
            "or 'auto' for the checkpoint's"
        )
    return name


def jax_dtype(name: str):
    return WEIGHT_DTYPES[name][0]


def torch_dtype(name: str) -> torch.dtype:
    return WEIGHT_DTYPES[name][1]


def itemsize(name: str) -> int:
    """Bytes per element of a dtype name ("float32", "bfloat16", "int64", ...)."""
    return jnp.dtype(name).itemsize if name != "bool" else np.dtype(bool).itemsize
