"""Tiny quantized checkpoints in the formats people download, for tests/test_quantization.py.

Each writer takes an unquantized tiny checkpoint (`hfjax.testing.save_tiny_checkpoint`) and writes
the same model quantized, as its tool lays it out:

- compressed-tensors: written by compressed-tensors itself, as llmcompressor's `oneshot` with a
  `QuantizationModifier(scheme=PRESET)` does: the preset's scheme applied with compressed-tensors'
  `apply_quantization_config`, scales from each weight's min and max (llmcompressor's default
  "memoryless_minmax" observer) through compressed-tensors' `calculate_qparams`, then
  `ModelCompressor.compress_model`, `save_pretrained` and `update_config`. For the presets used here
  the tensors are byte for byte those of llmcompressor 0.14 (checked when this was written, in a
  separate environment: llmcompressor pins transformers <= 5.17, so CI's pinned stack cannot install it).
- transformers' fine-grained fp8: transformers' own quantizing op (`Fp8Quantize`) on each linear
  weight; transformers cannot run its fp8 quantizer on a machine without a GPU, so the files are
  written here with its op.
- GPTQ and AWQ: the documented tensor layouts, written by this module (their tools need a GPU):
  GPTQ (AutoGPTQ's "gptq" format): qweight int32 [K / 8, N], 8 values per word along the input,
  lowest bits first; qzeros int32 [G, N / 8] along the output, each zero point stored less 1
  ("gptq_v2" stores it as it is); scales float16 [G, N]; g_idx int32 [K] (act-order: the group of
  each input). AWQ (AutoAWQ's GEMM version): qweight int32 [K, N / 8] and qzeros [G, N / 8], packed
  along the output with field i of a word holding value [0, 2, 4, 6, 1, 3, 5, 7][i]; scales [G, N].
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import torch


def _copy_side_files(base: pathlib.Path, out: pathlib.Path) -> None:
    for file in base.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and file.name != "config.json":
            shutil.copy(file, out / file.name)


def _linear_weights(state: dict[str, torch.Tensor]) -> list[str]:
    # The decoder's linear layers (2-D weights of the layers), not embeddings or the LM head.
    return [k for k, v in state.items() if k.endswith(".weight") and v.ndim == 2 and ".layers." in k]


# ---- compressed-tensors ---------------------------------------------------------------


def _min_max(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    # The minimum and maximum of each cell of the scheme's strategy (llmcompressor's min-max observer).
    n, k = weight.shape
    if args.strategy == "channel":
        return weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    if args.strategy == "group":
        cells = weight.reshape(n, k // args.group_size, args.group_size)
        return cells.amin(-1), cells.amax(-1)
    if args.strategy == "block":
        rows, columns = args.block_structure
        padded = torch.nn.functional.pad(weight, (0, -k % columns, 0, -n % rows))
        cells = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // columns, columns)
        return cells.amin((1, 3)), cells.amax((1, 3))
    return weight.amin().reshape(1), weight.amax().reshape(1)


def compressed_tensors_checkpoint(base: pathlib.Path, out: pathlib.Path, preset: str, *, fmt: str | None = None):
    """`base` quantized with compressed-tensors' preset scheme `preset` ("FP8_DYNAMIC", "W4A16", ...),
    the LM head left out; `fmt` forces a compression format ("naive-quantized"). Returns `out`."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=["lm_head"]
    )
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None:
                continue
            low, high = _min_max(module.weight.float(), scheme.weights)
            scale, zero = calculate_qparams(low, high, scheme.weights)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
                    module.weight_zero_point.shape
                )
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    _copy_side_files(base, out)
    return out


def compressed_tensors_reference(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """The float32 state dict of a compressed-tensors checkpoint, each quantized layer decompressed
    by compressed-tensors' own compressor for its format."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    quantization = json.loads((path / "config.json").read_text())["quantization_config"]
    group = next(iter(quantization["config_groups"].values()))
    scheme = QuantizationScheme(
        **{k: group[k] for k in ("targets", "weights", "input_activations", "format") if k in group}
    )
    compressor = BaseCompressor.load_from_registry(group.get("format") or quantization["format"])
    tensors = load_file(path / "model.safetensors")
    quantized = {key.rpartition(".")[0] for key in tensors if key.endswith(".weight_scale")}
    state = {k: v.float() for k, v in tensors.items() if k.rpartition(".")[0] not in quantized}
    for prefix in quantized:
        local = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.rpartition(".")[0] == prefix}
        state[f"{prefix}.weight"] = compressor.decompress(local, scheme)["weight"].float()
    return state


# ---- transformers' fine-grained fp8 ---------------------------------------------------------


def fine_grained_fp8_checkpoint(base: pathlib.Path, out: pathlib.Path, block: tuple[int, int]) -> pathlib.Path:
    """`base`'s decoder linear layers quantized by transformers' own fp8 op, with `weight_scale_inv`
    per `block`, and the config's quantization_config as transformers writes it."""
    from safetensors.torch import load_file, save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    quantization = FineGrainedFP8Config(weight_block_size=list(block))
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(quantization))
    state = load_file(base / "model.safetensors")
    for key in _linear_weights(state):
        state.update(quantize._quantize_one(key, state.pop(key)))
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = quantization.to_dict()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_side_files(base, out)
    return out


