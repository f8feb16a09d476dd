"""The continuous-batching core: a KV cache of S sequence slots and its two programs.

Each slot is one row of a static KV cache [S, heads, L, head_dim] per layer: its request's token at
position p has its keys and values in column p. Rows advance independently, so the model is given a
4-D attention mask built from each row's positions and writes its new keys and values through
`SlotLayer`, a transformers `StaticLayer` that writes each row at that row's own column.

    prefill_chunk   the next C prompt tokens of P slots written into their rows (each row's real
                    tokens last in the chunk, so the model makes logits at one index); the token
                    after each row's last real token chosen with the slot's settings
                    (`choose_prefilled`, which a server compiles as a program of its own)
    decode_chunk    up to K one-token steps of the first R slots in one program (a `while_loop`,
                    which ends early once every row has stopped, where the program has stop
                    tokens), over the first W columns of the cache; rows that are not decoding
                    write nowhere

A recurrent model (Mamba: `_recurrent.recurrent_model`) keeps no keys and values: each slot holds its
layers' states instead (`SlotState.recurrent`, [S, ...] per array); a hybrid (`_recurrent.hybrid_model`)
keeps its attention layers' keys and values in the cache and its recurrent layers' states beside
them. Such a model's prefill chunk is a row's whole prompt, scanned from zeros (the pads before it
masked, so they leave the state as the prompt alone gives it), and each decode step moves the active
rows' states on and leaves the others' as they were; a window does not cut a state. A model that
keeps no cache a slot can hold (`recomputed`: GPT-1, RecurrentGemma) keeps each row's tokens in their
columns instead, and every program runs a row's window whole, as transformers runs it without a cache.

Each slot's sampling settings are per-row arrays (`RowSampling`), and the token choice is the one
every program makes (`_choose.choose_tokens`), so requests coming and going never change a
program's shape. `_slot_programs.SlotPrograms` compiles and keeps the programs (`ProgramCache`: in
memory, and on disk as `jax.export` blobs), one per (kind, rows, columns).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import weakref

import jax
import jax.numpy as jnp
import torch

from .. import _backend, bridge, parallel
from .. import lora as _lora
from .._errors import DataDependentError, GenerationError
from . import _caches, _multimodal, _sampling, _stops
from ._adapters import RecomputeAdapter, StaticCacheAdapter, adapter_for
from ._choose import apply_rules, choose_tokens
from ._recurrent import (
    hybrid_model,
    number_of_states,
    recurrent_kinds,
    recurrent_model,
    state_layer,
    state_names,
    states_of,
)
from ._rows import RowSampling, SamplingFeatures

TOP_LOGPROBS = 20  # the most alternatives OpenAI's API lets a request ask for per token
STOPPED = -1  # `SlotState.tokens` of a row past its stop token


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """What the device holds for S slots between programs."""

    cache: list  # [(keys, values)] per layer, each [S, heads, L, head_dim]
    # [S] int32: each slot's last token, not yet in its cache; STOPPED where a row (Model.generate's)
    # has stopped and its stop token is in the cache: it runs on pad tokens (`decode_chunk`)
    tokens: jax.Array
    positions: jax.Array  # [S] int32: that token's position
    seen: jax.Array | None  # [S, V] bool: the row's tokens so far (repetition penalty); else None
    counts: jax.Array | None  # [S, V] int32: the answer's tokens (presence / frequency penalties); else None
    # [S, L] int32: each row's tokens so far as transformers' input_ids hold them (its pads first, see
    # `RowSampling.pads`), where a `HistoryRules` rule reads them (Model.generate's: its L columns hold
    # the prompt bucket and the token buffer, so the caller's narrower padded prompt and the answer fit); else None
    history: jax.Array | None = None
    # [(keys, values)] per layer of a draft model's own cache in the same slots and columns, where a
    # speculative decode drafts with one (`SpeculativeSlotModel`); else None
    draft: list | None = None
    # An encoder-decoder's (`EncoderDecoderSlotModel`; else None): [(keys, values)] per decoder layer of
    # each slot's cross-attention over its encoder output, each [S, heads, E, head_dim] (E: the encoder
    # length the slot model is built for), written by the prefill that reads the encoder's input; and
    # encoder_mask [S, E] int32, 1 on the encoder's real positions
    cross: list | None = None
    encoder_mask: jax.Array | None = None
    # (state arrays, ...) per layer of a recurrent model (Mamba: its conv and SSM states, each [S, ...]),
    # in `SlotModel.state_layout`'s order: a row's state after its tokens so far; else None
    recurrent: list | None = None
    # [S, E] int32: a token encoder's input ids as transformers' encoder_input_ids hold them (-1 past
    # them), the n-grams encoder_no_repeat_ngram_size bans (`history_rules`); else None
    encoder_ids: jax.Array | None = None

    def leaves(self) -> tuple:
        """The state as plain containers, which `jax.export` keeps (programs take and return these)."""
        return (
            self.cache, self.tokens, self.positions, self.seen, self.counts, self.history, self.draft, self.cross,
            self.encoder_mask, self.recurrent, self.encoder_ids,
        )  # fmt: skip


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Chosen:
    """The tokens a program chose, with their log-probabilities (R rows, T tokens each)."""

    token: jax.Array  # [R, T] int32
    logprob: jax.Array  # [R, T] float32: log-softmax of the model's logits at the chosen token
    top_token: jax.Array  # [R, T, TOP_LOGPROBS] int32: the most likely tokens, most likely first
    top_logprob: jax.Array  # [R, T, TOP_LOGPROBS] float32
    ran: jax.Array  # [] int32: the steps run (T where no row stops early; see `decode_chunk`)
    # Model.generate's return_dict_in_generate: each new token's processed scores and raw logits
    # [R, T, V] float32, where the programs keep them (`SlotPrograms.kept`); else None.
    scores: jax.Array | None = None
    logits: jax.Array | None = None
    # A speculative decode's (`SpeculativeSlotModel`; else None): the tokens each row made [R] int32
    # (its first `made` of T; `ran` is the most any row made), the drafts each row offered for
    # verification and those it kept [R] int32, and the rounds run ([] int32: the target's forwards);
    # the rounds in which each row offered drafts [R] int32 (vLLM's drafts), and how often each row kept
    # its draft at each of the k indices [R, k] int32 (vLLM's acceptance per position)
    made: jax.Array | None = None
    drafted: jax.Array | None = None
    accepted: jax.Array | None = None
    rounds: jax.Array | None = None
    proposed: jax.Array | None = None
    accepted_at: jax.Array | None = None


def _packs_grouped_queries() -> bool:
    """Whether transformers' sdpa attention hands torch's attention a decode step's query heads packed
    by key/value head (transformers 5.24's `pack_gqa`), not each key/value head repeated."""
    from transformers.integrations import sdpa_attention

    return hasattr(sdpa_attention, "pack_gqa")


def _slot_layer_class():
    from transformers.cache_utils import StaticLayer

    class SlotLayer(StaticLayer):
        """A StaticLayer [B, heads, L, head_dim] whose rows are written at their own columns: the
        keys of row b's query j go to column columns[b, j] (out of range: dropped). `indexer`: a
        sparse-attention layer's indexer keys [B, 1, L, index_head_dim] (DeepSeek V3.2's DSA:
        transformers' `StaticIndexedLayer`), written at the same columns; else None."""

        def __init__(self, keys, values, columns, indexer=None):
            super().__init__(max_cache_len=keys.shape[2])
            self.keys, self.values, self.columns, self.indexer = keys, values, columns, indexer
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            self.keys = _written(self.keys, key_states, self.columns)
            self.values = _written(self.values, value_states, self.columns)
            return self.keys, self.values

        def update_indexer(self, indexer_key_states):
            # [B, q, index_head_dim] -> every column's indexer keys [B, L, index_head_dim], as transformers'
            self.indexer = _written(self.indexer, indexer_key_states.unsqueeze(1), self.columns)
            return self.indexer[:, 0]

        def arrays(self) -> tuple:
            """The layer's arrays as the slot cache holds them: (keys, values), and its indexer keys where it has them."""
            return tuple(bridge.to_jax(a) for a in (self.keys, self.values, self.indexer) if a is not None)

        def get_seq_length(self):
            return 0  # positions come from position_ids, the mask is given whole

    return SlotLayer


def _slot_state_layer_class(slot_layer):
    from transformers.cache_utils import LinearAttentionLayer

    class SlotStateLayer(LinearAttentionLayer, slot_layer):
        """A `slot_layer` (keys and values written at each row's columns) that also holds a recurrent
        layer's states: a layer that attends and scans (Zamba's and Falcon-H1's "hybrid" layers)."""

        def __init__(self, keys, values, columns, states: int):
            LinearAttentionLayer.__init__(self, number_of_states=states)
            slot_layer.__init__(self, keys, values, columns)

        update = slot_layer.update
        get_seq_length = slot_layer.get_seq_length

    return SlotStateLayer


@contextlib.contextmanager
def _grouped_queries():
    """While traced in it, transformers' sdpa attention hands torch's attention its query heads grouped
    by key/value head (`enable_gqa`; every backend's attention groups them by their shapes) wherever it
    would repeat each key/value head over its keys (`repeat_kv`: with a mask, off CUDA), a copy of the
    keys and values a layer reads, made in every layer of every call. A prompt chunk's (`run_chunk`,
    `run_prompts`), over its rows' window: a lone 4000-token prompt's first token 1.33x sooner on the
    CPU (docs/architecture.md, "Grouped heads in a prefill"). Within `bound` (torch runs one at a time)."""
    from transformers.integrations import sdpa_attention

    repeats = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
    if repeats is None:  # (a transformers without it: its own rule stands)
        yield
        return
    sdpa_attention.use_gqa_in_sdpa = lambda *args, **kwargs: True
    try:
        yield
    finally:
        sdpa_attention.use_gqa_in_sdpa = repeats


def _written(cache, new, columns):
    cache, new, columns = bridge.to_jax(cache), bridge.to_jax(new), bridge.to_jax(columns)  # [B,H,L,D] [B,H,q,D] [B,q]
    new = new.astype(cache.dtype)
    if columns.shape == (1, 1):
        # One row's one token (a decode step at batch 1): XLA turns the scatter below into an update of
        # a slice whose bounds check reads the old layer, and then copies the whole layer at every
        # step; a `cond` on the column writes in place, or not at all.
        column = columns[0, 0]
        written = jax.lax.cond(
            column < cache.shape[2],
            lambda: jax.lax.dynamic_update_slice(cache, new, (0, 0, column, 0)),
            lambda: cache,
        )
        return bridge.to_torch(written)
    rows = jnp.broadcast_to(jnp.arange(new.shape[0], dtype=jnp.int32)[:, None], columns.shape)
    # Advanced indices around a slice put their dimensions first: cache[rows, :, columns] is [B, q, H, D].
    return bridge.to_torch(cache.at[rows, :, columns].set(jnp.swapaxes(new, 1, 2), mode="drop"))


def check_supported(model) -> None:
    """Raises GenerationError for a decoder-only model the slot cache cannot serve, saying why (an
    encoder-decoder: `_encoder_slots.check_supported`)."""
    adapter = adapter_for(model.module)
    config = model.module.config.get_text_config(decoder=True)
    if recurrent_model(model.module):
        return  # a state per slot (`SlotState.recurrent`)
    if recomputed(model):  # each slot's tokens so far, run whole at every step (`SlotModel.recomputes`)
        if hasattr(model.module, "get_image_features"):  # (what `serving.Engine` reads)
            raise GenerationError(
                f"hfjax serve's slots rerun {type(model.module).__name__}'s tokens at every step (it keeps no "
                "cache), and its images would be read at the prefill only; use Model.generate for it without images"
            )
        return
    if type(adapter) is not StaticCacheAdapter and not hybrid_model(model.module) and not _cached_anyway(model):
        raise GenerationError(
            f"hfjax serve batches decoder-only causal LMs with a static KV cache or a recurrent state; "
            f"{type(model.module).__name__} keeps its past as {adapter.kind!r}; use Model.generate for it"
        )
    if any(_caches.recurrent(layer) for layer in _caches.static_cache(config, 1).layers) and not hybrid_model(
        model.module
    ):
        raise GenerationError(
            f"hfjax serve's slot cache holds keys and values per slot; {config.model_type} also has "
            "linear-attention or mamba layers, whose states it does not keep; use Model.generate for it"
        )
    if position_source(model.module) is None:
        raise GenerationError(
            f"hfjax serve's slots give each token its position; {type(model.module).__name__} takes no position_ids "
            "(it counts positions from its cache's length); use Model.generate for it"
        )
    unknown = layer_kinds(config) - set(MASKS) - recurrent_kinds(config)
    if hybrid_model(model.module):  # (its slot layers are laid out beside the states: `SlotModel.run_states`)
        unknown -= _caches.kinds_where(config, _caches.keeps_nothing)  # (Nemotron-H's MLP and MoE layers)
    unknown = sorted(unknown)
    if unknown:
        raise GenerationError(
            f"hfjax serve's slot cache masks full, sliding-window and chunked attention; {config.model_type} also has "
            f"{', '.join(unknown)} layers; use Model.generate for it"
        )


def _cached_anyway(model) -> bool:
    """Whether `model`'s module, which `Generator` runs without a cache (transformers compiles it in no
    whole program), takes transformers' cache anyway: its forward has the cache's argument, every layer
    of its static cache keeps keys and values, and a forward gives that cache back (an abstract run of
    one token: RecurrentGemma before transformers 5.24 takes the argument and keeps its state in its
    modules)."""
    from transformers.cache_utils import StaticLayer

    module = model.module
    if type(adapter_for(module)) is not RecomputeAdapter:
        return False
    if _caches.cache_keyword(module) not in inspect.signature(module.forward).parameters:
        return False
    config = module.config.get_text_config(decoder=True)
    layers = _caches.static_cache(config, 1).layers
    if not layers or not all(isinstance(layer, StaticLayer) and not _caches.recurrent(layer) for layer in layers):
        return False
    returned = []

    def one_token(params):
        with bridge.bound(module, params, model.aliases, bridge.prng_key()):
            ids = bridge.to_torch(jnp.zeros((1, 1), jnp.int32))
            out = module(
                input_ids=ids,
                position_ids=ids,
                use_cache=True,
                **{_caches.cache_keyword(module): _probe_cache(config, 1)},
            )
            returned.append(_caches.returned_cache(out) is not None)
            return bridge.to_jax(out.logits)

    with reads_no_data(model):
        jax.eval_shape(one_token, model.params)
    return returned[0]


def recomputed(model) -> bool:
    """Whether `model` is one the slots run without a cache of transformers': `Generator` recomputes it
    (`RecomputeAdapter`: transformers compiles it in no whole program) and it keeps no cache a slot can
    hold (GPT-1 takes none; RecurrentGemma keeps its state in its modules before transformers 5.24, and
    its recurrent layers' state in a cache without a layout of them here after). Each slot then holds
    its tokens so far, and every step runs them whole (`SlotModel.recomputes`)."""
    module = model.module
    if type(adapter_for(module)) is not RecomputeAdapter or recurrent_model(module) or hybrid_model(module):
        return False
    if "attention_mask" not in inspect.signature(module.forward).parameters:  # (every run gives it)
        return False
    if numbers_columns(module):  # (it would count positions from a cache, which a run from column 0 has none of)
        return True
    if module not in _RECOMPUTED:  # (an abstract run: once per module)
        _RECOMPUTED[module] = not _cached_anyway(model)
    return _RECOMPUTED[module]


def numbers_columns(module) -> bool:
    """Whether `module` takes no positions the slots can give (`position_source` None: RoFormer's
    rotary and TrOCR's and ProphetNet's learned positions count from its cache's length, RWKV has none),
    so that its slots recompute it: each run numbers a row's columns from 0, its left pads laid before
    it (`reads_pads`), as transformers' generate numbers a padded batch's tokens (its pads counted)."""
    return "position_ids" not in inspect.signature(module.forward).parameters and position_source(module) is None


_RECOMPUTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module: whether it recomputes


def reads_pads(model) -> bool:
    """Whether a recomputed model's tokens depend on the left pads before a prompt, where the slots' tokens
    hold none: layers that are not attention read them (RecurrentGemma's convolution and recurrence: its
    "recurrent" block_types, and "linear_attention" layer_types in transformers 5.24; RWKV's), or its
    positions count them (`numbers_columns`)."""
    config = model.module.config.get_text_config(decoder=True)
    kinds = layer_kinds(config) | set(getattr(config, "block_types", None) or ())
    if not recomputed(model):
        return False
    return numbers_columns(model.module) or bool(kinds - set(MASKS) - {"attention"})


def _probed_arrays(layer) -> tuple:
    """A probe cache layer's arrays as the slot cache holds them (`SlotLayer.arrays`): keys and values,
    and an indexed layer's indexer keys [B, L, D] as [B, 1, L, D], its columns where the keys' are."""
    arrays = (bridge.to_jax(layer.keys), bridge.to_jax(layer.values))
    indexer = getattr(layer, "indexer_keys", None)
    return arrays if indexer is None else (*arrays, bridge.to_jax(indexer)[:, None])


def _probe_cache(config, length: int):
    """A static cache for an abstract run that finds what the slots' cache holds: it counts no tokens
    seen, as the slots' layers do (`SlotLayer.get_seq_length`), so a model that reads that count as a
    Python value (MPT's bias offsets) reads no data."""
    cache = _caches.static_cache(config, length)
    cache.get_seq_length = lambda layer_idx=0: 0
    return cache


@contextlib.contextmanager
def reads_no_data(model):
    """Within the block, a model whose trace reads values of its data (`DataDependentError`) is a
    GenerationError saying so: the slot core (hfjax serve's engine) compiles each program once, where
    `Generator` specialises its programs per call and guards them."""
    try:
        yield
    except DataDependentError as error:
        raise GenerationError(
            f"{type(model.module).__name__} reads values of its data ({str(error).split('. ')[0]}), and the slot "
            "core compiles each program once, before it runs; use Model.generate for it"
        ) from error


# The attention masks the slot programs build. DeepSeek V3.2's sparse attention layers ("indexed_attention";
# "deepseek_sparse_attention" before transformers 5.24) take the causal mask and narrow it themselves, to
# the keys their indexer picks (its keys a third array per layer: `SlotLayer`).
MASKS = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention", "deepseek_sparse_attention")
_BOTH = ("hybrid",)  # the layer_types of layers that attend and keep a recurrent state


def alibi_builder(module):
    """The submodule that builds `module`'s ALiBi biases from its 2-D attention mask (Bloom's
    `build_alibi_tensor`), where its forward takes no position_ids; else None."""
    if "position_ids" in inspect.signature(module.forward).parameters:
        return None
    return next((m for m in module.modules() if callable(getattr(m, "build_alibi_tensor", None))), None)


def _plain_embedding(module, positions):
    """Blenderbot's learned and Marian's and Pegasus' sinusoidal positions: row b's position p is the table's row p."""
    return module.weight[positions]


def _offset_embedding(module, positions):
    """BART's (mBART's, PLBart's) learned positions: row b's position p is the embedding's row p + module.offset (2)."""
    return module.weight[positions + module.offset]


def _sinusoids(module, positions):
    """Pegasus-X's positions, computed: the sines then the cosines of position x 10000^(-i / (half - 1))
    over the first half of the features, as its forward computes them for positions it counts."""
    import torch

    half = module.embed_dim // 2
    frequencies = torch.exp(
        torch.arange(half, dtype=torch.int64, device=positions.device).to(torch.float32)
        * -(math.log(float(module.max_scale)) / (half - 1))
    )
    angles = positions[..., None] * frequencies  # [B, q, half]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)


def _m2m100_embedding(module, positions):
    """M2M100's (NLLB's, NLLB-MoE's), SeamlessM4T's and FSMT's sinusoidal positions: transformers numbers
    a row's tokens that are not padding from padding_idx + 1, so row b's position p is the table's row
    p + padding_idx + 1 (a decoder's tokens are never padding, unless it makes the pad token itself:
    transformers then gives that token the padding's row, and the slots its position's). M2M100 and
    SeamlessM4T keep their tables in `weights`, FSMT in `weight`."""
    table = module.weights if hasattr(module, "weights") else module.weight
    return table[positions + module.padding_idx + 1]


# Position embeddings that count from the cache's length (one scalar for every row), by class name,
# and how each looks up rows' own positions [B, q] (torch): `looked_up` replaces the module's output.
POSITION_EMBEDDINGS = {
    "BartLearnedPositionalEmbedding": _offset_embedding,
    "MBartLearnedPositionalEmbedding": _offset_embedding,
    "PLBartLearnedPositionalEmbedding": _offset_embedding,
    "MvpLearnedPositionalEmbedding": _offset_embedding,
    "PegasusSinusoidalPositionalEmbedding": _plain_embedding,
    "BigBirdPegasusLearnedPositionalEmbedding": _plain_embedding,
    "PegasusXSinusoidalPositionalEmbedding": _sinusoids,
    "BlenderbotLearnedPositionalEmbedding": _plain_embedding,
    "LEDLearnedPositionalEmbedding": _plain_embedding,
    "BlenderbotSmallLearnedPositionalEmbedding": _plain_embedding,
    "MarianSinusoidalPositionalEmbedding": _plain_embedding,
    "M2M100SinusoidalPositionalEmbedding": _m2m100_embedding,
    "NllbMoeSinusoidalPositionalEmbedding": _m2m100_embedding,
    "SinusoidalPositionalEmbedding": _m2m100_embedding,  # FSMT's
    "SeamlessM4TSinusoidalPositionalEmbedding": _m2m100_embedding,
    "SeamlessM4Tv2SinusoidalPositionalEmbedding": _m2m100_embedding,
    "WhisperPositionalEmbedding": _plain_embedding,  # WhisperForCausalLM's (its forward takes no position_ids)
}

# Methods that build an ALiBi bias from the key columns alone: MPT's is slope x (column - last column)
# for every query, a shift the same across a query's keys, which the softmax takes out. No position
# reaches it, so a slot's keys in their columns get the weights transformers gives them.
COLUMN_BIASES = ("build_mpt_alibi_tensor",)


@contextlib.contextmanager
def looked_up(embedding, positions):
    """Within the block, `embedding` (a `POSITION_EMBEDDINGS` module) gives the rows' own `positions`
    [B, q] (torch) in place of the ones it counts from its cache's length."""
    lookup = POSITION_EMBEDDINGS[type(embedding).__name__]
    handle = embedding.register_forward_hook(lambda module, args, output: lookup(module, positions).to(output.dtype))
    try:
        yield
    finally:
        handle.remove()


def position_embedding(module):
    """`module`'s `POSITION_EMBEDDINGS` module (its decoder's, for an encoder-decoder), or None."""
    decoder = module.get_decoder() if getattr(module.config, "is_encoder_decoder", False) else module
    return next((m for m in decoder.modules() if type(m).__name__ in POSITION_EMBEDDINGS), None)


def position_source(module) -> str | None:
    """How the slots give a decoder-only `module` each token's position: "keyword" (its forward's
    position_ids), "alibi" (Bloom's ALiBi from the 2-D mask: `SlotModel._alibi_by_column`), "columns"
    (an ALiBi of the key columns alone, `COLUMN_BIASES`: MPT's), "hook" (a `POSITION_EMBEDDINGS` table
    looked up per row: BlenderbotForCausalLM, MarianForCausalLM); or None, where it counts positions
    from its cache's length in a way the slots do not know."""
    if "position_ids" in inspect.signature(module.forward).parameters:
        return "keyword"
    if alibi_builder(module) is not None:
        return "alibi"
    if any(callable(getattr(m, name, None)) for m in module.modules() for name in COLUMN_BIASES):
        return "columns"
    if position_embedding(module) is not None:
        return "hook"
    return None


def layer_kinds(config) -> set[str]:
    """The masks the attention layers read, as transformers' models choose them: by `layer_types` where
    the config has them, else one mask for every layer, sliding where `sliding_window` is set (Mistral's
    rule). A hybrid's recurrent layers' kinds are among them (`recurrent_kinds`)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return set(types)
    sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    return {"sliding_attention" if sliding else "full_attention"}


def _sliding_window(config, length: int) -> int | None:
    """The sliding window the slot programs mask with over a cache of `length` columns, or None where
    none does (no sliding layer, or a window no narrower than the cache: it hides nothing)."""
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" not in layer_kinds(config) or not isinstance(window, int) or window >= length:
        return None
    return window


def _attention_chunk(config, length: int) -> int | None:
    """The chunk the slot programs mask chunked-attention layers with (Llama 4's `attention_chunk_size`:
    a key is seen only from its query's chunk of positions) over a cache of `length` columns, or None
    where none does (no chunked layer, or a chunk no narrower than the cache)."""
    chunk = getattr(config, "attention_chunk_size", None)
    if "chunked_attention" not in layer_kinds(config) or not isinstance(chunk, int) or chunk >= length:
        return None
    return chunk


class SlotModel:
    """A causal LM run over S slots of one static KV cache of L columns (inside traces)."""

    def __init__(self, model, slots: int, length: int):
        self.model = model
        self.module = model.module
        self.config = model.module.config.get_text_config(decoder=True)
        self.slots, self.length = slots, length
        self.layer_class = _slot_layer_class()
        self.state_layer_class = _slot_state_layer_class(self.layer_class)
        self.boolean_mask = getattr(self.config, "_attn_implementation", "sdpa") != "eager"
        # Sliding-window layers see only the last `window` positions; where every layer slides, one mask
        # serves them all, and where some do not, the model takes a mask per kind of layer (a dict).
        self.window = _sliding_window(self.config, length)
        self.chunk = _attention_chunk(self.config, length)
        narrowed = self.window is not None or self.chunk is not None  # (else every kind's mask is the causal one)
        self.mask_kinds = layer_kinds(self.config) if narrowed else {"full_attention"}
        self.module_names = {id(m): n for n, m in self.module.named_modules()}
        self.cache_keyword = _caches.cache_keyword(self.module)
        self.takes_logits_to_keep = "logits_to_keep" in inspect.signature(self.module.forward).parameters
        # A multimodal rope (Qwen2-VL's): decode positions shift by each row's `RowSampling.rope_delta`.
        self.rope_shift = hasattr(getattr(self.module, "model", None), "get_rope_index")
        # How each token's position reaches the model (`position_source`): its forward's position_ids;
        # Bloom's ALiBi: biases by key column (`_alibi_by_column`); a table that counts from the cache's
        # length: each row's own positions looked up (`looked_up`)
        self.position_source = position_source(self.module)
        self.takes_positions = self.position_source == "keyword"
        self.alibi = alibi_builder(self.module) if self.position_source == "alibi" else None
        self.embedding = position_embedding(self.module) if self.position_source == "hook" else None
        # Recurrent layers (Mamba's; a hybrid's linear-attention or mamba layers) keep no keys and values:
        # a state per layer and slot, in `SlotState.recurrent`; the other layers' keys and values in `cache`.
        from transformers.cache_utils import StaticLayer

        layers = _caches.static_cache(self.config, 1).layers
        types = list(getattr(self.config, "layer_types", None) or ())
        types += [None] * (len(layers) - len(types))
        # Layers that keep nothing: a hybrid's layers without attention (`_caches.keeps_nothing`)
        self.layer_kept = tuple(not _caches.keeps_nothing(layer, kind) for layer, kind in zip(layers, types))
        self.layer_recurrent = tuple(_caches.keeps_state(layer, kind) for layer, kind in zip(layers, types))
        # Layers that keep keys and values: all but the purely recurrent ones (a "hybrid" layer does both)
        # and those that keep nothing
        self.layer_attends = tuple(
            (not r and kept) or isinstance(layer, StaticLayer)
            for r, kept, layer in zip(self.layer_recurrent, self.layer_kept, layers)
        )
        self.recurrent = any(self.layer_recurrent)
        self.attends = any(self.layer_attends)  # some layers keep keys and values (cut into windows)
        # Query heads per key/value head; and whether decoding attention may read the slots' rows of the
        # whole cache where they lie (`decode_chunk`): a decoder whose layers all attend through torch's
        # attention with no ALiBi, whose grouped heads reach it as kept (transformers 5.24 packs a
        # decode step's query heads by group; 5.17 repeats each key/value head, which over the whole
        # cache would copy it at every step).
        heads = getattr(self.config, "num_attention_heads", None)
        kv_heads = getattr(self.config, "num_key_value_heads", None) or heads
        self.groups = heads // kv_heads if heads and kv_heads and heads % kv_heads == 0 else 0
        self.attends_in_place = (
            getattr(self.config, "_attn_implementation", None) == "sdpa" and self.takes_positions
            and not self.recurrent and self.groups > 0 and (self.groups == 1 or _packs_grouped_queries())
        )  # fmt: skip
        # A hybrid's recurrent layers' kind of layer (config.layer_types), the key of their mask; a layer
        # that also attends reads transformers' recurrent mask, "linear_attention"
        kinds = [kind for kind, r in zip(getattr(self.config, "layer_types", None) or (), self.layer_recurrent) if r]
        self.recurrent_kind = next((kind for kind in kinds if kind not in _BOTH), "linear_attention" if kinds else None)
        self.state_layout = None  # per recurrent layer: the (kind, index) of each state array, "conv" or "recurrent"
        # A model that keeps no cache a slot can hold (`recomputed`): its "cache" is one pair of [S, 1, L, 1]
        # int32 arrays, each row's token at each position (column), and each step runs a row's columns
        # up to its window whole, reading the logits at the row's own position (`_recomputed`).
        self.recomputes = recomputed(model)
        # Where its layers read a prompt's left pads (`reads_pads`, Model.generate's): up to `pad_room` of the
        # caller's `pad_token` laid before each row's tokens, as many as its `RowSampling.pads` (`lay_pads`)
        self.pad_room, self.pad_token = 0, 0
        if self.recomputes:
            self.layer_recurrent, self.layer_attends, self.layer_kept = (False,), (True,), (True,)
            self.recurrent, self.attends, self.attends_in_place = False, True, False
        self._shapes = None
        self._state_shapes = None
        self._logits_dtype = None  # (set with `_shapes`)
        self._empty = {}  # the programs that make `empty_state`, per state layout

    def shapes(self) -> tuple[list[tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]], int]:
        """(each layer's (keys, values) shape for S slots, with its indexer's keys where it has an indexer
        (`SlotLayer.indexer`), the width of the logits), from an
        abstract run of the model on one token (a model with recurrent layers: of its other layers)."""
        if self._shapes is None and self.recurrent:
            self._shapes, self._state_shapes = self._recurrent_shapes()
        if self._shapes is None and self.recomputes:

            def logits(params):
                with self.bound(params):
                    return bridge.to_jax(self.module(input_ids=bridge.to_torch(jnp.zeros((1, 1), jnp.int32))).logits)

            tokens = jax.ShapeDtypeStruct((self.slots, 1, self.length, 1), jnp.int32)
            made = jax.eval_shape(logits, self.model.params)
            self._shapes, self._logits_dtype = ([(tokens, tokens)], made.shape[-1]), made.dtype
        if self._shapes is None:

            def one_token(params):
                cache = _probe_cache(self.config, self.length)
                with self.bound(params):
                    ids = bridge.to_torch(jnp.zeros((1, 1), jnp.int32))  # position 0, as `run` gives positions
                    out = self.module(input_ids=ids, position_ids=ids, use_cache=True, **{self.cache_keyword: cache})
                layers = _caches.returned_cache(out).layers
                return [_probed_arrays(layer) for layer in layers], bridge.to_jax(out.logits)

            layers, logits = jax.eval_shape(one_token, self.model.params)
            cache = [tuple(jax.ShapeDtypeStruct((self.slots, *s.shape[1:]), s.dtype) for s in pair) for pair in layers]
            self._shapes, self._logits_dtype = (cache, logits.shape[-1]), logits.dtype
        return self._shapes

    def logits_dtype(self):
        """The dtype of the model's logits (`shapes`' abstract run)."""
        self.shapes()
        return self._logits_dtype

    def state_shapes(self) -> list[tuple[jax.ShapeDtypeStruct, ...]] | None:
        """The recurrent layers' state arrays for S slots (`state_layout` names them); None without such layers."""
        self.shapes()
        return self._state_shapes

    def _recurrent_shapes(self) -> tuple[tuple[list, int], list[tuple[jax.ShapeDtypeStruct, ...]]]:
        """((the attention layers' (keys, values) shapes, the width of the logits), the recurrent layers'
        state arrays), each for S slots, from an abstract run of the model on one token (with a static
        cache where some layers attend; else with the cache it makes itself); sets `state_layout`."""
        layout = []
        attends = self.attends

        def one_token(params):
            ids = bridge.to_torch(jnp.zeros((1, 1), jnp.int32))  # position 0
            kwargs = {"use_cache": True, "position_ids": ids} if self.takes_positions else {"use_cache": True}
            if attends:
                kwargs[self.cache_keyword] = _caches.static_cache(self.config, self.length)
            with self.bound(params):
                out = self.module(input_ids=ids, **kwargs)
            layers = _caches.returned_cache(out).layers
            recurrent = [layer for layer, kept in zip(layers, self.layer_recurrent) if kept]
            layout[:] = [state_names(layer) for layer in recurrent]
            cache = [(bridge.to_jax(a.keys), bridge.to_jax(a.values)) for a, k in zip(layers, self.layer_attends) if k]
            return (
                cache,
                [states_of(layer, names) for layer, names in zip(recurrent, layout)],
                bridge.to_jax(out.logits),
            )

        cache, states, logits = jax.eval_shape(one_token, self.model.params)
        self._logits_dtype = logits.dtype
        self.state_layout = tuple(layout)

        def rows(arrays):
            return tuple(jax.ShapeDtypeStruct((self.slots, *s.shape[1:]), s.dtype) for s in arrays)

        return ([rows(pair) for pair in cache], logits.shape[-1]), [rows(layer) for layer in states]

    def bytes_per_slot(self) -> int:
        """The KV cache's bytes for one slot of L columns (a recurrent model: its states' bytes for one slot)."""
        cache, _ = self.shapes()
        states = [s for layer in self.state_shapes() or () for s in layer]
        return sum(int(s.size // self.slots) * s.dtype.itemsize for pair in [*cache, states] for s in pair)

    def empty_state(self, features: SamplingFeatures, *, history: bool = False) -> SlotState:
        """Zeros, placed where the programs' outputs will be, so the first call and every later one
        have the same signature: on the weights' device; on a mesh (of one process or several), the
        slots split over "data" and each layer's cache over "model" by heads, where they divide. Made
        by one program (kept per layout): a zeros call per array cost `Model.generate` ~8 ms a call.
        `history`: keep each row's tokens (`SlotState.history`) though no rule reads them."""
        layout = (
            features.repetition,
            features.presence,
            history or (features.history is not None and features.history.reads_tokens),
        )
        if layout not in self._empty:
            cache, vocab = self.shapes()
            states = self.state_shapes()
            repetition, presence, history = layout

            def zeros() -> SlotState:
                return SlotState(
                    cache=[tuple(jnp.zeros(s.shape, s.dtype) for s in pair) for pair in cache],
                    tokens=jnp.zeros(self.slots, jnp.int32),
                    positions=jnp.zeros(self.slots, jnp.int32),
                    seen=jnp.zeros((self.slots, vocab), bool) if repetition else None,
                    counts=jnp.zeros((self.slots, vocab), jnp.int32) if presence else None,
                    history=jnp.zeros((self.slots, self.length), jnp.int32) if history else None,
                    recurrent=None
                    if states is None
                    else [tuple(jnp.zeros(s.shape, s.dtype) for s in a) for a in states],
                    **self.extra_state(),
                )

            mesh, placed = self.model.mesh, None  # None: left to the programs (weights over several devices)
            if mesh is not None:
                shapes = jax.eval_shape(zeros)
                placed = jax.tree_util.tree_map(lambda a: self._sharding(mesh, a), shapes)
                # (a state's axes after the rows are the model's own: the rows alone are split)
                placed.recurrent = jax.tree_util.tree_map(
                    lambda a: self._sharding(mesh, a, heads=False), shapes.recurrent
                )
            else:
                weights = next(iter(self.model.params.values())).sharding
                placed = weights if len(weights.device_set) == 1 else None
            self._empty[layout] = jax.jit(zeros, out_shardings=placed)
        return self._empty[layout]()

    def extra_state(self) -> dict:
        """Zeros of the `SlotState` fields a kind of model keeps beside the KV cache (inside `empty_state`'s
        trace): none here."""
        return {}

    def _sharding(self, mesh, array, *, heads: bool = True) -> jax.sharding.NamedSharding:
        """A state array's place on `mesh`: slots over "data", a cache's heads ([S, heads, L, D]) over "model"."""
        data, model = parallel.data_size(mesh), dict(mesh.shape).get("model", 1)
        rows = "data" if data > 1 and self.slots % data == 0 else None
        if heads and array.ndim == 4 and model > 1 and array.shape[1] % model == 0:
            return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(rows, "model"))
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(rows))

    @contextlib.contextmanager
    def bound(self, params):
        with bridge.explain_errors(self.module, self.module_names):
            with bridge.bound(self.module, params, self.model.aliases, bridge.prng_key()):
                yield

    def prompt_inputs(self, ids, processed: dict, width: int) -> tuple[dict, int]:
        """One prompt's prefill-only inputs for a one-row `prefill_chunk` of `width` columns holding
        its whole prompt (`_multimodal.chunk_inputs`: `ids` [S], `processed` the processor's other
        outputs), an eager image encoder's output in place of its pixels (run here, op by op, with
        the weights bound). Returns (the inputs, the row's `RowSampling.rope_delta`)."""
        inputs, delta = _multimodal.chunk_inputs(self.module, ids, processed, width)
        if type(self.module).__name__ in _multimodal.EAGER_IMAGE_ENCODERS:
            precision = bridge.resolve_precision(self.model.matmul_precision)
            with self.bound(self.model.params), bridge.products(precision):
                inputs = _multimodal.encode_images_eagerly(self.module, inputs, ids)
        return {name: jnp.asarray(value) for name, value in inputs.items()}, delta

    def weights(self) -> dict:
        """What the programs take as their weights (`prefill_chunk` and `decode_chunk`'s `params`)."""
        return self.model.params

    def program_key(self) -> tuple:
        """What, beside `SlotPrograms.key`, the programs depend on: the pads laid before each row (`lay_pads`)."""
        return ("pads", self.pad_room, self.pad_token) if self.pad_room else ()

    def lay_pads(self, room: int, token: int) -> None:
        """For a model that keeps no cache and whose layers read a prompt's left pads (`reads_pads`): each
        program runs a row's tokens after its `RowSampling.pads` of `token` (at most `room`), with their
        attention mask 0, as transformers' input_ids hold the caller's batch."""
        self.pad_room, self.pad_token = room, token

    def run(
        self, params, cache, ids, positions, columns, keep=None, *, lora=None, inputs=None, blocks=None, window=None,
        shift=None,
    ):  # fmt: skip
        """Logits [B, q, V] (or at the query indices `keep` [k] int32 only: [B, k, V]) and the cache
        after ids [B, q] at positions [B, q], whose keys and values go to columns [B, q] (past the
        cache's end: nowhere). lora: [B] int32, each row's LoRA adapter slot (`RowSampling.lora`).
        window: the cache's leading columns the queries attend over (default: all), where the cache
        is the whole one of more rows than B (`decode_chunk` in place: the mask is that wide, and
        attention reads the B rows' first `window` columns where they lie).
        inputs: other forward arguments (a prefill's images), position_ids among them where the
        model's rope positions differ from the cache's (multimodal rope: [3, B, q]). blocks: (query
        blocks [B, q], key blocks [B, L]) int32, where queries and keys of one block (>= 0) see each
        other both ways (`_multimodal.BIDIRECTIONAL_BLOCKS`). shift: [B] int32, each row's left pads in
        the caller's batch (`RowSampling.pads`), which a position table that counts from the cache's
        length counts in transformers (`position_source` "hook": its rows look up positions + shift)."""
        if self.recomputes:
            return self._recomputed(cache, ids, positions, columns, keep, lora=lora, inputs=inputs, shift=shift)
        from transformers import StaticCache

        length = cache[0][0].shape[2]  # the columns given: all L, or a chunk's window
        past = StaticCache(config=self.config, max_cache_len=length)
        past.layers = [
            self.layer_class(
                *(bridge.to_torch(a) for a in arrays[:2]), bridge.to_torch(columns), *map(bridge.to_torch, arrays[2:])
            )
            for arrays in cache
        ]
        mask = self.attention_mask(positions, length if window is None else window, cache[0][0].dtype, blocks=blocks)
        kwargs = {"use_cache": True, self.cache_keyword: past, "attention_mask": mask}
        if self.takes_positions:
            kwargs["position_ids"] = bridge.to_torch(positions)
        if keep is not None and self.takes_logits_to_keep:
            kwargs["logits_to_keep"] = bridge.to_torch(keep)
            keep = None
        kwargs.update({name: bridge.to_torch(value) for name, value in (inputs or {}).items()})
        lookup = contextlib.nullcontext()
        if self.embedding is not None:
            lookup = looked_up(
                self.embedding, bridge.to_torch(positions if shift is None else positions + shift[:, None])
            )
        with contextlib.nullcontext() if lora is None else _lora.rows(lora), self._alibi_by_column(), lookup:
            out = self.module(input_ids=bridge.to_torch(ids), **kwargs)
        logits = bridge.to_jax(out.logits).astype(jnp.float32)
        if keep is not None:
            logits = jnp.take(logits, keep, axis=1)
        return logits, [layer.arrays() for layer in past.layers]

    def _recomputed(self, cache, ids, positions, columns, keep=None, *, lora=None, inputs=None, shift=None):
        """`run` for a model that keeps no cache (`recomputes`): ids [B, q] written into the rows' tokens
        at columns [B, q] (the "cache", its two arrays alike), then the model run over each row's W
        columns from position 0, as transformers' generate runs it without a cache (later columns, from
        another step or request, are masked), its logits read at each query's position. With `pad_room`,
        each row's `shift` [B] pads go before its tokens."""
        tokens = cache[0][0][:, 0, :, 0]  # [B, W]
        width = tokens.shape[1]
        tokens = tokens.at[jnp.arange(ids.shape[0])[:, None], columns].set(ids, mode="drop")
        queries = positions if keep is None else jnp.take(positions, keep, axis=1)
        queries = jnp.minimum(queries, width - 1)  # [B, k]: the columns whose logits are wanted
        run = tokens
        at = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)  # each column's position
        # A row's tokens so far are up to its last query: the columns after it are masked, as transformers'
        # generate has no such tokens (a model that is not causal, BertGeneration's without is_decoder,
        # would read them)
        last = jnp.max(queries, axis=1, keepdims=True)  # [B, 1]
        mask = (at <= last).astype(jnp.int32)
        if self.pad_room:  # column j of the run holds the row's position j - pads (a pad before 0)
            pads = jnp.zeros(tokens.shape[0], jnp.int32) if shift is None else shift
            source = jnp.arange(width + self.pad_room, dtype=jnp.int32)[None, :] - pads[:, None]
            taken = jnp.take_along_axis(tokens, jnp.clip(source, 0, width - 1), axis=1)
            run = jnp.where(source >= 0, taken, jnp.int32(self.pad_token))
            at, mask = jnp.maximum(source, 0), ((source >= 0) & (source <= last)).astype(jnp.int32)
            queries = queries + pads[:, None]
        kwargs = {"attention_mask": bridge.to_torch(mask)}  # (`recomputed`)
        if self.takes_positions:  # (else its columns are its positions: `numbers_columns`)
            kwargs["position_ids"] = bridge.to_torch(at)
        kwargs.update({name: bridge.to_torch(value) for name, value in (inputs or {}).items()})

        read = []

        def read_queries(head, args):  # the output layer sees the queries' hidden states only
            hidden = args[0]
            if hidden.dim() != 3 or hidden.shape[1] != run.shape[1]:  # (not one state per column: as it is)
                return None
            read.append(True)
            index = bridge.to_torch(queries)[:, :, None].expand(-1, -1, hidden.shape[-1])
            return (torch.gather(hidden, 1, index), *args[1:])

        head = self.module.get_output_embeddings()
        hook = None if head is None else head.register_forward_pre_hook(read_queries)
        try:
            with contextlib.nullcontext() if lora is None else _lora.rows(lora):
                out = self.module(input_ids=bridge.to_torch(run), use_cache=False, **kwargs)
        finally:
            if hook is not None:
                hook.remove()
        logits = bridge.to_jax(out.logits).astype(jnp.float32)
        if not read:  # (no output layer read per column: every column's logits, then the queries')
            logits = jnp.take_along_axis(logits, queries[:, :, None], axis=1)
        held = tokens[:, None, :, None]
        return logits, [(held, held)]

    @contextlib.contextmanager
    def _alibi_by_column(self):
        """For a model that builds ALiBi from its 2-D mask (Bloom: slope x (cumsum(mask) - 1) per key):
        while the model runs, it builds it from the 4-D mask the slots give as from a mask of ones as
        wide, slope x column. A slot's key in column c is its row's position c, so each key gets the
        bias transformers gives it (its position among the row's real tokens, pads before them not
        counted)."""
        if self.alibi is None:
            yield
            return
        builder = self.alibi.build_alibi_tensor

        def by_column(mask, num_heads, dtype):
            return builder(bridge.to_torch(jnp.ones((mask.shape[0], mask.shape[-1]), jnp.int32)), num_heads, dtype)

        self.alibi.build_alibi_tensor = by_column
        try:
            yield
        finally:
            del self.alibi.build_alibi_tensor

    def run_states(self, params, cache, states: list, ids, positions, columns, pads, *, carried, keep=None, lora=None):
        """`run` for a model with recurrent layers (Mamba's; a hybrid's linear-attention or mamba layers
        beside attention ones): logits, the attention layers' cache (as `run`'s; none for Mamba) and
        the recurrent layers' states after ids [B, q]. The states start from `states` (per recurrent
        layer, `state_layout`'s arrays [B, ...]) where `carried`, else from zeros (the model scans a
        prompt from no state, as transformers' does; `states` then gives only their shapes). pads: [B, q]
        int32, 0 at a row's padding, whose inputs the recurrent layers zero (so left padding leaves a
        prompt's state as the prompt alone gives it), or None (a decode step: no padding).
        Returns (logits, cache, states)."""
        from transformers import StaticCache

        length = cache[0][0].shape[2] if cache else 1
        past = StaticCache(config=self.config, max_cache_len=length)
        pairs, held = iter(cache), iter(zip(self.state_layout, states))
        layers = []
        for is_recurrent, attends, kept in zip(self.layer_recurrent, self.layer_attends, self.layer_kept):
            if not kept:  # (no attention: transformers' DummyLayer)
                layers.append(past.layers[len(layers)])
                continue
            if attends:
                k, v = (bridge.to_torch(a) for a in next(pairs))
            if is_recurrent and attends:  # both: keys and values, and states
                names, arrays = next(held)
                layer = self.state_layer_class(k, v, bridge.to_torch(columns), number_of_states(names))
                layers.append(state_layer(names, arrays, carried=carried, layer=layer))
            elif is_recurrent:
                layers.append(state_layer(*next(held), carried=carried))
            else:
                layers.append(self.layer_class(k, v, bridge.to_torch(columns)))
        past.layers = layers
        pads = None if pads is None else bridge.to_torch(pads)
        mask = pads
        if cache:  # a hybrid: a mask per kind of layer, the recurrent layers' the padding's
            mask = {**self.attention_masks(positions, length, cache[0][0].dtype), self.recurrent_kind: pads}
        kwargs = {"use_cache": True, self.cache_keyword: past, "attention_mask": mask}
        if self.takes_positions:
            kwargs["position_ids"] = bridge.to_torch(positions)
        if keep is not None and self.takes_logits_to_keep:
            kwargs["logits_to_keep"] = bridge.to_torch(keep)
            keep = None
        with contextlib.nullcontext() if lora is None else _lora.rows(lora):
            out = self.module(input_ids=bridge.to_torch(ids), **kwargs)
        logits = bridge.to_jax(out.logits).astype(jnp.float32)
        if keep is not None:
            logits = jnp.take(logits, keep, axis=1)
        recurrent = [layer for layer, is_recurrent in zip(past.layers, self.layer_recurrent) if is_recurrent]
        cache = [
            (bridge.to_jax(layer.keys), bridge.to_jax(layer.values))
            for layer, attends in zip(past.layers, self.layer_attends)
            if attends
        ]
        return logits, cache, [states_of(layer, names) for layer, names in zip(recurrent, self.state_layout)]

    def run_prompts(self, params, cache: list, states: list, which, ids, count, *, window: int, lora=None):
        """Whole prompts of a model with recurrent layers run into rows `which` [P] of `cache` (over its
        first `window` columns) and of `states`: ids [P, C] int32, row p's count[p] real tokens last, at
        positions 0.. (its padding before them masked, writing nowhere). Returns (logits [P, 1, V] at
        index C-1, the cache and the states with those rows written, offset [P, C] int32 as `run_chunk`'s)."""
        gathered = [tuple(a.at[which, :, :window].get(mode="fill", fill_value=0) for a in pair) for pair in cache]
        chunk = ids.shape[1]
        offset = jnp.arange(chunk, dtype=jnp.int32)[None, :] - (chunk - count)[:, None]
        positions = jnp.maximum(offset, 0)
        columns = jnp.where(offset >= 0, positions, window)
        zeros = [tuple(jnp.zeros((ids.shape[0], *a.shape[1:]), a.dtype) for a in layer) for layer in states]
        with self.bound(params), _grouped_queries():
            logits, gathered, new = self.run_states(
                params, gathered, zeros, ids, positions, columns, (offset >= 0).astype(jnp.int32), carried=False,
                keep=jnp.array([chunk - 1], jnp.int32), lora=lora,
            )  # fmt: skip
        cache = [
            tuple(a.at[which, :, :window].set(r, mode="drop") for a, r in zip(pair, rows))
            for pair, rows in zip(cache, gathered)
        ]
        states = [
            tuple(a.at[which].set(n.astype(a.dtype), mode="drop") for a, n in zip(layer, rows))
            for layer, rows in zip(states, new)
        ]
        return logits, cache, states, offset

    def attention_masks(self, positions, length: int, dtype, *, blocks=None) -> dict:
        """{kind: [B, 1, q, L] mask, as torch} of each attention kind the layers read (`mask_kinds`), for
        queries at positions [B, q] over `length` cache columns (each column holding the key of its
        position): each key at or before its query, or in its bidirectional block (`run`'s `blocks`),
        within the sliding window where layers slide, within the query's chunk where layers attend by chunks."""
        every = jnp.arange(length, dtype=jnp.int32)[None, None, :]
        masks = {}
        family = _multimodal.blocks_of(self.module) if blocks is not None else None
        for kind in self.mask_kinds:
            allowed = every <= positions[:, :, None]  # [B, q, L]
            if family is not None and (family.kinds is None or kind in family.kinds):
                # transformers' OR of the causal mask and the blocks, before the window
                query, key = blocks
                allowed |= (query[:, :, None] == key[:, None, :]) & (query[:, :, None] >= 0)
            # transformers' sliding window: the key within `window` of the query
            if kind == "sliding_attention" and self.window is not None:
                allowed &= every > positions[:, :, None] - self.window
            if kind == "chunked_attention" and self.chunk is not None:  # the key in the query's chunk of positions
                allowed &= every // self.chunk == positions[:, :, None] // self.chunk
            masks[kind] = bridge.to_torch(self._mask(allowed[:, None], dtype))  # [B, 1, q, L]
        return masks

    def attention_mask(self, positions, length: int, dtype, *, blocks=None):
        """`attention_masks` as the model takes them: the one mask, or a dict per kind of layer where it reads several."""
        masks = self.attention_masks(positions, length, dtype, blocks=blocks)
        return masks if len(masks) > 1 else next(iter(masks.values()))

    def _mask(self, allowed, dtype):
        """The attention mask of `allowed` [B, 1, q, L] bool in the form the attention takes: the booleans,
        or (eager attention) zeros where allowed and the dtype's minimum elsewhere."""
        return allowed if self.boolean_mask else jnp.where(allowed, jnp.zeros((), dtype), jnp.finfo(dtype).min)

    # -- the two programs (traced) --------------------------------------------------

    def run_chunk(
        self, params, cache: list, which, ids, start, count, *, window: int, lora=None, inputs=None, shift=None
    ):
        """A prompt chunk run into rows `which` [P] of `cache` over its first `window` columns: ids [P, C]
        int32, row p's count[p] real tokens last, at positions start[p].. (the padding before them writes
        nowhere). `inputs`: the chunk's prefill-only inputs (see `prefill_chunk`); `shift`: as `run`'s. Returns (logits
        [P, 1, V] at index C-1, the cache with those rows written, offset [P, C] int32: each token's
        place among the row's real ones, < 0 for padding)."""
        gathered = [tuple(a.at[which, :, :window].get(mode="fill", fill_value=0) for a in pair) for pair in cache]
        chunk = ids.shape[1]
        offset = jnp.arange(chunk, dtype=jnp.int32)[None, :] - (chunk - count)[:, None]
        positions = start[:, None] + jnp.maximum(offset, 0)
        columns = jnp.where(offset >= 0, positions, window)
        arguments, blocks, static = {}, None, ()
        if inputs:
            static = tuple(sorted((n, v) for n, v in inputs.items() if n in _multimodal.STATIC_INPUTS))
            arrays = {n: v for n, v in inputs.items() if n not in _multimodal.STATIC_INPUTS}
            query = _multimodal.block_ids(self.module, arrays)  # [P, C]
            if query is not None:  # each key's block, by the column its token writes (else -1)
                rows = jnp.broadcast_to(jnp.arange(ids.shape[0], dtype=jnp.int32)[:, None], columns.shape)
                key = jnp.full((ids.shape[0], window), -1, jnp.int32).at[rows, columns].set(query, mode="drop")
                blocks = (query, key)
            prefill = _multimodal.PrefillInputs(model_inputs=arrays, position_shift=None, static=static)
        # Static inputs (image grids) stay concrete through the ops the model runs on them.
        evaluate = jax.ensure_compile_time_eval() if static else contextlib.nullcontext()
        known = _multimodal.known_reads(self.module, inputs) if inputs else contextlib.nullcontext()
        with self.bound(params), evaluate, known, _grouped_queries():
            if inputs:
                arguments = prefill.arguments()
            logits, gathered = self.run(
                params, gathered, ids, positions, columns, keep=jnp.array([chunk - 1], jnp.int32), lora=lora,
                inputs=arguments, blocks=blocks, shift=shift,
            )  # fmt: skip
        return logits, columns_written(cache, gathered, which, columns, window=window), offset

    def prefill_chunk(
        self,
        params,
        state: SlotState,
        rows: RowSampling,
        which,
        ids,
        start,
        count,
        last,
        fresh,
        want_logprobs,
        *,
        window: int,
        features: SamplingFeatures,
        kept: tuple[str, ...] = (),
        inputs: dict | None = None,
        choose: bool = True,
    ) -> tuple[SlotState, Chosen]:
        """Prompt chunks of P slots at once: ids [P, C] int32, row p's count[p] real tokens last (at
        positions start[p]..; the padding before them writes nowhere), so every row's last real
        token is at index C-1 and the model makes logits there only; which [P] int32, the slots (S:
        a padding row, which reads zeros and writes nowhere); last [P] bool, the rows whose chunk
        ends their prompt (their next token becomes the slot's next input); fresh [P] bool, the
        rows whose request starts here (its penalties' history starts empty). Only the first
        `window` columns are read and written. `kept`: "scores" and / or "logits", the first new
        token's processed scores and raw logits to return (see `Chosen`). `inputs`: the chunks'
        prefill-only model inputs (`_multimodal`), where each row's chunk holds its whole prompt:
        {name: array [P, ...]} (token_type_ids [P, C], laid out as `ids`; multimodal rope's
        position_ids [3, P, C]; an eager image encoder's image_features), and the `STATIC_INPUTS` as
        nested tuples of ints. Returns (state, Chosen [P, 1]); with `choose=False`, (state, the
        rows' logits [P, V]) before the choice, which `choose_prefilled` then makes (a server
        compiles it once per row count instead of into each window's prefill: the choice was about
        half of a prefill program's compile)."""
        mine = jax.tree_util.tree_map(lambda a: a.at[which].get(mode="fill", fill_value=0), rows)
        cache, recurrent = state.cache, state.recurrent
        if self.recurrent:  # each row's chunk is its whole prompt (start 0): its state starts from zeros
            logits, cache, recurrent, offset = self.run_prompts(
                params, cache, recurrent, which, ids, count, window=window, lora=mine.lora
            )
        else:
            logits, cache, offset = self.run_chunk(
                params, state.cache, which, ids, start, count, window=window, lora=mine.lora, inputs=inputs,
                shift=mine.pads,
            )  # fmt: skip
        state = dataclasses.replace(state, cache=cache, recurrent=recurrent)
        if state.seen is not None:  # the chunk's real tokens join the row's history
            before = jnp.where(fresh[:, None], False, state.seen.at[which].get(mode="fill", fill_value=False))
            real = jnp.where(offset >= 0, ids, before.shape[-1])
            seen = before.at[jnp.arange(ids.shape[0])[:, None], real].set(True, mode="drop")  # [P, V]
            state = dataclasses.replace(state, seen=state.seen.at[which].set(seen, mode="drop"))
        if state.counts is not None:
            counts = jnp.where(fresh[:, None], 0, state.counts.at[which].get(mode="fill", fill_value=0))  # [P, V]
            state = dataclasses.replace(state, counts=state.counts.at[which].set(counts, mode="drop"))
        if state.history is not None:  # the chunk's real tokens, and a fresh row's pads before them
            column = offset + (start + mine.pads)[:, None]  # [P, C]
            # (not over a reused prefix's tokens, which the slot's history holds from the request before)
            written = (offset >= 0) | (fresh[:, None] & (column >= 0) & (column < mine.pads[:, None]))
            column = jnp.where(written, column, state.history.shape[1])  # past the end: dropped
            before = state.history.at[which].get(mode="fill", fill_value=0)
            history = before.at[jnp.arange(ids.shape[0])[:, None], column].set(ids, mode="drop")  # [P, L]
            state = dataclasses.replace(state, history=state.history.at[which].set(history, mode="drop"))
        if not choose:
            return state, logits[:, 0]
        return self.choose_prefilled(
            state, rows, which, logits[:, 0], start + count, last, want_logprobs, features=features, kept=kept
        )

    def choose_prefilled(
        self, state: SlotState, rows: RowSampling, which, logits, length, last, want_logprobs, *, features, kept=()
    ) -> tuple[SlotState, Chosen]:
        """The token after each row's prompt chunk, from its logits [P, V] (`prefill_chunk`'s with
        `choose=False`, which wrote the chunk into the state): length [P], the row's tokens so far;
        which, last and the rest as `prefill_chunk`'s. Returns (state, Chosen [P, 1])."""
        mine = jax.tree_util.tree_map(lambda a: a.at[which].get(mode="fill", fill_value=0), rows)
        seen, counts, history, encoder_ids = (
            None if a is None else a.at[which].get(mode="fill", fill_value=fill)
            for a, fill in ((state.seen, False), (state.counts, 0), (state.history, 0), (state.encoder_ids, -1))
        )
        token, scores = choose_tokens(
            logits, mine, features, length, seen=seen, counts=counts,
            history=history_rules(features, mine, history, length, encoder_ids=encoder_ids),
        )  # fmt: skip
        chosen = with_logprobs(logits, token, want_logprobs)
        chosen = dataclasses.replace(chosen, **kept_values(kept, scores=scores, logits=logits))
        # The chosen token is the slot's next input where the prompt ended (other rows: slot S, dropped),
        # at the position after the prompt; it joins the row's history.
        ended = jnp.where(last, which, self.slots)
        state = dataclasses.replace(
            state,
            tokens=state.tokens.at[ended].set(token, mode="drop"),
            positions=state.positions.at[ended].set(length, mode="drop"),
        )
        if seen is not None:
            seen = _sampling.update_seen(seen, token)
            state = dataclasses.replace(state, seen=state.seen.at[ended].set(seen, mode="drop"))
        if counts is not None:
            counts = _sampling.update_counts(counts, token, last)
            state = dataclasses.replace(state, counts=state.counts.at[which].set(counts, mode="drop"))
        per_token = [f for f in (*PER_TOKEN, *_KEPT) if getattr(chosen, f) is not None]
        return state, dataclasses.replace(chosen, **{f: getattr(chosen, f)[:, None] for f in per_token})

    def decodes_in_place(self, dtype) -> bool:
        """Whether a decode chunk over a cache of `dtype` runs over the whole cache, its rows' attention
        reading their keys and values where they lie (`Backend.attention_in_place`), instead of over
        its rows' window, sliced out and written back: that copy of rows x window columns per chunk
        is what a long window cost (16 rows at 8192 columns: most of a chunk's time). For a decoder
        whose layers all attend through sdpa (`attends_in_place`), where the backend can."""
        return self.attends_in_place and _backend.active().attention_in_place(dtype, self.groups) is not None

    def reads_cache_in_place(self, cache=None) -> bool:
        """Whether a decode chunk reads the whole `cache` in place (`decodes_in_place`): a decoder's own
        keys only, every layer keeping the same columns (one mask serves them all). Default: the cache
        this model's slots hold (`shapes`), known before any state is made: then a chunk's window only
        sizes its mask, and one window serves every chunk (`serving.engine_grid`)."""
        cache = self.shapes()[0] if cache is None else cache
        shapes = {a.shape for pair in cache for a in pair}
        return len(shapes) == 1 and self.decodes_in_place(cache[0][0].dtype)

    def decode_chunk(
        self,
        params,
        state: SlotState,
        rows: RowSampling,
        active,
        count,
        want_logprobs,
        *,
        steps: int,
        decoding_rows: int,
        window: int,
        features: SamplingFeatures,
        stop_tokens: tuple[int, ...] = (),
        pad_token: int = 0,
        logprobs: bool = True,
        kept: tuple[str, ...] = (),
    ) -> tuple[SlotState, Chosen]:
        """`count` ([] int32, at most `steps`) decode steps of the first `decoding_rows` slots (R) over
        the first `window` columns (every decoding slot is among those rows and writes within those
        columns: one request does not pay for S rows, nor a short one for L columns); read in place
        in the whole cache where the backend's attention can (`reads_cache_in_place`), else sliced out. active: [S]
        bool, the decoding slots; want_logprobs: [] bool, whether any row reports log-probabilities.
        With `stop_tokens`, a row whose last token is one of them has stopped (its stop token runs
        once more, then `STOPPED` marks it), and the loop ends early once every active row has
        stopped (`Model.generate`'s EOS rule; a server stops its requests on the host); until then a stopped row runs on `pad_token`, which its
        tokens so far take in, as transformers' generate feeds a finished row (its scores are kept).
        `logprobs=False` compiles no log-probabilities at all (`Model.generate`'s calls; its
        Chosen's log-probability fields are then [R, 0, ...]). `kept`: as the prefill's, per step.
        Returns (state with each active row's last token and position moved on by the steps run,
        Chosen [R, steps], whose steps from `Chosen.ran` on are zeros)."""
        r = decoding_rows
        whole = state.cache
        backend = _backend.active()
        in_place = self.reads_cache_in_place(whole)
        # In place, attention reads the rows' first `window` columns of the whole cache where they lie:
        # nothing is sliced out or written back.
        cache = whole if in_place else [tuple(a[:r, :, :window] for a in pair) for pair in whole]
        tokens, positions, on = state.tokens[:r], state.positions[:r], active[:r]
        mine = jax.tree_util.tree_map(lambda a: a[:r], rows)
        seen = None if state.seen is None else state.seen[:r]
        counts = None if state.counts is None else state.counts[:r]
        history = None if state.history is None else state.history[:r]
        encoder_ids = None if state.encoder_ids is None else state.encoder_ids[:r]
        # A recurrent model's states of those rows (the window does not apply: a state has no columns).
        states = None if state.recurrent is None else [tuple(a[:r] for a in layer) for layer in state.recurrent]
        write_nowhere = jnp.int32(whole[0][0].shape[2] if in_place else window)  # past the carried columns
        # The loop carries the cache in the backend's layout (on the CPU: without size-1 axes, in
        # which XLA does not copy each layer for the attention kernel on every step).
        carried, restore = backend.loop_carry(cache)

        def going(tokens):  # [R] bool: the rows with steps left to run (not at a stop token, nor past one)
            return on & ~_stops.stopped(tokens, stop_tokens) & (tokens != STOPPED) if stop_tokens else on

        def running(carry):
            i, _, tokens, *_ = carry
            return (i < count) & jnp.any(going(tokens))

        def step(carry):
            i, cache, tokens, seen, counts, history, chosen, states = carry
            at = jnp.minimum(positions + i, window - 1)  # a finished row may run past the end
            write_at = jnp.where(on & (positions + i < window), at, write_nowhere)
            going_now = going(tokens)
            # A row's stop token runs once, as any token; after it, pad tokens (transformers' rows).
            inputs = jnp.where(tokens == STOPPED, jnp.int32(pad_token), tokens) if stop_tokens else tokens
            # Multimodal rope: the row's rope position is its column shifted by the row's delta.
            rope = {"position_ids": (at + mine.rope_delta)[:, None]} if self.rope_shift else None
            with self.bound(params):
                if states is None:
                    # Each row's queries read its columns up to its position (`at`), not the window's.
                    reading = backend.attention_in_place(whole[0][0].dtype, self.groups, at + 1) if in_place else None
                    with reading or contextlib.nullcontext():
                        logits, cache = self.run(
                            params, restore(cache), inputs[:, None], at[:, None], write_at[:, None], lora=mine.lora,
                            inputs=rope, shift=mine.pads, **({"window": window} if in_place else {}),
                        )  # fmt: skip
                else:  # the rows that are not decoding keep their states
                    logits, cache, new = self.run_states(
                        params, restore(cache), states, inputs[:, None], at[:, None], write_at[:, None], None,
                        carried=True, lora=mine.lora,
                    )  # fmt: skip
                    states = [
                        tuple(
                            jnp.where(on.reshape(-1, *(1,) * (a.ndim - 1)), n.astype(a.dtype), a)
                            for a, n in zip(old, now)
                        )
                        for old, now in zip(states, new)
                    ]
            if history is not None:  # the step's input joins the row's tokens so far
                column = jnp.where(write_at < write_nowhere, mine.pads + at, history.shape[1])
                history = history.at[jnp.arange(r), column].set(inputs, mode="drop")
            token, scores = choose_tokens(
                logits[:, 0], mine, features, at + 1, seen=seen, counts=counts,
                history=history_rules(features, mine, history, at + 1, encoder_ids=encoder_ids),
            )  # fmt: skip
            kept_now = kept_values(kept, scores=scores, logits=logits[:, 0])
            chosen = dataclasses.replace(chosen, **{f: getattr(chosen, f).at[:, i].set(v) for f, v in kept_now.items()})
            # What the row's tokens so far take in: the token, or a stopped row's pad.
            appended = jnp.where(going_now, token, jnp.int32(pad_token)) if stop_tokens else token
            if logprobs:
                picked = with_logprobs(logits[:, 0], token, want_logprobs)
                chosen = dataclasses.replace(
                    chosen, **{f: getattr(chosen, f).at[:, i].set(getattr(picked, f)) for f in PER_TOKEN}
                )
            else:
                chosen = dataclasses.replace(chosen, token=chosen.token.at[:, i].set(token))
            if seen is not None:
                seen = jnp.where(on[:, None], _sampling.update_seen(seen, appended), seen)
            if counts is not None:
                counts = _sampling.update_counts(counts, appended, on)
            tokens = jnp.where(going_now, token, jnp.where(on, STOPPED, tokens))  # (no stop tokens: going_now is on)
            return i + 1, backend.loop_carry(cache)[0], tokens, seen, counts, history, chosen, states

        reported = steps if logprobs else 0
        chosen = Chosen(
            token=jnp.zeros((r, steps), jnp.int32),
            logprob=jnp.zeros((r, reported), jnp.float32),
            top_token=jnp.zeros((r, reported, TOP_LOGPROBS), jnp.int32),
            top_logprob=jnp.zeros((r, reported, TOP_LOGPROBS), jnp.float32),
            ran=jnp.int32(0),
            **{f: jnp.zeros((r, steps, self.shapes()[1]), jnp.float32) for f in kept},
        )
        ran, carried, tokens, seen, counts, history, chosen, states = jax.lax.while_loop(
            running, step, (jnp.int32(0), carried, tokens, seen, counts, history, chosen, states)
        )
        # Each row wrote at most `steps` columns from its position: only those go back.
        written = positions[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]  # [R, steps]
        written = jnp.where(on[:, None], written, window)  # (rows not decoding: nowhere)
        cache = restore(carried)
        if any(part.shape != a.shape for pair, new in zip(whole, cache) for a, part in zip(pair, new)):
            # (else the loop ran on the whole cache, which it returns)
            cache = columns_written(whole, cache, jnp.arange(r, dtype=jnp.int32), written, window=window)
        state = SlotState(
            cache=cache,
            tokens=state.tokens.at[:r].set(tokens),
            positions=jnp.where(active, state.positions + ran, state.positions),
            seen=None if seen is None else state.seen.at[:r].set(seen),
            counts=None if counts is None else state.counts.at[:r].set(counts),
            history=None if history is None else state.history.at[:r].set(history),
            draft=state.draft,
            recurrent=None if states is None else written_back(state.recurrent, states),
            cross=state.cross,
            encoder_mask=state.encoder_mask,
            encoder_ids=state.encoder_ids,
        )
        return state, dataclasses.replace(chosen, ran=ran)


