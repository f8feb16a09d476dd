"""Op lowerings that only help XLA:CPU, installed where the CPU hook is active (`backend="cpu"`).

- convolutions run channels-last, with weights held in that layout (`store_convolutions_channels_last`);
- a few rows times a Linear weight go to hfjax's kernel, or to a swapped product; a thin weight's
  gradient (LoRA's B) is taken as (input^T @ grad)^T, so that XLA transposes only small operands;
- decoding attention goes to hfjax's kernel, or computes its scores as key @ query.T; a prompt
  chunk's attention over a long cache runs in key blocks, only as far as its rows' last key;
- the static cache is updated without its size-1 axes, the layout the decode loop carries.

Each has a parity test against torch in tests/test_cpu.py.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torchax.ops import op_base
from torchax.tensor import Tensor as _TorchaxTensor

from ..bridge import attention, check_no_dropout, grouped_scores, override_op, torchax_lowering
from ..quantization import quantized_linear_jax
from . import _kernels

# -- convolution -----------------------------------------------------------------


@override_op(
    torch.ops.aten.convolution,
    backend="cpu",
    why="torchax convolves in torch's channels-first layout; outside loops XLA's CPU backend converts "
    "that to channels-last itself, but inside a while loop (a whole diffusion loop) it keeps it and "
    "runs its generic convolution, 80x slower",
)
def _convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    # input: [N, C, *spatial] (or [C, *spatial]); weight: [O, C / groups, *kernel] -> [N, O, *spatial']
    if transposed:
        return torchax_lowering(torch.ops.aten.convolution)(
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

# Rows of activations (batch x tokens) for which `_linear` swaps the product's operands, where
# the kernel does not take them; XLA:CPU runs the swapped product faster for 2-64 rows, even at
# 128 and slower from there and at 1 row (benchmarks/README.md).
_SWAPPED_ROWS = range(2, 65)


def _linear(input, weight, bias=None):
    # input: [..., K]; weight: [N, K] (torch's layout); bias: [N] -> [..., N]
    rows = int(np.prod(input.shape[:-1], dtype=np.int64))
    if rows in _kernels.ROWS and weight.ndim == 2 and _kernels.products_usable(input, weight):  # decoding
        out = _kernels.rows_times_weight(input.reshape(rows, -1), weight).reshape(*input.shape[:-1], -1)
    elif weight.ndim == 2 and rows in _SWAPPED_ROWS:
        # The barriers stop XLA from folding the small transposes back into the product.
        block = jax.lax.optimization_barrier(input.reshape(rows, -1).T)  # [K, rows]
        out = jax.lax.optimization_barrier(weight @ block).T.reshape(*input.shape[:-1], -1)
    elif weight.ndim == 2 and _thin_inner(rows, *weight.shape):
        out = _thin_product(input, weight)
    else:
        out = jnp.einsum("...k,nk->...n", input, weight)
    return out if bias is None else out + bias


def _thin_inner(rows: int, n: int, k: int) -> bool:
    # Whether transposing the input [rows, k] and the weight's gradient [k, n] moves fewer values
    # than transposing the output's gradient [rows, n]: a small k, such as a LoRA layer's B [n, r].
    return rows * n > rows * k + n * k


@jax.custom_vjp
def _thin_product(input, weight):
    return jnp.einsum("...k,nk->...n", input, weight)


def _thin_product_forward(input, weight):
    return _thin_product(input, weight), (input, weight)


def _thin_product_backward(saved, grad):
    # The weight's gradient grad^T @ input, computed as (input^T @ grad)^T: XLA:CPU then transposes
    # the small input and result, where for grad^T it transposed the whole output gradient, inside
    # the fusion of the elementwise ops that produce it (strided writes: ~40 ms per LoRA B of a
    # [512, 3072] MLP projection). The barrier keeps XLA from turning the product back around.
    input, weight = saved
    flipped = jax.lax.optimization_barrier(jnp.einsum("...k,...n->kn", input, grad))
    return jnp.einsum("...n,nk->...k", grad, weight), flipped.T


_thin_product.defvjp(_thin_product_forward, _thin_product_backward)


_LINEAR_WHY = (
    "a few rows (decoding) run in hfjax's kernel, which reads each weight once; without it, "
    "XLA:CPU multiplies 2-64 rows by a transposed [N, K] weight ~1.4x slower than the swapped product; "
    "a thin weight's gradient (LoRA's B) transposes its small operands, not the output's gradient"
)
override_op(torch.nn.functional.linear, why=_LINEAR_WHY, backend="cpu")(_linear)
override_op(torch.ops.aten.linear, why=_LINEAR_WHY, backend="cpu")(_linear)


# -- quantized linear layers (hfjax.quantization) --------------------------------


def _quantized_linear(x, weight, scale, zero, bias, mode, rows_per_scale, columns_per_scale):
    # x: [..., K]; weight: int8 / e4m3 [N, K] or packed 4-bit [N, K / 2] -> [..., N]
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    if (
        rows in _kernels.ROWS
        and _kernels.products_usable(x)
        and _kernels.quantized_usable(x, weight, columns_per_scale)
    ):
        flat = x.reshape(rows, -1)
        out = _kernels.rows_times_quantized(flat, weight, scale, zero, rows_per_scale, columns_per_scale)
        out = out.reshape(*x.shape[:-1], -1)
        return out if bias is None else out + bias.astype(out.dtype)
    per_channel = rows_per_scale == 1 and columns_per_scale >= x.shape[-1]
    if rows in _kernels.ROWS and per_channel and mode == "int8" and x.dtype == jnp.float32:
        # Without the kernel: products summed as one reduction, which XLA:CPU fuses with the int8
        # weight's conversion; its dot converts the whole weight into a float32 copy first (~15x slower).
        flat = x.reshape(rows, 1, -1)  # [R, 1, K]
        out = jnp.sum(weight.astype(jnp.float32)[None] * flat, axis=-1)  # [R, N]
        if zero is not None:
            out = out - jnp.sum(flat, axis=-1) * zero[:, 0]
        out = (out * scale[:, 0]).reshape(*x.shape[:-1], -1)
        return out if bias is None else out + bias.astype(out.dtype)
    return quantized_linear_jax(x, weight, scale, zero, bias, mode, rows_per_scale, columns_per_scale)


override_op(
    torch.ops.hfjax.quantized_linear,
    backend="cpu",
    why="a few rows (decoding) times a quantized weight run in hfjax's kernel, which reads the weight as "
    "stored (1/4 or 1/8 of float32's bytes) and converts it in registers; XLA:CPU converts the whole "
    "weight to float32 in memory first, on every call",
)(_quantized_linear)


# -- attention -----------------------------------------------------------------

# Query rows per key/value head (query heads per group x query length) up to which scores are
# computed as key @ query.T where the kernel does not run: decoding. XLA:CPU then reads the
# cache as it lies, where query @ key.T transposed every layer's keys on every token.
_SWAPPED_SCORE_ROWS = 8


def _swapped_scores(grouped, key):
    # grouped: [..., Hkv, G, L, D]; key: [..., Hkv, S, D] -> [..., Hkv, G, L, S]
    *batch, kv_heads, groups, length, depth = grouped.shape
    block = jax.lax.optimization_barrier(grouped.reshape(*batch, kv_heads, groups * length, depth))
    flipped = jnp.einsum("...hsd,...hrd->...hsr", key, block, preferred_element_type=jnp.float32)
    scores = jnp.swapaxes(jax.lax.optimization_barrier(flipped), -1, -2)
    return scores.reshape(*batch, kv_heads, groups, length, key.shape[-2])


def _kernel_takes(query, key, value, attn_mask, rows: int) -> bool:
    """Whether the attention kernel takes this attention: a few float32 query rows per key/value
    head (decoding), keys and values per sequence (or a slot cache read in place: `_in_place`), a
    mask the same for every head."""
    batch = query.shape[:-3]
    return (
        rows in _kernels.QUERY_ROWS
        and (key.shape[:-3] == batch or _in_place(query, key, attn_mask))
        and value.shape[:-3] == key.shape[:-3]
        and (attn_mask is None or attn_mask.ndim < 3 or attn_mask.shape[-3] == 1)
        and _kernels.usable(query, key, value)
    )


def _kernel_attention(grouped, key, value, attn_mask, is_causal: bool, scale: float):
    # grouped: [..., Hkv, G, L, D] -> [..., Hkv, G, L, Dv]
    *batch, kv_heads, groups, length, depth = grouped.shape
    kv_length = attn_mask.shape[-1] if _in_place(grouped, key, attn_mask) else key.shape[-2]  # columns read
    sequences = int(np.prod(batch, dtype=np.int64))
    # One [L, S] bias per sequence, added to the scores: 0 where a query may look, -inf where not.
    allowed = jnp.tril(jnp.ones((length, kv_length), bool)) if is_causal else jnp.ones((length, kv_length), bool)
    bias = jnp.where(allowed, 0.0, -jnp.inf).astype(jnp.float32)
    if attn_mask is not None:
        mask = jnp.broadcast_to(attn_mask, (*batch, 1, length, kv_length)).reshape(sequences, length, kv_length)
        bias = jnp.where(mask, bias, -jnp.inf) if mask.dtype == jnp.bool_ else bias + mask.astype(jnp.float32)
    bias = jnp.broadcast_to(bias, (sequences, length, kv_length))
    # Keys and values go in squeezed, as the decode loop carries a batch of 1 (`Cpu.loop_carry`);
    # in [1, H, S, D], XLA copied each cache layer into a second buffer for the call on every token.
    query = grouped.reshape(sequences, kv_heads, groups * length, depth)
    # Each row's columns where the slot decode's step says (its rows' cache read in place, or, when the
    # chunk has every row and column, as it is); else the kernel's wrapper finds them in the bias.
    (used,) = _READING_IN_PLACE.get() or (None,)
    if used is not None and used.shape != (sequences,):
        used = None
    out = _kernels.decode_attention(query, jnp.squeeze(key), jnp.squeeze(value), bias, scale, key.shape[-2], used)
    return out.reshape(*batch, kv_heads, groups, length, -1)


# Keys per block of the blocked attention, and the fewest keys it takes: below that, one pass's
# scores fit the caches and no column is past a row's length often enough to pay for the loop.
_KEY_BLOCK = 512
_BLOCKED_LEAST_KEYS = 2048


def _blocked_takes(query, key, attn_mask, is_causal: bool, rows: int) -> bool:
    """Whether attention runs in key blocks (`_blocked_attention`): many query rows per key/value head
    (a prompt's chunk, not decoding) over a long cache, under a boolean mask the same for every head."""
    kv_length = key.shape[-2]
    return (
        rows > _SWAPPED_SCORE_ROWS
        and not is_causal
        and kv_length >= _BLOCKED_LEAST_KEYS
        and kv_length % _KEY_BLOCK == 0
        and attn_mask is not None
        and attn_mask.dtype == jnp.bool_
        and attn_mask.ndim >= 3
        and attn_mask.shape[-3] == 1
        and attn_mask.shape[-1] == kv_length
    )


def _blocked_attention(query, key, value, attn_mask, scale):
    """torch's attention with a boolean mask, over the keys in blocks of _KEY_BLOCK with a running
    softmax, and only as far as the last key any query may see: a prompt chunk's cost follows its
    rows' lengths, not the cache's width, and no [queries, keys] score matrix of the whole cache is
    ever written.

    query [..., Hq, L, D]; key [..., Hkv, S, D]; value [..., Hkv, S, Dv]; attn_mask bool [..., 1, L, S].
    A query that may see nothing gets zeros, as `attention` gives."""
    *batch, heads, length, depth = query.shape
    kv_heads, kv_length = key.shape[-3], key.shape[-2]
    grouped = query.reshape(*batch, kv_heads, heads // kv_heads, length, depth)
    mask = jnp.broadcast_to(attn_mask, (*batch, 1, length, kv_length))[..., None, :, :]  # [..., 1, 1, L, S]
    seen = jnp.any(mask, axis=tuple(range(mask.ndim - 1)))  # [S]: a column some query may see
    last = jnp.max(jnp.where(seen, jnp.arange(kv_length), -1))
    blocks = (last + _KEY_BLOCK) // _KEY_BLOCK
    shape = (*batch, kv_heads, heads // kv_heads, length)

    def attend(carry, i):
        top, total, out = carry
        start = i * _KEY_BLOCK
        keys = jax.lax.dynamic_slice_in_dim(key, start, _KEY_BLOCK, axis=-2)
        values = jax.lax.dynamic_slice_in_dim(value, start, _KEY_BLOCK, axis=-2)
        allowed = jax.lax.dynamic_slice_in_dim(mask, start, _KEY_BLOCK, axis=-1)
        logits = grouped_scores(grouped, keys) * scale
        logits = jnp.where(allowed, logits, -jnp.inf)
        now = jnp.maximum(top, jnp.max(logits, axis=-1))
        shift = jnp.where(jnp.isfinite(now), now, 0.0)
        exp = jnp.exp(logits - shift[..., None])
        kept = jnp.exp(top - shift)  # what the blocks before weigh against the new top (0 where none)
        part = jnp.einsum(
            "...hgls,...hsd->...hgld", exp.astype(value.dtype), values, preferred_element_type=jnp.float32
        )
        return now, total * kept + jnp.sum(exp, axis=-1), out * kept[..., None] + part

    def block(carry, i):  # a block past the last key any query sees is skipped (a scan, not a while
        # loop, so that gradients flow through it: training on long sequences takes this path too)
        return jax.lax.cond(i < blocks, attend, lambda carry, i: carry, carry, i), None

    start = (
        jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, value.shape[-1]), jnp.float32),
    )  # fmt: skip
    (_, total, out), _ = jax.lax.scan(block, start, jnp.arange(kv_length // _KEY_BLOCK))
    out = out / jnp.where(total > 0, total, 1.0)[..., None]
    return out.reshape(*batch, heads, length, value.shape[-1]).astype(query.dtype)


_READING_IN_PLACE = contextvars.ContextVar("hfjax_reading_in_place", default=None)


@contextlib.contextmanager
def reading_in_place(columns=None):
    """While traced in it, attention takes keys and values of a slot cache read in place (`_in_place`;
    `Cpu.attention_in_place`, the slot decode's step). columns [B] int32, where given: how many of
    its columns each row's queries may read at most (the mask hides every key past them), so that
    the kernel stops there without looking for the last one in the mask, layer after layer."""
    token = _READING_IN_PLACE.set((columns,))
    try:
        yield
    finally:
        _READING_IN_PLACE.reset(token)


def _in_place(query, key, attn_mask) -> bool:
    """Whether `key` is a slot cache read in place (in `reading_in_place`): [B', Hkv, K, D] beside
    queries [B, Hq, L, D] (or grouped [B, Hkv, G, L, D]) and a mask [B, 1, L, S], with more rows
    (B' > B) or more columns (K > S) than the queries read, which are its leading ones. (torch
    would broadcast a query batch of 1 over the keys' rows instead: the context tells them apart.)"""
    columns = key.shape[-2] if attn_mask is None else attn_mask.shape[-1]
    return (
        _READING_IN_PLACE.get() is not None and key.ndim == 4 and query.ndim >= 4 and key.shape[0] >= query.shape[0]
        and (key.shape[0] > query.shape[0] or columns < key.shape[-2])
    )  # fmt: skip


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    # query: [..., Hq, L, D]; key: [..., Hkv, S, D]; value: [..., Hkv, S, Dv] -> [..., Hq, L, Dv]
    # (or key and value [B', Hkv, K, D], a slot cache whose leading rows and columns are read: `_in_place`)
    check_no_dropout(dropout_p)
    *batch, heads, length, depth = query.shape
    kv_heads = key.shape[-3]
    rows = heads // kv_heads * length if heads % kv_heads == 0 else 0
    scale = 1.0 / float(np.sqrt(depth)) if scale is None else scale
    if rows and _kernel_takes(query, key, value, attn_mask, rows):
        grouped = query.reshape(*batch, kv_heads, heads // kv_heads, length, depth)
        out = _kernel_attention(grouped, key, value, attn_mask, is_causal, scale)
        return out.reshape(*batch, heads, length, value.shape[-1])
    if _in_place(query, key, attn_mask):  # the kernel does not take it: those rows and columns, sliced out
        columns = key.shape[-2] if attn_mask is None else attn_mask.shape[-1]
        key, value = key[: query.shape[0], :, :columns], value[: query.shape[0], :, :columns]
    if rows and _blocked_takes(query, key, attn_mask, is_causal, rows):
        return _blocked_attention(query, key, value, attn_mask, scale)
    scores = _swapped_scores if 0 < rows <= _SWAPPED_SCORE_ROWS else grouped_scores
    return attention(query, key, value, attn_mask, is_causal, scale, scores=scores)


_SDPA_WHY = (
    "decoding attention (a few query rows per key/value head) runs in hfjax's kernel, scores, "
    "softmax and values in one pass over the cache; without it, the scores as key @ query.T"
)
override_op(torch.nn.functional.scaled_dot_product_attention, why=_SDPA_WHY, backend="cpu")(_sdpa)
override_op(torch.ops.aten.scaled_dot_product_attention, why=_SDPA_WHY, backend="cpu")(_sdpa)


# -- cache updates ---------------------------------------------------------------


def _index_copy(x, dim, index, source):
    # x: any shape; index: [N] positions along `dim`; source: x's shape with N at `dim`.
    if x.ndim == 0:
        return source.reshape(())
    dim = dim % x.ndim
    # The update is made on x without its size-1 axes (a batch of 1): the shape in which the
    # decode loop carries the cache (`Cpu.loop_carry`) and XLA's attention product reads
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
override_op(torch.ops.aten.index_copy, why=_INDEX_COPY_WHY, backend="cpu")(_index_copy)
override_op(torch.ops.aten.index_copy_, why=_INDEX_COPY_WHY, backend="cpu", is_jax_function=False, is_view_op=True)(
    op_base.InplaceOp(torch.ops.aten.index_copy)
)
