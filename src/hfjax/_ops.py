"""Op lowerings that hfjax adds to or fixes in torchax, all in one registry.

Each override is registered with `@override(aten_op)` and installed into the
torchax environment by `install()`, which `hfjax` calls once at import. Every
override has a parity test in tests/test_ops.py against the same op run by torch.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import torch
from torchax.ops import mappings, ops_registry
from torchax.view import View


@dataclasses.dataclass(frozen=True)
class _Override:
    op: object
    impl: Callable
    is_jax_function: bool  # impl takes and returns jax arrays (else torchax tensors)
    is_view_op: bool  # impl receives torchax View objects unmaterialised
    why: str


_OVERRIDES: dict[object, _Override] = {}


def override(aten_op, *, why: str, is_jax_function: bool = True, is_view_op: bool = False):
    """Registers `impl` as hfjax's lowering of `aten_op`; `why` says what torchax lacks."""

    def register(impl: Callable) -> Callable:
        if aten_op in _OVERRIDES:
            warnings.warn(f"hfjax: {aten_op} is overridden twice; the later one wins", stacklevel=2)
        _OVERRIDES[aten_op] = _Override(aten_op, impl, is_jax_function, is_view_op, why)
        return impl

    return register


def overrides() -> dict[object, _Override]:
    """The registered overrides, keyed by aten op."""
    return dict(_OVERRIDES)


def install(env) -> None:
    """Puts every registered override into a torchax Environment's op table."""
    for op, entry in _OVERRIDES.items():
        env._ops[op] = ops_registry.Operator(
            op,
            entry.impl,
            is_jax_function=entry.is_jax_function,
            is_user_defined=True,
            needs_env=False,
            is_view_op=entry.is_view_op,
        )


# ---- overrides ---------------------------------------------------------------


def _index_dtype(out_int32: bool):
    # torch's int64 indices become int32 when jax runs without x64, as torchax does.
    return jnp.int32 if out_int32 else jax.dtypes.canonicalize_dtype(jnp.int64)


@override(
    torch.ops.aten._grouped_mm.default,
    why="torchax has no lowering; transformers' default 'grouped_mm' MoE experts call it",
)
def _grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    # offs: [G] int, cumulative end of each group along the jagged dimension; data past offs[-1]
    # is ignored and its output is zero (torch leaves it uninitialised).
    if bias is not None:
        raise NotImplementedError(
            "torch._grouped_mm(..., bias=...) is not supported; torch's own kernels reject it too. "
            "Add the bias to the result instead."
        )
    if mat_a.ndim not in (2, 3) or mat_b.ndim not in (2, 3):
        raise ValueError(
            f"torch._grouped_mm takes 2D or 3D operands; got mat_a {mat_a.shape} and mat_b {mat_b.shape}."
        )
    jagged = mat_a.ndim == 2 or mat_b.ndim == 2
    if jagged != (offs is not None):
        raise ValueError(
            f"torch._grouped_mm with mat_a {mat_a.ndim}D and mat_b {mat_b.ndim}D "
            f"{'needs' if jagged else 'takes no'} offs; got offs={None if offs is None else offs.shape}."
        )
    result_dtype = mat_a.dtype if out_dtype is None else mappings.t2j_dtype(out_dtype)
    # Low-precision inputs accumulate in float32, as torch's grouped GEMM kernels do.
    accumulate_dtype = jnp.promote_types(result_dtype, jnp.float32)

    if offs is None:  # [G, M, K] @ [G, K, N] -> [G, M, N]
        out = jnp.matmul(mat_a, mat_b, preferred_element_type=accumulate_dtype)
        return out.astype(result_dtype)

    offs = offs.astype(jnp.int32)
    group_sizes = jnp.diff(offs, prepend=0)  # [G]
    if mat_a.ndim == 2 and mat_b.ndim == 3:  # rows of [M, K] grouped; [G, K, N] -> [M, N]
        out = jax.lax.ragged_dot(mat_a, mat_b, group_sizes, preferred_element_type=accumulate_dtype)
    elif mat_a.ndim == 3:  # columns of [K, N] grouped; [G, M, K] -> [M, N], solved as its transpose
        out = jax.lax.ragged_dot(
            mat_b.T, jnp.swapaxes(mat_a, 1, 2), group_sizes, preferred_element_type=accumulate_dtype
        ).T
    else:  # contraction of [M, K] @ [K, N] grouped -> [G, M, N]
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([1], [0]), ([], [])),
            lhs_ragged_dimensions=[1],
            rhs_group_dimensions=[],
        )
        out = jax.lax.ragged_dot_general(
            mat_a, mat_b, group_sizes, dims, preferred_element_type=accumulate_dtype
        )
    return out.astype(result_dtype)


