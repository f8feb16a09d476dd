"""Which linear layers are quantized, and how: the settings of `hfjax.load(quantize=...)`, the layers
chosen, the skeleton's Linear modules swapped for `QuantizedLinear`, and the loader's `convert`
hook that fills them one checkpoint tensor at a time.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import re

import jax
import numpy as np
import torch

from .. import _dtypes, bridge
from .._errors import LoadError
from ._formats import Layer, Planned, checkpoint_format, read_headers
from ._linear import QuantizedLinear
from ._schemes import GROUP_SIZE, MODES, Layout, Mode, layout_for, quantize

# Routers pick experts from their scores: quantizing them changes which experts run (llmcompressor's
# recipes and vLLM leave them out too).
_ROUTERS = re.compile(r"(^|\.)(gate|router)$")


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How `hfjax.load(path, quantize=...)` quantizes a model's linear layers while it reads them.

    Attributes:
      mode: "int8" (symmetric, a scale per output channel), "fp8" (float8 e4m3, a scale per output
        channel, or per block with `fp8_block`) or "int4" (asymmetric, groups of `group_size` inputs,
        two values per byte).
      lm_head: quantize the LM head too (by default it stays in the compute dtype, as do the
        embeddings and norms).
      group_size: int4's inputs per scale.
      fp8_block: fp8 with one scale per (output, input) block, e.g. (128, 128); None: per channel.

    Example:
      >>> hfjax.load(path, quantize=Quantization("fp8", fp8_block=(128, 128)))
    """

    mode: Mode
    lm_head: bool = False
    group_size: int = GROUP_SIZE
    fp8_block: tuple[int, int] | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise LoadError(f"Quantization(mode={self.mode!r}): use one of {MODES}")
        if not isinstance(self.group_size, int) or self.group_size < 2 or self.group_size % 2:
            raise LoadError(f"Quantization(group_size={self.group_size!r}): pass an even int >= 2, e.g. 128")
        block = self.fp8_block
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise LoadError(f"Quantization(fp8_block={block!r}): pass two positive ints, e.g. (128, 128), or None")

    def layout(self, layer: Layer) -> Layout | None:
        """The layout of a layer quantized this way, or None where the mode cannot hold it."""
        if self.mode == "fp8" and self.fp8_block is not None:
            return Layout("fp8", *self.fp8_block)
        return layout_for(self.mode, layer.out_features, layer.in_features, group_size=self.group_size)

    def describe(self) -> str:
        extra = f", group_size={self.group_size}" if self.mode == "int4" else ""
        extra += f", fp8_block={self.fp8_block}" if self.fp8_block else ""
        return f"quantize={self.mode!r}{extra}{', lm_head' if self.lm_head else ''}"


def settings(quantize, quantize_lm_head: bool, *, caller: str) -> Quantization | None:
    """`quantize=` (None, a mode name or a `Quantization`) and `quantize_lm_head=` as one setting.

    Raises:
      LoadError: naming `caller`, the value and what is allowed.
    """
    if quantize is None:
        if quantize_lm_head:
            raise LoadError(f"{caller}: quantize_lm_head=True needs quantize=; pass quantize='int8', 'fp8' or 'int4'")
        return None
    if isinstance(quantize, Quantization):
        return dataclasses.replace(quantize, lm_head=True) if quantize_lm_head else quantize
    if isinstance(quantize, str) and quantize in MODES:
        return Quantization(quantize, lm_head=bool(quantize_lm_head))  # type: ignore[arg-type]
    allowed = ", ".join(repr(m) for m in MODES)
    raise LoadError(
        f"{caller}: quantize={quantize!r} is not a quantization; pass one of {allowed}, a "
        "hfjax.quantization.Quantization, or None"
    )


# ---- the model's linear layers ------------------------------------------------------


def linear_layers(module: torch.nn.Module) -> dict[str, Layer]:
    """{module name: Layer} of every torch Linear and transformers Conv1D in `module`."""
    layers = {}
    for name, child in module.named_modules():
        if isinstance(child, QuantizedLinear):
            continue
        if isinstance(child, torch.nn.Linear):
            layers[name] = Layer(child.in_features, child.out_features, child.bias is not None)
        elif type(child).__name__ == "Conv1D" and getattr(child, "weight", None) is not None:  # weight [in, out]
            layers[name] = Layer(child.weight.shape[0], child.weight.shape[1], child.bias is not None, conv1d=True)
    return layers


