"""Op lowerings that hfjax adds to or fixes in torchax, all in one registry.

Each override is registered with `@override_op(aten_op, why=...)` and installed into hfjax's own
torchax environment (`_env.env()`) when that is made. An override registered for a backend
(`backend="cpu"`, from `hfjax.cpu`) is installed only where that backend's hook is active, after
the generic ones. Every override has a parity test against the same op run by torch
(tests/test_ops.py, tests/cpu/test_cpu_ops.py). `hfjax.override_op` is this decorator.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils import _mode_utils, _pytree
from torchax.ops import mappings, op_base, ops_registry
from torchax.tensor import Tensor as _TorchaxTensor
from torchax.view import View

from ._specialize import concrete


@dataclasses.dataclass(frozen=True)
class Override:
    """One registered lowering of a torch op."""

    op: object
    impl: Callable
    is_jax_function: bool  # impl takes and returns jax arrays (else torchax tensors)
    is_view_op: bool  # impl receives torchax View objects unmaterialised
    why: str  # what torchax lacks, or what the backend gains
    backend: str | None  # None: every backend; else the name of the backend hook it belongs to


_OVERRIDES: dict[tuple[object, str | None], Override] = {}
_INSTALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # environment -> its backend name


def override_op(
    aten_op, *, why: str, backend: str | None = None, is_jax_function: bool = True, is_view_op: bool = False
):
    """Registers the decorated function as hfjax's lowering of a torch op.

    Args:
      aten_op: the op, e.g. `torch.ops.aten.pow` or `torch.nn.functional.linear`.
      why: what torchax lacks or does wrong (or, with `backend`, what the backend gains); required.
      backend: None for every backend; "cpu" for XLA:CPU only (used by `hfjax.cpu`).
      is_jax_function: the function takes and returns jax.Arrays (else torchax tensors).
      is_view_op: the function receives torchax View objects as they are.

    Example:
      >>> @hfjax.override_op(torch.ops.aten.erfinv, why="torchax has no lowering")
      ... def erfinv(x):
      ...     return jax.scipy.special.erfinv(x)
    """
    if not isinstance(why, str) or not why.strip():
        raise ValueError(
            f"override_op({aten_op}): why={why!r} must say what torchax lacks, e.g. why='torchax has no lowering'"
        )

    def register(impl: Callable) -> Callable:
        if (aten_op, backend) in _OVERRIDES:
            warnings.warn(f"hfjax: {aten_op} is overridden twice; the later one wins", stacklevel=2)
        entry = Override(aten_op, impl, is_jax_function, is_view_op, why, backend)
        _OVERRIDES[(aten_op, backend)] = entry
        for environment, name in list(_INSTALLED.items()):
            if backend in (None, name) and not (backend is None and (aten_op, name) in _OVERRIDES):
                _put(environment, entry)
        return impl

    return register


def overrides(backend: str | None = None) -> dict[object, Override]:
    """The overrides that apply on `backend`, keyed by op: the generic ones, then the backend's."""
    applying = {op: entry for (op, name), entry in _OVERRIDES.items() if name is None}
    if backend is not None:
        applying.update({op: entry for (op, name), entry in _OVERRIDES.items() if name == backend})
    return applying


def registered() -> list[Override]:
    """Every registered override, of every backend."""
    return list(_OVERRIDES.values())


def install(environment, *, backend: str | None) -> None:
    """Puts the overrides that apply on `backend` into a torchax Environment's op table."""
    for entry in overrides(backend).values():
        _put(environment, entry)
    _INSTALLED[environment] = backend
    _fix_methods()


def _put(environment, entry: Override) -> None:
    environment._ops[entry.op] = ops_registry.Operator(
        entry.op,
        entry.impl,
        is_jax_function=entry.is_jax_function,
        is_user_defined=True,
        needs_env=False,
        is_view_op=entry.is_view_op,
    )


