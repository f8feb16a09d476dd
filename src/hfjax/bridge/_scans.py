"""One `lax.scan` for recurrences that transformers writes as a Python loop over the sequence.

Without the `mamba_ssm` package, the Mamba 1 mixers (Mamba, FalconMamba, Jamba's and Zamba's mamba
layers) run transformers' reference selective scan, `mamba_selective_scan` in each model's module: a
`for index in range(seq_len)` loop, which a trace unrolls into seq_len copies of its step. A
prompt's program as wide as a served model's context (the slot core's prefill windows, up to
`max_model_len`) then takes minutes to compile: tiny Zamba's 256-column prefill took 51 s.

`scans(module)` points those modules' `mamba_selective_scan` at `selective_scan` for the length of
the block (`bound` enters it around all torch code it runs, one thread at a time): the same
arithmetic, in the same order, with the loop one `lax.scan` whose program does not grow with the
sequence. On tensors that are not torchax's (PyTorch run in another thread meanwhile) it calls the
module's own function.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref

import jax
import jax.numpy as jnp
import torch
from torchax import interop
from torchax.tensor import Tensor as JaxTensor
from torchax.tensor import View as JaxView

_NAME = "mamba_selective_scan"


def _states_read_out(decay, inflow, readout, output_dtype):
    """The recurrence state[t] = decay[t] * state[t-1] + inflow[t] from zeros, each state read out by
    readout[t]: decay and inflow [B, D, L, N] (the discretised A and B times the input), readout
    [B, L, N] (C). Returns the outputs [B, D, L] in `output_dtype` and the last state [B, D, N]."""
    state_dtype = jnp.result_type(decay.dtype, inflow.dtype, output_dtype)

    def step(state, inputs):  # state [B, D, N]
        a, u, c = inputs  # [B, D, N], [B, D, N], [B, N]
        state = a * state + u
        return state, jnp.matmul(state.astype(output_dtype), c[:, :, None])[:, :, 0]  # [B, D]

    start = jnp.zeros(decay.shape[:2] + decay.shape[3:], state_dtype)
    last, outputs = jax.lax.scan(step, start, (jnp.moveaxis(decay, 2, 0), jnp.moveaxis(inflow, 2, 0),
                                               jnp.moveaxis(readout, 1, 0)))  # fmt: skip
    return jnp.moveaxis(outputs, 0, 2), last


def selective_scan(original, hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False, **_):  # fmt: skip
    """transformers' `mamba_selective_scan`: hidden_states and dt [B, D, L], A [D, N], B and C
    [B, N, L]; returns the output [B, D, L] (and the last state [B, D, N] with return_last_state).
    `original` is the module's own function, for tensors that are not torchax's."""
    if not isinstance(hidden_states, (JaxTensor, JaxView)):
        return original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                        return_last_state=return_last_state, **_)  # fmt: skip
    dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = torch.nn.functional.softplus(dt)
    B, C = B.transpose(1, 2), C.transpose(1, 2)  # [B, L, N]
    decay = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # [B, D, L, N]
    inflow = dt[:, :, :, None] * B[:, None, :, :].float() * hidden_states[:, :, :, None].float()  # [B, D, L, N]
    output, last = interop.call_jax(_states_read_out, decay, inflow, C, dtype)  # (call_jax maps the dtype too)
    if D is not None:
        output = output + hidden_states * D[None, :, None]
    if z is not None:
        output = output * torch.nn.functional.silu(z)
    return (output, last) if return_last_state else output


_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> the model modules it runs


@contextlib.contextmanager
def scans(module: torch.nn.Module):
    """Within the block, the transformers modules of `module`'s submodules that define the reference
    selective scan run `selective_scan` in its place (see the docstring)."""
    found = _FOUND.get(module)
    if found is None:
        names = {type(m).__module__ for m in module.modules()}
        found = _FOUND[module] = [
            sys.modules[n] for n in sorted(names) if callable(getattr(sys.modules.get(n), _NAME, None))
        ]
    swapped = []
    for model_module in found:
        original = getattr(model_module, _NAME)
        if isinstance(original, functools.partial) and original.func is selective_scan:  # an enclosing block's
            continue
        setattr(model_module, _NAME, functools.partial(selective_scan, original))
        swapped.append((model_module, original))
    try:
        yield
    finally:
        for model_module, original in swapped:
            setattr(model_module, _NAME, original)