def default_targets(module: torch.nn.Module, *, lm_head: bool) -> list[str]:
    """The layers `quantize=` quantizes: the linear layers of the model's body (its base model),
    but routers and those transformers keeps in float32 (`_keep_in_fp32_modules`); the LM head only
    with `lm_head`. Task heads (a classifier's `score`) stay as they are."""
    base = getattr(module, "base_model", module)
    inside = {id(m) for m in base.modules()}
    output = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    keep = [
        *(getattr(module, "_keep_in_fp32_modules", None) or ()),
        *(getattr(module, "_keep_in_fp32_modules_strict", None) or ()),
    ]
    chosen = []
    for name in linear_layers(module):
        child = module.get_submodule(name)
        if child is output:
            if lm_head:
                chosen.append(name)
            continue
        if (
            id(child) not in inside
            or _ROUTERS.search(name)
            or any(name.split(".")[-1] == k or name.endswith("." + k) for k in keep)
        ):
            continue
        chosen.append(name)
    return chosen


def swap(module: torch.nn.Module, name: str, layer: Layer, planned: Planned, dtype: torch.dtype) -> QuantizedLinear:
    """Replaces the linear layer `name` of `module` (on the meta device) by a QuantizedLinear."""
    quantized = QuantizedLinear(
        layer.in_features, layer.out_features, planned.layout, bias=layer.bias, compute_dtype=dtype,
        input_order=planned.input_order is not None,
    )  # fmt: skip
    parent_name, _, child = name.rpartition(".")
    setattr(module.get_submodule(parent_name) if parent_name else module, child, quantized)
    return quantized


# ---- loading: the convert hook -----------------------------------------------------------


@dataclasses.dataclass
class Quantized:
    """What was quantized, for `Model.quantization` and messages."""

    source: str  # "quantize='int8'", or the checkpoint's format
    layers: dict[str, Layout]  # module name -> layout
    skipped: list[str] = dataclasses.field(default_factory=list)  # chosen layers the mode cannot hold

    def __str__(self) -> str:
        modes = sorted({layout.mode for layout in self.layers.values()})
        text = f"{self.source}: {len(self.layers)} linear layers in {'/'.join(modes) or 'nothing'}"
        return text + (
            f" ({len(self.skipped)} left unquantized: {', '.join(self.skipped[:3])})" if self.skipped else ""
        )


class _Quantizer:
    """`quantize=` as the loader's format: each chosen layer's float weight quantized as it is read."""

    claimed: tuple[str, ...] = ()

    def convert(self, leaf, array, layer, planned):
        if leaf != "weight":
            return None
        weight = np.asarray(array)
        return quantize(weight.T if layer.conv1d else weight, planned.layout)


class Converter:
    """The loader's `convert(name, array)`: for a tensor of a quantized layer, the QuantizedLinear's
    tensors made from it; None for every other tensor. `claims(name)`: the checkpoint's tensors of
    quantized layers that the module has no parameter of that name for (weight_scale_inv, qweight, ...)."""

    def __init__(
        self, fmt, planned: dict[str, tuple[Layer, Planned]], prefixes: dict[str, str], ties: dict, dtype: str
    ):
        self._format = fmt
        self._planned = planned
        self._by_prefix = {p: name for name, p in prefixes.items()} | {name: name for name in planned}
        self._ties = ties  # {checkpoint name of a tied weight: [quantized layer made from it]}
        self._dtype = _dtypes.jax_dtype(dtype)

    def _layer(self, name: str):
        prefix, _, leaf = name.rpartition(".")
        module_name = self._by_prefix.get(prefix)
        return (None, leaf) if module_name is None else (module_name, leaf)

    def __call__(self, name: str, array) -> dict[str, np.ndarray] | None:
        if name in self._ties:
            out = {name: np.asarray(array).astype(self._dtype)}
            for target in self._ties[name]:
                out.update(self._one(target, "weight", array) or {})
            return out
        module_name, leaf = self._layer(name)
        if module_name is None:
            return None
        return self._one(module_name, leaf, array)

    def _one(self, module_name: str, leaf: str, array):
        layer, planned = self._planned[module_name]
        tensors = self._format.convert(leaf, array, layer, planned)
        return None if tensors is None else {f"{module_name}.{k}": v for k, v in tensors.items()}

    def claims(self, name: str) -> bool:
        module_name, leaf = self._layer(name)
        return module_name is not None and leaf in self._format.claimed