# Three methods of torchax's tensor classes run Python of their own, which no op table reaches.
# They are wrapped once; the wrappers change only tensors of an environment made by install()
# (hfjax's), where torchax's own method fails or differs from torch's. Parity tests in
# tests/test_ops.py (`test_tolist_matches_torch`, `test_boolean_mask_write_into_a_view`,
# `test_type_as_a_view_matches_torch`).
_ORIGINAL_METHODS: dict[str, Callable] = {}


def _fix_methods() -> None:
    if _ORIGINAL_METHODS:
        return
    _ORIGINAL_METHODS["tolist"] = _TorchaxTensor.tolist
    _ORIGINAL_METHODS["view_setitem"] = View.__setitem__
    _ORIGINAL_METHODS["type_as"] = _TorchaxTensor.type_as
    _TorchaxTensor.tolist = _tensor_tolist
    View.__setitem__ = _view_setitem
    _TorchaxTensor.type_as = _tensor_type_as


def _tensor_tolist(self):
    # torchax's `self._elem.tolist()` cannot read a traced value (jetmoe's router:
    # `expert_size.tolist()`); in hfjax's environment it is a value of the data, specialised.
    if self._env in _INSTALLED:
        return concrete(self._elem, "Tensor.tolist()").tolist()
    return _ORIGINAL_METHODS["tolist"](self)


def _tensor_type_as(self, other):
    # torchax casts `self` in place and reads `other._elem`, which a View lacks (Gemma 3n:
    # `normed.type_as(hidden_states[i])`); torch returns a cast copy and leaves `self` alone.
    if self._env in _INSTALLED:
        return self.to(other.dtype)
    return _ORIGINAL_METHODS["type_as"](self, other)


def _view_setitem(self, indexes, value):
    # torchax's View passes a torchax index tensor itself to `jax_array.at[...]`, which JAX refuses
    # (longformer: `mask[attention_mask == 2] = v` into a slice). The view's values get the write as a
    # torchax Tensor would take it (a boolean mask keeps static shapes), then go back to its source.
    leaves = _pytree.tree_leaves(indexes)
    if self._env not in _INSTALLED or not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return _ORIGINAL_METHODS["view_setitem"](self, indexes, value)
    values = _TorchaxTensor(self.jax(), self._env)
    values[indexes] = value
    self.update(values)


def torchax_lowering(op) -> Callable:
    """torchax's own lowering of `op`, for overrides that change only some of its cases."""
    return ops_registry.all_aten_ops.get(op, ops_registry.all_torch_functions.get(op)).func


# ---- overrides ---------------------------------------------------------------


def _index_dtype(out_int32: bool):
    # torch's int64 indices are int32 when jax runs without x64, as torchax runs by default.
    return jnp.int32 if out_int32 else jax.dtypes.canonicalize_dtype(jnp.int64)


# -- mixture of experts --------------------------------------------------------


@override_op(
    torch.ops.aten._grouped_mm.default,
    why="torchax has no lowering; transformers' default 'grouped_mm' MoE experts call it",
)
def _grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    # offs: [G] int, the cumulative end of each group along the jagged dimension. Rows (or
    # columns) past offs[-1] come out zero; torch leaves them uninitialised.
    if bias is not None:
        raise NotImplementedError(
            "torch._grouped_mm(..., bias=...) is not supported, as in torch's own kernels; "
            "add the bias to the result instead."
        )
    if mat_a.ndim not in (2, 3) or mat_b.ndim not in (2, 3):
        raise ValueError(f"torch._grouped_mm takes 2D or 3D operands; got mat_a {mat_a.shape} and mat_b {mat_b.shape}.")
    jagged = mat_a.ndim == 2 or mat_b.ndim == 2
    if jagged != (offs is not None):
        raise ValueError(
            f"torch._grouped_mm with a {mat_a.ndim}D mat_a and a {mat_b.ndim}D mat_b "
            f"{'needs offs' if jagged else 'takes no offs'}; got offs={offs if offs is None else offs.shape}."
        )
    result_dtype = mat_a.dtype if out_dtype is None else mappings.t2j_dtype(out_dtype)
    # bf16 / fp16 accumulate in fp32, as torch's grouped GEMM kernels do.
    accumulate = jnp.promote_types(result_dtype, jnp.float32)

    if offs is None:  # [G, M, K] @ [G, K, N] -> [G, M, N]
        return jnp.matmul(mat_a, mat_b, preferred_element_type=accumulate).astype(result_dtype)

    group_sizes = jnp.diff(offs.astype(jnp.int32), prepend=0)  # [G]
    if mat_b.ndim == 3:  # [M, K] rows grouped, @ [G, K, N] -> [M, N]
        out = jax.lax.ragged_dot(mat_a, mat_b, group_sizes, preferred_element_type=accumulate)
    elif mat_a.ndim == 3:  # [G, M, K] @ [K, N] columns grouped -> [M, N], computed transposed
        out = jax.lax.ragged_dot(mat_b.T, jnp.swapaxes(mat_a, 1, 2), group_sizes, preferred_element_type=accumulate).T
    else:  # [M, K] @ [K, N], K grouped -> [G, M, N]
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([1], [0]), ([], [])),
            lhs_ragged_dimensions=[1],
            rhs_group_dimensions=[],
        )
        out = jax.lax.ragged_dot_general(mat_a, mat_b, group_sizes, dims, preferred_element_type=accumulate)
    return out.astype(result_dtype)


