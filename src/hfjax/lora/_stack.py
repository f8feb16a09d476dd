"""The adapter slots a Model holds beside its weights: per targeted linear layer, the factors of N adapters
of rank up to R stacked into two arrays of fixed shapes, so that loading or dropping an adapter writes
values and never changes a program."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .._errors import LoadError
from ._peft import PeftAdapter
from ._product import ACTIVE, PREFIX

NONE = -1  # a row's adapter slot where it runs on the base alone


@dataclasses.dataclass(frozen=True)
class Adapter:
    """A LoRA adapter held by a Model: its name, where it was read from, its rank and its slot."""

    name: str
    path: str
    rank: int
    index: int  # the slot its rows name (`RowSampling.lora`), 0 .. max_loras - 1
    base_model: str | None  # adapter_config.json's base_model_name_or_path


@dataclasses.dataclass(frozen=True)
class _Target:
    inputs: int
    outputs: int
    conv1d: bool  # transformers' Conv1D, whose weight is [in, out]


def linear_targets(module: torch.nn.Module) -> dict[str, _Target]:
    """{name: sizes} of every linear layer of `module` (torch Linear, quantized ones included, and Conv1D)."""
    found = {}
    for name, child in module.named_modules():
        if isinstance(child, torch.nn.Linear):
            found[name] = _Target(child.in_features, child.out_features, False)
        elif type(child).__name__ == "Conv1D" and getattr(child, "weight", None) is not None:
            found[name] = _Target(child.weight.shape[0], child.weight.shape[1], True)
    return found


def _matching(names: Sequence[str], wanted: Sequence[str]) -> list[str]:
    """The layer names that a name or peft-style tail in `wanted` matches ("q_proj", "self_attn.q_proj")."""
    return [n for n in names if any(n == w or n.endswith("." + w) for w in wanted)]


class AdapterSlots:
    """`max_loras` slots of adapters of rank up to `max_rank` on the layers `targets` of a Model, kept in
    its params (`PREFIX` names) where every program reads them."""

    def __init__(self, model, *, max_loras: int, max_rank: int, targets: Sequence[str] | None, caller: str):
        for name, value in (("max_loras", max_loras), ("max_lora_rank", max_rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LoadError(f"{caller}: {name}={value!r}; pass a positive int")
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        layers = linear_targets(model.module)
        if targets is None:  # every linear layer but the LM head (peft's "all-linear")
            output = model.module.get_output_embeddings() if hasattr(model.module, "get_output_embeddings") else None
            chosen = [n for n in layers if model.module.get_submodule(n) is not output]
        else:
            chosen = _matching(list(layers), list(targets))
            if not chosen:
                raise LoadError(
                    f"{caller}: target_modules={list(targets)} names none of the model's linear layers; pass names "
                    f"such as {sorted({n.rsplit('.', 1)[-1] for n in layers})[:8]}"
                )
        self.targets = {name: layers[name] for name in chosen}
        self.adapters: dict[str, Adapter] = {}
        self.read: dict[str, PeftAdapter] = {}  # the host copies, to write again into grown slots (Model.load_adapter)
        self._lock = threading.Lock()
        dtype = _compute_dtype(model.params)
        params = model.params
        for name, target in self.targets.items():
            a_place, b_place = _placements(params, name, target)
            params[f"{PREFIX}{name}.a"] = jax.device_put(
                jnp.zeros((target.inputs, max_loras, max_rank), dtype), a_place
            )
            params[f"{PREFIX}{name}.b"] = jax.device_put(
                jnp.zeros((max_loras, max_rank, target.outputs), dtype), b_place
            )
        params[PREFIX + ACTIVE] = jax.device_put(jnp.int32(NONE), _replicated(params))

    def load(self, adapter: PeftAdapter, name: str, *, caller: str) -> Adapter:
        """`adapter` (read by `read_adapter`) into a free slot, as `name`."""
        if not isinstance(name, str) or not name:
            raise LoadError(f"{caller}: adapter_name={name!r}; pass a non-empty str")
        with self._lock:
            if name in self.adapters:
                raise LoadError(
                    f"{caller}: adapter_name={name!r} is already loaded (from {self.adapters[name].path}); delete it "
                    "first (Model.delete_adapter) or pick another name"
                )
            index = self._free_slot(caller)
            self._check_fits(adapter, caller)
            self._write(index, adapter)
            held = Adapter(
                name=name, path=str(adapter.path), rank=adapter.rank, index=index, base_model=adapter.base_model
            )
            self.adapters[name] = held
            self.read[name] = adapter
        return held

    def fits(self, adapter: PeftAdapter) -> bool:
        """Whether `adapter` fits these slots as they are (a free slot, its rank, its layers)."""
        return (
            len(self.adapters) < self.max_loras
            and adapter.rank <= self.max_rank
            and all(name in self.targets for name in adapter.layers)
        )

    def drop(self) -> None:
        """Removes every array of these slots from the model's params."""
        for key in [k for k in self.model.params if k.startswith(PREFIX)]:
            del self.model.params[key]

    def delete(self, name: str, *, caller: str) -> None:
        """Frees `name`'s slot (its factors zeroed); the base's rows are untouched."""
        with self._lock:
            held = self._held(name, caller)
            self._write(held.index, None)
            del self.adapters[name], self.read[name]
            if int(self.model.params[PREFIX + ACTIVE]) == held.index:
                self.set_active(None, caller=caller)

    def index(self, name: str | None, *, caller: str) -> int:
        """The slot rows of adapter `name` use; `NONE` for None (the base)."""
        return NONE if name is None else self._held(name, caller).index

    def set_active(self, name: str | None, *, caller: str) -> None:
        params = self.model.params
        params[PREFIX + ACTIVE] = jax.device_put(jnp.int32(self.index(name, caller=caller)), _replicated(params))

    def active(self) -> int:
        return int(self.model.params[PREFIX + ACTIVE])

    def _held(self, name, caller: str) -> Adapter:
        if name not in self.adapters:
            loaded = ", ".join(repr(n) for n in self.adapters) or "none"
            raise LoadError(
                f"{caller}: no adapter named {name!r} is loaded (loaded: {loaded}); load it with Model.load_adapter"
            )
        return self.adapters[name]

    def _free_slot(self, caller: str) -> int:
        used = {held.index for held in self.adapters.values()}
        free = [i for i in range(self.max_loras) if i not in used]
        if not free:
            raise LoadError(
                f"{caller}: all {self.max_loras} adapter slots are in use ({', '.join(self.adapters)}); delete one "
                "(Model.delete_adapter) or reserve more (Model.reserve_adapters(max_loras=...), --max-loras)"
            )
        return free[0]

    def _check_fits(self, adapter: PeftAdapter, caller: str) -> None:
        if adapter.rank > self.max_rank:
            raise LoadError(
                f"{caller}: the adapter at {str(adapter.path)!r} has rank {adapter.rank}, above max_lora_rank="
                f"{self.max_rank}; reserve a larger rank (Model.reserve_adapters(max_lora_rank={adapter.rank}), "
                "--max-lora-rank)"
            )
        for name, layer in adapter.layers.items():
            target = self.targets.get(name)
            if target is None:
                raise LoadError(
                    f"{caller}: the adapter at {str(adapter.path)!r} adapts {name!r}, which is not among the layers "
                    f"reserved for adapters ({len(self.targets)} layers such as {next(iter(self.targets))!r}); "
                    "reserve it (Model.reserve_adapters(target_modules=...))"
                )
            if layer.a.shape[1] != target.inputs or layer.b.shape[0] != target.outputs:
                raise LoadError(
                    f"{caller}: the adapter at {str(adapter.path)!r} has {name!r} of {layer.a.shape[1]} -> "
                    f"{layer.b.shape[0]} features, where the model's layer is {target.inputs} -> {target.outputs}; "
                    "it was trained for another model"
                )

    def _write(self, index: int, adapter: PeftAdapter | None) -> None:
        """Slot `index` of every targeted layer set to `adapter`'s factors (zeros past its rank or where it
        does not adapt the layer; all zeros for None)."""
        params = self.model.params
        for name, target in self.targets.items():
            a = np.zeros((target.inputs, self.max_rank), np.float32)
            b = np.zeros((self.max_rank, target.outputs), np.float32)
            layer = None if adapter is None else adapter.layers.get(name)
            if layer is not None:
                rank = layer.a.shape[0]
                a[:, :rank] = layer.a.T
                b[:rank] = layer.scaling * layer.b.T
            for suffix, values in ((".a", a), (".b", b)):
                key = f"{PREFIX}{name}{suffix}"
                params[key] = _set_slot(params[key], values, jnp.int32(index), axis=1 if suffix == ".a" else 0)


