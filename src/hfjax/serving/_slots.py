"""The device side of continuous batching: a KV cache of S sequence slots, and its two programs.

Each slot is one row of a static KV cache [S, heads, L, head_dim] per layer: its request's
token at position p has its keys and values in column p. Rows advance independently, so the
model is given a 4-D attention mask built from each row's positions, and writes its new keys
and values through `SlotLayer`, a transformers `StaticLayer` that writes each row at that row's
own column instead of one column shared by the batch.

    prefill_chunk   the next C prompt tokens of P slots (row p's at columns start[p] ..) written
                    into their rows; the token after each row's last real token chosen with the
                    slot's settings (the real tokens sit last in the chunk: logits at one index)
    decode_chunk    K one-token steps (or fewer: `count`) of every slot in one program (a
                    `fori_loop`), over the first W columns of the cache (W: a window holding every
                    decoding row's positions); rows that are not decoding write nowhere (column W)

Per-request sampling settings are per-row arrays (`RowSettings`), so requests coming and going
never change a program's shape: after the first call of each, nothing is traced again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import jax
import jax.numpy as jnp

from .. import _backend, _compile, _env
from .._errors import GenerationError
from ..generation import _caches, _sampling

TOP_LOGPROBS = 20  # the most alternatives OpenAI's API lets a request ask for per token


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowSettings:
    """How each slot picks its next token (S rows)."""

    temperature: jax.Array  # [S] float32: 0 takes the most likely token
    top_p: jax.Array  # [S] float32 in (0, 1]; 1 keeps every token
    key: jax.Array  # [S, 2] uint32: each request's PRNG key data (from its seed)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Chosen:
    """The tokens a program chose, with their log-probabilities (R rows, T tokens each)."""

    token: jax.Array  # [R, T] int32
    logprob: jax.Array  # [R, T] float32: log-softmax of the model's logits at the chosen token
    top_token: jax.Array  # [R, T, TOP_LOGPROBS] int32: the most likely tokens, most likely first
    top_logprob: jax.Array  # [R, T, TOP_LOGPROBS] float32


def _slot_layer_class():
    from transformers.cache_utils import StaticLayer

    class SlotLayer(StaticLayer):
        """A StaticLayer [B, heads, L, head_dim] whose rows are written at their own columns: the
        keys of row b's query j go to column columns[b, j] (out of range: dropped)."""

        def __init__(self, keys, values, columns):
            super().__init__(max_cache_len=keys.shape[2])
            self.keys, self.values, self.columns = keys, values, columns
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            self.keys = _written(self.keys, key_states, self.columns)
            self.values = _written(self.values, value_states, self.columns)
            return self.keys, self.values

        def get_seq_length(self):
            return 0  # positions come from position_ids, the mask is given whole

    return SlotLayer


def _written(cache, new, columns):
    cache, new, columns = _env.to_jax(cache), _env.to_jax(new), _env.to_jax(columns)  # [B,H,L,D] [B,H,q,D] [B,q]
    rows = jnp.broadcast_to(jnp.arange(new.shape[0], dtype=jnp.int32)[:, None], columns.shape)
    # Advanced indices around a slice put their dimensions first: cache[rows, :, columns] is [B, q, H, D].
    updated = cache.at[rows, :, columns].set(jnp.swapaxes(new, 1, 2).astype(cache.dtype), mode="drop")
    return _env.to_torch(updated)


