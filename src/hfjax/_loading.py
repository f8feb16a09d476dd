"""Checkpoint directory (or hub id) -> HF module skeleton + {name: jax.Array}.

The module is built with its parameters on the meta device, so torch never holds
the weights; each safetensors tensor is read straight into a jax.Array in the
requested dtype. Checkpoints whose keys need transformers' conversions (per-expert
MoE weights fused into one tensor, renamed legacy keys) go through transformers' own
conversion rules, one target tensor at a time.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import torch
from safetensors import safe_open

from . import _dtypes, _env, _tasks
from ._errors import LoadError

_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "1_Pooling/*"]
_PROGRESS_BYTES = 64 * 2**20  # show a progress bar above this checkpoint size


# ---- where the files are ------------------------------------------------------


def resolve(path_or_hub_id: str | os.PathLike) -> pathlib.Path:
    """A local checkpoint directory for a path or a hub id (downloading where a hub is reachable)."""
    path = pathlib.Path(path_or_hub_id).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LoadError(
                f"hfjax.load: {str(path)!r} is a directory but holds no config.json; pass a checkpoint directory"
            )
        return path
    text = str(path_or_hub_id)
    looks_local = text.startswith((".", "/", "~")) or text.count("/") > 1 or path.suffix != ""
    if looks_local or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", text):
        raise LoadError(
            f"hfjax.load: no checkpoint directory at {text!r}; pass an existing local path or a hub id like 'org/name'"
        )
    return _download(text)


def _download(repo_id: str) -> pathlib.Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return pathlib.Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except RepositoryNotFoundError:
        raise LoadError(
            f"hfjax.load: {repo_id!r} is neither a local directory nor a model on the Hugging Face Hub"
        ) from None
    except (LocalEntryNotFoundError, OSError) as error:
        raise LoadError(
            f"hfjax.load: {repo_id!r} is not a local directory and the Hugging Face Hub could not be reached "
            f"({type(error).__name__}); pass a local path to a checkpoint directory"
        ) from None


# ---- config, task, class --------------------------------------------------------


def read_config(path: pathlib.Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as error:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
        raise LoadError(
            f"hfjax.load: {str(path)!r} has model_type {model_type!r}, which the installed transformers does not know "
            f"({error.__class__.__name__}); upgrade transformers or check config.json"
        ) from None


def context_length(config) -> int | None:
    """The most tokens a model's positions allow (config.max_position_embeddings or its aliases)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def build_skeleton(config, task: str, dtype: str | None) -> torch.nn.Module:
    """The HF module for `config` and `task`: parameters on the meta device (no memory, no random
    init), buffers real, in eval mode.

    The module is built on the meta device, then its buffers get real values the way transformers'
    own `from_pretrained` gives them: moved to the CPU and set by the model's `_init_weights`, with
    every parameter marked as initialized so that none is touched.
    """
    auto = _tasks.auto_class(task, config)
    torch_dtype = _dtypes.torch_dtype(dtype) if dtype else torch.float32
    try:
        with torch.device("meta"):
            module = auto.from_config(config, dtype=torch_dtype)
    except ValueError as error:
        raise LoadError(
            f"hfjax.load: task={task!r} has no model class for model_type {config.model_type!r} ({error}); "
            f"pick another task from {_tasks.TASKS}"
        ) from None
    _materialize_buffers(module)
    return module.eval()


def _materialize_buffers(module: torch.nn.Module) -> None:
    # A buffer the model's _init_weights does not set keeps its sentinel and goes back to the meta
    # device: then the checkpoint must hold it (`load_weights` says so), and no garbage is used.
    for parameter in module.parameters():
        parameter._is_hf_initialized = True
    made = []
    for submodule in module.modules():
        for name, buffer in list(submodule._buffers.items()):
            if buffer is not None and buffer.device.type == "meta":
                submodule._buffers[name] = torch.full_like(buffer, _sentinel(buffer.dtype), device="cpu")
                made.append((submodule, name))
    module.initialize_weights()
    for parameter in module.parameters():
        del parameter._is_hf_initialized
    for submodule, name in made:
        buffer = submodule._buffers[name]
        if (
            buffer.numel()
            and buffer.dtype != torch.bool
            and bool((buffer.isnan() | (buffer == _sentinel(buffer.dtype))).all())
        ):
            submodule._buffers[name] = buffer.to("meta")


def _sentinel(dtype: torch.dtype):
    # What an unset buffer holds: NaN (complex too: llama4's vision rotary table), or the smallest
    # integer (bool buffers are left False).
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return False if dtype == torch.bool else torch.iinfo(dtype).min


# ---- weights -------------------------------------------------------------------


