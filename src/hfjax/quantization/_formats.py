"""Quantized checkpoints as people publish them, read into `Layout`s one tensor at a time.

Each format says which linear layers it quantized (read from the tensor names in the safetensors
headers) and turns each of their tensors, as the loader reads it, into the tensors a
`QuantizedLinear` holds: packed integers are unpacked and repacked, never dequantized.

    transformers' fine-grained fp8   quant_method "fp8": weight (float8_e4m3fn), weight_scale_inv per
                                     weight_block_size block (W = q * scale_inv)
    compressed-tensors               quant_method "compressed-tensors", as llmcompressor writes it:
                                     float-quantized (weight float8, weight_scale), naive-quantized and
                                     int-quantized (weight int8, weight_scale[, weight_zero_point]),
                                     pack-quantized (weight_packed: 4- or 8-bit values in int32, low
                                     bits first, stored + 2^(bits-1); weight_scale; weight_zero_point
                                     packed along the output; weight_g_idx for act-order)
    GPTQ                             quant_method "gptq", 4 bits: qweight int32 [K / 8, N] (packed along
                                     the input), qzeros int32 [G, N / 8], scales [G, N], g_idx [K];
                                     W = (q - (z + 1)) * s ("gptq" format; "gptq_v2" stores z itself)
    AWQ                              quant_method "awq", GEMM version, 4 bits: qweight int32 [K, N / 8]
                                     and qzeros [G, N / 8] packed along the output in the order
                                     0 2 4 6 1 3 5 7, scales [G, N]; W = (q - z) * s
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re

import numpy as np

from .._errors import LoadError
from ._schemes import Layout, pack_int4, unpack_int32

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_READABLE = ("fp8", "compressed-tensors", "gptq", "awq")
_WHAT_TO_DO = (
    "load the unquantized checkpoint with hfjax.load(path, quantize='int8' | 'fp8' | 'int4'), or one "
    f"published in a format hfjax reads ({', '.join(_READABLE)})"
)


@dataclasses.dataclass(frozen=True)
class Layer:
    """One linear layer of the module: its sizes, and whether transformers holds it as a Conv1D [in, out]."""

    in_features: int
    out_features: int
    bias: bool
    conv1d: bool = False


@dataclasses.dataclass
class Planned:
    """How a quantized layer of a checkpoint is held: its layout, and GPTQ-style act-order's input
    permutation (int32 [K]: the layer reads input[..., order]), or None."""

    layout: Layout
    input_order: np.ndarray | None = None
    constant_zero: float | None = None  # the zero point of every cell, where the checkpoint stores none


class Format:
    """A checkpoint format: which layers it quantized, and its tensors turned into a QuantizedLinear's.

    `headers`: {checkpoint tensor name: (shape, safetensors dtype code)}; `prefixes`: {module name
    of a linear layer: the prefix of its tensors in the checkpoint}.
    """

    name = "quantized"
    marker = "weight_scale"  # the tensor (after a layer's prefix) that marks a layer as quantized
    claimed: tuple[str, ...] = ()  # tensor names (after the layer's prefix) the module lacks but the format reads

    def __init__(self, config: dict, headers: dict, files: list[pathlib.Path]):
        self.config, self.headers, self.files = config, headers, files

    def plan(self, name: str, prefix: str, layer: Layer) -> Planned | None:
        """The layer's plan, or None where the checkpoint holds it unquantized."""
        raise NotImplementedError

    def convert(self, leaf: str, array: np.ndarray, layer: Layer, planned: Planned) -> dict[str, np.ndarray] | None:
        """{tensor name in the QuantizedLinear: array} for one checkpoint tensor of the layer (`leaf`:
        its name after the prefix), {} to drop it, None to let the loader read it as usual."""
        raise NotImplementedError

    def _has(self, prefix: str, leaf: str) -> bool:
        return f"{prefix}.{leaf}" in self.headers

    def _shape(self, prefix: str, leaf: str) -> tuple[int, ...]:
        return tuple(self.headers[f"{prefix}.{leaf}"][0])

    def _dtype(self, prefix: str, leaf: str) -> str:
        return self.headers[f"{prefix}.{leaf}"][1]

    def _refuse(self, what: str) -> LoadError:
        return LoadError(
            f"hfjax.load: the checkpoint's {self.name} quantization {what}, which hfjax cannot read; {_WHAT_TO_DO}"
        )


