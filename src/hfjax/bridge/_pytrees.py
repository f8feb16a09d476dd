"""Lets every Hugging Face output and cache type cross a `jax.jit` boundary.

Three kinds of classes are registered as JAX pytree nodes, with no user action:

- transformers `ModelOutput` and diffusers `BaseOutput` subclasses: flattened by
  dataclass field name, so fields that are `None` survive and nothing shifts.
- transformers `Cache` classes and their layers (`DynamicLayer`, `StaticLayer`, ...),
  and any other stateful object the model hands back: flattened by attribute, the
  array-holding attributes as children and everything else as static metadata.

A class is registered the first time hfjax meets one of its objects at a jit boundary
(`register_tree`, which hfjax calls on every value it flattens): importing hfjax registers
nothing and wraps no class of transformers or diffusers. Registration is process-wide, as
JAX's pytree registry is: README.md lists it under "What hfjax changes in your process".
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from typing import Any

import jax
import numpy as np
import torch

_registered: set[type] = set()


# ---- output types: dataclass fields ------------------------------------------


def _output_fields(obj) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(obj))


def _flatten_output_with_keys(obj):
    names = _output_fields(obj)
    return [(jax.tree_util.GetAttrKey(n), getattr(obj, n)) for n in names], names


def _flatten_output(obj):
    names = _output_fields(obj)
    return [getattr(obj, n) for n in names], names


def _output_unflattener(cls):
    # Bypasses __init__/__post_init__, which reinterpret a lone non-tensor first field.
    def unflatten(names, children):
        obj = cls.__new__(cls)
        collections.OrderedDict.__init__(obj)
        for name, value in zip(names, children):
            object.__setattr__(obj, name, value)
            if value is not None:
                collections.OrderedDict.__setitem__(obj, name, value)
        return obj

    return unflatten


def _register_output(cls: type) -> None:
    if cls in _registered:
        return
    _registered.add(cls)
    jax.tree_util.register_pytree_with_keys(cls, _flatten_output_with_keys, _output_unflattener(cls), _flatten_output)


# ---- stateful objects (caches, cache layers): attributes ----------------------


class _Static:
    """Hashable, comparable holder of an object's non-array attributes (pytree aux data)."""

    __slots__ = ("cls", "dynamic", "static")

    def __init__(self, cls: type, dynamic: tuple[str, ...], static: tuple[tuple[str, Any], ...]):
        self.cls, self.dynamic, self.static = cls, dynamic, static

    def __hash__(self):
        return hash((self.cls, self.dynamic, tuple(k for k, _ in self.static)))

    def __eq__(self, other):
        if not isinstance(other, _Static):
            return NotImplemented
        if (self.cls, self.dynamic) != (other.cls, other.dynamic):
            return False
        if [k for k, _ in self.static] != [k for k, _ in other.static]:
            return False
        return all(_same(a, b) for (_, a), (_, b) in zip(self.static, other.static))

    def __repr__(self):
        return f"{self.cls.__name__}(static={[k for k, _ in self.static]})"


def _same(a, b) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # values whose == is not a plain bool compare by identity
        return False


def _holds_arrays(value) -> bool:
    if isinstance(value, (torch.Tensor, jax.Array, np.ndarray, jax.core.Tracer)):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_arrays(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_arrays(v) for v in value.values())
    return type(value) in _registered or _is_stateful(type(value))


def _flatten_state(obj):
    dynamic, static = [], []
    for name, value in sorted(vars(obj).items()):
        if _holds_arrays(value):
            register_tree(value)
            dynamic.append((name, value))
        else:
            static.append((name, value))
    aux = _Static(type(obj), tuple(n for n, _ in dynamic), tuple(static))
    return [v for _, v in dynamic], aux


def _flatten_state_with_keys(obj):
    children, aux = _flatten_state(obj)
    return [(jax.tree_util.GetAttrKey(n), v) for n, v in zip(aux.dynamic, children)], aux


def _unflatten_state(aux: _Static, children):
    obj = aux.cls.__new__(aux.cls)
    state = dict(aux.static)
    state.update(zip(aux.dynamic, children))
    obj.__dict__.update(state)
    return obj


