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
    past each adapter's own rank); slots [B] int32, or [] for every row, -1 for none. Returns
    [B, ..., out], zeros where no row uses an adapter (a `lax.cond`: a batch on the base alone skips the
    products). One slot for every row reads its factors alone; fewer rows than slots gather each row's;
    more take the products over every slot, masked to each row's (the bytes read are the fewest)."""
    inputs, count, rank = a.shape
    slots = jnp.asarray(slots, jnp.int32)
    rows = x.reshape(x.shape[0], -1, inputs)  # [B, T, in]
    on = slots >= 0
    picked = jnp.maximum(slots, 0)

    def one_slot():
        a_slot = jax.lax.dynamic_index_in_dim(a, picked, axis=1, keepdims=False).astype(x.dtype)  # [in, R]
        b_slot = jax.lax.dynamic_index_in_dim(b, picked, axis=0, keepdims=False).astype(x.dtype)  # [R, out]
        return jnp.matmul(jnp.matmul(rows, a_slot), b_slot)

    def each_rows_slot():
        a_rows = jnp.take(a, picked, axis=1).astype(x.dtype)  # [in, B, R]
        b_rows = jnp.take(b, picked, axis=0).astype(x.dtype)  # [B, R, out]
        down = jnp.einsum("bti,ibr->btr", rows, a_rows) * on[:, None, None].astype(x.dtype)
        return jnp.einsum("btr,bro->bto", down, b_rows)

    def every_slot():
        mask = jnp.repeat(jax.nn.one_hot(slots, count, dtype=x.dtype), rank, axis=-1)  # [B, N*R]
        down = jnp.matmul(rows, a.reshape(inputs, count * rank).astype(x.dtype)) * mask[:, None, :]
        return jnp.matmul(down, b.reshape(count * rank, -1).astype(x.dtype))

    if slots.ndim == 0:
        chosen = one_slot
    else:
        chosen = each_rows_slot if slots.shape[0] < count else every_slot

    def none():
        return jnp.zeros((*rows.shape[:-1], b.shape[-1]), x.dtype)

    added = jax.lax.cond(jnp.any(on), chosen, none)
    return added.reshape(*x.shape[:-1], b.shape[-1])
