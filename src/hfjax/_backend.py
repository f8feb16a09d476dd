"""Which backend hook runs (`hfjax.bridge.Backend`): the CPU's (`hfjax.cpu`) on XLA:CPU, the GPU's
(`hfjax.gpu`) on XLA:GPU, else the generic one. The only module that reaches `hfjax.cpu` and
`hfjax.gpu`.

On the CPU the hook is `hfjax.cpu.Cpu` unless HFJAX_CPU_KERNELS=0 or the package is absent: then,
as on TPUs, the generic engine runs. On a GPU it is `hfjax.gpu.Gpu`, whose levers are off unless
asked for (HFJAX_GPU_COMMAND_BUFFERS, HFJAX_GPU_ATTENTION): it then runs the generic engine too.
"""

from __future__ import annotations

import functools
import os

import jax

from . import bridge

CPU_SWITCH = "HFJAX_CPU_KERNELS"  # "0" runs the generic engine on the CPU, as if hfjax.cpu were absent


@functools.cache
def active() -> bridge.Backend:
    """The hook of the backend JAX runs on (`jax.default_backend()`), handed to the bridge once."""
    hook = bridge.Backend()
    if jax.default_backend() == "cpu" and os.environ.get(CPU_SWITCH, "1") != "0":
        try:
            from . import cpu
        except ImportError:
            pass
        else:
            hook = cpu.Cpu()
    elif jax.default_backend() == "gpu":
        from . import gpu

        hook = gpu.Gpu()
    bridge.use_hook(hook)
    return hook


# `hfjax build-kernels` reaches the CPU package through here (ImportError where it is absent).


def kernel_compiler() -> tuple[str | None, str]:
    """(the compiler command the CPU kernels build with, or None and why they do not apply here)."""
    from . import cpu

    return cpu.kernel_compiler()


def build_kernels(timeout_s: float) -> str | None:
    """Builds and loads the CPU kernels now; their digest, or None (`kernels_status()` says why)."""
    from . import cpu

    return cpu.build_kernels(timeout_s=timeout_s)


def kernels_status() -> str:
    """One line: whether the CPU kernels are loaded in this process, and if not, why."""
    from . import cpu

    return cpu.kernels_status()