@functools.partial(jax.jit, static_argnames="axis")
def _set_slot(stack: jax.Array, values: jax.Array, index, *, axis: int) -> jax.Array:
    """`stack` with slot `index` ([] int32, an argument: one program per shape serves every slot) along
    `axis` (1 of a [in, N, R], 0 of b [N, R, out]) set to `values` ([in, R] or [R, out])."""
    values = jnp.expand_dims(values.astype(stack.dtype), axis)
    start = (0, index, 0) if axis == 1 else (index, 0, 0)
    return jax.lax.dynamic_update_slice(stack, values, start)


def with_active(params: dict, index: int) -> dict:
    """A copy of a model's `params` whose rows all use adapter slot `index` where no per-row slots are given
    (a call's adapter, without changing the model's default)."""
    current = params[PREFIX + ACTIVE]
    return {**params, PREFIX + ACTIVE: jax.device_put(jnp.int32(index), current.sharding)}


def _compute_dtype(params: dict):
    """The compute dtype: the floating dtype most of the model's weights have, 8-bit ones left out (a
    quantized model's: its norms' and embeddings')."""
    counts: dict = {}
    for array in params.values():
        if jnp.issubdtype(array.dtype, jnp.floating) and jnp.finfo(array.dtype).bits >= 16:  # not fp8 weights
            counts[array.dtype] = counts.get(array.dtype, 0) + int(array.size)
    return max(counts, key=counts.get) if counts else jnp.float32


def _replicated(params: dict):
    weights = next(iter(params.values())).sharding
    if isinstance(weights, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(weights.mesh, jax.sharding.PartitionSpec())
    return weights


def _placements(params: dict, name: str, target: _Target):
    """Where a layer's stacked factors live: split as its weight is (a [in, N, R] by the weight's input
    axis, b [N, R, out] by its output axis), on the weight's device otherwise."""
    weight = params.get(f"{name}.weight")
    sharding = weight.sharding if weight is not None else _replicated(params)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding, sharding
    spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
    outputs, inputs = (spec[1], spec[0]) if target.conv1d else (spec[0], spec[1])
    P = jax.sharding.PartitionSpec
    return (
        jax.sharding.NamedSharding(sharding.mesh, P(inputs, None, None)),
        jax.sharding.NamedSharding(sharding.mesh, P(None, None, outputs)),
    )