# -- in-place copies -----------------------------------------------------------


# torchax makes each in-place op of its table from the functional one (`op_base.InplaceOp`: the
# result written back into the tensor or View); abs_ is not in that table.
override_op(
    torch.ops.aten.abs_,
    why='torchax has no in-place abs ("unsupported op aten::abs_"); transformers 5.24\'s Siglip2 '
    "weighs its antialiased position-embedding resize with `(...).abs_().div_(...)`",
    is_jax_function=False,
    is_view_op=True,
)(op_base.InplaceOp(torch.ops.aten.abs))


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    return len(shape) <= len(target) and all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


@override_op(
    torch.ops.aten.copy_,
    why="torchax's copy_ reads `src._elem`, which a View lacks (\"'View' object has no attribute "
    "'_elem'\"), and does not broadcast src; state-space and hybrid caches (mamba, jamba, zamba...) "
    "copy_ a slice of the new conv state into the cache",
    is_jax_function=False,
    is_view_op=True,
)
def _copy_(dst, src, non_blocking=False):
    # dst: torchax Tensor or View, or a CPU tensor receiving a torchax one; src: any tensor.
    if not isinstance(dst, (_TorchaxTensor, View)):
        host = src._env.j2t_copy(src.jax())
        with _mode_utils.no_dispatch(), torch._C.DisableTorchFunction():
            return dst.copy_(host)
    if isinstance(src, (_TorchaxTensor, View)):
        value = src.jax()
    else:
        value = dst._env.t2j_copy(src)
    dst_array_dtype = dst.source_jax().dtype if isinstance(dst, View) else dst.jax().dtype
    value = value.astype(dst_array_dtype)
    dst_shape = tuple(dst.shape)
    if _broadcasts_to(value.shape, dst_shape):
        value = jnp.broadcast_to(value, dst_shape)
    elif isinstance(dst, View):
        raise ValueError(f"copy_: the source's shape {value.shape} does not broadcast to the view's {dst_shape}.")
    # Else a Tensor dst takes src's shape, as in torchax's own copy_: torchax's sdpa fallback
    # relies on it when masked_fill_ grows an [L, S] bias to a [B, H, L, S] mask.
    if isinstance(dst, View):
        dst.update(value)
    else:
        dst._elem = value
    return dst


# -- checks --------------------------------------------------------------------


class _CheckOutcome(_TorchaxTensor):
    """The reduction `torch._check_tensor_all` takes `.item()` of. Inside a jit trace its value is
    not known, and the check is taken to hold, as TRANSFORMERS_DISABLE_TORCH_CHECK=1 would have
    it; outside one, `.item()` is the value and a failed check raises as in torch."""

    def item(self):
        value = self.jax()
        return True if isinstance(value, jax.core.Tracer) else bool(value)


