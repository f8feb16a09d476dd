"""Encoder-decoders on the continuous-batching core (`_slots.py`): Whisper, BART and their kin.

A slot holds its request's decoder keys and values as a decoder-only model's does, and beside them
its cross-attention keys and values (`SlotState.cross`, [S, heads, E, head_dim] per decoder layer)
and its encoder mask (`SlotState.encoder_mask`, [S, E]), E being the encoder length the slot model
is built for (Whisper's 2 x max_source_positions feature frames make max_source_positions; a text
encoder's longest input, padded on the right):

    prefill_chunk   with `inputs` (the encoder's main input [P, ...] and, for token inputs, its
                    attention_mask [P, E]): the encoder runs over the rows' inputs and each decoder
                    layer's cross-attention keys and values are written into the rows' slots; the
                    chunk's tokens (the decoder prompt: the decoder start token, or Whisper's forced
                    prefix) then run as a decoder-only model's chunk does
    decode_chunk    as a decoder-only model's; each step reads the slots' cross keys and values
                    (transformers' EncoderDecoderCache with every layer's `is_updated` set) and never
                    runs the encoder

The decoder's positions are each row's own. Whisper takes them (`decoder_position_ids`); a decoder
whose position embedding counts from its cache's length takes them through a hook on that module
for the length of the call (`POSITION_EMBEDDINGS`: the modules it knows, and how each looks a
position up: BART, mBART, PLBart, MVP, Blenderbot, Marian, Pegasus, Pegasus-X, BigBird-Pegasus, M2M100
and NLLB, NLLB-MoE, FSMT, LED). A decoder that masks nothing where it runs over a cache (FSMT's, and
LED's for a single query: transformers' generate gives them a cache of exactly their tokens so far)
gets the slots' self-attention mask through the module that takes one (`UNMASKED_DECODERS`); an
encoder that reads values its slot inputs fix gets them (`KNOWN_READS`: LED's). T5's relative
position bias, which its attention computes from the cache's length (one scalar for every row), is
each row's own through a hook on that attention's `compute_bias` for the length of the call
(`RELATIVE_BIASES`: T5's, mT5's, UMT5's, LongT5's and Switch Transformers' decoders). A decoder with
none of these is refused by `check_supported`, saying why.

`SpeculativeEncoderDecoderSlotModel` drafts by prompt lookup over each row's decoder tokens and
verifies the drafts with one decoder run over the rows' cross keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import bridge
from .. import lora as _lora
from .._errors import GenerationError
from . import _slots
from ._adapters import check_generated
from ._slots import POSITION_EMBEDDINGS, SlotModel, SlotState
from ._speculative_slots import SpeculativeSlotModel

# The prefill input that gives the n-grams encoder_no_repeat_ngram_size bans ([P, E] int32, as
# `SlotState.encoder_ids`), where they are not the encoder's ids on its mask (transformers reads the
# caller's pads too: `BatchPlan.ngram_source`).
NGRAM_SOURCE = "ngram_source"


# Attention modules whose relative position bias counts its queries from the cache's length (one
# scalar for every row), by class name: each has `compute_bias(query_length, key_length, device=,
# past_seen_tokens=)` giving [1, heads, q, k] for keys at columns 0..k-1, a function of (key's
# column - query's position) alone. The bias hook replaces it, for the decoder's self-attention
# modules that hold a bias table, with each row's own [B, heads, q, k].
RELATIVE_BIASES = frozenset(
    {"T5Attention", "MT5Attention", "UMT5Attention", "LongT5Attention", "SwitchTransformersAttention"}
)

# Models whose forward reads the encoder output's `router_logits` (a mixture-of-experts encoder's), by
# class name: the decoder runs get transformers' `MoEModelOutput` (its routers' fields None) in place of
# `BaseModelOutput`, which has no such field.
ROUTED_ENCODERS = frozenset({"SwitchTransformersForConditionalGeneration", "NllbMoeForConditionalGeneration"})


def _fsmt_mask(args, kwargs, additive, mask):
    return args, {**kwargs, "decoder_causal_mask": additive}  # (added to its attention weights)


def _layer_mask(args, kwargs, additive, mask):
    return (args[0], mask, *args[2:]), kwargs  # (hidden_states, attention_mask, ...)


# Decoders that mask nothing where they run over a cache (transformers' generate gives them a cache of
# exactly the tokens so far), by the class name of the module that takes their self-attention mask,
# and how the slots hand it theirs, [B, 1, q, L], each key at or before its query (`_masked`): FSMT's
# decoder takes an additive `decoder_causal_mask` (with a cache it makes none); LED's decoder makes no
# mask for a single query, so each of its layers gets the slots' own.
UNMASKED_DECODERS = {"FSMTDecoder": _fsmt_mask, "LEDDecoderLayer": _layer_mask}

# Encoders whose forward reads values of its data that the slots' inputs fix, by class name, and those
# values in the order it reads them (`bridge.replaying` hands them to its trace): LED's asks whether any
# token attends globally (`is_index_global_attn.flatten().any().item()`); the slots give it no
# global_attention_mask, so its mask holds 0 (masked) and 1 (local) only, and no token does. Its other
# reads are of arithmetic on its shapes (`torch.div(seq_len, window_overlap)`), which JAX stages like any
# op inside a trace: the encoder runs under `jax.ensure_compile_time_eval`, so those are computed there.
KNOWN_READS = {"LEDEncoder": (False,)}


@contextlib.contextmanager
def _known_reads(encoder):
    """Within the block, `encoder`'s trace (a `KNOWN_READS` one) gets the values it reads."""
    known = KNOWN_READS.get(type(encoder).__name__)
    if known is None:
        yield
        return
    with bridge.replaying([np.asarray(value) for value in known]), jax.ensure_compile_time_eval():
        yield


