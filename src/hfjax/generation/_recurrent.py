"""A recurrent state per slot: which models keep one (Mamba's layers all; a hybrid's linear-attention
or mamba layers beside attention ones), and transformers' cache layers that hold a slot's rows of it.

    recurrent_model(module)   every layer keeps a state (Mamba, Mamba 2, FalconMamba)
    hybrid_model(module)      attention layers and recurrent ones, a layer one or the other or both
    state_names(layer)        the (kind, index) of each state array a cache layer holds
    state_layer(names, arrays, carried=...)   a LinearAttentionLayer holding those arrays
    states_of(layer, names)   its arrays after a forward

`_slots.SlotModel` keeps the states in `SlotState.recurrent` and runs them (`run_states`).
"""

from __future__ import annotations

from .. import bridge
from . import _caches
from ._adapters import RecomputeAdapter, StateCacheAdapter, StaticCacheAdapter, adapter_for


def hybrid_model(module) -> bool:
    """Whether `module` mixes attention (a static KV cache's keys and values) with recurrent layers
    (linear attention, mamba: a state per slot), a layer holding either or both (Zamba's and Falcon-H1's
    "hybrid" layers: full attention beside mamba), named by `config.layer_types` (whose masks the model
    takes as a dict by kind, as transformers' Qwen3.5, Jamba, Bamba, Zamba or Falcon-H1 do)."""
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    adapter = type(adapter_for(module))
    if adapter not in (StaticCacheAdapter, RecomputeAdapter):
        return False
    config = module.config.get_text_config(decoder=True)
    layers = _caches.static_cache(config, 1).layers
    kinds = [_caches.recurrent(layer) for layer in layers]
    attends = [isinstance(layer, StaticLayer) for layer in layers]
    # transformers compiles no Zamba or Falcon-H1 whole, so `Generator` recomputes them without a cache;
    # the slot core keeps their layers' states and keys and values in transformers' cache (and falls back
    # where a trace reads data). Other models without a cache keep none of transformers' (RecurrentGemma).
    if adapter is RecomputeAdapter and not any(k and a for k, a in zip(kinds, attends)):
        return False
    # (a state beside a sliding window's rolling buffer: none of the slots' columns)
    rolling = any(isinstance(layer, StaticSlidingWindowLayer) for layer in layers if _caches.recurrent(layer))
    types = getattr(config, "layer_types", None)
    return any(kinds) and any(attends) and not rolling and types is not None and len(types) == len(layers)


def recurrent_kinds(config) -> set[str]:
    """The `layer_types` of a model's recurrent layers (a hybrid's "linear_attention"); empty for others."""
    return _caches.kinds_where(config, _caches.keeps_state)


def recurrent_model(module) -> bool:
    """Whether `module` keeps its whole past as recurrent states (Mamba: every layer's conv and SSM
    states), which the slots hold per row (`SlotState.recurrent`) instead of keys and values."""
    if type(adapter_for(module)) is not StateCacheAdapter:
        return False
    layers = _caches.static_cache(module.config.get_text_config(decoder=True), 1).layers
    return bool(layers) and all(_caches.recurrent(layer) for layer in layers)


def state_names(layer) -> tuple[tuple[str, int], ...]:
    """The (kind, index) of each state a recurrent cache layer holds: "conv" then "recurrent" states."""
    return tuple(
        (kind, index)
        for kind in ("conv", "recurrent")
        for index in range(layer.number_of_states)
        if getattr(layer, f"is_{kind}_states_initialized")[index]
    )


def state_layer(names, arrays, *, carried: bool, layer=None):
    """transformers' LinearAttentionLayer holding `arrays`, the states `names` (`state_names`), as after
    a previous forward where `carried` (else as before the first: the model starts from zeros);
    `layer`: a LinearAttentionLayer (made empty) to fill, else a new one."""
    from transformers.cache_utils import LinearAttentionLayer

    if layer is None:
        layer = LinearAttentionLayer(number_of_states=number_of_states(names))
    for (kind, index), array in zip(names, arrays):
        tensor = bridge.to_torch(array)
        getattr(layer, f"{kind}_states")[index] = tensor
        getattr(layer, f"is_{kind}_states_initialized")[index] = True
        if kind == "conv":
            layer.conv_kernel_size[index] = array.shape[-1]
        layer.has_previous_state[index] = carried
        layer.dtype, layer.device = tensor.dtype, tensor.device
    return layer


def number_of_states(names) -> int:
    """How many states a LinearAttentionLayer holding `names` (`state_names`) keeps per kind."""
    return 1 + max(index for _, index in names)


def states_of(layer, names) -> tuple:
    """The arrays of a recurrent cache layer's states `names` (`state_names`)."""
    return tuple(bridge.to_jax(getattr(layer, f"{kind}_states")[index]) for kind, index in names)
