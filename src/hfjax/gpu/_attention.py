"""torch's scaled_dot_product_attention through cuDNN's fused attention, where asked for.

With HFJAX_GPU_ATTENTION=cudnn, the lowering hands the product to `jax.nn.dot_product_attention`
(cuDNN's flash attention kernels) where cuDNN takes its operands: float16 or bfloat16, a head size
that is a multiple of 8 up to 128, no mask or a boolean one (transformers' sdpa masks are boolean;
a float mask's -inf rows would need their own handling). Everything else, and every call without the switch, runs the
generic lowering (`bridge.attention`). As torch does, a query that may attend to nothing (a
left-padded prompt's padding) gets zeros. On another backend (a test on the CPU) the switch runs
the same call with XLA's implementation of it.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import torch

from .. import bridge

ATTENTION = "HFJAX_GPU_ATTENTION"
CHOICES = ("generic", "cudnn")
# The custom calls `jax.nn.dot_product_attention` lowers to on a GPU without dropout (forward, and backward
# for training). jax.export refuses to keep them on disk unless named, as they carry no compatibility
# guarantee; a stored program's key holds the library versions, so only the jax that wrote it reads it.
CUDNN_TARGETS = (
    "__cudnn$fmhaSoftmax", "__cudnn$fmhaScaleBiasSoftmax",
    "__cudnn$fmhaSoftmaxBackward", "__cudnn$fmhaScaleBiasSoftmaxBackward",
)  # fmt: skip


def choice() -> str:
    """The attention the switch asks for: "generic" (the default) or "cudnn"."""
    wanted = os.environ.get(ATTENTION, "generic")
    if wanted not in CHOICES:
        raise ValueError(f"{ATTENTION}={wanted!r}: pass one of {', '.join(CHOICES)}")
    return wanted


def fits_cudnn(query, key) -> bool:
    """Whether cuDNN's fused attention takes these operands ([B, H, L, D] query, [B, Hkv, S, D] key)."""
    depth = query.shape[-1]
    return (
        query.dtype in (jnp.bfloat16, jnp.float16)
        and key.dtype == query.dtype
        and depth % 8 == 0
        and depth <= 128
        and key.shape[-1] == depth
    )


def fused(query, key, value, attn_mask=None, is_causal=False, scale=None, *, implementation: str):
    """scaled_dot_product_attention of [B, H, L, D] operands (key and value both [B, Hkv, S, D], H a
    multiple of Hkv, attn_mask None or boolean) through `jax.nn.dot_product_attention`, which takes
    [B, L, H, D]."""
    batch, heads, length = query.shape[:3]
    full = (batch, heads, length, key.shape[2])
    mask = None if attn_mask is None else jnp.broadcast_to(attn_mask, full)
    out = jax.nn.dot_product_attention(
        jnp.swapaxes(query, 1, 2), jnp.swapaxes(key, 1, 2), jnp.swapaxes(value, 1, 2),
        mask=mask, scale=scale, is_causal=is_causal, implementation=implementation,
    )  # fmt: skip
    out = jnp.swapaxes(out, 1, 2)
    if mask is None:
        return out
    allowed = mask & jnp.tril(jnp.ones(full[2:], bool)) if is_causal else mask
    return jnp.where(jnp.any(allowed, axis=-1, keepdims=True), out, jnp.zeros((), out.dtype))


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    bridge.check_no_dropout(dropout_p)
    takes = query.ndim == 4 and key.ndim == 4 and value.shape == key.shape and query.shape[1] % key.shape[1] == 0
    takes = takes and (attn_mask is None or attn_mask.dtype == jnp.bool_)
    if choice() == "cudnn" and takes:
        if jax.default_backend() != "gpu":
            return fused(query, key, value, attn_mask, is_causal, scale, implementation="xla")
        if fits_cudnn(query, key):
            try:
                return fused(query, key, value, attn_mask, is_causal, scale, implementation="cudnn")
            except (ValueError, NotImplementedError, RuntimeError):
                pass  # shapes or a mask cuDNN refuses at trace time: the generic lowering below
    return bridge.attention(query, key, value, attn_mask, is_causal, scale)


_WHY = "cuDNN's fused attention kernels, where HFJAX_GPU_ATTENTION=cudnn asks for them"
bridge.override_op(torch.nn.functional.scaled_dot_product_attention, why=_WHY, backend="gpu")(_sdpa)
bridge.override_op(torch.ops.aten.scaled_dot_product_attention, why=_WHY, backend="gpu")(_sdpa)
