"""What hfjax does only on XLA:GPU, behind the one hook the engine calls (`hfjax.cpu`'s counterpart).

`Gpu` is the GPU's `hfjax.bridge.Backend`. It has two levers, which `benchmarks/decode.py
--gpu-levers` measures against each other in one run (benchmarks/README.md has the figures):

- command buffers: the programs that loop on the device are compiled with XLA's command buffers
  for `while` and `conditional` too (`compiler_options`), so that one decode step's kernels are
  launched as one CUDA graph instead of one by one. On by default for generate's and the server's
  decode: on an H200 (2026-12-04) Llama-3.2-1B's bfloat16 decode at batch 1 ran 1.05x faster with
  them, with the same tokens. HFJAX_GPU_COMMAND_BUFFERS=1 adds diffusion's whole loop (not yet
  measured), =0 turns them off;
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
        if stage in command_buffer_stages():
            return {"xla_gpu_enable_command_buffer": LOOP_COMMAND_BUFFERS}
        return None

    def custom_calls(self) -> tuple[str, ...]:
        return _attention.CUDNN_TARGETS if _attention.choice() == "cudnn" else ()

    def fingerprint(self) -> str | None:
        return f"command_buffers={'+'.join(command_buffer_stages())} attention={_attention.choice()}"


def command_buffer_stages() -> tuple[str, ...]:
    """The looping stages whose programs get command buffers: by default the decode, where an H200
    measured them (diffusion's whole loop has not been: HFJAX_GPU_COMMAND_BUFFERS=1 adds it); none
    with HFJAX_GPU_COMMAND_BUFFERS=0."""
    wanted = os.environ.get(COMMAND_BUFFERS)
    if wanted not in (None, "0", "1"):
        raise ValueError(f"{COMMAND_BUFFERS}={wanted!r}: pass 1 (the decode and diffusion's whole loop) or 0 (none)")
    return {None: ("decode",), "1": LOOPING_STAGES, "0": ()}[wanted]