def _bias_modules(decoder) -> list:
    """The decoder's attention modules of `RELATIVE_BIASES` that compute a bias of their own."""
    return [
        m
        for m in decoder.modules()
        if type(m).__name__ in RELATIVE_BIASES and getattr(m, "has_relative_attention_bias", False)
    ]


def _rows_bias(compute_bias, positions):
    """A `compute_bias` of each row's queries at `positions` [B, q] (torch), from the module's own
    `compute_bias`: one query at position `key_length - 1` over 2 x key_length - 1 keys gives the
    bias of every offset from -(key_length - 1) to key_length - 1, which each row then picks."""

    def bias(query_length, key_length, device=None, past_seen_tokens=0):
        table = compute_bias(1, 2 * key_length - 1, device=device, past_seen_tokens=key_length - 1)[0, :, 0]
        columns = torch.arange(key_length, device=positions.device)
        offsets = columns[None, None, :] - positions[:, :, None].long() + (key_length - 1)  # [B, q, k]
        offsets = offsets.clamp(0, 2 * key_length - 2)
        picked = torch.nn.functional.embedding(offsets, table.transpose(0, 1))  # [B, q, k, heads]
        return picked.permute(0, 3, 1, 2)

    return bias


def _numbers_whole_input(embedding) -> bool:
    """Whether a decoder's position table numbers its whole input at every step, keeping the last
    token's: FSMT's before transformers 5.24 (its forward takes no `cache_length`), whose decoder takes
    all its tokens so far at every step, where the slots give a step's tokens only."""
    return type(embedding).__name__ == "SinusoidalPositionalEmbedding" and (
        "cache_length" not in inspect.signature(embedding.forward).parameters
    )


def decoder_positions(module) -> str | None:
    """How `module`'s decoder takes each row's own positions: "keyword" (its forward's
    decoder_position_ids), "hook" (a `POSITION_EMBEDDINGS` module in its decoder), "bias" (a
    `RELATIVE_BIASES` attention in its decoder, and no other position embedding), or None."""
    if "decoder_position_ids" in inspect.signature(module.forward).parameters:
        return "keyword"
    decoder = module.get_decoder()
    embedding = getattr(decoder, "embed_positions", None)
    if type(embedding).__name__ in POSITION_EMBEDDINGS and not _numbers_whole_input(embedding):
        return "hook"
    if getattr(decoder, "embed_positions", None) is None and _bias_modules(decoder):
        return "bias"
    return None


def check_encoder_decoder(model) -> None:
    """Raises GenerationError for an encoder-decoder the slot core cannot run, saying why."""
    module = model.module
    main = module.main_input_name
    if main != "input_ids" and not (main == "input_features" and hasattr(module.config, "max_source_positions")):
        raise GenerationError(
            f"the slot core holds an encoder output of a length fixed per slot model: token ids, or Whisper's "
            f"feature frames; {type(module).__name__}'s encoder reads {main}; use Model.generate for it"
        )
    if decoder_positions(module) is None:
        raise GenerationError(
            f"the slot core gives each row's decoder its own positions; {type(module).__name__}'s decoder takes "
            "none (its positions, or its relative position bias, count from the cache's length, one for every "
            "row); use Model.generate for it, which runs it on a loop of its own"
        )
    config = module.config.get_text_config(decoder=True)
    other = sorted(_slots.layer_kinds(config) - set(_slots.MASKS))
    if other:
        raise GenerationError(
            f"the slot core masks full, sliding-window and chunked self-attention; {config.model_type}'s decoder also has "
            f"{', '.join(other)} layers; use Model.generate for it"
        )


