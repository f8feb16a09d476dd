"""Checkpoint directory -> HF module skeleton + {name: jax.Array}.

The module is built with its parameters on the meta device, so torch never holds the weights.
The weights are read from the safetensors files by their header's offsets, several tensors at a
time on a pool of threads, into host buffers that become the device arrays (on the CPU without a
copy; on accelerators as asynchronous transfers); each lands in its skeleton tensor's dtype, cast
on the device. A sharded load reads each device's block alone. Checkpoints whose keys need
transformers' conversions (per-expert MoE weights fused into one tensor, renamed legacy keys) go
through transformers' own conversion rules, one target tensor at a time. A `convert` hook sees each
tensor as stored and may replace it (quantization).
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import dataclasses
import json
import math
import pathlib
import re
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import _dtypes, _tasks
from .._errors import LoadError
from ._env import env
from ._reading import Reader, Stored, read_header

# Bytes read ahead of the tensor being placed: at most this, and an eighth of the checkpoint (so
# that what is in flight stays small beside the model), but never less than its largest tensor.
_WINDOW = 256 * 2**20


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
    """The dtype of the checkpoint's first floating weight, by name ("float32" when it has none)."""
    stored = read_header(files[0])
    for key in sorted(stored):
        if stored[key].dtype.name in _dtypes.NAMES:
            return stored[key].dtype.name
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


class Convert(Protocol):
    """What `load_weights(convert=...)` calls: (name, the tensor as stored) -> the arrays to keep, or
    None for the loader's own handling. An optional `claims(name) -> bool` names tensors the module
    lacks that it still wants to see."""

    def __call__(self, name: str, array: np.ndarray) -> dict[str, jax.Array | np.ndarray] | None: ...


