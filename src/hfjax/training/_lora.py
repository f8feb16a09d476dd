"""LoRA through peft: peft wraps the model's torch skeleton, and its LoRA layers, plain torch code,
run through torchax like the rest of the model.

The wrapped module is peft's `LoraModel.model`: the transformers class itself, whose targeted
layers are now peft's `lora.Linear` (names such as `...q_proj.base_layer.weight` and
`...q_proj.lora_A.default.weight`). Only the parameters peft leaves trainable (`requires_grad`)
are trained; the base weights are the loaded jax.Arrays, unchanged and shared.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pathlib

import jax
import torch

from .. import _quiet, bridge
from .._errors import TrainingError
from ..lora import PEFT_PREFIX

ADAPTER = "default"


@dataclasses.dataclass
class LoraModule:
    """The peft-wrapped skeleton and how its names relate to the original model's."""

    peft_model: torch.nn.Module  # peft's PeftModel, for its config and its state-dict naming
    module: torch.nn.Module  # the transformers module with LoRA layers in it
    config: object  # the peft LoraConfig
    params: dict[str, jax.Array]  # every weight and buffer of `module`, by its name there
    aliases: dict[str, str]
    trainable: list[str]  # names of `params` that are trained


def wrap(module: torch.nn.Module, params: dict, aliases: dict, lora, *, seed: int) -> LoraModule:
    """`module` (a Model's skeleton, left as it is) with LoRA layers, from a `peft.LoraConfig` or the
    directory of a saved adapter, whose weights are then the starting point."""
    peft = _import_peft()
    adapter_dir = None
    if isinstance(lora, (str, os.PathLike)):
        adapter_dir = pathlib.Path(lora)
        if not (adapter_dir / "adapter_config.json").is_file():
            raise TrainingError(
                f"hfjax.Trainer(lora={str(lora)!r}): no adapter_config.json there; pass the directory of an adapter "
                "saved by peft (PeftModel.save_pretrained) or a peft.LoraConfig"
            )
        config = peft.PeftConfig.from_pretrained(str(adapter_dir))
        config.inference_mode = False  # a saved config says True: it was saved for inference
    elif isinstance(lora, peft.LoraConfig):
        config = copy.deepcopy(lora)
    else:
        raise TrainingError(
            f"hfjax.Trainer(lora=...): got a {type(lora).__name__}; pass None (full fine-tuning), a "
            "peft.LoraConfig, or the directory of a saved peft adapter"
        )
    if getattr(config, "peft_type", None) != peft.PeftType.LORA or getattr(config, "use_dora", False):
        raise TrainingError(
            f"hfjax.Trainer(lora=...): the adapter is {getattr(config, 'peft_type', None)}"
            f"{' with use_dora=True' if getattr(config, 'use_dora', False) else ''}; hfjax trains plain LoRA adapters"
        )
    with _quiet.peft_wrapping():
        peft_model = peft.get_peft_model(_meta_copy(module), config)
    inner = peft_model.base_model.model
    canonical, new_aliases = bridge.tensor_names(inner)
    trainable = [n for n, p in inner.named_parameters() if p.requires_grad]
    saved = saved_names(peft_model, trainable)
    fresh = _initial_lora(inner, config, seed) if adapter_dir is None else _read_adapter(adapter_dir, saved)
    new_params = {}
    for name in canonical:
        if name in fresh:
            new_params[name] = fresh[name]
        else:
            source = original_name(name)
            new_params[name] = params[aliases.get(source, source)]
    return LoraModule(peft_model, inner, config, new_params, new_aliases, trainable)


def original_name(name: str) -> str:
    """The name a weight of the wrapped module has in the unwrapped one."""
    return (
        name.replace(".base_layer.", ".").replace(".original_module.", ".").replace(f".modules_to_save.{ADAPTER}.", ".")
    )


def saved_names(peft_model, names: list[str]) -> dict[str, str]:
    """{name in the wrapped module: its key in adapter_model.safetensors}, as peft's own
    `get_peft_model_state_dict` names it."""
    from peft import get_peft_model_state_dict

    markers = {f"{PEFT_PREFIX}{n}": torch.zeros(1) for n in names}
    by_id = {id(t): n.removeprefix(PEFT_PREFIX) for n, t in markers.items()}
    named = get_peft_model_state_dict(peft_model, state_dict=markers, adapter_name=ADAPTER, save_embedding_layers=False)
    return {by_id[id(t)]: key for key, t in named.items() if id(t) in by_id}


def _meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    # The skeleton without its parameters' data (a module from Model.from_module holds real ones):
    # the values come from the params dict.
    memo = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    return copy.deepcopy(module, memo)


def _initial_lora(inner: torch.nn.Module, config, seed: int) -> dict[str, jax.Array]:
    # peft's own initialisation (`reset_lora_parameters`), run on CPU copies of the new layers.
    from peft.tuners.lora import LoraLayer

    values = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for prefix, layer in inner.named_modules():
            if not isinstance(layer, LoraLayer) or ADAPTER not in layer.lora_A:
                continue
            parts = [layer.lora_A[ADAPTER], layer.lora_B[ADAPTER]]
            for part in parts:
                part.to_empty(device="cpu")
            layer.reset_lora_parameters(ADAPTER, config.init_lora_weights)
            for attr, part in zip(("lora_A", "lora_B"), parts):
                for name, p in part.named_parameters():
                    values[f"{prefix}.{attr}.{ADAPTER}.{name}"] = bridge.torch_to_jax(p)
                part.to("meta")
    return values


def _read_adapter(directory: pathlib.Path, saved: dict[str, str]) -> dict[str, jax.Array]:
    from safetensors.torch import load_file

    file = directory / "adapter_model.safetensors"
    if not file.is_file():
        raise TrainingError(
            f"hfjax.Trainer(lora={str(directory)!r}): no adapter_model.safetensors there; save the adapter with "
            "peft's save_pretrained (safe_serialization=True, the default)"
        )
    tensors = load_file(file)
    missing = sorted(key for key in saved.values() if key not in tensors)
    if missing:
        raise TrainingError(
            f"hfjax.Trainer(lora={str(directory)!r}): the adapter lacks {len(missing)} weights the config asks for, "
            f"e.g. {missing[0]!r}; was it saved for this model?"
        )
    return {name: bridge.torch_to_jax(tensors[key]) for name, key in saved.items()}


def merged_params(lora: LoraModule, params: dict) -> dict[str, jax.Array]:
    """The unwrapped model's weights with each LoRA update added in (peft's `get_delta_weight`),
    by their names in the unwrapped model."""
    from peft.tuners.lora import LoraLayer

    merged = {original_name(n): a for n, a in params.items() if ".lora_" not in n}
    # modules_to_save: the trained copy replaces the original.
    merged.update({original_name(n): a for n, a in params.items() if f".modules_to_save.{ADAPTER}." in n})
    with bridge.bound(lora.module, params, lora.aliases, bridge.prng_key()):
        for prefix, layer in lora.module.named_modules():
            if isinstance(layer, LoraLayer) and ADAPTER in layer.lora_A:
                delta = bridge.to_jax(layer.get_delta_weight(ADAPTER))
                base = f"{prefix}.weight"
                merged[base] = (merged[base] + delta.astype(merged[base].dtype)).astype(merged[base].dtype)
    return merged


def _import_peft():
    try:
        import peft
    except ImportError:
        raise TrainingError(
            "hfjax.Trainer(lora=...) needs peft: pip install 'hfjax[train]' (or pip install peft)"
        ) from None
    return peft
