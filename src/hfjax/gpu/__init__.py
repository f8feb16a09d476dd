"""What hfjax does only on XLA:GPU, behind the one hook the engine calls (`hfjax.cpu`'s counterpart).

`Gpu` is the GPU's `hfjax.bridge.Backend`. Its two levers are off unless asked for, because no GPU
has measured them yet (issue 36; `benchmarks/decode.py --gpu-levers` measures each against the
default in one run):

- HFJAX_GPU_COMMAND_BUFFERS=1: the programs that loop on the device (generate's and the server's
  decode, diffusion's whole loop) are compiled with XLA's command buffers for `while` and
  `conditional` too (`compiler_options`), so that one decode step's kernels are launched as one
  CUDA graph instead of one by one;
- HFJAX_GPU_ATTENTION=cudnn: torch's scaled_dot_product_attention runs as
  `jax.nn.dot_product_attention(implementation="cudnn")` (cuDNN's fused attention) where cuDNN
  takes its shapes and dtypes, else as the generic lowering (`_attention.py`).

Public name: `Gpu`. Only `hfjax._backend` imports this package.
"""

from __future__ import annotations

import os

from ..bridge import Backend
from . import _attention

__all__ = ["Gpu"]

COMMAND_BUFFERS = "HFJAX_GPU_COMMAND_BUFFERS"
# The kinds XLA puts in command buffers by default (as read from its flags' defaults in 2026; not checked on a
# GPU), plus the loops, so that the kernels of a decode step inside the `while` become one graph. A per-program
# option lists every kind: XLA takes no "+while" there.
LOOP_COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
LOOPING_STAGES = ("decode", "whole loop")  # the `jit_program` stages whose program is a device-side loop


class Gpu(Backend):
    """The GPU's hook."""

    name = "gpu"

    def compiler_options(self, stage: str) -> dict[str, str] | None:
        if stage in LOOPING_STAGES and os.environ.get(COMMAND_BUFFERS, "0") == "1":
            return {"xla_gpu_enable_command_buffer": LOOP_COMMAND_BUFFERS}
        return None

    def fingerprint(self) -> str | None:
        return f"command_buffers={os.environ.get(COMMAND_BUFFERS, '0')} attention={_attention.choice()}"
