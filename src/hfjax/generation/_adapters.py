"""How each kind of model keeps its past while decoding: one adapter per cache kind.

An adapter runs the model for the decode loop, inside a trace, with the weights bound
(`hfjax._compile.bound`): `prefill` builds the past from the prompt and gives the first logits,
`step` runs one new token against it. Arrays in and out are jax.Arrays (or tracers); logits are
float32 [B, V].

    StaticCacheAdapter      transformers' StaticCache, for decoders that support it
    StateCacheAdapter       the model's own fixed-size cache (state-space models such as mamba)
    EncoderDecoderAdapter   an EncoderDecoderCache of two static caches, and the encoder's output
    RecomputeAdapter        no cache: the whole token buffer runs at every step (any causal model)

`adapter_for(module)` picks one. A server's slots or a trainer's evaluation reuse the same
adapters with the engine's state (`_state.DecodeState`).
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import torch

from .. import bridge
from .._errors import GenerationError
from . import _caches


def _accepts(module: torch.nn.Module, name: str) -> bool:
    return name in inspect.signature(module.forward).parameters


def _last_logits(out):
    return bridge.to_jax(out.logits)[:, -1].astype(jnp.float32)  # [B, V]


class CacheAdapter:
    """Runs a model for the decode loop; subclasses say how its past is kept."""

    kind: str = ""
    windowable = False  # the decode loop may attend over growing windows of the cache
    reorders_beams = True  # beam search may reorder the past by each beam's parent
    pads_prompts = True  # prompts may be left-padded to a bucket
    encoder_decoder = False
    takes_prefill_inputs = False  # the prefill takes other model inputs (images), the decode steps do not

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.config = module.config
        self.takes_positions = _accepts(module, "position_ids")
        self.takes_logits_to_keep = _accepts(module, "logits_to_keep")
        self.cache_keyword = _caches.cache_keyword(module)

    def prefill(self, ids, mask, sequence, full_mask, offset: int, inputs: dict):
        """(past, encoder output or None, logits [B, V]) after the prompt.

        ids, mask: [B, P] the padded prompts; sequence, full_mask: [B, L] the token buffer and its
        mask, holding what the decoder sees first in columns [0, offset) (the prompt, or the
        decoder start token); inputs: other forward arguments for the prefill only (empty
        unless `takes_prefill_inputs`), position_ids among them where the host computed them.
        """
        raise NotImplementedError

    def step(self, state, token, slot, window: int):
        """(past, logits [B, V]) after one token [B, 1] at buffer column `slot`; `window` is how
        many cache slots attention reads."""
        raise NotImplementedError

    def _positions(self, kwargs: dict, positions) -> dict:
        if self.takes_positions:
            kwargs["position_ids"] = bridge.to_torch(positions)
        return kwargs


class StaticCacheAdapter(CacheAdapter):
    kind = "static"
    windowable = True
    takes_prefill_inputs = True

    def __init__(self, module: torch.nn.Module):
        super().__init__(module)
        # A model that takes no position_ids counts positions from its cache's length, pads
        # included (BlenderbotForCausalLM, MarianForCausalLM): more pads on the left would move its
        # tokens, so its prompts keep the caller's length.
        self.pads_prompts = self.takes_positions

    def prefill(self, ids, mask, sequence, full_mask, offset: int, inputs: dict):
        cache = _caches.static_cache(self.config.get_text_config(decoder=True), sequence.shape[1])
        # The buffer's mask, as long as the cache (BLOOM's ALiBi is as long as the mask). A hybrid model gets
        # the prompt's, as transformers' generate passes it (its attention pads it to the cache): a
        # linear-attention or mamba layer zeroes its input's pads by the mask's last P columns
        # (create_recurrent_attention_mask), which in the buffer's mask are future columns.
        seen = mask if any(_caches.recurrent(layer) for layer in cache.layers) else full_mask
        kwargs = {"use_cache": True, self.cache_keyword: cache, "attention_mask": bridge.to_torch(seen)}
        if self.takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        if "position_ids" not in inputs:
            kwargs = self._positions(kwargs, _positions_of(mask))
        kwargs.update({name: bridge.to_torch(value) for name, value in inputs.items()})
        out = self.module(input_ids=bridge.to_torch(ids), **kwargs)
        return bridge.to_jax(_own_cache(out)), None, _last_logits(out)

    def step(self, state, token, slot, window: int):
        kwargs = {
            "use_cache": True,
            self.cache_keyword: bridge.to_torch(state.cache),
            "attention_mask": bridge.to_torch(state.mask[:, :window]),
        }
        out = self.module(input_ids=bridge.to_torch(token), **self._positions(kwargs, state.next_position[:, None] - 1))
        return bridge.to_jax(_own_cache(out)), _last_logits(out)


class StateCacheAdapter(CacheAdapter):
    kind = "state"
    reorders_beams = False

    def prefill(self, ids, mask, sequence, full_mask, offset: int, inputs: dict):
        kwargs = {"use_cache": True, "attention_mask": bridge.to_torch(mask)}
        if self.takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.module(input_ids=bridge.to_torch(ids), **self._positions(kwargs, _positions_of(mask)))
        return bridge.to_jax(_own_cache(out)), None, _last_logits(out)

    def step(self, state, token, slot, window: int):
        kwargs = {"use_cache": True, self.cache_keyword: bridge.to_torch(state.cache)}
        out = self.module(input_ids=bridge.to_torch(token), **self._positions(kwargs, state.next_position[:, None] - 1))
        return bridge.to_jax(_own_cache(out)), _last_logits(out)


class EncoderDecoderAdapter(CacheAdapter):
    """The encoder reads the module's main input (input_ids, or e.g. Whisper's input_features [B, C, F]);
    the decoder starts from the buffer's first `offset` columns (one start token, or a prompt)."""

    kind = "encoder-decoder"
    encoder_decoder = True
    # The encoder's output type (e.g. NLLB-MoE's, whose decoder call reads its router_logits), as
    # the prefill found it; BaseModelOutput where the prefill program was read from the store.
    encoder_output = None

    def prefill(self, ids, mask, sequence, full_mask, offset: int, inputs: dict):
        from transformers import EncoderDecoderCache

        inputs = bridge.to_torch(ids)
        if inputs.is_floating_point():
            inputs = inputs.to(self.module.dtype)
        encoded = self.module.get_encoder()(
            **{self.module.main_input_name: inputs}, attention_mask=bridge.to_torch(mask)
        )
        hidden = bridge.to_jax(encoded.last_hidden_state)  # [B, P, H]
        self.encoder_output = type(encoded)
        config = self.config.get_text_config(decoder=True)
        total = sequence.shape[1]
        cache = EncoderDecoderCache(_caches.static_cache(config, total), _caches.static_cache(config, hidden.shape[1]))
        # The cross-attention mask is the encoder's input mask where it covers the encoder's output
        # (token inputs); a mask over feature frames (speech) is not one.
        encoder = (hidden, mask if mask.shape[1] == hidden.shape[1] else None)
        out = self.module(**self._decoder_inputs(encoder, sequence[:, :offset], full_mask, cache))
        return bridge.to_jax(_own_cache(out)), encoder, _last_logits(out)

    def step(self, state, token, slot, window: int):
        cache = bridge.to_torch(state.cache)
        out = self.module(**self._decoder_inputs(state.encoder, token, state.mask, cache))
        return bridge.to_jax(_own_cache(out)), _last_logits(out)

    def _decoder_inputs(self, encoder, token, decoder_mask, cache) -> dict:
        from transformers.modeling_outputs import BaseModelOutput

        hidden, encoder_mask = encoder  # [B, P, H], [B, P] or None
        # The encoder's other output fields are None, as an encoder run without output_* flags gives them.
        return {
            "encoder_outputs": (self.encoder_output or BaseModelOutput)(last_hidden_state=bridge.to_torch(hidden)),
            "attention_mask": None if encoder_mask is None else bridge.to_torch(encoder_mask),
            "decoder_input_ids": bridge.to_torch(token),
            "decoder_attention_mask": bridge.to_torch(decoder_mask),
            self.cache_keyword: cache,
            "use_cache": True,
        }


