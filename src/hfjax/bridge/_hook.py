"""The hook through which a backend package changes how hfjax runs (`hfjax.cpu`, `hfjax.gpu`).

The generic engine is backend-neutral. At a few fixed points it asks the active hook, which may
change what happens there:

    prepare()            outside any trace, when a model is loaded or jitted: build what the backend needs
    name                 which op lowerings of the registry apply (`hfjax.override_op(..., backend=name)`)
    prepare_weights()    weights just loaded into jax.Arrays
    prepare_module()     a torch module (a diffusers component) about to move to JAX
    loop_carry()         the layout in which the decode loop carries its cache
    attention_in_place() where decoding attention reads a slot cache's leading rows and columns in place
    custom_calls()       custom calls that exported programs may hold
    compiler_options()   XLA options a program of one stage is compiled with (`jit_program`)
    fingerprint()        what the backend adds to the key of a program kept on disk

`Backend`, the default, changes nothing. `hfjax._backend.active()` picks the hook of the backend JAX
runs on (the one place that reaches `hfjax.cpu` and `hfjax.gpu`) and hands it to the bridge (`_env.use_hook`);
until then the generic hook answers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax


class Backend:
    """The generic engine's hook: every method leaves things as they are."""

    name: str | None = None

    def prepare(self) -> None:
        """Called outside any trace when a model is loaded or jitted."""

    def prepare_weights(self, params: dict[str, jax.Array]) -> None:
        """Called with the weights `hfjax.load` has just read."""

    def prepare_module(self, module) -> None:
        """Called with a torch module whose weights are about to move to JAX (diffusers components)."""

    def loop_carry(self, cache) -> tuple[Any, Callable[[Any], Any]]:
        """(the cache as the decode loop carries it, a function giving the model's layout back)."""
        return cache, lambda carried: carried

    def attention_in_place(self, dtype, groups: int, columns=None) -> contextlib.AbstractContextManager | None:
        """A context in which torch's attention, lowered here, takes keys and values of more rows and
        columns than its queries read, theirs the leading ones (the mask as wide as those columns),
        and reads them where they lie, for a cache of `dtype` with `groups` query heads per key/value
        head; None where it cannot. In it the slot decode runs over the whole cache instead of
        copying its rows' window out and back (`generation._slots`). columns [B] int32, where given:
        how many columns each row's queries may read at most (the mask hides every key past them)."""
        return None

    def custom_calls(self) -> tuple[str, ...]:
        """XLA custom-call targets that programs exported with `jax.export` may hold."""
        return ()

    def compiler_options(self, stage: str) -> dict[str, str] | None:
        """XLA's per-program options (debug options by name) for the programs of `stage` ("decode",
        "whole loop", "train step", ...); None: XLA's defaults."""
        return None

    def fingerprint(self) -> str | None:
        """What programs kept on disk depend on beyond hfjax's source and the library versions."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


_active: list[Backend] = [Backend()]


def active() -> Backend:
    """The hook in use: the one `hfjax._backend.active()` picked, else the generic one."""
    return _active[0]


def set_active(hook: Backend) -> None:
    _active[0] = hook
