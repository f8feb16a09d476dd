"""The decode loop's KV cache: transformers' StaticCache built for a traced loop, and cut into
windows of its first slots."""

from __future__ import annotations

import copy

import jax


def static_cache(config, length: int):
    """transformers' StaticCache of `length` slots in which every layer is a plain StaticLayer.

    Its sliding-window layers roll their buffer based on a Python int, which a loop with a
    traced step count cannot do; a full-length layer under the model's own sliding-window
    mask attends to the same tokens.
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    cache = StaticCache(config=config, max_cache_len=length)
    cache.layers = [
        StaticLayer(max_cache_len=length) if getattr(layer, "is_sliding", False) and not recurrent(layer) else layer
        for layer in cache.layers
    ]  # a hybrid model's linear-attention (or mamba) layers keep their states
    return cache


def cache_keyword(module) -> str:
    """The name under which `module.forward` takes its cache: `cache` (transformers 5.24, which
    deprecated the others), else the model's own `cache_params` (mamba before 5.24), else
    `past_key_values`. A forward that takes **kwargs would swallow an old name silently."""
    import inspect

    parameters = inspect.signature(module.forward).parameters
    return next((name for name in ("cache", "cache_params") if name in parameters), "past_key_values")


def returned_cache(out):
    """The cache a forward returned (transformers 5.24: `cache`; before: `past_key_values`, or mamba's
    `cache_params`), or None."""
    for field in ("cache", "past_key_values", "cache_params"):
        if field in out.keys():
            return out[field]
    return None


def recurrent(layer) -> bool:
    """Whether a cache layer holds a linear-attention or mamba layer's states."""
    from transformers import cache_utils

    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)  # (older transformers: none)
    return mixin is not None and isinstance(layer, mixin)


CACHELESS = ("mlp", "moe")  # `layer_types` of layers without attention, which transformers gives a DummyLayer


def keeps_nothing(layer, kind: str | None = None) -> bool:
    """Whether a cache layer of `config.layer_types` kind `kind` holds nothing: transformers' DummyLayer
    (5.24 on), which a model's layers without attention get (`CACHELESS`: Nemotron-H's), or the
    recurrent layer transformers gave those before, whose states no layer writes."""
    return type(layer).__name__ == "DummyLayer" or (kind in CACHELESS and recurrent(layer))


def keeps_state(layer, kind: str | None = None) -> bool:
    """Whether a cache layer of kind `kind` holds a linear-attention or mamba layer's states (`recurrent`,
    less the layers that keep nothing)."""
    return recurrent(layer) and not keeps_nothing(layer, kind)


def kinds_where(config, test) -> set[str]:
    """The `layer_types` of `config`'s layers whose static cache layer passes `test(layer, kind)`
    (`keeps_state`, `keeps_nothing`)."""
    types = getattr(config, "layer_types", None) or ()
    return {kind for kind, layer in zip(types, static_cache(config, 1).layers) if test(layer, kind)}


def windowable(cache) -> bool:
    """Whether `cache` is a decoder's StaticCache of plain StaticLayers, which `window` can cut."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    return type(cache) is StaticCache and all(type(layer) is StaticLayer for layer in cache.layers)


def slots(cache) -> int | None:
    """The slots of a windowable cache; None for any other."""
    return cache.layers[0].max_cache_len if windowable(cache) and cache.layers else None


def window(cache, length: int):
    """A StaticCache holding the first `length` slots of `cache`'s layers (copies of them)."""
    cut = copy.copy(cache)
    cut.layers = []
    for layer in cache.layers:
        part = copy.copy(layer)
        part.keys, part.values, part.max_cache_len = layer.keys[:, :, :length], layer.values[:, :, :length], length
        cut.layers.append(part)
    return cut


def written_back(cache, cut):
    """`cache` after the loop over its window `cut`: each layer's first slots are the
    window's, and so is its count of slots written."""
    full = copy.copy(cut)
    full.layers = []
    for layer, part in zip(cache.layers, cut.layers):
        whole = copy.copy(part)
        whole.keys = jax.lax.dynamic_update_slice(layer.keys, part.keys, (0, 0, 0, 0))
        whole.values = jax.lax.dynamic_update_slice(layer.values, part.values, (0, 0, 0, 0))
        whole.max_cache_len = layer.max_cache_len
        full.layers.append(whole)
    return full
