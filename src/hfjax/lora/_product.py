"""The adapters' products inside a program: each targeted linear layer's output gains its row's adapter
product, for every row at once (Punica's "bgmv", as one pair of dense products over the stacked slots).

A Model's params hold, per targeted layer, the stacked factors of every adapter slot (`_stack`), under
names that start with `PREFIX`. `bridge.bound` hands those to `applied`, which hooks the layers for the
length of the trace. Which slot each row uses comes from `rows` (the slot core's per-row array), else
from the params' `active` entry (`Model.set_adapter`), the same for every row.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import torch

from .. import bridge

PREFIX = "hfjax.lora."  # the params' names of the adapters' arrays
ACTIVE = "active"  # [] int32: the adapter slot of every row where `rows` gives none; -1: the base alone
_FACTORS = (".a", ".b")  # "<layer>.a" [in, N, R] and "<layer>.b" [N, R, out] (the scaling folded in)

_ROWS: contextvars.ContextVar = contextvars.ContextVar("hfjax_lora_rows", default=None)


@contextlib.contextmanager
def rows(slots):
    """Inside it, the traced model's rows use the adapter slots `slots` ([B] int32 per row, -1: the base)."""
    token = _ROWS.set(slots)
    try:
        yield
    finally:
        _ROWS.reset(token)


@bridge.extension(PREFIX)
@contextlib.contextmanager
def applied(module: torch.nn.Module, arrays: dict[str, torch.Tensor]):
    """Hooks every targeted layer of `module` with its adapters' product while torch code runs."""
    active = arrays[ACTIVE]
    handles = []
    for name in sorted({key[: -len(".a")] for key in arrays if key.endswith(_FACTORS[0])}):
        hook = functools.partial(_add_product, a=arrays[name + ".a"], b=arrays[name + ".b"], active=active)
        handles.append(module.get_submodule(name).register_forward_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _add_product(layer, args, kwargs, output, *, a, b, active):
    x = args[0] if args else kwargs["input"]
    slots = _ROWS.get()
    slots = bridge.to_jax(active) if slots is None else slots
    added = product(bridge.to_jax(x), bridge.to_jax(a), bridge.to_jax(b), slots)
    out = bridge.to_jax(output)
    return bridge.to_torch(out + added.astype(out.dtype))


def product(x, a, b, slots):
    """Each row's adapter product: x [B, ..., in]; a [in, N, R], b [N, R, out] (N slots of rank R, zero
    past each adapter's own rank); slots [B] int32 or [] (every row), -1 for none. Returns [B, ..., out],
    zeros where no row uses an adapter (a `lax.cond`: a batch on the base alone skips the products)."""
    inputs, count, rank = a.shape
    slots = jnp.asarray(slots, jnp.int32)

    def with_adapters():
        picked = jnp.repeat(jax.nn.one_hot(slots, count, dtype=x.dtype), rank, axis=-1)  # [B, N*R] or [N*R]
        if slots.ndim == 1:
            picked = picked.reshape(slots.shape[0], *(1,) * (x.ndim - 2), count * rank)
        down = jnp.matmul(x, a.reshape(inputs, count * rank).astype(x.dtype))  # [B, ..., N*R]
        return jnp.matmul(down * picked, b.reshape(count * rank, -1).astype(x.dtype))

    def none():
        return jnp.zeros((*x.shape[:-1], b.shape[-1]), x.dtype)

    return jax.lax.cond(jnp.any(slots >= 0), with_adapters, none)