class SlotModel:
    """A causal LM run over S slots of one static KV cache of L columns (inside traces)."""

    def __init__(self, model, slots: int, length: int):
        self.model = model
        self.module = model.module
        self.config = model.module.config.get_text_config(decoder=True)
        self.slots, self.length = slots, length
        self.layer_class = _slot_layer_class()
        self.boolean_mask = getattr(self.config, "_attn_implementation", "sdpa") != "eager"
        self.module_names = {id(m): n for n, m in self.module.named_modules()}
        self.cache_keyword = _caches.cache_keyword(self.module)

    def cache_shapes(self) -> list[tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]]:
        """Each layer's (keys, values) shape for S slots, read from an abstract run of the model."""

        def one_token(params):
            cache = _caches.static_cache(self.config, self.length)
            with self.bound(params):
                ids = _env.to_torch(jnp.zeros((1, 1), jnp.int32))
                out = self.module(input_ids=ids, use_cache=True, **{self.cache_keyword: cache})
            return [
                (_env.to_jax(layer.keys), _env.to_jax(layer.values)) for layer in _caches.returned_cache(out).layers
            ]

        shapes = jax.eval_shape(one_token, self.model.params)
        return [tuple(jax.ShapeDtypeStruct((self.slots, *s.shape[1:]), s.dtype) for s in pair) for pair in shapes]

    def empty_cache(self) -> list[tuple[jax.Array, jax.Array]]:
        return [tuple(jnp.zeros(s.shape, s.dtype) for s in pair) for pair in self.cache_shapes()]

    @contextlib.contextmanager
    def bound(self, params):
        with _compile.explain_errors(self.module, self.module_names):
            with _compile.bound(self.module, params, self.model.aliases, _env.prng_key()):
                yield

    def run(self, params, cache, ids, positions, columns, keep=None):
        """Logits [B, q, V] (or at the query indices `keep` [k] int32 only: [B, k, V]) and the cache
        after ids [B, q] at positions [B, q], whose keys and values go to columns [B, q] (past the
        cache's end: nowhere)."""
        from transformers import StaticCache

        length = cache[0][0].shape[2]  # the columns given: all L, or a decode chunk's window
        past = StaticCache(config=self.config, max_cache_len=length)
        past.layers = [self.layer_class(_env.to_torch(k), _env.to_torch(v), _env.to_torch(columns)) for k, v in cache]
        every = jnp.arange(length, dtype=jnp.int32)
        allowed = (every[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, q, L]
        if self.boolean_mask:
            mask = allowed
        else:
            dtype = cache[0][0].dtype
            mask = jnp.where(allowed, jnp.zeros((), dtype), jnp.finfo(dtype).min)
        kwargs = {"use_cache": True, self.cache_keyword: past, "attention_mask": _env.to_torch(mask)}
        kwargs["position_ids"] = _env.to_torch(positions)
        if keep is not None and "logits_to_keep" in _accepts(self.module):
            kwargs["logits_to_keep"] = _env.to_torch(keep)
            keep = None
        out = self.module(input_ids=_env.to_torch(ids), **kwargs)
        logits = _env.to_jax(out.logits).astype(jnp.float32)
        if keep is not None:
            logits = jnp.take(logits, keep, axis=1)
        cache = [(_env.to_jax(layer.keys), _env.to_jax(layer.values)) for layer in past.layers]
        return logits, cache

    # -- the two programs (traced) --------------------------------------------------

    def prefill_chunk(
        self,
        params,
        cache,
        slots,
        ids,
        start,
        count,
        settings: RowSettings,
        want_logprobs,
        *,
        window: int | None = None,
    ):
        """Prompt chunks of P slots at once: ids [P, C] int32, row p's count[p] real tokens last (at
        positions start[p]..; the padding before them writes nowhere), so every row's last real
        token is at index C-1 and the model makes logits there only; slots [P] int32 (S: a padding
        row, which reads zeros and writes nowhere). Only the first `window` columns are read and
        written (every row's chunk ends within them): a short prompt does not attend over L columns.
        Returns (cache, Chosen [P, 1]) with the token that follows each last real token."""
        window = window or self.length
        rows = [tuple(a.at[slots, :, :window].get(mode="fill", fill_value=0) for a in pair) for pair in cache]
        chunk = ids.shape[1]
        offset = jnp.arange(chunk, dtype=jnp.int32)[None, :] - (chunk - count)[:, None]  # [P, C]: < 0 is padding
        positions = start[:, None] + jnp.maximum(offset, 0)
        columns = jnp.where(offset >= 0, positions, window)
        with self.bound(params):
            logits, rows = self.run(params, rows, ids, positions, columns, keep=jnp.array([chunk - 1], jnp.int32))
        cache = [
            tuple(a.at[slots, :, :window].set(r, mode="drop") for a, r in zip(pair, new))
            for pair, new in zip(cache, rows)
        ]
        mine = jax.tree_util.tree_map(lambda a: a.at[slots].get(mode="fill", fill_value=0), settings)
        chosen = choose(logits[:, 0], mine, start + count - 1, want_logprobs)
        return cache, jax.tree_util.tree_map(lambda a: a[:, None], chosen)

    def decode_chunk(
        self,
        params,
        cache,
        tokens,
        positions,
        active,
        settings: RowSettings,
        want_logprobs,
        *,
        steps: int,
        rows: int,
        window: int | None = None,
        count=None,
    ):
        """`count` ([] int32, at most `steps`; default `steps`) decode steps of the first `rows` slots
        over the first `window` columns (every decoding slot is among those rows and writes within
        those columns: a batch of 1 request does not pay for S rows, nor a short one for L columns).
        tokens, positions: [S] int32 each row's last token and its position; active: [S] bool;
        want_logprobs: [] bool, whether any row reports log-probabilities. Returns (cache, Chosen
        [rows, steps], whose steps from `count` on are zeros; each row's last token chosen [rows])."""
        window = window or self.length
        whole = cache
        cache = [tuple(a[:rows, :, :window] for a in pair) for pair in whole]
        tokens, positions, active = tokens[:rows], positions[:rows], active[:rows]
        settings = jax.tree_util.tree_map(lambda a: a[:rows], settings)
        write_nowhere = jnp.int32(window)
        # The loop carries the cache in the backend's layout (on the CPU: without size-1 axes, in
        # which XLA does not copy each layer for the attention kernel on every step).
        backend = _backend.active()
        carried, restore = backend.loop_carry(cache)

        def step(i, carry):
            cache, tokens, chosen = carry
            at = jnp.minimum(positions + i, write_nowhere - 1)  # a finished row may run past the end
            write_at = jnp.where(active & (positions + i < write_nowhere), at, write_nowhere)
            with self.bound(params):
                logits, cache = self.run(params, restore(cache), tokens[:, None], at[:, None], write_at[:, None])
            picked = choose(logits[:, 0], settings, at, want_logprobs)
            chosen = jax.tree_util.tree_map(lambda all_, one: all_.at[:, i].set(one), chosen, picked)
            return backend.loop_carry(cache)[0], picked.token, chosen

        chosen = Chosen(
            token=jnp.zeros((rows, steps), jnp.int32),
            logprob=jnp.zeros((rows, steps), jnp.float32),
            top_token=jnp.zeros((rows, steps, TOP_LOGPROBS), jnp.int32),
            top_logprob=jnp.zeros((rows, steps, TOP_LOGPROBS), jnp.float32),
        )
        count = steps if count is None else count
        carried, last, chosen = jax.lax.fori_loop(0, count, step, (carried, tokens, chosen))
        cache = restore(carried)
        if rows < self.slots or window < self.length:
            cache = [
                tuple(jax.lax.dynamic_update_slice(a, part, (0,) * a.ndim) for a, part in zip(pair, parts))
                for pair, parts in zip(whole, cache)
            ]
        return cache, chosen, last


def choose(logits, settings: RowSettings, positions, want_logprobs) -> Chosen:
    """Each row's next token from logits [R, V]: the argmax where temperature is 0, else a draw at
    its temperature from its top-p tokens, with a key from its seed and the position (so a
    request's tokens depend on its seed, never on its neighbours). Returns Chosen [R].

    What no row needs is skipped at run time (`lax.cond`): the sort of top-p, the noise of
    sampling, and the log-probabilities unless `want_logprobs` ([] bool).
    """
    greedy = _sampling.first_argmax(logits)  # [R]
    sampling = settings.temperature > 0  # [R]

    def drawn():
        temperature = settings.temperature[:, None]  # [R, 1]
        scores = logits / jnp.where(temperature > 0, temperature, 1.0)
        top_p = settings.top_p[:, None]
        scores = jax.lax.cond(
            jnp.any(sampling & (settings.top_p < 1)), lambda: _sampling._top_p(scores, top_p), lambda: scores
        )

        def noise(key_data, position):
            key = jax.random.fold_in(jax.random.wrap_key_data(key_data), position)
            return jax.random.gumbel(key, logits.shape[-1:], jnp.float32)

        picked = _sampling.first_argmax(scores + jax.vmap(noise)(settings.key, positions))
        return jnp.where(sampling, picked, greedy)

    token = jax.lax.cond(jnp.any(sampling), drawn, lambda: greedy)
    rows, top = logits.shape[0], min(TOP_LOGPROBS, logits.shape[-1])

    def logprobs():
        every = jax.nn.log_softmax(logits, axis=-1)  # [R, V]
        top_logprob, top_token = jax.lax.top_k(every, top)
        chosen = jnp.take_along_axis(every, token[:, None], axis=-1)[:, 0]
        return chosen, top_token.astype(jnp.int32), top_logprob

    def none():
        return jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, top), jnp.int32), jnp.zeros((rows, top), jnp.float32)

    logprob, top_token, top_logprob = jax.lax.cond(want_logprobs, logprobs, none)
    return Chosen(token=token, logprob=logprob, top_token=top_token, top_logprob=top_logprob)


