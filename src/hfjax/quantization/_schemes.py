"""How a quantized weight is held (`Layout`), and the host-side quantizers of `hfjax.load(quantize=...)`.

Every quantized linear layer holds, whatever the checkpoint it came from:

    weight        int8 [N, K] ("int8"), float8_e4m3fn [N, K] ("fp8"), or uint8 [N, K / 2] ("int4":
                  two 4-bit values 0..15 per byte, input feature 2i in the low half, 2i + 1 in the high)
    weight_scale  float32 [ceil(N / rows_per_scale), ceil(K / columns_per_scale)]
    weight_zero   float32, the scale's shape, where the layout has zero points (int4 groups; GPTQ, AWQ)

and stands for the float weight W[n, k] = (q[n, k] - zero[n // r, k // c]) * scale[n // r, k // c],
with r = rows_per_scale and c = columns_per_scale: a scale per output channel is (1, K), groups of
128 along the input are (1, 128), 128 x 128 blocks are (128, 128).

The quantizers run in numpy on one tensor at a time, as the loader reads it (so loading never holds
more than the quantized model plus one float tensor).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import ml_dtypes
import numpy as np

Mode = Literal["int8", "fp8", "int4"]
MODES: tuple[str, ...] = Mode.__args__
GROUP_SIZE = 128  # int4: input features per scale
FP8_BLOCK = (128, 128)  # fp8 with blocks: (output, input) features per scale
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
_STORED = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn), "int4": np.dtype(np.uint8)}


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one linear layer's weight is held (see the module's docstring)."""

    mode: Mode
    rows_per_scale: int  # output features that share a scale
    columns_per_scale: int  # input features that share a scale
    zero: bool = False  # whether the layer holds zero points

    def shapes(self, out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """{tensor name: (shape, numpy dtype)} of a layer [out_features, in_features] held this way."""
        columns = in_features // 2 if self.mode == "int4" else in_features
        grid = (math.ceil(out_features / self.rows_per_scale), math.ceil(in_features / self.columns_per_scale))
        shapes = {"weight": ((out_features, columns), _STORED[self.mode]), "weight_scale": (grid, np.dtype(np.float32))}
        if self.zero:
            shapes["weight_zero"] = (grid, np.dtype(np.float32))
        return shapes

    def nbytes(self, out_features: int, in_features: int) -> int:
        """Bytes the layer's quantized tensors take."""
        return sum(
            math.prod(shape) * dtype.itemsize for shape, dtype in self.shapes(out_features, in_features).values()
        )


def layout_for(mode: Mode, out_features: int, in_features: int, *, group_size: int = GROUP_SIZE) -> Layout | None:
    """The layout `hfjax.load(quantize=mode)` gives a layer [out_features, in_features], or None
    where the mode cannot hold it. int4 groups `group_size` inputs, or half or a quarter of that
    where the layer's inputs are not a multiple of it (tiny models); None where none divides them."""
    if mode == "int8":
        return Layout("int8", 1, in_features)
    if mode == "fp8":
        return Layout("fp8", 1, in_features)
    for group in (group_size, group_size // 2, group_size // 4):
        if group >= 2 and group % 2 == 0 and in_features % group == 0:
            return Layout("int4", 1, group, zero=True)
    return None


# ---- quantizers (host, numpy) ------------------------------------------------------


def quantize(weight: np.ndarray, layout: Layout) -> dict[str, np.ndarray]:
    """A float weight [N, K] (any float dtype) held as `layout`: {"weight", "weight_scale"[, "weight_zero"]}.

    int8: symmetric, scale = max |W| / 127 per scale cell; fp8: e4m3, scale = max |W| / 448 per
    cell; int4: asymmetric, the cell's [min, max] cut into 15 steps (zero = -min / scale). Holds one
    float32 copy of the weight and one float32 temporary besides the result.
    """
    w = np.asarray(weight, dtype=np.float32)  # [N, K]
    cells = _cells(w, layout)  # [N / r, r, K / c, c]: a view where the cells tile the weight
    if layout.mode == "int4":
        low, high = cells.min(axis=(1, 3)), cells.max(axis=(1, 3))  # [N / r, K / c]
        scale = (high - low) / 15.0
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        zero = (-low / scale).astype(np.float32)
        q = _scaled(w, scale, layout)
        q += _spread(zero, layout, w.shape)
        np.clip(np.rint(q, out=q), 0, 15, out=q)
        return {"weight": pack_int4(q.astype(np.uint8)), "weight_scale": scale, "weight_zero": zero}
    top = 127.0 if layout.mode == "int8" else FP8_MAX
    largest = np.maximum(cells.max(axis=(1, 3)), -cells.min(axis=(1, 3)))
    scale = np.where(largest > 0, largest / top, 1.0).astype(np.float32)
    q = np.clip(_scaled(w, scale, layout), -top, top)
    q = np.rint(q, out=q).astype(np.int8) if layout.mode == "int8" else q.astype(ml_dtypes.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}


def _scaled(w: np.ndarray, scale: np.ndarray, layout: Layout) -> np.ndarray:
    # w / scale, cell by cell: a new float32 [N, K].
    n, k = w.shape
    r, c = layout.rows_per_scale, layout.columns_per_scale
    if n % r == 0 and k % c == 0:
        out = w.reshape(n // r, r, k // c, c) / scale[:, None, :, None]
        return out.reshape(n, k)
    return w / _spread(scale, layout, w.shape)


def dequantize(tensors: dict[str, np.ndarray], layout: Layout, in_features: int) -> np.ndarray:
    """The float32 weight [N, K] that quantized `tensors` stand for (numpy; for checks and references)."""
    q = tensors["weight"]
    q = unpack_int4(q) if layout.mode == "int4" else np.asarray(q).astype(np.float32)
    q = q.astype(np.float32)[:, :in_features]
    scale = _spread(np.asarray(tensors["weight_scale"], np.float32), layout, q.shape)
    if layout.zero:
        q = q - _spread(np.asarray(tensors["weight_zero"], np.float32), layout, q.shape)
    return q * scale


def _cells(w: np.ndarray, layout: Layout) -> np.ndarray:
    # w [N, K] -> [N / r, r, K / c, c]: a view where the cells tile w, else a copy padded with zeros.
    r, c = layout.rows_per_scale, layout.columns_per_scale
    n, k = w.shape
    padded = w if n % r == 0 and k % c == 0 else np.pad(w, ((0, -n % r), (0, -k % c)))
    return padded.reshape(padded.shape[0] // r, r, padded.shape[1] // c, c)


def _spread(grid: np.ndarray, layout: Layout, shape: tuple[int, int]) -> np.ndarray:
    # One value per scale cell [N / r, K / c] -> one per weight [N, K].
    spread = np.repeat(np.repeat(grid, layout.rows_per_scale, axis=0), layout.columns_per_scale, axis=1)
    return spread[: shape[0], : shape[1]]


# ---- 4-bit packing -------------------------------------------------------------------


def pack_int4(q: np.ndarray) -> np.ndarray:
    """uint8 [..., K] of values 0..15 -> uint8 [..., K / 2]: input 2i in the low half of byte i."""
    q = np.asarray(q, np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., K / 2] -> uint8 [..., K] of values 0..15 (the inverse of `pack_int4`)."""
    packed = np.asarray(packed, np.uint8)
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def unpack_int32(packed: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """Values of `bits` bits packed 32 // bits per int32 along `axis`, lowest bits first (GPTQ,
    compressed-tensors), or in `order` (AWQ's [0, 2, 4, 6, 1, 3, 5, 7]: the i-th field of a word
    holds value order[i]) -> uint8, `axis` 32 // bits times longer."""
    per_word = 32 // bits
    words = np.moveaxis(np.asarray(packed).view(np.uint32), axis, -1)
    fields = np.stack([(words >> (bits * i)) & ((1 << bits) - 1) for i in range(per_word)], axis=-1)
    if order is not None:
        fields = fields[..., np.argsort(order)]
    values = fields.reshape(*words.shape[:-1], -1).astype(np.uint8)
    return np.moveaxis(values, -1, axis)