# ---- GPTQ and AWQ (the documented layouts) ---------------------------------------------------


def _pack_along(values: np.ndarray, axis: int, order=tuple(range(8))) -> np.ndarray:
    # uint values 0..15 -> int32, 8 per word along `axis`, field i holding value order[i].
    values = np.moveaxis(values.astype(np.uint32), axis, -1)
    grouped = values.reshape(*values.shape[:-1], -1, 8)
    words = np.zeros(grouped.shape[:-1], np.uint32)
    for field, which in enumerate(order):
        words |= grouped[..., which] << np.uint32(4 * field)
    return np.ascontiguousarray(np.moveaxis(words.view(np.int32), -1, axis))


def _integer_layers(state: dict[str, torch.Tensor], group_size: int, seed: int, low_zero: int):
    """For each decoder linear layer, 4-bit values q [N, K], zero points [N, G] in [low_zero, 15]
    and scales [N, G] (float16-exact) near the layer's weight: (q - z) * s stands for the weight."""
    rng = np.random.default_rng(seed)
    layers = {}
    for key in _linear_weights(state):
        n, k = state[key].shape
        q = rng.integers(0, 16, (n, k), dtype=np.uint8)
        zero = rng.integers(low_zero, 16, (n, k // group_size)).astype(np.float32)
        scale = (np.abs(rng.standard_normal((n, k // group_size))) * 0.004 + 0.001).astype(np.float16)
        layers[key.removesuffix(".weight")] = (q, zero, scale.astype(np.float32))
    return layers


def gptq_checkpoint(base, out, *, group_size: int, act_order: bool, fmt: str = "gptq", seed: int = 0):
    """A GPTQ checkpoint of `base`'s decoder layers with random 4-bit values; returns (path,
    {layer: float32 weight [N, K] it stands for})."""
    from safetensors.torch import load_file

    state = load_file(base / "model.safetensors")
    layers = _integer_layers(state, group_size, seed, low_zero=1 if fmt == "gptq" else 0)
    rng = np.random.default_rng(seed + 1)
    weights = {}
    for prefix, (q, zero, scale) in layers.items():
        n, k = q.shape
        group_of = np.arange(k) // group_size
        if act_order:  # the quantizer's column order: g_idx[k] is the group of input k
            group_of = np.argsort(rng.permutation(k)) // group_size
        weights[prefix] = (q.astype(np.float32) - zero[:, group_of]) * scale[:, group_of]
        del state[f"{prefix}.weight"]
        stored_zero = zero - 1 if fmt == "gptq" else zero
        state[f"{prefix}.qweight"] = torch.from_numpy(_pack_along(q.T, axis=0))
        state[f"{prefix}.qzeros"] = torch.from_numpy(_pack_along(stored_zero.T.astype(np.uint8), axis=1))
        state[f"{prefix}.scales"] = torch.from_numpy(np.ascontiguousarray(scale.T, np.float16))
        state[f"{prefix}.g_idx"] = torch.from_numpy(group_of.astype(np.int32))
    quantization = {
        "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": False,
        "checkpoint_format": fmt,
    }  # fmt: skip
    return _write(base, out, state, quantization), weights


def awq_checkpoint(base, out, *, group_size: int, seed: int = 0):
    """An AWQ (GEMM) checkpoint of `base`'s decoder layers with random 4-bit values; returns (path,
    {layer: float32 weight [N, K] it stands for})."""
    from safetensors.torch import load_file

    state = load_file(base / "model.safetensors")
    layers = _integer_layers(state, group_size, seed, low_zero=0)
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    weights = {}
    for prefix, (q, zero, scale) in layers.items():
        group_of = np.arange(q.shape[1]) // group_size
        weights[prefix] = (q.astype(np.float32) - zero[:, group_of]) * scale[:, group_of]
        del state[f"{prefix}.weight"]
        state[f"{prefix}.qweight"] = torch.from_numpy(_pack_along(q.T, axis=1, order=order))
        state[f"{prefix}.qzeros"] = torch.from_numpy(_pack_along(zero.T.astype(np.uint8), axis=1, order=order))
        state[f"{prefix}.scales"] = torch.from_numpy(np.ascontiguousarray(scale.T, np.float16))
    quantization = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    return _write(base, out, state, quantization), weights


def _write(base, out, state, quantization) -> pathlib.Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_side_files(base, out)
    return out


def plain_model(path: pathlib.Path, state: dict[str, torch.Tensor]):
    """The checkpoint's model class without its quantization, in float32, holding `state` (float weights)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.tie_weights()
    return model
