"""Everything hfjax does only to run faster on XLA:CPU, behind the one hook the engine calls.

`Cpu` is the CPU's `hfjax.bridge.Backend`: the generic engine asks it at fixed points, and it

- builds hfjax's decoding kernels (`_kernels.cc`: AVX-512, or AVX2's attention alone) at load time, never inside a trace
  (`prepare`; also `hfjax build-kernels`);
- installs the CPU's op lowerings (`_lowerings.py`: kernels, operand swaps, channels-last convolutions);
- moves loaded weights onto 2 MB pages when asked (`_pages.py`, HFJAX_HUGE_PAGES=1);
- holds diffusers' convolution weights channels-last (`prepare_module`);
- carries the decode loop's cache without its size-1 axes (`loop_carry`);
- has the slot decode read its rows of the cache where they lie (`attention_in_place`).

Deleting this package, or setting HFJAX_CPU_KERNELS=0, runs the generic engine on the CPU:
every feature works, only slower. docs/architecture.md says what each part gains.

Public names: `Cpu`, `build_kernels`, `kernel_compiler`, `kernels_status`. Only `hfjax._backend`
imports this package.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..bridge import Backend
from . import _build, _kernels, _lowerings, _pages

__all__ = ["Cpu", "build_kernels", "kernel_compiler", "kernels_status"]


class Cpu(Backend):
    """The CPU's hook."""

    name = "cpu"

    def prepare(self) -> None:
        _build.build()

    def prepare_weights(self, params) -> None:
        _pages.huge_pages(params.values())

    def prepare_module(self, module) -> None:
        _lowerings.store_convolutions_channels_last(module)

    def loop_carry(self, cache):
        # XLA:CPU drops a batch of 1 from the attention's product, so the product reads each cache
        # layer without that axis. Carried with it, every layer was copied four times per token
        # (0.4 ms of a 150M model's 9 ms at 128 cache slots); carried without it, and updated
        # without it (`_lowerings._index_copy`), the product reads the buffer the loop carries.
        shapes = [jnp.shape(leaf) for leaf in jax.tree_util.tree_leaves(cache)]
        treedef = jax.tree_util.tree_structure(cache)

        def restore(carried):
            leaves = jax.tree_util.tree_leaves(carried)
            return jax.tree_util.tree_unflatten(treedef, [jnp.reshape(x, s) for x, s in zip(leaves, shapes)])

        return jax.tree_util.tree_map(jnp.squeeze, cache), restore

    def attention_in_place(self, dtype, groups: int, columns=None):
        # The attention kernel reads a sequence's row of a cache of more rows and columns
        # (`_lowerings.reading_in_place`), where it takes the attention at all (`_kernels.usable`).
        usable = (
            dtype == jnp.float32 and groups in _kernels.QUERY_ROWS and _build.built() is not None
            and jax.device_count() == 1
        )  # fmt: skip
        return _lowerings.reading_in_place(columns) if usable else None

    def custom_calls(self) -> tuple[str, ...]:
        return tuple(_build.TARGETS) if _build.built() is not None else ()

    def fingerprint(self) -> str | None:
        built = _build.built()
        return built and f"{built}:{'products' if _build.products() else 'attention'}"


def build_kernels(timeout_s: float = _build.TIMEOUT_S) -> str | None:
    """Builds and loads the CPU kernels now (they are otherwise built when a model is loaded).

    Returns:
      The library's digest, or None where they are not used; `kernels_status()` says why.
    """
    return _build.build(timeout_s)


def kernel_compiler() -> tuple[str | None, str]:
    """(the C++ compiler that builds the kernels, or None; why not, where None)."""
    return _build.compiler()


def kernels_status() -> str:
    """One line: whether the CPU kernels are loaded in this process, and if not, why."""
    if _build.built() is not None:
        used = "products and attention" if _build.products() else "attention (HFJAX_CPU_KERNELS=avx2 adds the products)"
        return f"loaded ({_build.built()[:12]}): {used}, for float32 on a single CPU device"
    return f"not loaded: {_build.reason() or 'not built yet in this process (hfjax build-kernels)'}"
