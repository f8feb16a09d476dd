"""Random weights for tiny checkpoints: constant parameters made to vary."""

from __future__ import annotations

import torch


@torch.no_grad()
def perturb_constant_parameters(model: torch.nn.Module, std: float) -> None:
    # Families initialise biases to 0 and norm scales (and Mamba's D) to 0 or 1. Adding
    # N(0, std) noise to every such constant tensor lets each parameter change the logits,
    # so a parity test fails if a bias is dropped or a norm offset is mishandled. Tensors
    # the family initialised randomly (including special ones like Mamba's A_log) are kept.
    for param in model.parameters():
        if param.is_floating_point() and param.numel() > 1 and bool((param == param.flatten()[0]).all()):
            param.add_(torch.randn_like(param) * std)
