"""`QuantizedLinear`: a torch Linear layer whose parameters are the quantized weight and its scales.

Its forward is one torch op, `torch.ops.hfjax.quantized_linear`, so that every program hfjax
traces (forward, prefill, decode loops, beams, the server's slots, a training step) runs it
unchanged. The op has three implementations:

- in PyTorch (eager torch, peft, references): the weight dequantized, then `F.linear`;
- in JAX (`quantized_linear_jax`, the generic lowering, on every backend): the same, written so
  that XLA fuses the conversion and scaling into the product where the backend can (per-channel
  scales are applied to the product's output, not to the weight);
- on XLA:CPU, the CPU package's kernels where they take the layout (registered there with
  `override_op(..., backend="cpu")`).

A `QuantizedLinear` is a `torch.nn.Linear` (in_features, out_features, bias), so peft wraps it in
its LoRA layers, and `hfjax.parallel` splits its weight as a Linear's; `sharded_like` tells the
sharding plan that the scales and zero points split as the weight does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..bridge import override_op
from ._schemes import Layout

_TORCH_DTYPES = {
    np.dtype(np.int8): torch.int8,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.int32): torch.int32,
}


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype that quantized layers hold (float8_e4m3fn included)."""
    dtype = np.dtype(dtype)
    if dtype.name == "float8_e4m3fn":
        return torch.float8_e4m3fn
    return _TORCH_DTYPES[dtype]


# ---- the op ----------------------------------------------------------------------


@torch.library.custom_op("hfjax::quantized_linear", mutates_args=())
def quantized_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
    mode: str,
    rows_per_scale: int,
    columns_per_scale: int,
) -> torch.Tensor:
    """x [..., K] times the weight [N, K] that (weight, scale, zero) hold (see `Layout`), plus bias -> [..., N]."""
    layout = Layout(mode, rows_per_scale, columns_per_scale, zero is not None)  # type: ignore[arg-type]
    w = dequantize_torch(weight, scale, zero, layout).to(x.dtype)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


@quantized_linear.register_fake
def _quantized_linear_shape(x, weight, scale, zero, bias, mode, rows_per_scale, columns_per_scale):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _quantized_linear_backward(ctx, grad):
    # The gradient of the input only: the quantized weights are frozen (QLoRA trains adapters beside them).
    w = dequantize_torch(*ctx.saved_tensors, ctx.layout).to(grad.dtype)
    return grad @ w, None, None, None, None, None, None, None


def _quantized_linear_save(ctx, inputs, output):
    _, weight, scale, zero, _, mode, rows, columns = inputs
    ctx.layout = Layout(mode, rows, columns, zero is not None)
    ctx.save_for_backward(weight, scale, zero)


quantized_linear.register_autograd(_quantized_linear_backward, setup_context=_quantized_linear_save)


def dequantize_torch(
    weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, layout: Layout
) -> torch.Tensor:
    """The float32 weight [N, K] that quantized torch tensors stand for."""
    if layout.mode == "int4":
        q = torch.stack([weight & 0xF, weight >> 4], dim=-1).reshape(weight.shape[0], -1)  # [N, K]
    else:
        q = weight
    q = q.to(torch.float32)
    n, k = q.shape

    def spread(grid):  # [N / r, K / c] -> [N, K]
        grid = grid.to(torch.float32).repeat_interleave(layout.rows_per_scale, 0)
        return grid.repeat_interleave(layout.columns_per_scale, 1)[:n, :k]

    if zero is not None:
        q = q - spread(zero)
    return q * spread(scale)


# ---- the generic lowering (JAX) ------------------------------------------------------


def unpack_jax(weight: jax.Array, layout: Layout) -> jax.Array:
    """The stored weight as integers or floats [N, K] (4-bit values unpacked), not yet scaled."""
    if layout.mode != "int4":
        return weight
    return jnp.stack([weight & 0xF, weight >> 4], axis=-1).reshape(weight.shape[0], -1)  # [N, K] uint8