def _grid(array: np.ndarray, layout: Layout, layer: Layer) -> np.ndarray:
    # A scale or zero point as the layout's float32 grid [ceil(N / r), ceil(K / c)].
    shape = (
        math.ceil(layer.out_features / layout.rows_per_scale),
        math.ceil(layer.in_features / layout.columns_per_scale),
    )
    return np.asarray(array, dtype=np.float32).reshape(shape)


def _ordered_columns(q: np.ndarray, planned: Planned) -> np.ndarray:
    # q [N, K] with its columns in the order the layer reads its input.
    return q if planned.input_order is None else q[:, planned.input_order]


def _act_order(g_idx: np.ndarray, group_size: int, where: str) -> np.ndarray | None:
    """The input permutation that makes GPTQ act-order groups contiguous, or None where g_idx is
    already in order (k // group_size)."""
    g_idx = np.asarray(g_idx).astype(np.int64)
    if np.array_equal(g_idx, np.arange(g_idx.size) // group_size):
        return None
    counts = np.bincount(g_idx)
    if not np.all(counts == group_size):
        raise LoadError(
            f"hfjax.load: {where} has groups of {sorted(set(counts.tolist()))} inputs where the config says "
            f"group_size={group_size}; the checkpoint is inconsistent"
        )
    return np.argsort(g_idx, kind="stable").astype(np.int32)


def _read_tensor(files: list[pathlib.Path], key: str) -> np.ndarray:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="np") as f:
            if key in f.keys():
                return f.get_tensor(key)
    raise LoadError(f"hfjax.load: the checkpoint lists {key!r} but no file holds it")


# ---- transformers' fine-grained fp8 ---------------------------------------------------


class FineGrainedFp8(Format):
    name = "fp8 (transformers' fine-grained FP8)"
    marker = "weight_scale_inv"
    claimed = ("weight_scale_inv", "activation_scale", "input_scale")

    def plan(self, name, prefix, layer):
        if not self._has(prefix, "weight_scale_inv"):
            return None
        if self._dtype(prefix, "weight") != "F8_E4M3":
            raise self._refuse(f"stores {prefix}.weight as {self._dtype(prefix, 'weight')} (not float8_e4m3fn)")
        block = self.config.get("weight_block_size") or (layer.out_features, layer.in_features)
        return Planned(Layout("fp8", int(block[0]), int(block[1])))

    def convert(self, leaf, array, layer, planned):
        if leaf == "weight":
            return {"weight": np.asarray(array)}
        if leaf == "weight_scale_inv":  # despite its name, multiplied: W = q * weight_scale_inv
            return {"weight_scale": _grid(array, planned.layout, layer)}
        if leaf in ("activation_scale", "input_scale"):
            return {}  # hfjax keeps activations in the compute dtype (weight-only)
        return None


# ---- compressed-tensors (llmcompressor) ---------------------------------------------------


