"""The one table of weight dtypes, and the one check of a `dtype=` argument."""

from __future__ import annotations

import functools

from ._errors import LoadError

# Floating dtypes weights can be loaded in, by name; `_table()` gives each one's jax and torch
# dtypes (imported when first needed: the command line's parsers read NAMES alone).
NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")
# safetensors' dtype codes -> dtype names.
SAFETENSORS = {
    "F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
}  # fmt: skip


@functools.cache
def _table() -> dict:
    """name -> (jax dtype, torch dtype) of each of NAMES."""
    import jax.numpy as jnp
    import torch

    return {name: (getattr(jnp, name), getattr(torch, name)) for name in NAMES}


def resolve(dtype, *, caller: str) -> str | None:
    """The name of a weight dtype given as "auto"/None (the checkpoint's: None), a name, a torch
    dtype, or a numpy / jax dtype.

    Raises:
      LoadError: naming `caller`, the value and the dtypes allowed.
    """
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return None
    import jax.numpy as jnp
    import torch

    if isinstance(dtype, str):
        name = dtype
    elif isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        try:
            name = jnp.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    if name not in NAMES:
        raise LoadError(
            f"{caller}: dtype={dtype!r} is not supported; use one of {NAMES} (as a name, a torch dtype or a jnp dtype), "
            "or 'auto' for the checkpoint's"
        )
    return name


def jax_dtype(name: str):
    return _table()[name][0]


def torch_dtype(name: str):
    return _table()[name][1]


def itemsize(name: str) -> int:
    """Bytes per element of a dtype name ("float32", "bfloat16", "int64", ...)."""
    import jax.numpy as jnp
    import numpy as np

    return jnp.dtype(name).itemsize if name != "bool" else np.dtype(bool).itemsize
