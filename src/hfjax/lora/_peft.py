"""peft's LoRA adapters as saved by `PeftModel.save_pretrained` (or `hfjax finetune --lora-r`), read into
host arrays: per linear layer its two factors and the scaling peft applies."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import numpy as np

from .._errors import LoadError

PEFT_PREFIX = "base_model.model."  # what peft puts before a module's (and so a parameter's) name in a saved adapter
# "<module>.lora_A.weight", or with the adapter's name kept ("<module>.lora_A.default.weight")
_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<factor>[AB])(?:\.[^.]+)?\.weight$")
_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


@dataclasses.dataclass(frozen=True)
class LoraLayer:
    """One linear layer's adapter: its output gains `scaling * x @ a.T @ b.T`."""

    a: np.ndarray  # [r, in]
    b: np.ndarray  # [out, r]
    scaling: float  # lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)), or alpha_pattern's alpha


@dataclasses.dataclass(frozen=True)
class PeftAdapter:
    """A peft LoRA adapter read from its directory."""

    path: pathlib.Path
    layers: dict[str, LoraLayer]  # {module name in the transformers model: its factors}
    base_model: str | None  # adapter_config.json's base_model_name_or_path

    @property
    def rank(self) -> int:
        return max(layer.a.shape[0] for layer in self.layers.values())


def read_adapter(path, *, caller: str) -> PeftAdapter:
    """The adapter saved in directory `path`; a LoadError naming what peft wrote that hfjax does not carry
    out (DoRA, LoRA on embeddings, trained biases, `modules_to_save`) or where the files are missing."""
    directory = pathlib.Path(path)
    config_file = directory / "adapter_config.json"
    if not config_file.is_file():
        raise LoadError(
            f"{caller}: {str(path)!r} has no adapter_config.json; pass the directory of an adapter saved by peft "
            "(PeftModel.save_pretrained) or by hfjax finetune --lora-r"
        )
    config = json.loads(config_file.read_text())
    kind = config.get("peft_type")
    if kind != "LORA":
        raise LoadError(f"{caller}: {str(path)!r} holds a {kind} adapter (peft_type); hfjax serves LoRA adapters")
    refused = {
        "use_dora": "DoRA (use_dora=True)",
        "modules_to_save": f"whole modules saved beside the adapter (modules_to_save={config.get('modules_to_save')})",
        "lora_bias": "trained biases of lora_B (lora_bias=True)",
        "alora_invocation_tokens": "an activated LoRA (alora_invocation_tokens)",
        "layer_replication": "replicated layers (layer_replication)",
        "target_parameters": "LoRA on parameters rather than layers (target_parameters)",
        "trainable_token_indices": "trained embedding rows (trainable_token_indices)",
        "use_qalora": "QALoRA's pooled inputs (use_qalora=True)",
        "use_bdlora": "block-diagonal factors (use_bdlora)",
        "arrow_config": "Arrow's routing between adapters (arrow_config)",
        "monteclora_config": "MonteCLoRA's sampled factors (monteclora_config)",
    }
    for field, what in refused.items():
        if config.get(field):
            raise LoadError(
                f"{caller}: {str(path)!r} holds {what}, which hfjax does not apply beside the base; merge it with "
                "peft (PeftModel.merge_and_unload) and load the merged checkpoint"
            )
    if config.get("bias", "none") != "none":
        raise LoadError(
            f"{caller}: {str(path)!r} trains the base's biases (bias={config['bias']!r}); hfjax serves adapters "
            "saved with bias='none'; merge it with peft (PeftModel.merge_and_unload) instead"
        )
    tensors = _tensors(directory, caller)
    factors: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        match = _FACTOR.match(name)
        if match is None:
            raise LoadError(
                f"{caller}: {str(path)!r} holds {key!r}, which is not a LoRA factor of a linear layer (LoRA on "
                "embeddings or convolutions is not served); merge it with peft (PeftModel.merge_and_unload) instead"
            )
        factors.setdefault(match["module"], {})[match["factor"]] = value
    if not factors:
        raise LoadError(f"{caller}: {str(path)!r} holds no LoRA weights")
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    layers = {}
    for module, pair in sorted(factors.items()):
        if set(pair) != {"A", "B"}:
            raise LoadError(
                f"{caller}: {str(path)!r} holds lora_{''.join(pair)} of {module!r} without its other factor"
            )
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != rank:
            raise LoadError(
                f"{caller}: {str(path)!r}: {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                "expected [r, in] and [out, r]"
            )
        layer_alpha = _pattern(config.get("alpha_pattern") or {}, module, alpha)
        scaling = layer_alpha / (rank**0.5 if rslora else rank)
        layers[module] = LoraLayer(a=a, b=b, scaling=scaling)
    return PeftAdapter(path=directory, layers=layers, base_model=config.get("base_model_name_or_path"))


def _pattern(patterns: dict, module: str, default: float) -> float:
    """peft's per-layer override: a key matches the module's name or its dotted tail (as a regex)."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?(?:{key})", module):
            return float(value)
    return default


def _tensors(directory: pathlib.Path, caller: str) -> dict[str, np.ndarray]:
    """{saved name: float32 array} of the adapter's weights file."""
    for filename in _WEIGHTS:
        file = directory / filename
        if file.is_file():
            break
    else:
        raise LoadError(f"{caller}: {str(directory)!r} has neither of {' nor '.join(_WEIGHTS)}; save the adapter again")
    import torch

    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        loaded = load_file(str(file))
    else:
        loaded = torch.load(str(file), map_location="cpu", weights_only=True)
    return {key: value.detach().to(torch.float32).numpy() for key, value in loaded.items()}