@override_op(
    torch.ops.aten._is_all_true.default,
    why="torchax has no lowering; torch._check_tensor_all (transformers' torch_compilable_check, "
    "e.g. prophetnet's cached decode, masks) and torch.distributions' argument checks (blt) call it, then "
    "take .item(), which a jit trace cannot give",
    is_jax_function=False,
)
def _is_all_true(x):
    return _CheckOutcome(jnp.all(x.jax()), x._env)  # [] bool


@override_op(
    torch.ops.aten._is_any_true.default,
    why="torchax has no lowering; the twin of _is_all_true",
    is_jax_function=False,
)
def _is_any_true(x):
    return _CheckOutcome(jnp.any(x.jax()), x._env)  # [] bool


# -- search --------------------------------------------------------------------


def _searchsorted(sorted_sequence, values, *, out_int32=False, right=False, side=None, sorter=None):
    # sorted_sequence: [..., S]; values: a scalar, any shape when sorted_sequence is 1D, else
    # [..., V] with sorted_sequence's leading dims. Returns indices shaped like values.
    if side not in (None, "left", "right"):
        raise ValueError(f"torch.searchsorted(side=...) takes 'left' or 'right'; got {side!r}.")
    if side == "left" and right:
        raise ValueError("torch.searchsorted got side='left' and right=True, which contradict; pass one.")
    side = "right" if right or side == "right" else "left"
    if sorter is not None:
        sorted_sequence = jnp.take_along_axis(sorted_sequence, sorter, axis=-1)
    dtype = jnp.result_type(sorted_sequence, values)
    sorted_sequence = sorted_sequence.astype(dtype)
    values = jnp.asarray(values, dtype=dtype)
    if sorted_sequence.ndim == 1:
        out = jnp.searchsorted(sorted_sequence, values, side=side)
    elif sorted_sequence.shape[:-1] == values.shape[:-1]:
        rows = sorted_sequence.reshape(-1, sorted_sequence.shape[-1])
        row_values = values.reshape(-1, values.shape[-1])
        search_row = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=side))
        out = search_row(rows, row_values).reshape(values.shape)
    else:
        raise ValueError(
            "torch.searchsorted with an N-D sorted_sequence needs values with the same leading "
            f"dims; got sorted_sequence {sorted_sequence.shape} and values {values.shape}."
        )
    return out.astype(_index_dtype(out_int32))


override_op(
    torch.ops.aten.searchsorted.Tensor,
    why="torchax's lowering rejects right=, side= and sorter= with a TypeError and handles only a 1D sorted_sequence",
)(_searchsorted)
override_op(
    torch.ops.aten.searchsorted.Scalar,
    why="torchax has no lowering; diffusers' DPMSolverMultistepScheduler.set_timesteps calls it",
)(_searchsorted)


# -- indexing and integer math -------------------------------------------------


def _concrete_bound(bound):
    # A tensor slice bound becomes a Python int, as torch's __index__ makes it.
    return int(concrete(bound.jax(), "a tensor used as a slice bound")) if isinstance(bound, torch.Tensor) else bound


@override_op(
    torch.Tensor.__getitem__,
    why="torchax keeps a tensor slice bound (x[:, :n], n a 0-d tensor) inside the View it returns, "
    "and using that View fails with 'torchax Tensors can only do math within the torchax "
    "environment' (BLT's entropy patcher slices this way); it indexes with a boolean mask by jnp's "
    "own, whose result size depends on the data (T5 and BART classifiers pool hidden[eos_mask, :]); "
    "it refuses an index that is a CPU tensor (SAM-style relative positions: "
    "table[torch.arange(n)[:, None] - torch.arange(n)[None, :]], arange made without a device)",
    is_jax_function=False,
    is_view_op=True,
)
def _getitem(self, indexes):
    def static(index) -> tuple:
        # One index as the indices it stands for: a boolean mask of k dims stands for k.
        if isinstance(index, torch.Tensor) and not isinstance(index, (_TorchaxTensor, View)):
            index = _TorchaxTensor(jnp.asarray(index.numpy()), self._env)
        if isinstance(index, slice):
            return (slice(*(_concrete_bound(b) for b in (index.start, index.stop, index.step))),)
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            mask = index.jax() if isinstance(index, _TorchaxTensor) else jnp.asarray(index.numpy())
            return _mask_indices(mask)
        return (index,)

    if isinstance(indexes, tuple):
        indexes = tuple(part for index in indexes for part in static(index))
    elif isinstance(indexes, slice):
        (indexes,) = static(indexes)
    elif isinstance(indexes, torch.Tensor):
        parts = static(indexes)
        indexes = parts if indexes.dtype == torch.bool else parts[0]
    return torchax_lowering(torch.Tensor.__getitem__)(self, indexes)