class RecomputeAdapter(CacheAdapter):
    kind = "recompute"
    pads_prompts = False

    def prefill(self, ids, mask, sequence, full_mask, offset: int, inputs: dict):
        return None, None, self.logits_at(sequence, full_mask, offset - 1)

    def step(self, state, token, slot, window: int):
        return None, self.logits_at(state.sequence, state.mask, slot)

    def logits_at(self, sequence, full_mask, index):
        """Logits [B, V] at column `index` of the whole buffer sequence [B, L], run without a cache."""
        kwargs = self._positions(
            {"attention_mask": bridge.to_torch(full_mask), "use_cache": False}, _positions_of(full_mask)
        )
        out = self.module(input_ids=bridge.to_torch(sequence), **kwargs)
        logits = bridge.to_jax(out.logits)  # [B, L, V]
        return jax.lax.dynamic_index_in_dim(logits, index, axis=1, keepdims=False).astype(jnp.float32)


# Generative heads whose transformers `generate` runs something other than their tokens so far, by class
# name, and why neither hfjax engine runs them (each gave other tokens than transformers', or failed).
_PLACEHOLDER = (
    "transformers' generate appends a placeholder token to every step's input and reads its logits "
    "(`prepare_inputs_for_generation`)"
)
UNGENERATED = {
    "XLNetLMHeadModel": f"{_PLACEHOLDER}, which no other token sees (a permutation mask), over memories of all "
    "but the last two tokens",
    "XLMWithLMHeadModel": f"{_PLACEHOLDER}, its mask token, without the attention mask",
    "FlaubertWithLMHeadModel": f"{_PLACEHOLDER}, its mask token, without the attention mask",
    "ProphetNetForConditionalGeneration": "its decoder counts its positions and its n-gram streams' relative "
    "buckets from its cache's length, and with a cache masks nothing",
}


def check_generated(module: torch.nn.Module) -> None:
    """Raises GenerationError for a model of `UNGENERATED`, saying why: `Model.generate` and `hfjax serve`
    refuse it before they run anything."""
    reason = UNGENERATED.get(type(module).__name__)
    if reason is not None:
        raise GenerationError(
            f"hfjax does not generate with {type(module).__name__}: {reason}; run transformers' generate for it"
        )


def adapter_for(module: torch.nn.Module) -> CacheAdapter:
    """The adapter for a transformers generative model."""
    if getattr(module.config, "is_encoder_decoder", False):
        return EncoderDecoderAdapter(module)
    if "mamba" in type(module).__name__.lower():
        return StateCacheAdapter(module)
    # A vision-language model that transformers will not compile whole (its image merge is
    # data-dependent) still decodes text tokens alone, against a static cache, after the prefill.
    compiles = module._can_compile_fullgraph or hasattr(module, "get_image_features")
    if not compiles or not module._supports_default_dynamic_cache():
        return RecomputeAdapter(module)
    return StaticCacheAdapter(module)


def _positions_of(mask):
    # Positions count the tokens attended to so far: left pads do not move them.
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)


def _own_cache(out):
    cache = _caches.returned_cache(out)
    if cache is None:
        raise GenerationError(f"{type(out).__name__} returned no cache with use_cache=True")
    return cache