def weight_files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise LoadError(
            f"hfjax.load: {str(path)!r} holds no *.safetensors weights; save the model with safe_serialization"
        )
    return found


def checkpoint_dtype(files: list[pathlib.Path]) -> str:
    """The dtype of the checkpoint's first floating weight ("float32" when it has none)."""
    with safe_open(files[0], framework="np") as f:
        for key in f.keys():
            name = _dtypes.SAFETENSORS.get(f.get_slice(key).get_dtype())
            if name in _dtypes.NAMES:
                return name
    return "float32"


def tensor_names(module: torch.nn.Module) -> tuple[dict, dict]:
    """({first name of each distinct parameter or buffer: the tensor}, {every other name of a tied
    tensor: its first name})."""
    first, aliases, seen = {}, {}, {}
    for name, tensor in list(module.named_parameters(remove_duplicate=False)) + list(
        module.named_buffers(remove_duplicate=False)
    ):
        if id(tensor) in seen:
            aliases[name] = seen[id(tensor)]
        else:
            seen[id(tensor)] = name
            first[name] = tensor
    return first, aliases


def load_weights(
    module: torch.nn.Module,
    files: list[pathlib.Path],
    dtype: str,
    *,
    progress: bool | None = None,
    shardings: dict[str, jax.sharding.NamedSharding] | None = None,
):
    """Reads every tensor the module needs into jax.Arrays of `dtype` (float tensors only are cast).

    With `shardings` ({name: NamedSharding}), each device's slice is read straight from the
    file into that device (see `_read_sharded`); names it lacks are replicated over its mesh.

    Returns:
        (params, aliases): {canonical name: jax.Array} and {tied name: canonical name}.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    target = _dtypes.jax_dtype(dtype)
    expected, aliases = tensor_names(module)
    meta_state = dict(expected)
    meta_state.update({k: expected[v] for k, v in aliases.items()})

    mapping = get_model_conversion_mapping(module)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(module, "base_model_prefix", None) or None

    direct: dict[str, tuple[pathlib.Path, str]] = {}
    grouped: dict[str, tuple[object, list]] = {}
    total_bytes = 0
    for file in files:
        with safe_open(file, framework="np") as f:
            for key in f.keys():
                renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
                if renamed not in meta_state and key in meta_state:
                    # A key the module already has is kept when a renaming would lose it, as transformers
                    # does (deepseek_v4's `\.norm\.` -> `.kv_norm.` also matches its final `model.norm.weight`).
                    renamed, pattern = rename_source_key(key, [], [], prefix, meta_state)
                renamed = aliases.get(renamed, renamed)
                if renamed not in expected:
                    continue
                total_bytes += _nbytes(f.get_slice(key))
                if pattern is None:
                    direct[renamed] = (file, key)
                else:
                    grouped.setdefault(renamed, (by_pattern[pattern], []))[1].append((file, key, pattern))

    params: dict[str, jax.Array] = {}
    bar = _progress(total_bytes, progress)
    for name, (file, key) in direct.items():
        if shardings is not None:
            params[name] = _read_sharded(file, key, _sharding_for(shardings, name), target, expected[name])
            bar.update(_nbytes_of(params[name]))
            continue
        with safe_open(file, framework="flax") as f:
            array = f.get_tensor(key)
        params[name] = _cast(array, target, expected[name])
        bar.update(array.nbytes)
    for first_name, (converter, sources) in grouped.items():
        for name, value in _convert_group(module, converter, first_name, sources).items():
            if name in expected:
                params[name] = _cast(_env.torch_to_jax(value), target, expected[name])
                if shardings is not None:
                    # Tensors built by transformers' conversions (per-expert weights fused into
                    # one) are assembled whole on the host first, then split to the devices.
                    params[name] = jax.device_put(params[name], _sharding_for(shardings, name))
                bar.update(params[name].nbytes)
    bar.close()

    missing = [n for n, t in expected.items() if n not in params and t.device.type == "meta"]
    for name in [n for n in missing if _not_saved(module, n)]:
        value = _initialized(module, name)
        if value is not None:
            params[name] = _cast(_env.torch_to_jax(value), target, expected[name])
            if shardings is not None:
                params[name] = jax.device_put(params[name], _sharding_for(shardings, name))
    missing = [n for n in missing if n not in params]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise LoadError(
            f"hfjax.load: the checkpoint has no weights for {len(missing)} parameters or buffers of {type(module).__name__}: {shown}; "
            "the checkpoint was saved for another architecture or task (pass task=...)"
        )
    for name, tensor in expected.items():
        if name not in params:  # real buffers the checkpoint does not store (rotary frequencies, ...)
            params[name] = _env.torch_to_jax(tensor)
            if shardings is not None:
                params[name] = _place(np.asarray(params[name]), _sharding_for(shardings, name))
    return params, aliases


def _not_saved(module: torch.nn.Module, name: str) -> bool:
    """Whether transformers leaves `name` out of the checkpoints it writes and sets it again when it
    loads them (`_keys_to_ignore_on_save`: MarianMTModel's sinusoidal position tables)."""
    return any(re.search(pattern, name) for pattern in getattr(module, "_keys_to_ignore_on_save", None) or ())


@torch.no_grad()
def _initialized(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The value `from_pretrained` gives a tensor that checkpoints leave out: the model's own
    `_init_weights` run on a CPU copy of the submodule that holds it (the skeleton stays on the
    meta device); None if `_init_weights` does not set it."""
    owner_name, _, leaf = name.rpartition(".")
    if not owner_name:  # a tensor of the model itself: materialising the whole model is not worth it
        return None
    owner = copy.deepcopy(module.get_submodule(owner_name)).to_empty(device="cpu")
    tensor = getattr(owner, leaf)
    if not tensor.is_floating_point():
        return None
    tensor.fill_(float("nan"))
    module._init_weights(owner)
    tensor = getattr(owner, leaf)
    return None if bool(tensor.isnan().any()) else tensor.detach()


# ---- sharded reads (hfjax.parallel decides the shardings) ----------------------


def _sharding_for(shardings: dict, name: str) -> jax.sharding.NamedSharding:
    if name in shardings:
        return shardings[name]
    mesh = next(iter(shardings.values())).mesh
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _read_sharded(file: pathlib.Path, key: str, sharding, target, reference: torch.Tensor) -> jax.Array:
    # Each addressable device's block is read from the file on its own, so no device and no
    # host buffer holds more than one block (blocks of replicated tensors are whole).
    with safe_open(file, framework="pt") as f:
        tensor = f.get_slice(key)
        shape = tuple(tensor.get_shape())
        if shape != tuple(reference.shape):
            raise LoadError(
                f"hfjax.load: the checkpoint tensor {key!r} has shape {shape} where the model expects "
                f"{tuple(reference.shape)}; config.json does not match the weights"
            )
        cast = reference.dtype.is_floating_point and tensor.get_dtype() in ("F32", "BF16", "F16", "F64")
        dtype = np.dtype(target) if cast else None
        return jax.make_array_from_callback(shape, sharding, lambda index: _to_numpy(tensor[index], dtype))


def _to_numpy(block: torch.Tensor, dtype) -> np.ndarray:
    if block.dtype == torch.bfloat16:
        array = block.contiguous().view(torch.int16).numpy().view(jnp.bfloat16)
    else:
        array = block.contiguous().numpy()
    return array if dtype is None else array.astype(dtype, copy=False)


def _place(array: np.ndarray, sharding) -> jax.Array:
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _nbytes_of(array: jax.Array) -> int:
    return array.size * array.dtype.itemsize


def _convert_group(module, converter, first_name: str, sources: list) -> dict[str, torch.Tensor]:
    from copy import deepcopy

    from transformers.core_model_loading import dot_natural_key, spawn_materialize

    converter = deepcopy(converter)
    # In transformers' order: digits numerically (experts.2 before experts.10), as from_pretrained
    # sorts a state dict; a file lists its keys as strings, which would stack experts 10-19 after 1.
    for file, key, pattern in sorted(sources, key=lambda source: dot_natural_key(source[1])):
        with safe_open(file, framework="pt") as f:
            tensor = f.get_tensor(key)
        converter.add_tensor(first_name, key, pattern, spawn_materialize(None, tensor))
    realized = converter.convert(first_name, model=module, config=module.config, hf_quantizer=None, loading_info=None)
    return {name: (value[0] if isinstance(value, list) else value) for name, value in realized.items()}


def _nbytes(slice_) -> int:
    return int(np.prod(slice_.get_shape(), dtype=np.int64)) * _dtypes.itemsize(
        _dtypes.SAFETENSORS.get(slice_.get_dtype(), "float32")
    )


def _cast(array, target, reference: torch.Tensor) -> jax.Array:
    array = jnp.asarray(array)
    if tuple(array.shape) != tuple(reference.shape):
        raise LoadError(
            f"hfjax.load: a checkpoint tensor has shape {tuple(array.shape)} where the model expects "
            f"{tuple(reference.shape)}; config.json does not match the weights"
        )
    if jnp.issubdtype(array.dtype, jnp.floating) and reference.dtype.is_floating_point:
        return array.astype(target)
    return array


def _progress(total_bytes: int, enabled: bool | None):
    from tqdm.auto import tqdm

    disable = (total_bytes < _PROGRESS_BYTES) if enabled is None else not enabled
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="Loading weights", disable=disable)