def _is_integer(x) -> bool:
    if isinstance(x, jax.Array):
        return jnp.issubdtype(x.dtype, jnp.integer)
    return isinstance(x, int) and not isinstance(x, bool)


@override_op(
    torch.ops.aten.pow,
    why="torchax raises integers to integer powers in float and casts back, which rounds past "
    "2**24, saturates instead of wrapping, and is wrong for negative exponents; BLT's rolling "
    "byte hash needs the exact, wrapping result",
)
def _pow(x, y):
    both_python = isinstance(x, int) and isinstance(y, int)
    if both_python or not (_is_integer(x) and _is_integer(y)):
        return torchax_lowering(torch.ops.aten.pow)(x, y)
    if isinstance(y, int) and y < 0:
        raise ValueError(f"Integers to negative integer powers are not allowed; got exponent {y}.")
    dtype = jnp.result_type(x, y)
    x = jnp.asarray(x, dtype=dtype)
    y = jnp.asarray(y, dtype=dtype)
    power = jnp.power(x, jnp.maximum(y, 0))  # wraps on overflow, as torch's integer pow does
    # x ** -n for integers: 1 for x == 1, +-1 for x == -1, else 0 (torch truncates 1 / x ** n).
    odd = (y % 2) == 1
    negative_power = jnp.where(x == 1, 1, jnp.where(x == -1, jnp.where(odd, -1, 1), 0)).astype(dtype)
    return jnp.where(y < 0, negative_power, power)


# -- attention -----------------------------------------------------------------


def grouped_scores(grouped, key):
    """Attention scores [..., Hkv, G, L, S] of query heads grouped over their key/value head,
    grouped [..., Hkv, G, L, D], against key [..., Hkv, S, D], in float32."""
    return jnp.einsum("...hgld,...hsd->...hgls", grouped, key, preferred_element_type=jnp.float32)


def attention(query, key, value, attn_mask=None, is_causal=False, scale=None, *, scores: Callable = grouped_scores):
    """torch's scaled_dot_product_attention in JAX, without dropout.

    query [..., Hq, L, D]; key [..., Hkv, S, D]; value [..., Hkv, S, Dv] -> [..., Hq, L, Dv].
    Query heads are grouped over their key/value head, so shared keys are read once (no repeat).
    `scores(grouped, key)` computes the raw scores; a backend may pass its own (`hfjax.cpu`).
    """
    *batch, heads, length, depth = query.shape
    kv_heads, kv_length = key.shape[-3], key.shape[-2]
    if heads % kv_heads:
        raise ValueError(
            f"scaled_dot_product_attention: {heads} query heads do not divide into {kv_heads} key/value heads"
        )
    groups = heads // kv_heads
    scale = 1.0 / float(np.sqrt(depth)) if scale is None else scale
    grouped = query.reshape(*batch, kv_heads, groups, length, depth)
    logits = scores(grouped, key) * scale  # [..., Hkv, G, L, S]
    allowed = None
    if is_causal:
        allowed = jnp.tril(jnp.ones((length, kv_length), bool))
    if attn_mask is not None:
        mask = jnp.broadcast_to(attn_mask, (*batch, heads, length, kv_length))
        mask = mask.reshape(*batch, kv_heads, groups, length, kv_length)
        if mask.dtype == jnp.bool_:
            allowed = mask if allowed is None else allowed & mask
        else:
            logits = logits + mask.astype(jnp.float32)
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    # A query that may attend to nothing (a padding row) gets zeros, as torch's softmax-safe path gives.
    top = jnp.max(logits, axis=-1, keepdims=True)
    exp = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(exp, axis=-1, keepdims=True)
    weights = exp / jnp.where(total > 0, total, 1.0)
    out = jnp.einsum("...hgls,...hsd->...hgld", weights.astype(value.dtype), value, preferred_element_type=jnp.float32)
    return out.reshape(*batch, heads, length, value.shape[-1]).astype(query.dtype)