def _register_state(cls: type) -> None:
    if cls in _registered:
        return
    _registered.add(cls)
    jax.tree_util.register_pytree_with_keys(cls, _flatten_state_with_keys, _unflatten_state, _flatten_state)


def assign_state(target, source) -> None:
    """Writes `source`'s attributes into `target` (same class), recursing into layers.

    Used to give a jitted call torch's in-place semantics for cache arguments.
    """
    for name, value in vars(source).items():
        current = getattr(target, name, None)
        if type(current) is type(value) and _is_stateful(type(value)):
            assign_state(current, value)
        elif isinstance(current, list) and isinstance(value, list) and len(current) == len(value):
            for i, (c, v) in enumerate(zip(current, value)):
                if type(c) is type(v) and _is_stateful(type(v)):
                    assign_state(c, v)
                else:
                    current[i] = v
        else:
            setattr(target, name, value)


# ---- which classes are which --------------------------------------------------


def _stateful_bases() -> tuple[type, ...]:
    # Until transformers is imported no object is one of its caches or outputs, so a plain torch
    # module's jit does not import it (as diffusers is looked at only once imported).
    if "transformers" not in sys.modules:
        return ()
    from transformers import cache_utils

    bases = [cache_utils.Cache, cache_utils.CacheLayerMixin]
    for name in ("LinearAttentionCacheLayerMixin", "DummyLayer"):  # DummyLayer: Gemma 3n's KV-shared layers
        if hasattr(cache_utils, name):
            bases.append(getattr(cache_utils, name))
    return tuple(bases)


def _output_bases() -> tuple[type, ...]:
    bases = []
    if "transformers" in sys.modules:
        from transformers.utils import ModelOutput

        bases.append(ModelOutput)
    if "diffusers" in sys.modules:
        from diffusers.utils import BaseOutput

        bases.append(BaseOutput)
    return tuple(bases)


def _is_stateful(cls: type) -> bool:
    return issubclass(cls, _stateful_bases()) or cls in _registered_stateful_extra


def _is_output(cls: type) -> bool:
    return issubclass(cls, _output_bases())


_registered_stateful_extra: set[type] = set()


def register_stateful(cls: type) -> type:
    """Registers a model's own cache-like class (not a transformers `Cache`) as a pytree.

    Example:
        >>> hfjax.register_stateful(MyModelCache)
    """
    _registered_stateful_extra.add(cls)
    _register_state(cls)
    return cls


def register_class(cls: type) -> bool:
    """Registers `cls` if it is an output or cache class; returns whether it is one now."""
    if cls in _registered:
        return True
    if _is_output(cls) and dataclasses.is_dataclass(cls):
        _register_output(cls)
        return True
    if _is_stateful(cls):
        _register_state(cls)
        return True
    return False


def register_tree(tree) -> None:
    """Registers every output or cache class found in `tree` (lists, tuples, dicts, attributes)."""
    if isinstance(tree, (list, tuple)):
        for v in tree:
            register_tree(v)
    elif isinstance(tree, dict) and not _is_output(type(tree)):
        for v in tree.values():
            register_tree(v)
    elif isinstance(tree, (torch.Tensor, jax.Array, np.ndarray, str, int, float, bool, type(None))):
        return
    elif register_class(type(tree)):
        if _is_output(type(tree)):
            for name in _output_fields(tree):
                register_tree(getattr(tree, name))


def register_pytree(value) -> None:
    """Registers the Hugging Face output and cache classes in `value` as JAX pytrees.

    `value` is an object (a `ModelOutput`, a `Cache`, or lists, tuples and dicts of them) or a
    class. hfjax's own calls register what they meet; call this to pass such objects through a
    `jax.jit` of your own first.

    Example:
      >>> hfjax.register_pytree(transformers.modeling_outputs.CausalLMOutputWithPast)
      >>> jax.jit(lambda out: out.logits)(out)
    """
    if isinstance(value, type):
        if not register_class(value):
            raise TypeError(
                f"hfjax.register_pytree({value.__qualname__}): not a transformers ModelOutput / Cache or diffusers "
                "BaseOutput class; for a model's own cache class use hfjax.register_stateful"
            )
        return
    register_tree(value)


def registered_classes() -> frozenset[type]:
    """The classes hfjax has registered as JAX pytree nodes so far."""
    return frozenset(_registered)
