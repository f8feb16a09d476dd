"""Calls into hfjax's CPU kernels for decoding (`_kernels.cc`), as XLA FFI custom calls.

Decoding multiplies a few rows of activations (one per sequence) by every Linear weight, and
attends with one new token per sequence over the cache. XLA:CPU gives the small products to a
general matrix-multiply library that packs a weight into tiles first, and runs attention as two
such products with seven fusions between them. The kernels read a weight once, straight
through, and attend in one pass over the cache; their own helper threads start each product on
every core at once (benchmarks/README.md has the figures).

They are used once `_build.build()` has loaded them (at load time, never inside a trace), for
float32 arrays on a single CPU device: a custom call cannot be partitioned over a mesh.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..quantization import Layout, dequantize_jax
from . import _build

PRODUCT, ATTENTION, QUANTIZED_PRODUCT = _build.TARGETS
ROWS = range(1, 9)  # activation rows the product takes (batch x new tokens)
QUERY_ROWS = range(1, 9)  # query rows per key/value head that attention takes (heads per group x tokens)


def usable(*arrays) -> bool:
    """Whether the kernels take float32 `arrays` here: loaded, on a single CPU device."""
    return (
        all(a.dtype == jnp.float32 for a in arrays)
        and _build.built() is not None
        and jax.default_backend() == "cpu"
        and jax.device_count() == 1
    )


def products_usable(*arrays) -> bool:
    """Whether the row products take float32 `arrays` here: `usable`, on a CPU whose products run
    (`_build.products`: AVX-512, or AVX2 where asked)."""
    return usable(*arrays) and _build.products()


def quantized_usable(rows: jax.Array, weight: jax.Array, columns_per_scale: int) -> bool:
    """Whether the quantized kernel takes rows [R, K] (float32) times this stored weight: int8,
    float8 e4m3 or packed 4-bit, with K and the inputs per scale multiples of 32."""
    k = rows.shape[-1]
    group = min(columns_per_scale, k)
    return (
        weight.ndim == 2
        and weight.dtype in (jnp.int8, jnp.uint8, jnp.float8_e4m3fn)
        and k % 32 == 0
        and group % 32 == 0
        and k % group == 0
        and usable(rows)
    )


# The kernels compute forward values only; their gradients (a training step on a few rows) are
# those of the same operations written in jnp, which XLA runs.


@jax.custom_vjp
def rows_times_weight(rows: jax.Array, weight: jax.Array) -> jax.Array:
    """rows [R, K] @ weight [N, K].T -> [R, N] for R <= 8, float32, through the kernel."""
    result = jax.ShapeDtypeStruct((rows.shape[0], weight.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(PRODUCT, result, vmap_method="sequential")(rows, weight)


def _product_forward(rows, weight):
    return rows_times_weight(rows, weight), (rows, weight)


def _product_backward(saved, grad):
    rows, weight = saved
    return grad @ weight, grad.T @ rows


rows_times_weight.defvjp(_product_forward, _product_backward)


def decode_attention(query, key, value, bias, scale: float, key_length: int | None = None, used=None) -> jax.Array:
    """Attention of a few query rows per key/value head, float32, through the kernel.

    query [B, H, R, D] (R in QUERY_ROWS); key and value [B', H, K, D] and [B', H, K, Dv] in any
    shape with those elements (the decode loop carries a batch of 1 without its size-1 axes,
    and reshaping it back would make XLA copy the cache); bias [B, L, S], added to the scores
    of query row r from its row r % L (-inf where a row may not look) -> [B, H, R, Dv]. Sequence
    b reads row b of key and value, its first S columns: K is `key_length` (default S) and
    B' >= B, so a slot cache's leading rows and columns are read where they lie, not sliced out.

    used [B] int32: how many columns of each sequence to read, at least up to the last one where
    some row's bias is above -inf (past it every weight is exactly 0), so that the kernel's cost
    follows the sequences' lengths, not the bias's width. Default: found from the bias
    (`used_columns`), a pass over it per call; a caller that knows it (the slot decode: each row's
    position + 1, the same for every layer) saves that pass.
    """
    used = used_columns(bias) if used is None else jnp.asarray(used, jnp.int32)  # (the kernel keeps it within S)
    return _attention(query, key, value, bias, used, scale, key_length)


def used_columns(bias) -> jax.Array:
    """[B] int32: for bias [B, L, S], the columns up to the last one where some row's bias is above -inf."""
    columns = jnp.arange(1, bias.shape[-1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(bias > -jnp.inf, columns, 0), axis=(1, 2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(query, key, value, bias, used, scale: float, key_length: int | None) -> jax.Array:
    batch, heads, rows, depth = query.shape
    key_length = bias.shape[-1] if key_length is None else key_length
    key_rows = key.size // (heads * key_length * depth)
    value_depth = value.size // (key_rows * heads * key_length)
    result = jax.ShapeDtypeStruct((batch, heads, rows, value_depth), jnp.float32)
    return jax.ffi.ffi_call(ATTENTION, result, vmap_method="sequential")(
        query, key, value, bias, used, scale=np.float32(scale), key_length=np.int64(key_length)
    )


def _attention_in_jnp(query, key, value, bias, scale: float, key_length: int | None) -> jax.Array:
    """What the attention kernel computes, in jnp (for its gradient)."""
    batch, heads, rows, depth = query.shape
    slots = bias.shape[-1]
    key_length = slots if key_length is None else key_length
    key_rows = key.size // (heads * key_length * depth)
    key = key.reshape(key_rows, heads, key_length, depth)[:batch, :, :slots]
    value = value.reshape(key_rows, heads, key_length, -1)[:batch, :, :slots]
    row_bias = bias[:, np.arange(rows) % bias.shape[1]]  # [B, R, S]
    scores = jnp.einsum("bhrd,bhsd->bhrs", query, key) * scale + row_bias[:, None]
    return jnp.einsum("bhrs,bhsv->bhrv", jax.nn.softmax(scores, axis=-1), value)


def _attention_forward(query, key, value, bias, used, scale, key_length):
    return _attention(query, key, value, bias, used, scale, key_length), (query, key, value, bias, used)


def _attention_backward(scale, key_length, saved, grad):
    *arrays, used = saved
    _, pullback = jax.vjp(lambda *arrays: _attention_in_jnp(*arrays, scale, key_length), *arrays)
    return (*pullback(grad), np.zeros(used.shape, jax.dtypes.float0))  # `used` is a count: no gradient


_attention.defvjp(_attention_forward, _attention_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def rows_times_quantized(rows, weight, scale, zero, rows_per_scale: int, columns_per_scale: int) -> jax.Array:
    """rows [R, K] @ W.T -> [R, N] for R <= 8, float32, through the kernel, where W [N, K] is held
    quantized (hfjax.quantization's Layout): weight int8 / e4m3 [N, K] or packed 4-bit uint8
    [N, K / 2]; scale and zero float32 [ceil(N / rows_per_scale), K / columns_per_scale], zero None
    where there are no zero points."""
    result = jax.ShapeDtypeStruct((rows.shape[0], weight.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(QUANTIZED_PRODUCT, result, vmap_method="sequential")(
        rows, weight, scale, scale if zero is None else zero,
        rows_per_scale=np.int64(rows_per_scale), columns_per_scale=np.int64(columns_per_scale),
        has_zero=np.int64(zero is not None),
    )  # fmt: skip


def _quantized_forward(rows, weight, scale, zero, rows_per_scale, columns_per_scale):
    out = rows_times_quantized(rows, weight, scale, zero, rows_per_scale, columns_per_scale)
    return out, (weight, scale, zero)


def _quantized_backward(rows_per_scale, columns_per_scale, saved, grad):
    # The rows' gradient only (QLoRA trains adapters beside the frozen quantized weight), in jnp.
    weight, scale, zero = saved
    mode = {jnp.dtype(jnp.int8): "int8", jnp.dtype(jnp.uint8): "int4"}.get(weight.dtype, "fp8")
    layout = Layout(mode, rows_per_scale, columns_per_scale, zero is not None)
    return grad @ dequantize_jax(weight, scale, zero, layout, jnp.float32), None, None, None


rows_times_quantized.defvjp(_quantized_forward, _quantized_backward)