def check_no_dropout(dropout_p) -> None:
    if dropout_p:
        raise NotImplementedError(
            f"scaled_dot_product_attention(dropout_p={dropout_p}): hfjax runs inference only; call model.eval()"
        )


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    check_no_dropout(dropout_p)
    return attention(query, key, value, attn_mask, is_causal, scale)


@override_op(
    torch.nn.functional.linear,
    why="torchax names its arguments (self, weights, bias), so torch's own keywords fail: ibert's "
    "QuantLinear calls linear(x, weight=..., bias=...)",
)
def linear(input, weight, bias=None):
    return torchax_lowering(torch.nn.functional.linear)(input, weight, bias)


@override_op(
    torch.ops.aten._upsample_bilinear2d_aa,
    why="torchax's passes its arguments in the wrong order (TypeError: 'tuple' object is not callable); "
    "siglip2 resizes its position embeddings with interpolate(mode='bilinear', antialias=True)",
)
def _upsample_bilinear2d_aa(input, output_size, align_corners, scale_factors=None, scales_h=None, scales_w=None):
    # input: [N, C, H, W]. torch's antialiased filter is a triangle widened by the scale when
    # shrinking, normalised per output pixel: jax.image.resize's "linear" with antialias.
    if align_corners:
        raise NotImplementedError(
            "hfjax: interpolate(mode='bilinear', antialias=True, align_corners=True) has no lowering; "
            "pass align_corners=False"
        )
    if output_size is None:
        output_size = [int(size * factor) for size, factor in zip(input.shape[2:], scale_factors)]
    shape = (*input.shape[:2], *output_size)
    return jax.image.resize(input, shape, method="linear", antialias=True).astype(input.dtype)


SDPA_WHY = (
    "torchax's reference attention gives NaN for a query that may attend to nothing (left padding "
    "makes such rows, and the NaN then spreads through the cache), where torch gives zeros; it also "
    "copies keys and values once per query head for grouped-query attention"
)
override_op(torch.nn.functional.scaled_dot_product_attention, why=SDPA_WHY)(_sdpa)
override_op(torch.ops.aten.scaled_dot_product_attention, why=SDPA_WHY)(_sdpa)


# -- values of the data (see hfjax._specialize) --------------------------------
# Each lowering below needs a value of its input in Python: a scalar, or the size of its result.
# `concrete()` gives it; under hfjax.jit the program is specialised on it and guarded.


def _hits(mask, what: str) -> int:
    return int(concrete(jnp.count_nonzero(mask), what))


def _true_positions(mask, what: str) -> tuple[jax.Array, ...]:
    # jnp.nonzero of `mask`, sized by its count of True values (a value of the data).
    return jnp.nonzero(mask, size=_hits(mask, what))


def _mask_indices(mask) -> tuple[jax.Array, ...]:
    # The integer indices a boolean mask index stands for, one array per dimension of the mask.
    return _true_positions(mask, "the number of True values in a boolean mask index")


@override_op(
    torch.arange,
    why="torchax's arange needs Python bounds; models that count positions from a cache's length "
    "(led: torch.arange(past_length, past_length + n)) give tensors, whose difference is a value of the data",
)
def arange(start, end=None, step=None, *, dtype=None, **_):
    if end is None:
        start, end = 0, start
    step = 1 if step is None else step
    if not any(isinstance(bound, jax.Array) for bound in (start, end, step)):
        return torchax_lowering(torch.arange)(start, end, step, dtype=dtype)
    if dtype is None:  # torch's rule: integers unless a bound is a floating point number
        floating = any(jnp.issubdtype(jnp.result_type(bound), jnp.floating) for bound in (start, end, step))
        dtype = torch.get_default_dtype() if floating else torch.int64
    dtype = jax.dtypes.canonicalize_dtype(mappings.t2j_dtype(dtype))
    length = concrete(jnp.maximum(jnp.ceil((end - start) / step), 0).astype(jnp.int32), "torch.arange's length")
    return (start + jnp.arange(int(length)) * step).astype(dtype)


