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
import numpy as np
import torch
from torch.utils import _mode_utils
from torchax.ops import mappings, op_base, ops_registry
from torchax.tensor import Tensor as _TorchaxTensor
from torchax.view import View

from . import _cpu_kernels


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


def _torchax_lowering(op) -> Callable:
    # torchax's own lowering of `op`, for overrides that fix only some of its cases.
    return ops_registry.all_aten_ops.get(op, ops_registry.all_torch_functions.get(op)).func


def _index_dtype(out_int32: bool):
    # torch's int64 indices are int32 when jax runs without x64, as torchax runs by default.
    return jnp.int32 if out_int32 else jax.dtypes.canonicalize_dtype(jnp.int64)


# -- mixture of experts --------------------------------------------------------


@override(
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
        raise ValueError(
            f"torch._grouped_mm takes 2D or 3D operands; got mat_a {mat_a.shape} and mat_b {mat_b.shape}."
        )
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
        out = jax.lax.ragged_dot(
            mat_b.T, jnp.swapaxes(mat_a, 1, 2), group_sizes, preferred_element_type=accumulate
        ).T
    else:  # [M, K] @ [K, N], K grouped -> [G, M, N]
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([1], [0]), ([], [])),
            lhs_ragged_dimensions=[1],
            rhs_group_dimensions=[],
        )
        out = jax.lax.ragged_dot_general(
            mat_a, mat_b, group_sizes, dims, preferred_element_type=accumulate
        )
    return out.astype(result_dtype)


# -- in-place copies -----------------------------------------------------------


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    return len(shape) <= len(target) and all(
        s in (1, t) for s, t in zip(reversed(shape), reversed(target))
    )