def load_weights(
    module: torch.nn.Module,
    files: list[pathlib.Path],
    dtype: str,
    *,
    progress: bool | None = None,
    shardings: dict[str, jax.sharding.NamedSharding] | None = None,
    convert: Convert | None = None,
):
    """Reads every tensor the skeleton `module` expects into jax.Arrays, several at a time, straight
    from the files into device buffers.

    Each tensor lands in the dtype of its parameter or buffer in the skeleton: a float tensor is
    cast (on the device) to its skeleton tensor's float dtype; float8 and integer tensors, and any
    tensor whose skeleton tensor is float8 or an integer (a quantized layer), keep the file's bytes.

    Args:
        module: the skeleton (`build_skeleton`): parameters on the meta device.
        files: its safetensors files (`weight_files`).
        dtype: the float dtype the skeleton was built in; the skeleton's own tensors decide each
            tensor's dtype (this one, except where the model's code fixes another).
        progress: show a progress bar (default: for checkpoints over 64 MiB).
        shardings: {name: NamedSharding}: each device's slice is read from the file on its own,
            and nothing holds the whole tensor; names it lacks are replicated over its mesh.
        convert: called as `convert(name, array)` for each tensor the checkpoint holds under a
            name the module expects, or that `convert.claims(name)` is true for (claimed names
            first, then the rest, in file order), with the tensor as stored (a numpy array in the
            checkpoint's dtype, on the host; a tensor that transformers' conversion rules build from
            several, such as fused MoE experts, is passed once built). It returns {name: array} to
            keep ({} keeps nothing), or None for the loader's own handling. Arrays it returns for
            names the module has land in their skeleton dtype and shape; with `shardings`, each
            takes its own name's sharding, else the source name's where the ranks agree and it
            divides the array, else is replicated. Names it produced are not missing. `name` is the module's name (the
            checkpoint key after transformers' renamings).

    Returns:
        (params, aliases): {canonical name: jax.Array} and {tied name: canonical name}.

    Example:
        >>> module = build_skeleton(config, "text-generation", "bfloat16")
        >>> params, aliases = load_weights(module, weight_files(path), "bfloat16")
    """
    expected, aliases = tensor_names(module)
    headers = [read_header(file) for file in files]
    landing = _Landing(expected, shardings)
    params: dict[str, jax.Array] = {}
    every = [stored for header in headers for stored in header.values()]
    bar = _progress(sum(s.nbytes for s in every), progress)

    def land(entries: list[tuple[str, Stored]]) -> dict[str, tuple[Stored, jax.Array]]:
        # Without convert: whole tensors streamed, or each device's blocks read on their own.
        landed = {}
        if shardings is None:
            for name, stored, array in reader.stream(entries):
                landed[name] = (stored, landing.land(name, array))
                bar.update(stored.nbytes)
        else:
            for name, stored in entries:
                landed[name] = (stored, landing.land_blocks(name, stored, reader))
                bar.update(stored.nbytes)
        return landed

    def keep(name: str, array) -> None:
        kept = convert(name, array)
        if kept is None:
            if name in expected:
                params[name] = landing.land(name, array)
            return
        for produced, value in kept.items():
            produced = aliases.get(produced, produced)
            params[produced] = landing.land_produced(produced, value, source=name)

    window = max(min(_WINDOW, sum(s.nbytes for s in every) // 8), max((s.nbytes for s in every), default=0))
    named = _stored_as_named(headers, expected, aliases)
    with Reader(window) as reader, concurrent.futures.ThreadPoolExecutor(1) as side:
        # transformers builds its conversion rules once per process (~900 regular expressions,
        # 0.1 s and more). A checkpoint whose every tensor is stored under a name and shape the
        # module has needs none of them (`_plan` keeps a key the module has), so they are not
        # built; else they are built on a side thread while the tensors stored under the
        # module's own names are read, and the plan keeps those reads it agrees with. hfjax's
        # torchax environment, made once per process (its PRNG key compiles, ~0.07 s), is made
        # there too.
        every_named = len(named) == len(every)
        rules = None if every_named else side.submit(_conversion_rules, module)
        side.submit(env)
        early = {} if convert is not None else land(named)
        plan = _plan(module, headers, expected, aliases, convert, ([], []) if every_named else rules.result())
        bar.total = plan.total_bytes
        bar.refresh()
        for name, stored in plan.direct.items():
            if name in early and early[name][0] is stored:
                params[name] = early[name][1]
        rest = [(name, stored) for name, stored in plan.direct.items() if name not in params]
        if convert is None:
            params.update({name: array for name, (_, array) in land(rest).items()})
        else:  # convert sees whole tensors, the claimed ones first
            for name, stored, array in reader.stream(list(plan.claimed.items()) + rest):
                keep(name, array)
                bar.update(stored.nbytes)
        for first_name, (converter, sources) in plan.grouped.items():
            built = _convert_group(module, converter, first_name, sources, reader)
            for name, value in built.items():
                if name not in expected:
                    continue
                if convert is None:
                    params[name] = landing.land(name, _torch_to_numpy(value))
                else:
                    keep(name, _torch_to_numpy(value))
            bar.update(sum(stored.nbytes for stored, _ in sources))
    bar.close()

    missing = [n for n, t in expected.items() if n not in params and t.device.type == "meta"]
    for name in [n for n in missing if _not_saved(module, n)]:
        value = _initialized(module, name)
        if value is not None:
            params[name] = landing.land(name, _torch_to_numpy(value))
    missing = [n for n in missing if n not in params]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise LoadError(
            f"hfjax.load: the checkpoint has no weights for {len(missing)} parameters or buffers of {type(module).__name__}: {shown}; "
            "the checkpoint was saved for another architecture or task (pass task=...)"
        )
    for name, tensor in expected.items():
        if name not in params:  # real buffers the checkpoint does not store (rotary frequencies, ...)
            params[name] = landing.land(name, _torch_to_numpy(tensor))
    return params, aliases


@dataclasses.dataclass
class _Plan:
    """Which stored tensor goes where: read as is (`direct`), seen by `convert` only (`claimed`), or
    built by one of transformers' conversion rules from several (`grouped`)."""

    direct: dict[str, Stored] = dataclasses.field(default_factory=dict)
    claimed: dict[str, Stored] = dataclasses.field(default_factory=dict)
    grouped: dict[str, tuple[object, list[tuple[Stored, str]]]] = dataclasses.field(default_factory=dict)
    total_bytes: int = 0


def _conversion_rules(module) -> tuple[list, list]:
    """(renamings, converters): transformers' rules for turning this model's checkpoint keys into its names."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    mapping = get_model_conversion_mapping(module)
    return [m for m in mapping if isinstance(m, WeightRenaming)], [m for m in mapping if isinstance(m, WeightConverter)]


def _stored_as_named(headers: list[dict], expected: dict, aliases: dict) -> list[tuple[str, Stored]]:
    """The stored tensors whose key is a name the module has, with its shape (a tied name as its first)."""
    found = {}
    for header in headers:
        for key, stored in header.items():
            name = aliases.get(key, key)
            if name in expected and tuple(expected[name].shape) == stored.shape:
                found[name] = stored
    return list(found.items())


def _plan(module, headers: list[dict], expected: dict, aliases: dict, convert, rules: tuple[list, list]) -> _Plan:
    from transformers.core_model_loading import rename_source_key

    renamings, converters = rules
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta_state = dict(expected)
    meta_state.update({k: expected[v] for k, v in aliases.items()})
    prefix = getattr(module, "base_model_prefix", None) or None
    claims = getattr(convert, "claims", None)

    plan = _Plan()
    for header in headers:
        for key, stored in header.items():  # in file order
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
            if renamed not in meta_state and key in meta_state:
                # A key the module already has is kept when a renaming would lose it, as transformers
                # does (deepseek_v4's `\.norm\.` -> `.kv_norm.` also matches its final `model.norm.weight`).
                renamed, pattern = rename_source_key(key, [], [], prefix, meta_state)
            renamed = aliases.get(renamed, renamed)
            if renamed in expected and pattern is not None:
                plan.grouped.setdefault(renamed, (by_pattern[pattern], []))[1].append((stored, pattern))
            elif renamed in expected:
                plan.direct[renamed] = stored
            elif claims is not None and claims(renamed):
                plan.claimed[renamed] = stored
            else:
                continue
            plan.total_bytes += stored.nbytes
    return plan


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


def _convert_group(module, converter, first_name: str, sources: list, reader: Reader) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import dot_natural_key, spawn_materialize

    converter = copy.deepcopy(converter)
    # In transformers' order: digits numerically (experts.2 before experts.10), as from_pretrained
    # sorts a state dict; a file lists its keys as strings, which would stack experts 10-19 after 1.
    for stored, pattern in sorted(sources, key=lambda source: dot_natural_key(source[0].key)):
        tensor = _numpy_to_torch(reader.read(stored))
        converter.add_tensor(first_name, stored.key, pattern, spawn_materialize(None, tensor))
    realized = converter.convert(first_name, model=module, config=module.config, hf_quantizer=None, loading_info=None)
    return {name: (value[0] if isinstance(value, list) else value) for name, value in realized.items()}


# ---- where each array lands ------------------------------------------------------

_CASTABLE = frozenset({"float16", "bfloat16", "float32", "float64"})  # float8 and integers keep their bytes


class _Landing:
    """Places host arrays on the device (or the mesh) in their skeleton tensor's dtype."""

    def __init__(self, expected: dict[str, torch.Tensor], shardings: dict | None):
        self.expected, self.shardings = expected, shardings

    def land(self, name: str, array, sharding=None) -> jax.Array:
        reference = self._check_shape(name, tuple(array.shape), "the checkpoint tensor")
        if sharding is None and self.shardings is not None:
            sharding = _sharding_for(self.shardings, name)
        # On the CPU, an aligned host buffer becomes the array's own, uncopied (it is never reused).
        placed = jax.device_put(array, sharding, may_alias=True)
        target = _landing_dtype(placed.dtype, reference.dtype)
        return placed if target is None else placed.astype(target)

    def land_produced(self, name: str, array, *, source: str) -> jax.Array:
        """An array `convert` returned for `name` while reading `source`."""
        if name not in self.expected:
            raise LoadError(
                f"hfjax.load: convert returned {name!r} for the checkpoint tensor {source!r}, a name the module "
                "does not have; return only the module's parameter and buffer names"
            )
        self._check_shape(name, tuple(array.shape), f"convert's array for {source!r}")
        sharding = None
        if self.shardings is not None:
            source_sharding = self.shardings.get(source)
            like_source = (
                name not in self.shardings
                and source_sharding is not None
                and array.ndim == len(self.expected[source].shape)
                and _divides(source_sharding, tuple(array.shape))
            )
            sharding = source_sharding if like_source else _sharding_for(self.shardings, name)
        return self.land(name, array, sharding)

    def land_blocks(self, name: str, stored: Stored, reader: Reader) -> jax.Array:
        """Each addressable device's block read from the file on its own; a block that several
        devices hold (a replicated tensor's, whole) is read once."""
        reference = self._check_shape(name, stored.shape, f"the checkpoint tensor {stored.key!r}")
        sharding = _sharding_for(self.shardings, name)
        indices = sharding.addressable_devices_indices_map(stored.shape)
        keys = {device: _block_key(index, stored.shape) for device, index in indices.items()}
        blocks = {key: reader.block(stored, key) for key in set(keys.values())}
        holders = collections.Counter(keys.values())
        target = _landing_dtype(stored.dtype, reference.dtype)
        arrays = []
        for device, key in keys.items():
            single = jax.device_put(blocks[key].result(), device, may_alias=holders[key] == 1)
            arrays.append(single if target is None else single.astype(target))
        return jax.make_array_from_single_device_arrays(stored.shape, sharding, arrays)

    def _check_shape(self, name: str, shape: tuple, what: str) -> torch.Tensor:
        reference = self.expected[name]
        if shape != tuple(reference.shape):
            raise LoadError(
                f"hfjax.load: {what} for {name!r} has shape {shape} where the model expects "
                f"{tuple(reference.shape)}; config.json does not match the weights"
            )
        return reference


def _landing_dtype(stored, reference: torch.dtype):
    """The dtype a stored float tensor is cast to (its skeleton tensor's), or None to keep it as is."""
    wanted = str(reference).removeprefix("torch.")
    if np.dtype(stored).name in _CASTABLE and wanted in _CASTABLE and wanted != np.dtype(stored).name:
        return jnp.dtype(wanted)
    return None


def _sharding_for(shardings: dict, name: str) -> jax.sharding.NamedSharding:
    if name in shardings:
        return shardings[name]
    mesh = next(iter(shardings.values())).mesh
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _divides(sharding: jax.sharding.NamedSharding, shape: tuple[int, ...]) -> bool:
    """Whether every axis the sharding splits divides evenly over its mesh axes."""
    for size, axes in zip(shape, sharding.spec):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        if size % math.prod(sharding.mesh.shape[axis] for axis in axes):
            return False
    return True


def _block_key(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A device's block as ((start, stop) per axis), whatever form its slices take."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    bounds = []
    for part, size in zip(index, shape):
        start, stop, step = part.indices(size)
        if step != 1:
            raise LoadError(f"hfjax.load: a sharding with strided blocks ({index}) cannot be read from a file")
        bounds.append((start, stop))
    return tuple(bounds)


_PROGRESS_BYTES = 64 * 2**20  # show a progress bar above this checkpoint size


def _numpy_to_torch(array: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing the array's memory (bfloat16 and float8 through a same-size integer view)."""
    if array.dtype.name in ("bfloat16",) or array.dtype.name.startswith("float8"):
        same_size = np.dtype(f"i{array.dtype.itemsize}")
        return torch.from_numpy(array.view(same_size)).view(getattr(torch, array.dtype.name))
    return torch.from_numpy(array)


def _torch_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's values as a host array of the same dtype (ml_dtypes' for bfloat16 and float8)."""
    tensor = tensor.detach().cpu().contiguous()
    name = str(tensor.dtype).removeprefix("torch.")
    if tensor.dtype == torch.bfloat16 or name.startswith("float8"):
        same_size = {1: torch.int8, 2: torch.int16}[tensor.element_size()]
        return tensor.view(same_size).numpy().view(jnp.dtype(name))
    return tensor.numpy()


def _progress(total_bytes: int, enabled: bool | None):
    from tqdm.auto import tqdm

    disable = (total_bytes < _PROGRESS_BYTES) if enabled is None else not enabled
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="Loading weights", disable=disable)