class CompressedTensors(Format):
    name = "compressed-tensors"
    claimed = (
        "weight_packed", "weight_shape", "weight_zero_point", "weight_g_idx",
        "input_scale", "input_zero_point", "output_scale", "output_zero_point",
    )  # fmt: skip

    def __init__(self, config, headers, files):
        super().__init__(config, headers, files)
        if config.get("sparsity_config"):
            raise self._refuse("has a sparsity_config (sparse weights)")
        if config.get("quantization_status", "compressed") != "compressed":
            raise self._refuse(f"has quantization_status {config.get('quantization_status')!r} (not compressed)")
        self.groups = list((config.get("config_groups") or {}).values())
        if not self.groups:
            raise self._refuse("has no config_groups")

    def _scheme(self, name: str, prefix: str) -> dict:
        for group in self.groups:
            if any(_matches(target, name) or _matches(target, prefix) for target in group.get("targets", ())):
                return group
        return self.groups[0]

    def plan(self, name, prefix, layer):
        if not self._has(prefix, "weight_scale"):
            return None
        group = self._scheme(name, prefix)
        fmt = group.get("format") or self.config.get("format")
        weights = group.get("weights") or {}
        bits, kind = weights.get("num_bits"), weights.get("type")
        if fmt == "float-quantized" and kind == "float" and bits == 8:
            mode = "fp8"
        elif fmt in ("naive-quantized", "int-quantized", "pack-quantized") and kind == "int" and bits == 8:
            mode = "int8"
        elif fmt == "pack-quantized" and kind == "int" and bits == 4:
            mode = "int4"
        else:
            raise self._refuse(f"of {prefix} is {fmt} with {bits}-bit {kind} weights")
        strategy = weights.get("strategy")
        if strategy == "tensor":
            rows, columns = layer.out_features, layer.in_features
        elif strategy == "channel":
            rows, columns = 1, layer.in_features
        elif strategy == "group":
            rows, columns = 1, int(weights["group_size"])
        elif strategy == "block":
            rows, columns = (int(b) for b in weights["block_structure"])
        else:
            raise self._refuse(f"of {prefix} has strategy {strategy!r}")
        zero = mode == "int4" or not weights.get("symmetric", True)
        order = None
        if self._has(prefix, "weight_g_idx"):
            order = _act_order(_read_tensor(self.files, f"{prefix}.weight_g_idx"), columns, f"{prefix}.weight_g_idx")
        constant = 8.0 if mode == "int4" and weights.get("symmetric", True) else None  # symmetric: q - 8
        return Planned(Layout(mode, rows, columns, zero), order, constant)

    def convert(self, leaf, array, layer, planned):
        layout = planned.layout
        if leaf == "weight":  # float8 or int8, stored as they are held
            return {"weight": _ordered_columns(np.asarray(array), planned)}
        if leaf == "weight_packed":  # values + 2^(bits - 1), 32 / bits per int32 along the input
            bits = 4 if layout.mode == "int4" else 8
            q = unpack_int32(array, bits, axis=1)[:, : layer.in_features]
            q = _ordered_columns(q, planned)
            return {"weight": pack_int4(q) if bits == 4 else (q.astype(np.int16) - 128).astype(np.int8)}
        if leaf == "weight_scale":
            tensors = {"weight_scale": _grid(array, layout, layer)}
            if planned.constant_zero is not None:
                tensors["weight_zero"] = np.full_like(tensors["weight_scale"], planned.constant_zero)
            return tensors
        if leaf == "weight_zero_point":
            zero = np.asarray(array)
            if zero.dtype == np.int32 and layout.mode == "int4":  # packed along the output, + 8
                zero = unpack_int32(zero, 4, axis=0)[: layer.out_features]
            elif zero.dtype == np.int32:  # 8-bit, packed along the output, + 128
                zero = unpack_int32(zero, 8, axis=0)[: layer.out_features].astype(np.int16) - 128
            return {"weight_zero": _grid(zero, layout, layer)}
        if leaf == "weight_g_idx":
            return {} if planned.input_order is None else {"input_order": planned.input_order}
        if leaf == "weight_shape" or leaf.startswith(("input_", "output_")):
            return {}  # the shape is the layer's; activations stay in the compute dtype (weight-only)
        return None