def _encoder_width(config) -> int:
    """The width of the encoder's output: `d_model` (BART's, T5's, Whisper's), else the encoder's hidden
    size (T5Gemma's, whose encoder and decoder have configs of their own)."""
    width = getattr(config, "d_model", None)
    return width if width is not None else getattr(config, "encoder", config).hidden_size


def _cross_layer_class():
    from transformers.cache_utils import StaticLayer

    class CrossLayer(StaticLayer):
        """A cross-attention layer [B, heads, E, head_dim]: given (`keys`, `values`), what the attention
        reads (`is_updated`); else it keeps what the attention computes from the encoder's output."""

        def __init__(self, keys=None, values=None):
            super().__init__(max_cache_len=0)
            self.keys, self.values = keys, values
            self.is_initialized = keys is not None

        def update(self, key_states, value_states, *args, **kwargs):
            self.keys, self.values = key_states, value_states
            self.is_initialized = True
            return key_states, value_states

        def get_seq_length(self):
            return 0

    return CrossLayer


class EncoderDecoderSlotModel(SlotModel):
    """An encoder-decoder run over S slots: a decoder KV cache of L columns per slot, and per slot the
    cross-attention keys and values over an encoder output of E positions (inside traces)."""

    def __init__(self, model, slots: int, length: int, encoder_length: int | None = None):
        super().__init__(model, slots, length)
        self._hold_encoder(encoder_length)

    def _hold_encoder(self, encoder_length: int | None) -> None:
        """What the slots keep of the encoder, beside `SlotModel`'s decoder cache (see the class)."""
        config = self.module.config
        self.main_input = self.module.main_input_name
        self.features_input = self.main_input != "input_ids"  # e.g. Whisper's input_features
        if self.features_input:
            encoder_length = config.max_source_positions  # Whisper: 2 x this many feature frames
        if encoder_length is None:
            raise GenerationError(
                f"EncoderDecoderSlotModel: {type(self.module).__name__} reads token ids; pass encoder_length=, the "
                "longest encoder input its slots hold"
            )
        self.encoder_length = encoder_length
        self.positions = decoder_positions(self.module)
        self.cross_class = _cross_layer_class()
        self._cross_shapes = None
        # The slots' cross keys and values and encoder mask that the decoder reads, within a program's trace.
        self._reading = None

    def program_key(self) -> tuple:
        return ("encoder", self.encoder_length)

    def encoder_inputs(self, rows: int) -> dict:
        """Zeros like the `inputs` a prefill of `rows` rows takes: the encoder's main input, and (token
        inputs) its attention mask."""
        config = self.module.config
        if self.features_input:
            shape = (rows, config.num_mel_bins, 2 * self.encoder_length)
            return {self.main_input: jnp.zeros(shape, jnp.float32)}
        zeros = jnp.zeros((rows, self.encoder_length), jnp.int32)
        return {"input_ids": zeros, "attention_mask": zeros}

    def shapes(self):
        if self._shapes is None:

            def one_token(params):
                cross, _ = self.encode(params, self.encoder_inputs(1))
                self_cache = [(jnp.zeros((1, k.shape[1], self.length, k.shape[3]), k.dtype),) * 2 for k, _ in cross]
                with self.attending(cross, jnp.ones((1, self.encoder_length), jnp.int32)), self.bound(params):
                    logits, _ = self.run(
                        params, self_cache, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                        jnp.zeros((1, 1), jnp.int32),
                    )  # fmt: skip
                return cross, logits

            cross, logits = jax.eval_shape(one_token, self.model.params)
            self._cross_shapes = [
                tuple(jax.ShapeDtypeStruct((self.slots, *s.shape[1:]), s.dtype) for s in pair) for pair in cross
            ]
            # The decoder's self-attention keys and values: as many heads as its cross-attention's, L columns.
            cache = [
                tuple(jax.ShapeDtypeStruct((self.slots, s.shape[1], self.length, s.shape[3]), s.dtype) for s in pair)
                for pair in self._cross_shapes
            ]
            self._shapes, self._logits_dtype = (cache, logits.shape[-1]), logits.dtype
        return self._shapes

    def bytes_per_slot(self) -> int:
        self.shapes()
        cross = sum(int(s.size // self.slots) * s.dtype.itemsize for pair in self._cross_shapes for s in pair)
        return super().bytes_per_slot() + cross + 4 * self.encoder_length

    def extra_state(self) -> dict:
        self.shapes()
        extra = {
            "cross": [tuple(jnp.zeros(s.shape, s.dtype) for s in pair) for pair in self._cross_shapes],
            "encoder_mask": jnp.zeros((self.slots, self.encoder_length), jnp.int32),
        }
        if not self.features_input:  # the n-grams encoder_no_repeat_ngram_size reads
            extra["encoder_ids"] = jnp.full((self.slots, self.encoder_length), -1, jnp.int32)
        return extra

    def encode(self, params, inputs: dict) -> tuple[list, jax.Array]:
        """(each decoder layer's cross-attention (keys, values) [P, heads, E, head_dim], the encoder mask
        [P, E] int32) for `inputs` of P rows: the encoder's output, projected by each layer's
        cross-attention (a decoder run of one token, whose cross-attention cache keeps them)."""
        from transformers import EncoderDecoderCache, StaticCache

        main = inputs[self.main_input]
        rows = main.shape[0]
        mask = inputs.get("attention_mask")
        with self.bound(params):
            value = bridge.to_torch(main)
            if value.is_floating_point():
                value = value.to(self.module.dtype)
            encoder_kwargs = {self.main_input: value}
            if mask is not None:
                encoder_kwargs["attention_mask"] = bridge.to_torch(mask)
            encoder = self.module.get_encoder()
            with _known_reads(encoder):
                hidden = encoder(**encoder_kwargs).last_hidden_state  # [P, E, H]
            if hidden.shape[1] != self.encoder_length:
                raise GenerationError(
                    f"EncoderDecoderSlotModel: the encoder gave {hidden.shape[1]} positions, and the slots hold "
                    f"{self.encoder_length}; pad the encoder's input to {self.encoder_length}"
                )
            decoder = self.module.get_decoder()
            layers = len(decoder.layers if hasattr(decoder, "layers") else decoder.block)  # (T5's: `block`)
            # Both caches keep what the layers compute: the token attends to itself, and the cross keys stay.
            own, cross = (StaticCache(config=self.config, max_cache_len=1) for _ in range(2))
            own.layers = [self.cross_class() for _ in range(layers)]
            cross.layers = [self.cross_class() for _ in range(layers)]
            past = EncoderDecoderCache(own, cross)
            past.is_updated = {i: False for i in range(layers)}
            ids = bridge.to_torch(jnp.zeros((rows, 1), jnp.int32))
            itself = bridge.to_torch(self._mask(jnp.ones((rows, 1, 1, 1), bool), bridge.to_jax(hidden).dtype))
            kwargs = self._decoder_kwargs(hidden, mask, ids, jnp.zeros((rows, 1), jnp.int32), past, itself)
            self.module(**kwargs)
        keys = [(bridge.to_jax(layer.keys), bridge.to_jax(layer.values)) for layer in cross.layers]
        if mask is None:
            mask = jnp.ones((rows, self.encoder_length), jnp.int32)
        return keys, mask.astype(jnp.int32)

    @contextlib.contextmanager
    def attending(self, cross: list, encoder_mask):
        """The decoder runs of this block read `cross` [(keys, values)] [B, heads, E, head_dim] and
        `encoder_mask` [B, E] (the rows' slots': `SlotState.cross`, `SlotState.encoder_mask`)."""
        before, self._reading = self._reading, (cross, encoder_mask)
        try:
            yield
        finally:
            self._reading = before

    def run(
        self, params, cache, ids, positions, columns, keep=None, *, lora=None, inputs=None, blocks=None, shift=None
    ):  # (shift: a decoder prompt has no pads)
        """`SlotModel.run` of the decoder, over the rows' cross-attention keys and values (`_attending`); the
        encoder's inputs went to `prefill_chunk`, so a decoder run takes no other `inputs` nor `blocks`."""
        from transformers import EncoderDecoderCache, StaticCache

        if inputs or blocks is not None:
            raise GenerationError(
                f"EncoderDecoderSlotModel.run: inputs={sorted(inputs or ())}, blocks={blocks is not None} for "
                f"{type(self.module).__name__}'s decoder; its encoder's inputs go to prefill_chunk"
            )
        cross, encoder_mask = self._reading
        length = cache[0][0].shape[2]
        past = StaticCache(config=self.config, max_cache_len=length)
        past.layers = [
            self.layer_class(bridge.to_torch(k), bridge.to_torch(v), bridge.to_torch(columns)) for k, v in cache
        ]
        crossed = StaticCache(config=self.config, max_cache_len=self.encoder_length)
        crossed.layers = [self.cross_class(bridge.to_torch(k), bridge.to_torch(v)) for k, v in cross]
        both = EncoderDecoderCache(past, crossed)
        both.is_updated = {i: True for i in range(len(crossed.layers))}
        rows, width = ids.shape[0], _encoder_width(self.module.config)
        # The encoder's output is read only through the cross keys and values: the decoder gets zeros of its shape.
        hidden = bridge.to_torch(jnp.zeros((rows, self.encoder_length, width), cross[0][0].dtype))
        mask = self.attention_mask(positions, length, cache[0][0].dtype)
        kwargs = self._decoder_kwargs(hidden, encoder_mask, bridge.to_torch(ids), positions, both, mask)
        with self._positions_hook(positions), self._masked(positions, length, cache[0][0].dtype, mask):
            with contextlib.nullcontext() if lora is None else _lora.rows(lora):
                out = self.module(**kwargs)
        logits = bridge.to_jax(out.logits).astype(jnp.float32)
        if keep is not None:
            logits = jnp.take(logits, keep, axis=1)
        return logits, [(bridge.to_jax(layer.keys), bridge.to_jax(layer.values)) for layer in past.layers]

    def _decoder_kwargs(self, hidden, encoder_mask, ids, positions, cache, mask) -> dict:
        """The module's forward arguments for a decoder run: the encoder's output `hidden` (torch), the
        cross-attention mask where the encoder reads tokens, the decoder's ids, positions and mask."""
        from transformers.modeling_outputs import BaseModelOutput, MoEModelOutput

        output = MoEModelOutput if type(self.module).__name__ in ROUTED_ENCODERS else BaseModelOutput
        kwargs = {
            "encoder_outputs": output(last_hidden_state=hidden),
            "decoder_input_ids": ids,
            "decoder_attention_mask": mask,
            self.cache_keyword: cache,
            "use_cache": True,
        }
        if not self.features_input and encoder_mask is not None:
            kwargs["attention_mask"] = bridge.to_torch(encoder_mask)
        if self.positions == "keyword":
            kwargs["decoder_position_ids"] = bridge.to_torch(positions)
        return kwargs

    @contextlib.contextmanager
    def _masked(self, positions, length: int, dtype, mask):
        """Within the block, the modules of an `UNMASKED_DECODERS` decoder get the self-attention mask of
        queries at positions [B, q] over `length` columns (`mask`, as the decoder takes it, or additive);
        nothing for another decoder (it takes the mask itself)."""
        modules = [m for m in self.module.get_decoder().modules() if type(m).__name__ in UNMASKED_DECODERS]
        if not modules:
            yield
            return
        allowed = jnp.arange(length, dtype=jnp.int32)[None, None, None, :] <= positions[:, None, :, None]
        additive = bridge.to_torch(jnp.where(allowed, jnp.zeros((), dtype), jnp.finfo(dtype).min))  # [B, 1, q, L]
        handles = [
            m.register_forward_pre_hook(
                lambda module, args, kwargs: UNMASKED_DECODERS[type(module).__name__](args, kwargs, additive, mask),
                with_kwargs=True,
            )
            for m in modules
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def _positions_hook(self, positions):
        """Within the block, the decoder's position embedding (a `POSITION_EMBEDDINGS` module) looks up
        each row's `positions` [B, q], or its relative bias (`RELATIVE_BIASES`) is each row's own;
        nothing where the decoder takes them as an argument."""
        rows = bridge.to_torch(positions)
        if self.positions == "bias":
            attentions = _bias_modules(self.module.get_decoder())
            for attention in attentions:  # an instance attribute over the class's method, for this block
                attention.compute_bias = _rows_bias(type(attention).compute_bias.__get__(attention), rows)
            try:
                yield
            finally:
                for attention in attentions:
                    del attention.compute_bias
            return
        if self.positions != "hook":
            yield
            return
        with _slots.looked_up(self.module.get_decoder().embed_positions, rows):
            yield

    def prefill_chunk(self, params, state: SlotState, rows, which, *args, inputs=None, **kwargs):
        """`SlotModel.prefill_chunk`; with `inputs`, the encoder runs over them first and its cross keys
        and values go to the rows' slots (see the module's docstring)."""
        if inputs is not None:
            inputs = dict(inputs)
            source = inputs.pop(NGRAM_SOURCE, None)
            cross, mask = self.encode(params, inputs)
            state = dataclasses.replace(
                state,
                cross=[
                    tuple(a.at[which].set(n.astype(a.dtype), mode="drop") for a, n in zip(pair, new))
                    for pair, new in zip(state.cross, cross)
                ],
                encoder_mask=state.encoder_mask.at[which].set(mask, mode="drop"),
            )
            if state.encoder_ids is not None:  # (without a source: the ids on the encoder's mask)
                if source is None:
                    source = jnp.where(mask > 0, inputs["input_ids"], -1)
                state = dataclasses.replace(
                    state, encoder_ids=state.encoder_ids.at[which].set(source.astype(jnp.int32), mode="drop")
                )
        else:
            cross = [tuple(a.at[which].get(mode="fill", fill_value=0) for a in pair) for pair in state.cross]
            mask = state.encoder_mask.at[which].get(mode="fill", fill_value=0)
        with self.attending(cross, mask):
            return super().prefill_chunk(params, state, rows, which, *args, **kwargs)

    def reads_cache_in_place(self, cache=None) -> bool:
        return False  # its decode reads the rows' cross keys too: the window is sliced out

    def decode_chunk(self, params, state: SlotState, rows, active, count, want_logprobs, *, decoding_rows, **kwargs):
        r = decoding_rows
        cross = [tuple(a[:r] for a in pair) for pair in state.cross]
        with self.attending(cross, state.encoder_mask[:r]):
            return super().decode_chunk(params, state, rows, active, count, want_logprobs, decoding_rows=r, **kwargs)


class SpeculativeEncoderDecoderSlotModel(EncoderDecoderSlotModel, SpeculativeSlotModel):
    """An `EncoderDecoderSlotModel` whose decode drafts by prompt lookup over each row's decoder tokens
    and verifies in rounds (`SpeculativeSlotModel`): its prefill and every decoder run, the verifying
    forward of k + 1 tokens included, read the rows' cross keys (`attending`)."""

    def __init__(self, model, slots: int, length: int, encoder_length: int | None, speculation):
        if speculation.method != "ngram":
            raise GenerationError(
                f"SpeculativeEncoderDecoderSlotModel: Speculation(method={speculation.method!r}); an encoder-decoder "
                "drafts by prompt lookup only (method='ngram'): a draft model would need cross slots of its own"
            )
        SpeculativeSlotModel.__init__(self, model, slots, length, speculation)
        self._hold_encoder(encoder_length)

    def program_key(self) -> tuple:
        return (*EncoderDecoderSlotModel.program_key(self), *SpeculativeSlotModel.program_key(self))


def check_supported(model) -> None:
    """Raises GenerationError for a model the slot core cannot serve, saying why: a decoder-only model
    (`_slots.check_supported`), or an encoder-decoder (`check_encoder_decoder`); a model that no engine
    generates with (`check_generated`)."""
    check_generated(model.module)
    if getattr(model.module.config, "is_encoder_decoder", False):
        check_encoder_decoder(model)
    else:
        _slots.check_supported(model)


def slot_model(
    model, slots: int, length: int, *, encoder_length: int | None = None, speculation=None, draft=None
) -> SlotModel:
    """The slot model of `model`: an `EncoderDecoderSlotModel` for an encoder-decoder (whose slots hold
    `encoder_length` encoder positions where it reads tokens; default `length`), else a `SlotModel`;
    with `speculation` (and its `draft` model), the speculative kind of either."""
    if getattr(model.module.config, "is_encoder_decoder", False):
        if speculation is not None:
            return SpeculativeEncoderDecoderSlotModel(model, slots, length, encoder_length or length, speculation)
        return EncoderDecoderSlotModel(model, slots, length, encoder_length or length)
    if speculation is not None:
        return SpeculativeSlotModel(model, slots, length, speculation, draft=draft)
    return SlotModel(model, slots, length)