@override(
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
        raise ValueError(
            f"copy_: the source's shape {value.shape} does not broadcast to the view's {dst_shape}."
        )
    # Else a Tensor dst takes src's shape, as in torchax's own copy_: torchax's sdpa fallback
    # relies on it when masked_fill_ grows an [L, S] bias to a [B, H, L, S] mask.
    if isinstance(dst, View):
        dst.update(value)
    else:
        dst._elem = value
    return dst


# -- checks --------------------------------------------------------------------


@override(
    torch.ops.aten._is_all_true.default,
    why="torchax has no lowering; torch._check_tensor_all (transformers' torch_compilable_check, "
    "e.g. prophetnet's cached decode) and torch.distributions' argument checks (blt) call it",
)
def _is_all_true(x):
    return jnp.all(x)  # [] bool


@override(
    torch.ops.aten._is_any_true.default,
    why="torchax has no lowering; the twin of _is_all_true",
)
def _is_any_true(x):
    return jnp.any(x)  # [] bool


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


override(
    torch.ops.aten.searchsorted.Tensor,
    why="torchax's lowering rejects right=, side= and sorter= with a TypeError and handles only a "
    "1D sorted_sequence",
)(_searchsorted)
override(
    torch.ops.aten.searchsorted.Scalar,
    why="torchax has no lowering; diffusers' DPMSolverMultistepScheduler.set_timesteps calls it",
)(_searchsorted)


# -- indexing and integer math -------------------------------------------------


def _concrete_bound(bound):
    # A tensor slice bound becomes a Python int, as torch's __index__ makes it.
    return int(bound.jax()) if isinstance(bound, torch.Tensor) else bound


@override(
    torch.Tensor.__getitem__,
    why="torchax keeps a tensor slice bound (x[:, :n], n a 0-d tensor) inside the View it returns, "
    "and using that View fails with 'torchax Tensors can only do math within the torchax "
    "environment'; BLT's entropy patcher slices this way",
    is_jax_function=False,
    is_view_op=True,
)
def _getitem(self, indexes):
    def concrete(index):
        if isinstance(index, slice):
            return slice(*(_concrete_bound(b) for b in (index.start, index.stop, index.step)))
        return index

    indexes = tuple(map(concrete, indexes)) if isinstance(indexes, tuple) else concrete(indexes)
    return _torchax_lowering(torch.Tensor.__getitem__)(self, indexes)


def _is_integer(x) -> bool:
    if isinstance(x, jax.Array):
        return jnp.issubdtype(x.dtype, jnp.integer)
    return isinstance(x, int) and not isinstance(x, bool)


@override(
    torch.ops.aten.pow,
    why="torchax raises integers to integer powers in float and casts back, which rounds past "
    "2**24, saturates instead of wrapping, and is wrong for negative exponents; BLT's rolling "
    "byte hash needs the exact, wrapping result",
)
def _pow(x, y):
    both_python = isinstance(x, int) and isinstance(y, int)
    if both_python or not (_is_integer(x) and _is_integer(y)):
        return _torchax_lowering(torch.ops.aten.pow)(x, y)
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


# -- convolution -----------------------------------------------------------------


@override(
    torch.ops.aten.convolution,
    why="torchax convolves in torch's channels-first layout; outside loops XLA's CPU backend converts "
    "that to channels-last itself, but inside a while loop (a whole diffusion loop) it keeps it and "
    "runs its generic convolution, 80x slower",
)
def _convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    # input: [N, C, *spatial] (or [C, *spatial]); weight: [O, C / groups, *kernel] -> [N, O, *spatial']
    if transposed:
        return _torchax_lowering(torch.ops.aten.convolution)(
            input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
        )
    spatial = weight.ndim - 2
    unbatched = input.ndim == spatial + 1
    if unbatched:
        input = input[None]
    # Channels last, explicitly, in and out of every convolution: XLA cancels the transposes
    # between neighbours, and convolves channels-last inside loops as well as outside.
    to_last = (0, *range(2, spatial + 2), 1)
    numbers = jax.lax.ConvDimensionNumbers(
        lhs_spec=(0, spatial + 1, *range(1, spatial + 1)),
        rhs_spec=(spatial + 1, spatial, *range(spatial)),
        out_spec=(0, spatial + 1, *range(1, spatial + 1)),
    )
    out = jax.lax.conv_general_dilated(
        jnp.transpose(input, to_last),
        jnp.transpose(weight, _kernel_order(weight.ndim)),  # [*kernel, C / groups, O]
        window_strides=tuple(stride),
        padding=[(p, p) for p in _per_dim(padding, spatial)],
        rhs_dilation=tuple(_per_dim(dilation, spatial)),
        dimension_numbers=numbers,
        feature_group_count=groups,
    )
    out = jnp.transpose(out, (0, spatial + 1, *range(1, spatial + 1)))
    if bias is not None:
        out = out + bias.reshape((1, -1) + (1,) * spatial)
    return out[0] if unbatched else out


def _kernel_order(ndim: int) -> tuple[int, ...]:
    # The axes of a torch weight [O, C / groups, *kernel] in the order XLA convolves with,
    # [*kernel, C / groups, O]; shared by the lowering and the weights held in that order,
    # whose two transposes XLA folds only while they agree.
    return (*range(2, ndim), 1, 0)


class _ChannelsLastWeight(torch.nn.Module):
    """A convolution weight held as [*kernel, C / groups, O], the order `_convolution` hands XLA;
    the module still reads torch's [O, C / groups, *kernel]."""

    def forward(self, stored):
        # stored: [*kernel, C / groups, O] -> [O, C / groups, *kernel]
        return stored.permute(*np.argsort(_kernel_order(stored.ndim)).tolist())

    def right_inverse(self, weight):
        # weight: [O, C / groups, *kernel] -> [*kernel, C / groups, O]
        return weight.permute(*_kernel_order(weight.ndim)).contiguous()


def store_convolutions_channels_last(module: torch.nn.Module) -> int:
    """Keeps each convolution weight of a torch module (on the CPU, not yet moved) channels-last.

    `_convolution` transposes its weight to [*kernel, C / groups, O] on every call; with the weight
    held in that order the two transposes cancel and XLA's CPU backend copies no weights per call
    (for a Stable Diffusion UNet, 65% of its parameters). Returns how many weights were re-held.
    """
    from torch.nn.utils import parametrize

    count = 0
    for conv in list(module.modules()):
        weight = getattr(conv, "weight", None)
        if (
            not isinstance(conv, torch.nn.modules.conv._ConvNd)
            or conv.transposed
            or parametrize.is_parametrized(conv, "weight")
            or not isinstance(weight, torch.Tensor)
            or isinstance(weight, _TorchaxTensor)
            or weight.device.type != "cpu"
        ):
            continue
        parametrize.register_parametrization(conv, "weight", _ChannelsLastWeight())
        count += 1
    return count


def _per_dim(values, count: int) -> list[int]:
    values = list(values)
    return values * count if len(values) == 1 else values


# -- linear layers ---------------------------------------------------------------

# Rows of activations (batch x tokens) for which `_linear` swaps the product's operands on
# the CPU. Measured on 12 768x3072 layers: 8 rows 3.4 vs 4.8 ms, 64 rows 10.5 vs 12.4 ms,
# 128 rows even, 512 rows 80 vs 65 ms (slower), 1 row 4.1 vs 2.1 ms (slower).
_SWAPPED_ROWS = range(2, 65)


def _linear(input, weight, bias=None):
    # input: [..., K]; weight: [N, K] (torch's layout); bias: [N] -> [..., N]
    rows = int(np.prod(input.shape[:-1], dtype=np.int64))
    if rows in _cpu_kernels.ROWS and weight.ndim == 2 and _cpu_kernels.usable(input, weight):  # decoding
        out = _cpu_kernels.rows_times_weight(input.reshape(rows, -1), weight).reshape(*input.shape[:-1], -1)
    elif weight.ndim == 2 and rows in _SWAPPED_ROWS and jax.default_backend() == "cpu":
        # XLA:CPU multiplies a few rows by a transposed [N, K] weight ~1.4x slower than it
        # multiplies the weight by a [K, rows] block; the barriers stop XLA from folding the
        # small transposes back into the product.
        block = jax.lax.optimization_barrier(input.reshape(rows, -1).T)  # [K, rows]
        out = jax.lax.optimization_barrier(weight @ block).T.reshape(*input.shape[:-1], -1)
    else:
        out = jnp.einsum("...k,nk->...n", input, weight)
    return out if bias is None else out + bias


_LINEAR_WHY = (
    "torchax multiplies activations by the transposed weight, which XLA:CPU runs ~1.4x slower "
    "than the swapped product for 2-64 rows (batched decoding)"
)
override(torch.nn.functional.linear, why=_LINEAR_WHY)(_linear)
override(torch.ops.aten.linear, why=_LINEAR_WHY)(_linear)


# -- attention -----------------------------------------------------------------


# Query rows per key/value head (query heads per group x query length) up to which `_sdpa`
# computes the scores as key @ query.T on the CPU, where hfjax's attention kernel does not
# run (not built, or not float32): decoding, where the 150M benchmark model has 3 rows.
# There, batch 8 spends 0.79 instead of 1.06 ms a token on the scores, and batch 1 no longer
# copies 12 transposed key caches a token.
_SWAPPED_SCORE_ROWS = 8


def _kernel_takes(query, key, value, attn_mask, rows: int) -> bool:
    """Whether hfjax's CPU attention kernel takes this attention: a few float32 query rows per
    key/value head (decoding), keys and values per sequence, a mask the same for every head."""
    batch = query.shape[:-3]
    return (
        rows in _cpu_kernels.QUERY_ROWS
        and key.shape[:-3] == batch
        and value.shape[:-3] == batch
        and (attn_mask is None or attn_mask.ndim < 3 or attn_mask.shape[-3] == 1)
        and _cpu_kernels.usable(query, key, value)
    )


def _kernel_attention(grouped, key, value, attn_mask, is_causal: bool, scale: float):
    # grouped: [..., Hkv, G, L, D] -> [..., Hkv, G, L, Dv]
    *batch, kv_heads, groups, length, depth = grouped.shape
    kv_length = key.shape[-2]
    sequences = int(np.prod(batch, dtype=np.int64))
    # One [L, S] bias per sequence, added to the scores: 0 where a query may look, -inf where not.
    allowed = jnp.tril(jnp.ones((length, kv_length), bool)) if is_causal else jnp.ones((length, kv_length), bool)
    bias = jnp.where(allowed, 0.0, -jnp.inf).astype(jnp.float32)
    if attn_mask is not None:
        mask = jnp.broadcast_to(attn_mask, (*batch, 1, length, kv_length)).reshape(sequences, length, kv_length)
        bias = jnp.where(mask, bias, -jnp.inf) if mask.dtype == jnp.bool_ else bias + mask.astype(jnp.float32)
    bias = jnp.broadcast_to(bias, (sequences, length, kv_length))
    # Keys and values go in squeezed, as the decode loop carries a batch of 1
    # (`_caches.squeezed`); in [1, H, S, D], XLA copied each cache layer into a second buffer
    # for the call on every token.
    query = grouped.reshape(sequences, kv_heads, groups * length, depth)
    out = _cpu_kernels.decode_attention(query, jnp.squeeze(key), jnp.squeeze(value), bias, scale)
    return out.reshape(*batch, kv_heads, groups, length, -1)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    # query: [..., Hq, L, D]; key: [..., Hkv, S, D]; value: [..., Hkv, S, Dv] -> [..., Hq, L, Dv]
    if dropout_p:
        raise NotImplementedError(
            f"scaled_dot_product_attention(dropout_p={dropout_p}): hfjax runs inference only; call model.eval()"
        )
    *batch, heads, length, depth = query.shape
    kv_heads, kv_length = key.shape[-3], key.shape[-2]
    if heads % kv_heads:
        raise ValueError(f"scaled_dot_product_attention: {heads} query heads do not divide into {kv_heads} key/value heads")
    groups = heads // kv_heads
    scale = 1.0 / float(np.sqrt(depth)) if scale is None else scale
    # Query heads are grouped over their key/value head, so shared keys are read once (no repeat).
    grouped = query.reshape(*batch, kv_heads, groups, length, depth)
    rows = groups * length
    if _kernel_takes(query, key, value, attn_mask, rows):
        # Decoding on the CPU: scores, softmax and values in one pass over each head's cache,
        # where XLA ran two small products through YNNPACK and seven fusions between them.
        out = _kernel_attention(grouped, key, value, attn_mask, is_causal, scale)
        return out.reshape(*batch, heads, length, value.shape[-1])
    if rows <= _SWAPPED_SCORE_ROWS and jax.default_backend() == "cpu":
        # Decoding: a few query rows per key/value head. XLA:CPU multiplies them by the keys
        # fastest as key @ query.T, reading the cache as it lies; query @ key.T transposed
        # every layer's keys on every token. The barriers keep the transposes out of the product.
        block = jax.lax.optimization_barrier(grouped.reshape(*batch, kv_heads, rows, depth))
        flipped = jnp.einsum("...hsd,...hrd->...hsr", key, block, preferred_element_type=jnp.float32)
        scores = jnp.swapaxes(jax.lax.optimization_barrier(flipped), -1, -2)
        scores = scores.reshape(*batch, kv_heads, groups, length, kv_length) * scale
    else:
        scores = jnp.einsum("...hgld,...hsd->...hgls", grouped, key, preferred_element_type=jnp.float32) * scale
    allowed = None
    if is_causal:
        allowed = jnp.tril(jnp.ones((length, kv_length), bool))
    if attn_mask is not None:
        mask = jnp.broadcast_to(attn_mask, (*batch, heads, length, kv_length))
        mask = mask.reshape(*batch, kv_heads, groups, length, kv_length)
        if mask.dtype == jnp.bool_:
            allowed = mask if allowed is None else allowed & mask
        else:
            scores = scores + mask.astype(jnp.float32)
    if allowed is not None:
        scores = jnp.where(allowed, scores, -jnp.inf)
    # A query that may attend to nothing (a padding row) gets zeros, as torch's softmax-safe path gives.
    top = jnp.max(scores, axis=-1, keepdims=True)
    exp = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(exp, axis=-1, keepdims=True)
    weights = exp / jnp.where(total > 0, total, 1.0)
    out = jnp.einsum("...hgls,...hsd->...hgld", weights.astype(value.dtype), value, preferred_element_type=jnp.float32)
    return out.reshape(*batch, heads, length, value.shape[-1]).astype(query.dtype)


_SDPA_WHY = (
    "torchax's reference attention gives NaN for a query that may attend to nothing (left padding "
    "makes such rows, and the NaN then spreads through the cache), where torch gives zeros; it also "
    "copies keys and values once per query head for grouped-query attention"
)
override(torch.nn.functional.scaled_dot_product_attention, why=_SDPA_WHY)(_sdpa)
override(torch.ops.aten.scaled_dot_product_attention, why=_SDPA_WHY)(_sdpa)


# -- cache updates ---------------------------------------------------------------


def _index_copy(x, dim, index, source):
    # x: any shape; index: [N] positions along `dim`; source: x's shape with N at `dim`.
    if x.ndim == 0:
        return source.reshape(())
    dim = dim % x.ndim
    # The update is made on x without its size-1 axes (a batch of 1): the shape in which the
    # decode loop carries the cache (`_caches.squeezed`) and XLA's attention product reads
    # it, so both read the buffer the update writes. Made on the full shape, XLA fused a second
    # copy of the update into the reshape the product reads, and copied every cache layer four
    # times per token.
    kept = [axis for axis, size in enumerate(x.shape) if size != 1 or axis == dim]
    squeezed = x.reshape([x.shape[axis] for axis in kept])
    update = source.reshape([source.shape[axis] for axis in kept])
    where = (slice(None),) * kept.index(dim) + (index.reshape(-1),)
    return squeezed.at[where].set(update).reshape(x.shape)


_INDEX_COPY_WHY = (
    "torchax decomposes index_copy_ (transformers' StaticCache.update) into a scatter on the full "
    "[B, H, S, D] cache; at batch 1 XLA then copies each cache layer four times per decoded token"
)
override(torch.ops.aten.index_copy, why=_INDEX_COPY_WHY)(_index_copy)
override(torch.ops.aten.index_copy_, why=_INDEX_COPY_WHY, is_jax_function=False, is_view_op=True)(
    op_base.InplaceOp(torch.ops.aten.index_copy)
)