def _matches(target: str, name: str) -> bool:
    """compressed-tensors' targets and ignore entries: "re:<regex>" on the module name, a class name
    ("Linear": every linear layer here), or a module name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or name == target or name.endswith("." + target)


# ---- GPTQ and AWQ ---------------------------------------------------------------------


class Gptq(Format):
    name = "GPTQ"
    marker = "qweight"
    claimed = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, config, headers, files):
        super().__init__(config, headers, files)
        if config.get("bits", 4) != 4:
            raise self._refuse(f"has bits={config.get('bits')} (hfjax reads 4-bit GPTQ)")
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise self._refuse(f"has checkpoint_format {fmt!r}")
        self.zero_offset = 1.0 if fmt == "gptq" else 0.0  # the "gptq" format stores each zero point less 1

    def plan(self, name, prefix, layer):
        if not self._has(prefix, "qweight"):
            return None
        group = int(self.config.get("group_size", 128))
        group = layer.in_features if group <= 0 else group
        order = None
        if self.config.get("desc_act") and self._has(prefix, "g_idx"):
            order = _act_order(_read_tensor(self.files, f"{prefix}.g_idx"), group, f"{prefix}.g_idx")
        return Planned(Layout("int4", 1, group, zero=True), order)

    def convert(self, leaf, array, layer, planned):
        if leaf == "qweight":  # [K / 8, N], packed along the input
            q = unpack_int32(array, 4, axis=0)[: layer.in_features].T  # [N, K]
            return {"weight": pack_int4(_ordered_columns(q, planned))}
        if leaf == "qzeros":  # [G, N / 8], packed along the output
            zero = unpack_int32(array, 4, axis=1)[:, : layer.out_features].T.astype(np.float32) + self.zero_offset
            return {"weight_zero": _grid(zero, planned.layout, layer)}
        if leaf == "scales":  # [G, N]
            return {"weight_scale": _grid(np.asarray(array, np.float32).T, planned.layout, layer)}
        if leaf == "g_idx":
            return {} if planned.input_order is None else {"input_order": planned.input_order}
        return None


class Awq(Gptq):
    name = "AWQ"
    claimed = ("qweight", "qzeros", "scales")

    def __init__(self, config, headers, files):
        Format.__init__(self, config, headers, files)
        if config.get("bits", config.get("w_bit", 4)) != 4:
            raise self._refuse(f"has bits={config.get('bits')} (hfjax reads 4-bit AWQ)")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise self._refuse(f"is version {version!r} (hfjax reads the GEMM layout)")
        if not config.get("zero_point", True):
            raise self._refuse("has no zero points")

    def plan(self, name, prefix, layer):
        if not self._has(prefix, "qweight"):
            return None
        group = int(self.config.get("group_size", self.config.get("q_group_size", 128)))
        return Planned(Layout("int4", 1, group if group > 0 else layer.in_features, zero=True))

    def convert(self, leaf, array, layer, planned):
        if leaf == "qweight":  # [K, N / 8], packed along the output in AWQ's order
            q = unpack_int32(array, 4, axis=1, order=_AWQ_ORDER)[:, : layer.out_features].T  # [N, K]
            return {"weight": pack_int4(q)}
        if leaf == "qzeros":
            zero = unpack_int32(array, 4, axis=1, order=_AWQ_ORDER)[:, : layer.out_features].T
            return {"weight_zero": _grid(zero.astype(np.float32), planned.layout, layer)}
        if leaf == "scales":
            return {"weight_scale": _grid(np.asarray(array, np.float32).T, planned.layout, layer)}
        return None


_FORMATS = {"fp8": FineGrainedFp8, "compressed-tensors": CompressedTensors, "gptq": Gptq, "awq": Awq}
_NAMED = {"bitsandbytes": "bitsandbytes", "bitsandbytes_4bit": "bitsandbytes", "bitsandbytes_8bit": "bitsandbytes"}


def _quantization_config(config) -> dict | None:
    quantization = getattr(config, "quantization_config", None)
    if quantization is None or isinstance(quantization, dict):
        return quantization
    return quantization.to_dict()


def checkpoint_method(config) -> str | None:
    """The quantization method of a checkpoint's config (its quantization_config.quant_method,
    lower-case: "fp8", "compressed-tensors", "gptq", "awq", "bitsandbytes", ...; "" where it names
    none), or None for an unquantized checkpoint."""
    quantization = _quantization_config(config)
    if quantization is None:
        return None
    method = str(quantization.get("quant_method", "")).lower()
    if method == "bitsandbytes" or quantization.get("load_in_4bit") or quantization.get("load_in_8bit"):
        method = "bitsandbytes"
    return method


def checkpoint_format(config, headers: dict, files: list[pathlib.Path]) -> Format | None:
    """The format of a checkpoint whose config has a quantization_config, or None without one.

    Raises:
      LoadError: a quantization hfjax cannot read (bitsandbytes, GGUF, HQQ, ...), in one line that
        names it and says what to do.
    """
    method = checkpoint_method(config)
    if method is None:
        return None
    quantization = _quantization_config(config)
    if method not in _FORMATS:
        shown = _NAMED.get(method, method or "an unnamed method")
        raise LoadError(
            f"hfjax.load: the checkpoint is quantized with {shown} (quant_method {method!r}), which hfjax cannot read; "
            f"{_WHAT_TO_DO}"
        )
    return _FORMATS[method](quantization, headers, files)


def read_headers(files: list[pathlib.Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, safetensors dtype code)} of every tensor of the checkpoint, from the
    files' headers alone."""
    from safetensors import safe_open

    headers = {}
    for file in files:
        with safe_open(file, framework="np") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                headers[key] = (tuple(piece.get_shape()), piece.get_dtype())
    return headers
