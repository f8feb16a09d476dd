"""Tiny peft LoRA adapters of a tiny checkpoint, saved as `PeftModel.save_pretrained` writes them."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import torch
import transformers


def save_tiny_adapter(
    base: str | pathlib.Path,
    path: str | pathlib.Path,
    *,
    r: int = 4,
    lora_alpha: float = 8,
    target_modules: Sequence[str] | str = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    seed: int = 0,
    scale: float = 0.5,
    **config: object,
) -> pathlib.Path:
    """Writes a LoRA adapter of the causal LM checkpoint `base` with peft (the `train` extra).

    Both factors are random (peft starts B at zero, which would make the adapter change nothing): A as
    peft's `init_lora_weights=False` draws it, B from N(0, scale), under `torch.manual_seed(seed)`.
    `config`: other `peft.LoraConfig` fields (alpha_pattern, use_dora, ...). Returns `path`.

    Example:
        >>> base = save_tiny_checkpoint("llama", tmp / "llama")
        >>> adapter = save_tiny_adapter(base, tmp / "adapter", r=8, target_modules="all-linear")
    """
    import peft

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = peft.LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules) if not isinstance(target_modules, str) else target_modules,
        use_rslora=use_rslora,
        init_lora_weights=False,
        **config,
    )
    wrapped = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, scale)
    path = pathlib.Path(path)
    wrapped.save_pretrained(path)
    return path
