"""Float32 products computed as PyTorch computes them, on every backend.

PyTorch's float32 matrix products and convolutions are full float32 unless its user asks
otherwise (`torch.set_float32_matmul_precision`, "highest" by default). JAX's default lets the
backend choose: TF32 on recent NVIDIA GPUs, one bfloat16 pass on TPUs. So hfjax builds every
program with the precision torch's setting names (or the one a model was loaded with), read when
the program is built and part of the program's key:

    torch's setting   JAX precision            on GPUs              on TPUs
    "highest"         HIGHEST ("float32")      float32              float32 (6 bf16 passes)
    "high"            HIGH ("tensorfloat32")   TF32                 3 bfloat16 passes
    "medium"          DEFAULT ("bfloat16")     the backend's fastest (TF32)   1 bfloat16 pass

XLA:CPU computes float32 products in float32 whatever the setting. Products of bfloat16 or
float16 operands are not affected by any of them. JAX's process-wide config is never changed:
the precision is set around each trace only (`jax.default_matmul_precision` as a context, which
JAX reads when a product is traced).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Literal

import jax

Precision = Literal["highest", "high", "medium"]
PRECISIONS: tuple[str, ...] = ("highest", "high", "medium")  # torch.set_float32_matmul_precision's names
_JAX_NAMES = {"highest": "highest", "high": "high", "medium": "default"}


def check_precision(matmul_precision: str | None, *, caller: str, error: type[Exception] = ValueError) -> str | None:
    """`matmul_precision=` as given to a public call: one of PRECISIONS, or None (follow torch's setting).

    Raises:
      error: naming `caller`, the value and the names allowed.
    """
    if matmul_precision is not None and matmul_precision not in PRECISIONS:
        raise error(
            f"{caller}: matmul_precision={matmul_precision!r} is not one of {PRECISIONS}; pass one of them, as "
            "torch.set_float32_matmul_precision takes them, or None to follow torch's setting"
        )
    return matmul_precision


def resolve_precision(matmul_precision: str | None = None) -> str:
    """The precision a program built now uses: `matmul_precision`, else torch's current setting."""
    if matmul_precision is not None:
        return matmul_precision
    import torch

    return torch.get_float32_matmul_precision()


@contextlib.contextmanager
def products(precision: str):
    """Float32 products traced or run inside this context use `precision` (one of PRECISIONS)."""
    with jax.default_matmul_precision(_JAX_NAMES[precision]):
        yield


def under(precision: str, function: Callable) -> Callable:
    """`function`, whose products (traced or eager) use `precision`."""

    @functools.wraps(function)
    def computed(*args, **kwargs):
        with products(precision):
            return function(*args, **kwargs)

    return computed