@override_op(
    torch.ops.aten._local_scalar_dense,
    why="torchax's .item() fails inside a trace; `if mask.any():` and `assert x.max().item() <= n` "
    "(fsmt, led, xlm, flaubert) read a value of the data",
)
def _local_scalar_dense(x):
    return concrete(x, ".item() of a tensor (or its truth value)").item()


@override_op(
    torch.Tensor.tolist,
    why="torch refuses .tolist() on torchax's View (a slice: siglip2's spatial_shapes), and a traced "
    "tensor's list is a value of the data",
)
def tolist(x):
    return concrete(x, "Tensor.tolist()").tolist()


@override_op(
    torch.ops.aten.nonzero,
    why="torchax's nonzero has a size that depends on the data, which a trace cannot have; "
    "MoE expert loops (dbrx, transformers' 'eager' experts) and torch.where(mask) call it",
)
def _nonzero(x):
    x = jnp.asarray(x)
    hits = _hits(x, "the size of torch.nonzero's result")
    if x.ndim == 0:
        return jnp.zeros((hits, 0), _index_dtype(False))
    return jnp.argwhere(x, size=hits).astype(_index_dtype(False))


@override_op(
    torch.ops.aten.index.Tensor,
    why="torchax indexes with a boolean mask by jnp's own, whose result size depends on the data; "
    "T5 and BART classifiers pool hidden_states[eos_mask]",
)
def _index(self, indexes):
    positional = []
    for index in indexes:
        if index is not None and index.dtype == jnp.bool_:
            positional.extend(_mask_indices(index))
        else:
            positional.append(index)
    return torchax_lowering(torch.ops.aten.index.Tensor)(self, positional)


@override_op(
    torch.ops.aten.masked_select,
    why="torchax's masked_select has a size that depends on the data, which a trace cannot have",
)
def _masked_select(self, mask):
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    values, mask = jnp.broadcast_to(self, shape).reshape(-1), jnp.broadcast_to(mask, shape).reshape(-1)
    (positions,) = _true_positions(mask, "the size of torch.masked_select's result")
    return values[positions]


@override_op(
    torch.ops.aten.unique_consecutive,
    why="torchax's unique_consecutive has a size that depends on the data, which a trace cannot "
    "have; T5 and BART classifiers check their EOS counts with it",
)
def _unique_consecutive(x, return_inverse=False, return_counts=False, dim=None):
    # Returns (unique runs, inverse, counts), as aten does (the last two empty unless asked for).
    inverse_shape = x.shape if dim is None else (x.shape[dim],)
    if dim is None:
        x, dim = x.reshape(-1), 0
    dim = dim % x.ndim
    length = x.shape[dim]
    first, rest = jnp.take(x, jnp.arange(length - 1), axis=dim), jnp.take(x, jnp.arange(1, length), axis=dim)
    others = tuple(d for d in range(x.ndim) if d != dim)
    changes = jnp.any(first != rest, axis=others) if others else first != rest
    starts = jnp.concatenate([jnp.ones((min(length, 1),), bool), changes])  # [length]: a run starts here
    (start_at,) = _true_positions(starts, "the number of runs in torch.unique_consecutive")
    unique = jnp.take(x, start_at, axis=dim)
    index = _index_dtype(False)
    inverse = (
        (jnp.cumsum(starts) - 1).astype(index).reshape(inverse_shape) if return_inverse else jnp.zeros((0,), index)
    )
    counts = jnp.diff(jnp.append(start_at, length)).astype(index) if return_counts else jnp.zeros((0,), index)
    return unique, inverse, counts
