"""What hfjax does only on XLA:GPU, behind the one hook the engine calls (`hfjax.cpu`'s counterpart).

`Gpu` is the GPU's `hfjax.bridge.Backend`. It has two levers, which `benchmarks/decode.py
--gpu-levers` measures against each other in one run (benchmarks/README.md has the figures):

- command buffers, on unless HFJAX_GPU_COMMAND_BUFFERS=0: the programs that loop on the device
  (generate's and the server's decode, diffusion's whole loop) are compiled with XLA's command
  buffers for `while` and `conditional` too (`compiler_options`), so that one decode step's kernels
  are launched as one CUDA graph instead of one by one. On an H200 (2026-12-04) Llama-3.2-1B's
  bfloat16 decode at batch 1 ran 1.05x faster with them, with the same tokens;
- HFJAX_GPU_ATTENTION=cudnn, off by default (not yet measured: the first GPU run found its programs
  could not be kept on disk, since fixed): torch's scaled_dot_product_attention runs as
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
        if stage in LOOPING_STAGES and command_buffers():
            return {"xla_gpu_enable_command_buffer": LOOP_COMMAND_BUFFERS}
        return None

    def custom_calls(self) -> tuple[str, ...]:
        return _attention.CUDNN_TARGETS if _attention.choice() == "cudnn" else ()

    def fingerprint(self) -> str | None:
        return f"command_buffers={int(command_buffers())} attention={_attention.choice()}"


def command_buffers() -> bool:
    """Whether the looping programs get command buffers: yes unless HFJAX_GPU_COMMAND_BUFFERS=0."""
    wanted = os.environ.get(COMMAND_BUFFERS, "1")
    if wanted not in ("0", "1"):
        raise ValueError(f"{COMMAND_BUFFERS}={wanted!r}: pass 1 (the default) or 0")
    return wanted == "1"