def _accepts(module) -> set[str]:
    return set(inspect.signature(module.forward).parameters)


def check_supported(model, length: int) -> None:
    """Raises GenerationError for a model the slot cache cannot serve, saying why."""
    from ..generation._adapters import StaticCacheAdapter, adapter_for

    adapter = adapter_for(model.module)
    if type(adapter) is not StaticCacheAdapter:
        raise GenerationError(
            f"hfjax serve batches decoder-only causal LMs with a static KV cache; {type(model.module).__name__} "
            f"keeps its past as {adapter.kind!r}; use Model.generate for it"
        )
    config = model.module.config.get_text_config(decoder=True)
    if any(_caches.recurrent(layer) for layer in _caches.static_cache(config, 1).layers):
        raise GenerationError(
            f"hfjax serve's slot cache holds keys and values per slot; {config.model_type} also has "
            "linear-attention or mamba layers, whose states it does not keep; use Model.generate for it"
        )
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and window < length and _uses_window(config):
        raise GenerationError(
            f"max_model_len={length}: {config.model_type} attends over a sliding window of {window} tokens, which "
            f"the slot cache does not apply; pass max_model_len<={window}"
        )


def _uses_window(config) -> bool:
    if getattr(config, "use_sliding_window", True) is False:
        return False
    types = getattr(config, "layer_types", None)
    return types is None or "sliding_attention" in types