def prepare_load(
    module: torch.nn.Module, config, files: list[pathlib.Path], quantization: Quantization | None, dtype: str
) -> tuple[Converter, Quantized] | None:
    """Swaps the skeleton's quantized layers (as the checkpoint holds them, or as `quantization`
    asks) for QuantizedLinear modules, and returns the loader's convert hook and a summary; None
    where nothing is quantized.

    Raises:
      LoadError: a quantization format hfjax cannot read, or `quantize=` on a checkpoint that is
        quantized already.
    """
    headers = read_headers(files) if getattr(config, "quantization_config", None) is not None else {}
    fmt = checkpoint_format(config, headers, files)
    if fmt is not None and quantization is not None:
        raise LoadError(
            f"hfjax.load: the checkpoint is quantized already ({fmt.name}); drop {quantization.describe()} "
            "(hfjax reads its quantized weights as they are)"
        )
    if fmt is None and quantization is None:
        return None
    layers = linear_layers(module)
    torch_dtype = _dtypes.torch_dtype(dtype)
    planned: dict[str, tuple[Layer, Planned]] = {}
    prefixes: dict[str, str] = {}
    skipped = []
    if fmt is not None:
        present = {key.rpartition(".")[0] for key in headers}
        for name, layer in layers.items():
            prefix = _checkpoint_prefix(module, name, present)
            plan = None if prefix is None else fmt.plan(name, prefix, layer)
            if plan is not None:
                planned[name], prefixes[name] = (layer, plan), prefix
        quantized = {key.rpartition(".")[0] for key in headers if key.endswith("." + fmt.marker)}
        unread = sorted(quantized - set(prefixes.values()))
        if unread:  # e.g. per-expert weights that transformers fuses into one tensor
            raise LoadError(
                f"hfjax.load: the {fmt.name} checkpoint quantizes {len(unread)} tensors that are not linear layers "
                f"of {type(module).__name__} (e.g. {unread[0]!r}: mixture-of-experts weights fused into one tensor); "
                "hfjax reads quantized linear layers only: load the unquantized checkpoint with quantize="
            )
        source, converting = f"{fmt.name} checkpoint", fmt
    else:
        for name in default_targets(module, lm_head=quantization.lm_head):
            layout = quantization.layout(layers[name])
            if layout is None:
                skipped.append(name)
            else:
                planned[name] = (layers[name], Planned(layout))
        source, converting = quantization.describe(), _Quantizer()
    _, aliases = bridge.tensor_names(module)
    ties: dict[str, list[str]] = {}
    for name, (layer, plan) in planned.items():
        tied = aliases.get(f"{name}.weight")
        if tied is not None:
            ties.setdefault(tied, []).append(name)
        swap(module, name, layer, plan, torch_dtype)
    converter = Converter(converting, planned, prefixes, ties, dtype)
    return converter, Quantized(source, {n: p.layout for n, (_, p) in planned.items()}, skipped)


def _checkpoint_prefix(module: torch.nn.Module, name: str, present: set[str]) -> str | None:
    # The checkpoint's prefix of a layer's tensors: its module name, with or without the base model's prefix.
    base = getattr(module, "base_model_prefix", "") or ""
    for candidate in (name, name.removeprefix(base + "."), f"{base}.{name}"):
        if candidate in present:
            return candidate
    return None


# ---- a model already in memory (Model.from_module) --------------------------------------


def quantize_module(
    module: torch.nn.Module, params: dict[str, jax.Array], aliases: dict[str, str], quantization: Quantization
) -> tuple[torch.nn.Module, dict[str, jax.Array], dict[str, str], Quantized]:
    """A copy of `module` on the meta device with its chosen layers quantized, and its weights
    (`params`, by name, as `bridge.module_state` gives them) with those layers' quantized.

    Returns:
      (skeleton, params, aliases, summary).
    """
    memo = {
        id(p): torch.nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad) for p in module.parameters()
    }
    skeleton = copy.deepcopy(module, memo)
    layers = linear_layers(skeleton)
    params, aliases = dict(params), dict(aliases)
    dtype = _float_dtype(params)
    done, skipped = {}, []
    for name in default_targets(skeleton, lm_head=quantization.lm_head):
        layer = layers[name]
        layout = quantization.layout(layer)
        if layout is None:
            skipped.append(name)
            continue
        source = aliases.pop(f"{name}.weight", f"{name}.weight")
        weight = np.asarray(params[source].astype(jax.numpy.float32))
        if source == f"{name}.weight":
            del params[source]
        for leaf, value in quantize(weight.T if layer.conv1d else weight, layout).items():
            params[f"{name}.{leaf}"] = jax.numpy.asarray(value)
        swap(skeleton, name, layer, Planned(layout), dtype)
        done[name] = layout
    return skeleton, params, aliases, Quantized(quantization.describe(), done, skipped)


def _float_dtype(params: dict[str, jax.Array]) -> torch.dtype:
    # The compute dtype of a model's weights: that of its first float weight.
    for array in params.values():
        if str(array.dtype) in _dtypes.NAMES:
            return _dtypes.torch_dtype(str(array.dtype))
    return torch.float32
