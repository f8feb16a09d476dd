"""Optimizers and learning-rate schedules as the Hugging Face Trainer sets them up, in optax.

transformers' schedules are `LambdaLR` multipliers of the peak rate, read at the optimizer step
about to run (0 for the first); optax reads a schedule at the update count before the update,
the same number, so these give the same rate at every step.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
import torch

# Names that the HF Trainer keeps out of weight decay, besides parameters of LayerNorm modules.
_NO_DECAY_NAMES = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def linear_schedule(peak: float, *, warmup_steps: int = 0, total_steps: int) -> optax.Schedule:
    """transformers' `get_linear_schedule_with_warmup`: 0 -> `peak` over the warmup, then down to 0
    at `total_steps`.

    Example:
      >>> schedule = linear_schedule(1e-3, warmup_steps=10, total_steps=100)
      >>> float(schedule(5)), float(schedule(55))
      (0.0005, 0.0005)
    """
    _check_steps(warmup_steps, total_steps, caller="linear_schedule")

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        warmup = count / max(1, warmup_steps)
        decay = jnp.maximum(0.0, (total_steps - count) / max(1, total_steps - warmup_steps))
        return peak * jnp.where(count < warmup_steps, warmup, decay)

    return schedule


def cosine_schedule(peak: float, *, warmup_steps: int = 0, total_steps: int, num_cycles: float = 0.5) -> optax.Schedule:
    """transformers' `get_cosine_schedule_with_warmup`: 0 -> `peak` over the warmup, then half a cosine
    (`num_cycles=0.5`) down to 0 at `total_steps`.

    Example:
      >>> schedule = cosine_schedule(1e-3, warmup_steps=0, total_steps=100)
      >>> float(schedule(50))  # half way down
      0.0005
    """
    _check_steps(warmup_steps, total_steps, caller="cosine_schedule")

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        warmup = count / max(1, warmup_steps)
        progress = (count - warmup_steps) / max(1, total_steps - warmup_steps)
        decay = jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(math.pi * num_cycles * 2.0 * progress)))
        return peak * jnp.where(count < warmup_steps, warmup, decay)

    return schedule


def _check_steps(warmup_steps: int, total_steps: int, *, caller: str) -> None:
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"hfjax.training.{caller}: warmup_steps={warmup_steps}, total_steps={total_steps}; "
            "pass 0 <= warmup_steps <= total_steps"
        )


def decay_mask(module: torch.nn.Module) -> Callable[[dict], dict]:
    """Which parameters get weight decay, as the HF Trainer decides: all but biases and norms.

    A parameter is left out when it belongs to a normalisation module (`torch.nn.LayerNorm`, or a
    class whose name ends in "Norm", as LlamaRMSNorm or T5LayerNorm) or its name holds "bias" or
    a norm name ("layernorm", "rmsnorm", ".norm.", "_norm").

    Args:
      module: the model's torch module (`model.module`).

    Returns:
      A function {name: array} -> {name: bool}, for optax's `mask=` (it is called with the
      parameters being trained, all of them or LoRA's).

    Example:
      >>> optax.adamw(1e-4, weight_decay=0.01, mask=hfjax.training.decay_mask(model.module))
    """
    norms = set()
    for prefix, child in module.named_modules():
        if isinstance(child, torch.nn.LayerNorm) or type(child).__name__.endswith("Norm"):
            norms.update(f"{prefix}.{name}" if prefix else name for name, _ in child.named_parameters(recurse=False))

    def mask(params: dict) -> dict:
        return {name: name not in norms and not _NO_DECAY_NAMES.search(name.lower()) for name in params}

    return mask


def adamw(
    learning_rate: float | optax.Schedule,
    *,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    mask: Callable[[dict], dict] | None = None,
) -> optax.GradientTransformation:
    """AdamW as `torch.optim.AdamW` computes it, with its learning rate readable by the Trainer.

    Args:
      learning_rate: a float or a schedule (`linear_schedule`, `cosine_schedule`).
      weight_decay: decoupled decay, applied where `mask` says (pass `decay_mask(model.module)`
        for the HF Trainer's choice; None decays every trained parameter).

    Example:
      >>> opt = hfjax.training.adamw(linear_schedule(1e-4, total_steps=100), weight_decay=0.01,
      ...                            mask=hfjax.training.decay_mask(model.module))
    """
    return optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask
    )


def sgd(learning_rate: float | optax.Schedule, *, momentum: float | None = None) -> optax.GradientTransformation:
    """SGD (optionally with heavy-ball momentum, as `torch.optim.SGD`), its learning rate readable by the Trainer.

    Example:
      >>> opt = hfjax.training.sgd(0.1)
    """
    return optax.inject_hyperparams(optax.sgd)(learning_rate=learning_rate, momentum=momentum)


def learning_rate(opt_state) -> jax.Array | None:
    """The learning rate of the last update, where the optimizer keeps it (`optax.inject_hyperparams`)."""
    for node in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams")):
        if hasattr(node, "hyperparams") and "learning_rate" in node.hyperparams:
            return node.hyperparams["learning_rate"]
    return None