def columns_written(whole: list, parts: list, which, columns, *, window: int) -> list:
    """The cache `whole` [(keys, values)] per layer with the columns a program wrote into `parts`, its
    rows `which` [P] (a row S: none) over the first `window` columns ([P, H, W, D]), copied back: row
    p's columns `columns` [P, C] (`window` and past it: none). Only those columns move, not the rows'
    whole window."""
    taken = jnp.minimum(columns, window - 1)[:, None, :, None]  # [P, 1, C, 1]
    rows = which[:, None]

    def back(a, part):
        target = jnp.where(columns < window, columns, a.shape[2])  # past the end: dropped
        return a.at[rows, :, target].set(jnp.swapaxes(jnp.take_along_axis(part, taken, axis=2), 1, 2), mode="drop")

    return [tuple(back(a, part) for a, part in zip(pair, new)) for pair, new in zip(whole, parts)]


def written_back(whole: list, parts: list) -> list:
    """The cache `whole` [(keys, values)] per layer (or a recurrent model's states) with `parts`, a
    program's leading rows and columns of it (`cache[:R, :, :W]`), written back in place; `parts` itself
    where it is the whole cache."""
    if all(part.shape == a.shape for pair, new in zip(whole, parts) for a, part in zip(pair, new)):
        return parts
    return [
        tuple(jax.lax.dynamic_update_slice(a, part, (0,) * a.ndim) for a, part in zip(pair, new))
        for pair, new in zip(whole, parts)
    ]