@override(
    torch.ops.aten.copy_,
    why="torchax's copy_ reads `src._elem`, which a View lacks ('View' object has no attribute "
    "'_elem'), and does not broadcast src; hybrid / state-space caches copy_ slices into state",
    is_jax_function=False,
    is_view_op=True,
)
def _copy_(dst, src, non_blocking=False):
    # dst, src: torchax Tensor or View (src may also be a CPU tensor); dst keeps its shape and dtype.
    dst_dtype = dst.source_jax().dtype if isinstance(dst, View) else dst.jax().dtype
    if isinstance(src, torch.Tensor) and not isinstance(src, View) and src.device.type == "cpu":
        src = dst._env.t2j_copy(src)
    elif isinstance(src, torch.Tensor):
        src = src.jax()
    value = jnp.asarray(src).astype(dst_dtype)
    if _broadcasts_to(value.shape, tuple(dst.shape)):
        value = jnp.broadcast_to(value, tuple(dst.shape))
    elif isinstance(dst, View):
        raise ValueError(f"copy_: source of shape {value.shape} does not broadcast to the view's {tuple(dst.shape)}.")
    # Otherwise dst takes src's shape, as in torchax's own copy_: its sdpa fallback relies on
    # masked_fill_ growing a [L, S] bias to the mask's [B, H, L, S].
    if isinstance(dst, View):
        dst.update(value)
    else:
        dst._elem = value
    return dst


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    return len(shape) <= len(target) and all(
        s in (1, t) for s, t in zip(reversed(shape), reversed(target))
    )


@override(
    torch.ops.aten._is_all_true.default,
    why="torchax has no lowering; torch._check_tensor_all (transformers' torch_compilable_check) calls it",
)
def _is_all_true(x):
    return jnp.all(x)  # [] bool


@override(
    torch.ops.aten._is_any_true.default,
    why="torchax has no lowering; the twin of _is_all_true",
)
def _is_any_true(x):
    return jnp.any(x)  # [] bool


def _searchsorted(sorted_sequence, values, *, out_int32=False, right=False, side=None, sorter=None):
    # sorted_sequence: [..., S]; values: [..., V] matching its leading dims, or any shape when it is
    # 1D, or a scalar. Returns indices shaped like values.
    if side not in (None, "left", "right"):
        raise ValueError(f"torch.searchsorted(side=...) must be 'left' or 'right'; got {side!r}.")
    if side == "left" and right:
        raise ValueError("torch.searchsorted got side='left' and right=True, which contradict; pass one.")
    side = "right" if right or side == "right" else "left"
    if sorter is not None:
        sorted_sequence = jnp.take_along_axis(sorted_sequence, sorter, axis=-1)
    values = jnp.asarray(values, dtype=jnp.result_type(sorted_sequence, values))
    sorted_sequence = sorted_sequence.astype(values.dtype)
    if sorted_sequence.ndim == 1:
        out = jnp.searchsorted(sorted_sequence, values, side=side)
    else:
        if sorted_sequence.shape[:-1] != values.shape[:-1]:
            raise ValueError(
                "torch.searchsorted with an N-D sorted_sequence needs values with the same leading "
                f"dims; got sorted_sequence {sorted_sequence.shape} and values {values.shape}."
            )
        rows = sorted_sequence.reshape(-1, sorted_sequence.shape[-1])
        row_values = values.reshape(-1, values.shape[-1])
        out = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=side))(rows, row_values)
        out = out.reshape(values.shape)
    return out.astype(_index_dtype(out_int32))


override(
    torch.ops.aten.searchsorted.Tensor,
    why="torchax's lowering rejects right=, side= and sorter= (TypeError) and N-D sequences",
)(_searchsorted)
override(
    torch.ops.aten.searchsorted.Scalar,
    why="torchax has no lowering; diffusers' DPMSolverMultistepScheduler.set_timesteps calls it",
)(_searchsorted)


def _concrete_bound(bound):
    # A 0-d tensor used as a slice bound becomes a Python int, as torch does via __index__.
    if isinstance(bound, torch.Tensor):
        return int(bound.jax())
    return bound


@override(
    torch.Tensor.__getitem__,
    why="torchax keeps a tensor slice bound (x[:, :n], n a 0-d tensor) inside the view it returns, "
    "and materialising that view later fails ('torchax Tensors can only do math within the torchax "
    "environment'); BLT's entropy patcher slices this way",
    is_jax_function=False,
    is_view_op=True,
)
def _getitem(self, indexes):
    def concrete(index):
        if isinstance(index, slice):
            return slice(*(_concrete_bound(b) for b in (index.start, index.stop, index.step)))
        return index

    indexes = tuple(concrete(i) for i in indexes) if isinstance(indexes, tuple) else concrete(indexes)
    torchax_getitem = ops_registry.all_torch_functions[torch.Tensor.__getitem__].func
    return torchax_getitem(self, indexes)


def _is_integer(x) -> bool:
    return isinstance(x, int) or (isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.integer))


@override(
    torch.ops.aten.pow,
    why="torchax raises integer tensors to integer powers in float and casts back, which rounds "
    "past 2**24 and saturates instead of wrapping; BLT's rolling byte hash relies on int64 wrap",
)
def _pow(x, y):
    if _is_integer(x) and _is_integer(y) and not isinstance(x, int):
        dtype = jnp.result_type(x, y)
        return jnp.power(x.astype(dtype), jnp.asarray(y).astype(dtype))  # exact, wraps on overflow
    return ops_registry.all_aten_ops[torch.ops.aten.pow].func(x, y)