def dequantize_jax(weight: jax.Array, scale: jax.Array, zero: jax.Array | None, layout: Layout, dtype) -> jax.Array:
    """The weight [N, K] in `dtype`: unpacked, less its zero points, times its scales (float32 math)."""
    q = unpack_jax(weight, layout).astype(jnp.float32)
    n, k = q.shape
    r, c = layout.rows_per_scale, layout.columns_per_scale
    if n % r == 0 and k % c == 0:
        cells = q.reshape(n // r, r, k // c, c)  # the scale broadcast over each cell, which XLA fuses
        if zero is not None:
            cells = cells - zero.astype(jnp.float32)[:, None, :, None]
        return (cells * scale.astype(jnp.float32)[:, None, :, None]).reshape(n, k).astype(dtype)

    def spread(grid):  # cells cut by the weight's edge
        return jnp.repeat(jnp.repeat(grid.astype(jnp.float32), r, axis=0), c, axis=1)[:n, :k]

    if zero is not None:
        q = q - spread(zero)
    return (q * spread(scale)).astype(dtype)


def quantized_linear_jax(x, weight, scale, zero, bias, mode, rows_per_scale, columns_per_scale):
    """`torch.ops.hfjax.quantized_linear` in JAX: x [..., K] -> [..., N] in x's dtype."""
    layout = Layout(mode, rows_per_scale, columns_per_scale, zero is not None)
    k = x.shape[-1]
    if rows_per_scale == 1 and columns_per_scale >= k:
        # One scale per output channel: (x @ q.T - zero * sum(x)) * scale, the scale applied to
        # the product's [.., N] output rather than to the [N, K] weight.
        q = unpack_jax(weight, layout).astype(x.dtype)
        out = jnp.einsum("...k,nk->...n", x, q, preferred_element_type=jnp.float32)
        if zero is not None:
            out = out - jnp.sum(x, axis=-1, keepdims=True, dtype=jnp.float32) * zero[:, 0].astype(jnp.float32)
        out = out * scale[:, 0].astype(jnp.float32)
    else:
        w = dequantize_jax(weight, scale, zero, layout, x.dtype)
        out = jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32)
    out = out.astype(x.dtype)
    return out if bias is None else out + bias.astype(x.dtype)


override_op(
    torch.ops.hfjax.quantized_linear,
    why="hfjax's own op (QuantizedLinear): the weight dequantized inside the program, where XLA fuses it",
)(quantized_linear_jax)


# ---- the module ------------------------------------------------------------------


class QuantizedLinear(torch.nn.Linear):
    """A Linear layer [out_features, in_features] held quantized (`Layout`): parameters `weight`,
    `weight_scale`, `weight_zero` (where the layout has zero points) and `bias`, all frozen but the
    bias; `input_order` (int32 [K]) where the checkpoint's groups follow a permutation of the inputs
    (GPTQ's act-order), which the layer applies to its input first.

    Built on the meta device, as the loader's skeletons are; the loader fills in the tensors.
    """

    # The sharding plan splits these as it splits `weight` (hfjax.parallel).
    sharded_like = {"weight_scale": "weight", "weight_zero": "weight"}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        layout: Layout,
        *,
        bias: bool,
        compute_dtype: torch.dtype = torch.float32,
        input_order: bool = False,
        device: str | torch.device = "meta",
    ):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features, self.layout = in_features, out_features, layout
        self.compute_dtype = compute_dtype  # peft gives LoRA adapters this dtype
        for name, (shape, dtype) in layout.shapes(out_features, in_features).items():
            tensor = torch.nn.Parameter(
                torch.empty(shape, dtype=torch_dtype(dtype), device=device), requires_grad=False
            )
            self._parameters[name] = tensor  # "weight" directly: the class's `weight` is the float weight
        if not layout.zero:
            self.register_parameter("weight_zero", None)
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=compute_dtype, device=device))
        else:
            self.register_parameter("bias", None)
        order = torch.empty(in_features, dtype=torch.int32, device=device) if input_order else None
        self.register_buffer("input_order", order)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.input_order is not None:
            input = input.index_select(-1, self.input_order)
        layout = self.layout
        return torch.ops.hfjax.quantized_linear(
            input, self._parameters["weight"], self.weight_scale, self.weight_zero, self.bias,
            layout.mode, layout.rows_per_scale, layout.columns_per_scale,
        )  # fmt: skip

    @property
    def weight(self) -> torch.Tensor:
        """The float weight [out_features, in_features] in the compute dtype, dequantized: what model
        code that reads a layer's `.weight` itself expects (Mamba's `dt_proj.weight @ x`, casts to
        `lm_head.weight.dtype`). The quantized tensor is the parameter named "weight"."""
        weight = dequantize_torch(self._parameters["weight"], self.weight_scale, self.weight_zero, self.layout)
        if self.input_order is not None:  # back to the order of the inputs the layer is called with
            weight = torch.empty_like(weight).index_copy_(1, self.input_order.long(), weight)
        return weight.to(self.compute_dtype)

    def extra_repr(self) -> str:
        layout = self.layout
        scales = "per output channel" if layout.columns_per_scale >= self.in_features and layout.rows_per_scale == 1 else (
            f"per {layout.rows_per_scale} x {layout.columns_per_scale} block"
        )  # fmt: skip
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"{layout.mode}, scales {scales}{', zero points' if layout.zero else ''}"
        )