def history_rules(features: SamplingFeatures, rows: RowSampling, history, positions, *, encoder_ids=None):
    """The scores function applying `features.history` (generate's processors that read the tokens so
    far) to rows whose new tokens take `positions` [R], over their tokens `history` [R, L] (or None
    where no rule reads them); None where there are no such rules. The n-grams that
    encoder_no_repeat_ngram_size bans are `encoder_ids`' [R, E] (an encoder-decoder's,
    `SlotState.encoder_ids`), else each row's prompt in its history."""
    rules = features.history
    if rules is None:
        return None
    step = positions - rows.first_new
    if encoder_ids is not None:
        source = (encoder_ids, 0, encoder_ids.shape[1])
    else:
        source = (history, 0, rows.pads + rows.first_new)
    return functools.partial(
        apply_rules, rules=rules, sequence=history, start=0, end=rows.pads + positions, step=step,
        last_step=rows.max_new_tokens - 1, source=source,
    )  # fmt: skip


def with_logprobs(logits, token, want_logprobs) -> Chosen:
    """Chosen [R] for `token` [R] from `logits` [R, V]: the model's log-probabilities of the token and
    of its 20 most likely, where `want_logprobs` ([] bool) asks for them (a `lax.cond`: else zeros)."""
    rows, top = logits.shape[0], min(TOP_LOGPROBS, logits.shape[-1])

    def logprobs():
        every = jax.nn.log_softmax(logits, axis=-1)  # [R, V]
        top_logprob, top_token = jax.lax.top_k(every, top)
        chosen = jnp.take_along_axis(every, token[:, None], axis=-1)[:, 0]
        return chosen, top_token.astype(jnp.int32), top_logprob

    def none():
        return jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, top), jnp.int32), jnp.zeros((rows, top), jnp.float32)

    logprob, top_token, top_logprob = jax.lax.cond(want_logprobs, logprobs, none)
    return Chosen(token=token, logprob=logprob, top_token=top_token, top_logprob=top_logprob, ran=jnp.int32(1))


PER_TOKEN = ("token", "logprob", "top_token", "top_logprob")  # Chosen's [R, T, ...] fields
_KEPT = ("scores", "logits")  # Chosen's [R, T, V] fields, where a program keeps them


def kept_values(kept: tuple[str, ...], **values) -> dict:
    """The values of `values` ({"scores": [R, V], "logits": [R, V]}) that `kept` names."""
    return {name: values[name] for name in kept}
