"""Quantized weights: int8, fp8 and int4 weight-only, quantized on load or read from quantized checkpoints.

    hfjax.load(path, quantize="int8" | "fp8" | "int4")   quantize the decoder's linear layers as they are read
    hfjax.load(path)                                      a checkpoint published quantized (fine-grained fp8,
                                                          compressed-tensors, GPTQ, AWQ) is read as it is

A quantized linear layer is a `QuantizedLinear`: a torch Linear whose parameters are the quantized
weight and its scales (and zero points), and whose forward is one op, `torch.ops.hfjax.quantized_linear`,
that dequantizes inside the compiled program. Every engine (generate, beams, the server, pipelines,
training with LoRA) runs it as any other torch code. The weights stay on the device at their
quantized size; on XLA:CPU, the CPU package's kernels take the op (`hfjax.cpu`), elsewhere XLA fuses
the conversion into the product.

Parts: `_schemes.py` (the layouts and the host-side quantizers), `_linear.py` (the op and the module),
`_formats.py` (the checkpoint formats), `_plan.py` (which layers, the swap, the loader's convert hook).

Public names: `MODES`, `Quantization`, `Quantized`, `Layout`, `QuantizedLinear`, `quantize`, `dequantize`,
`dequantize_torch`, `dequantize_jax`, `quantized_linear_jax`, `prepare_load`, `quantize_module`, `settings`,
`linear_layers`, `default_targets`, `unpack_jax`, `checkpoint_method`.
"""

from ._formats import checkpoint_method
from ._linear import QuantizedLinear, dequantize_jax, dequantize_torch, quantized_linear_jax, unpack_jax
from ._plan import (
    Quantization,
    Quantized,
    default_targets,
    linear_layers,
    prepare_load,
    quantize_module,
    settings,
)
from ._schemes import MODES, Layout, dequantize, quantize

__all__ = [
    "MODES",
    "Layout",
    "Quantization",
    "Quantized",
    "QuantizedLinear",
    "checkpoint_method",
    "default_targets",
    "dequantize",
    "dequantize_jax",
    "dequantize_torch",
    "linear_layers",
    "prepare_load",
    "quantize",
    "quantize_module",
    "quantized_linear_jax",
    "settings",
    "unpack_jax",
]
