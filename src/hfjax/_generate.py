"""Generation: prefill compiled per prompt-length bucket, then the whole decode loop as ONE
XLA program of `while_loop`s with sampling inside it.

Stages (gpt-fast's names):
  prefill          the prompt, left-padded to a bucket, fills a static KV cache and samples
                   the first new token;
  decode_n_tokens  a `jax.lax.while_loop` over single-token steps that stops when every row
                   has produced an EOS or the step limit is reached. Its state is donated,
                   so the cache is updated in place. A streamer runs it in chunks.
                   Unstreamed, a decoder's static cache is attended in growing windows
                   (`_windows`): one loop per window, in the same program.

Both programs carry their state as a flat list of arrays. With the compilation cache on
(`hfjax.set_cache_dir`), each is also kept on disk as a `jax.export` blob (`_programs.py`),
so a new process runs it without tracing the model again. On a mesh the batch is split over
its "data" axis.

How the model keeps its past is chosen per architecture (`_cache_kind`):
  "static"     transformers' own `StaticCache` (or `EncoderDecoderCache` of two for
               encoder-decoders), carried through the loop as a pytree;
  "state"      the model's own fixed-size cache (state-space models such as mamba);
  "recompute"  no cache: the whole token buffer is run at every step (correct for any
               causal model, slower; used where neither cache can be carried).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import time
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import torch

from . import _beam, _caches, _compile, _cpu_kernels, _env, _programs, _sampling, _sharding
from ._errors import HfjaxError
from ._settings import GenerationSettings

CacheKind = Literal["static", "state", "recompute"]

_MIN_BUCKET = 16
_CACHE_MULTIPLE = 64  # cache lengths are rounded up to this, so nearby budgets share programs
STREAM_CHUNK = 8  # decode steps per host round trip when streaming


@dataclasses.dataclass
class GenerationStats:
    """Timings of the last `generate` call (seconds), for --stats and benchmarks."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    time_to_first_token: float = 0.0
    total: float = 0.0
    compiled: bool = False

    @property
    def tokens_per_second(self) -> float:
        decode = self.total - self.time_to_first_token
        return (self.new_tokens - 1) / decode if self.new_tokens > 1 and decode > 0 else float("nan")


def bucket(length: int) -> int:
    """The padded prompt length: the next power of two, at least 16."""
    size = _MIN_BUCKET
    while size < length:
        size *= 2
    return size


def _cache_kind(module: torch.nn.Module) -> CacheKind:
    name = type(module).__name__.lower()
    if "mamba" in name:
        return "state"
    if not module._can_compile_fullgraph or not module._supports_default_dynamic_cache():
        return "recompute"
    return "static"


def _accepts(module: torch.nn.Module, name: str) -> bool:
    parameters = inspect.signature(module.forward).parameters
    return name in parameters


class Generator:
    """Compiled generation for one loaded `Model`; programs are cached per shape and settings."""

    def __init__(self, model):
        self.model = model
        self.module = model.module
        self.config = model.config
        self.encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
        self.kind: CacheKind = _cache_kind(model.module)
        self._programs: dict[tuple, Any] = {}
        # Programs pass their state as a flat list of arrays, so that one read from disk needs no
        # tracing: per layout key (batch, offset, total, settings) the state's tree structure
        # (known once prefill is traced), and per program where the host's fields sit in the list.
        self._treedefs: dict[tuple, Any] = {}
        self._fields: dict[tuple, dict[str, int]] = {}
        params_on_one_device = _programs.single_device(model.params)
        self._store = _programs.ProgramStore(_programs.model_fingerprint(model)) if params_on_one_device else None
        self.trace_counts: dict[str, int] = {"prefill": 0, "decode": 0}
        self.load_counts: dict[str, int] = {"prefill": 0, "decode": 0}  # read from disk, not traced
        self.last_stats = GenerationStats()
        self._takes_positions = _accepts(self.module, "position_ids")
        self._takes_logits_to_keep = _accepts(self.module, "logits_to_keep")
        self._module_names = {id(m): n for n, m in model.module.named_modules()}

    # -- the host side ----------------------------------------------------------

    def generate(self, input_ids, attention_mask, settings: GenerationSettings, *, seed: int, streamer=None):
        """Returns int32 [B * num_return_sequences, S + T]: the prompt as given, then up to
        max_new_tokens new tokens (for encoder-decoders [.., 1 + T]: the decoder start token,
        then the new tokens)."""
        start = time.perf_counter()
        ids, mask = np.asarray(input_ids), np.asarray(attention_mask)
        prompts, length = ids.shape
        beam = settings.beam
        if beam is not None and streamer is not None:
            raise ValueError(f"num_beams={beam.num_beams} with a streamer: beam search knows its answer only at the end; "
                             "stream with num_beams=1")
        if beam is not None and self.kind == "state":
            raise ValueError(f"num_beams={beam.num_beams}: {type(self.module).__name__} keeps a recurrent state that "
                             "hfjax does not reorder between beams; use num_beams=1")
        # Rows per prompt, side by side as transformers orders them: its beams, or its samples.
        per_prompt = beam.num_beams if beam is not None else settings.num_return_sequences
        returned = settings.num_return_sequences
        # On a mesh the rows are split over "data": prompts that do not divide are padded with
        # copies of the last one (which stop when it stops), dropped from the result.
        data = _sharding.data_size(self.model.mesh)
        padded_prompts = _round_up(prompts, data // math.gcd(data, per_prompt))
        rows = padded_prompts * per_prompt
        # A model run without a cache may not mask left pads (recurrent_gemma's recurrence reads
        # them): its prompt gets no more pads than the caller gave, so each length compiles anew.
        size = length if self.kind == "recompute" else bucket(length)
        # Pad to the bucket with masked-out tokens: on the left for a decoder (its positions come
        # from the mask), on the right for an encoder (whose positions may not).
        padded_ids = np.full((rows, size), settings.pad_token_id, np.int32)
        padded_mask = np.zeros((rows, size), np.int32)
        columns = slice(0, length) if self.encoder_decoder else slice(size - length, size)
        for target, source in ((padded_ids, ids), (padded_mask, mask)):
            source = np.concatenate([source, np.repeat(source[-1:], padded_prompts - prompts, axis=0)])
            target[:, columns] = np.repeat(source, per_prompt, axis=0)
        # The token buffer holds the decoder's prompt (the padded prompt, or the decoder start
        # token of an encoder-decoder) and then the new tokens, from `offset` on.
        offset = 1 if self.encoder_decoder else size
        # Where each row starts as transformers sees it (its input_ids, pads included), for
        # the processors that read the tokens so far.
        first_column = 0 if self.encoder_decoder else size - length
        total = _round_up(offset + settings.max_new_tokens, _CACHE_MULTIPLE)
        budget = settings.max_new_tokens
        # Programs depend on the buffer length, not on the exact budget, which is an argument:
        # budgets that round to the same buffer share their compiled programs.
        least = settings.min_new_tokens
        settings = dataclasses.replace(settings, max_new_tokens=total - offset, min_new_tokens=0, num_return_sequences=1)
        batch = prompts * per_prompt  # the rows the caller sees, without beam search
        if streamer is not None:
            streamer.put(torch.as_tensor(ids.astype(np.int64)))

        prepared_before = self._prepared()
        params = self.model.params
        layout = (rows, offset, total, settings)
        prefill_key = ("prefill", rows, size, total, settings)
        # A streamer re-enters the decode program every few tokens: windows cut and written
        # back at each entry would copy more than they save, so it attends over the whole cache.
        windows = self._windows(offset, total) if streamer is None else (total,)
        decode_key = ("decode", *layout, windows)
        prefill_args = (params, self._place(padded_ids), self._place(padded_mask),
                        jax.random.key_data(jax.random.key(seed)), jnp.int32(budget), jnp.int32(least),
                        jnp.int32(first_column))
        prefill_function = functools.partial(self._prefill_flat, program=prefill_key, layout=layout, total=total, settings=settings)
        state = self._program(prefill_key, prefill_function, prefill_args)(*prefill_args)
        fields = self._fields[prefill_key]  # the decode loop's state has the same structure
        first = _host(state[fields["sequence"]])[:batch, offset]
        ttft = time.perf_counter() - start
        if streamer is not None:
            streamer.put(torch.as_tensor(first.astype(np.int64)))
        limit = budget
        decode_function = functools.partial(
            self._decode_flat, program=decode_key, layout=layout, offset=offset, settings=settings, windows=windows,
            trace_prefill=lambda: jax.eval_shape(prefill_function, *prefill_args),
        )
        decode = self._program(decode_key, decode_function, (params, state, jnp.int32(limit)), donate=(1,))
        steps = 1
        if streamer is None:
            state = decode(params, state, jnp.int32(limit))
            steps = int(_host(state[fields["step"]]))
        else:
            while steps < limit and not bool(np.all(_host(state[fields["done"]]))):
                state = decode(params, state, jnp.int32(min(steps + STREAM_CHUNK, limit)))
                now = int(_host(state[fields["step"]]))
                for token in _host(state[fields["sequence"]])[:batch, offset + steps : offset + now].T:
                    streamer.put(torch.as_tensor(token.astype(np.int64)))
                steps = now
            streamer.end()
        if beam is None:
            sequence = _host(state[fields["sequence"]])[:batch]
            prompt = np.repeat(ids, per_prompt, axis=0)
        else:
            # Each prompt's best finished sequences, best first, as long as the longest returned one.
            finished = _host(state[fields["finished"]]).reshape(padded_prompts, per_prompt, total)
            sequence = finished[:prompts, :returned].reshape(prompts * returned, total)
            steps = int(_host(state[fields["finished_length"]])[:prompts, :returned].max())
            prompt = np.repeat(ids, returned, axis=0)
        if self.encoder_decoder:
            prompt = sequence[:, :1]
        out = jnp.asarray(np.concatenate([prompt.astype(np.int32), sequence[:, offset : offset + steps]], axis=1))
        if settings.return_dict_in_generate:
            out = self._output(out, state, fields, batch, steps, beams=beam is not None)
        self.last_stats = GenerationStats(
            prompt_tokens=int(mask.sum()),
            new_tokens=steps,
            time_to_first_token=ttft,
            total=time.perf_counter() - start,
            compiled=self._prepared() > prepared_before,
        )
        return out

    def _output(self, sequences, state, fields, batch: int, steps: int, *, beams: bool):
        """transformers' Generate*Output for return_dict_in_generate: the sequences, and per new
        token the [B, V] raw logits and processed scores that output_logits / output_scores asked for."""
        from transformers.generation import utils

        kept = {}
        for name in ("logits", "scores"):
            if name in fields:
                values = jnp.asarray(_host(state[fields[name]])[:batch, :steps])  # [B, T, V]
                kept[name] = tuple(values[:, t] for t in range(steps))
        kind = f"Generate{'Beam' if beams else ''}{'EncoderDecoder' if self.encoder_decoder else 'DecoderOnly'}Output"
        return getattr(utils, kind)(sequences=sequences, **kept)

    def _place(self, array: np.ndarray) -> jax.Array:
        """[B, ...] host array -> device array; on a mesh, rows split over "data" (B divides it)."""
        mesh = self.model.mesh
        if mesh is None:
            return jnp.asarray(array)
        # Every process holds the whole batch and hands over the rows of its own devices.
        return jax.make_array_from_callback(array.shape, _sharding.batch_sharding(mesh, array.shape), lambda index: array[index])

    def _prepared(self) -> int:
        return sum(self.trace_counts.values()) + sum(self.load_counts.values())

    @property
    def program_counts(self) -> dict[str, int]:
        """Programs prepared per stage in this process, traced or read from disk."""
        return {stage: self.trace_counts[stage] + self.load_counts[stage] for stage in self.trace_counts}

    def _program(self, key: tuple, function, args: tuple, donate: tuple[int, ...] = ()):
        """The compiled program for `key`: kept from an earlier call, read from disk, or traced now."""
        if key in self._programs:
            return self._programs[key]
        store = self._store if _programs.directory() is not None else None
        found = store.load(key) if store is not None else None
        if found is not None:
            exported, metadata = found
            self.load_counts[key[0]] += 1
            self._fields[key] = metadata["fields"]
            program = jax.jit(exported.call, donate_argnums=donate)
        elif store is not None:
            kernels = [jax.export.DisabledSafetyCheck.custom_call(target) for target in _cpu_kernels.TARGETS]
            exported = jax.export.export(jax.jit(function), disabled_checks=kernels)(*args)
            exported = store.save(key, exported, {"fields": self._fields[key]})
            program = jax.jit(exported.call, donate_argnums=donate)
        else:
            program = jax.jit(function, donate_argnums=donate)
        self._programs[key] = program
        return program

    # -- traced: flat state in and out ---------------------------------------------

    def _prefill_flat(self, params, ids, mask, key, budget, least, first_column, *, program, layout, total,
                      settings) -> list:
        state = self._prefill(params, ids, mask, key, budget, least, first_column, total=total, settings=settings)
        return self._flatten(state, program, layout)

    def _decode_flat(self, params, leaves, limit, *, program, layout, offset, settings, windows, trace_prefill) -> list:
        if layout not in self._treedefs:
            trace_prefill()  # its program came from disk: trace it abstractly for the state's structure
        state = jax.tree_util.tree_unflatten(self._treedefs[layout], leaves)
        state = self._decode_n_tokens(params, state, limit, offset=offset, settings=settings, windows=windows)
        return self._flatten(state, program, layout)

    def _flatten(self, state: dict, program: tuple, layout: tuple) -> list:
        paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        self._treedefs[layout] = treedef
        paths = [jax.tree_util.keystr(path) for path, _ in paths_and_leaves]
        wanted = {name: f"['{name}']" for name in ("sequence", "step", "done", "logits", "scores")}
        wanted.update({name: f"['beams']['{name}']" for name in ("finished", "finished_length")})
        self._fields[program] = {name: paths.index(path) for name, path in wanted.items() if path in paths}
        return [leaf for _, leaf in paths_and_leaves]

    # -- traced: prefill ---------------------------------------------------------

    def _prefill(self, params, ids, mask, key, budget, least, first_column, *, total: int,
                 settings: GenerationSettings) -> dict:
        # ids, mask: [B, P] int32, left-padded; key: uint32 PRNG key data; budget, least: int32 max_new_tokens and
        # min_new_tokens; first_column: int32, where transformers' rows start in the buffer (all three arguments,
        # so they do not recompile); total: the buffer and cache length L.
        self.trace_counts["prefill"] += 1
        batch, size = ids.shape
        if self.encoder_decoder:
            prompt = jnp.full((batch, 1), settings.decoder_start_token_id, jnp.int32)
            prompt_mask = jnp.ones_like(prompt)
        else:
            prompt, prompt_mask = ids, mask
        offset = prompt.shape[1]
        fill = settings.pad_token_id if settings.beam is None else settings.beam.fill_token_id
        sequence = jnp.full((batch, total), fill, jnp.int32).at[:, :offset].set(prompt)
        full_mask = jnp.zeros((batch, total), jnp.int32).at[:, :offset].set(prompt_mask)
        encoder = None
        with self._bound(params):
            if self.encoder_decoder:
                encoder, cache, logits = self._prefill_encoder_decoder(ids, mask, prompt, full_mask, total)
            elif self.kind == "recompute":
                cache, logits = None, self._recompute_logits(sequence, full_mask, offset - 1)
            else:
                cache, logits = self._prefill_decoder(ids, mask, full_mask, total)
        state = {
            "cache": cache,
            "encoder": encoder,
            "sequence": sequence,
            "mask": full_mask,
            "next_position": jnp.sum(prompt_mask, axis=1).astype(jnp.int32),
            "seen": _sampling.seen_mask(prompt, prompt_mask, logits.shape[-1]) if _needs_seen(settings) else None,
            "done": jnp.zeros((batch,), bool),
            "step": jnp.int32(0),
            "key": key,
            "budget": budget,
            "least": least,
            "first_column": first_column,
            # The buffers of return_dict_in_generate: raw logits and processed scores of every new token.
            "logits": jnp.zeros((batch, total - offset, logits.shape[-1]), jnp.float32) if settings.output_logits else None,
            "scores": jnp.zeros((batch, total - offset, logits.shape[-1]), jnp.float32) if settings.output_scores else None,
            "beams": None if settings.beam is None else _beam.initial(batch // settings.beam.num_beams, settings.beam,
                                                                      sequence),
        }
        return _choose(state, logits, offset, settings)

    def _prefill_decoder(self, ids, mask, full_mask, total: int):
        positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
        kwargs = {"use_cache": True}
        if self.kind == "static":
            cache = _caches.static_cache(self.config.get_text_config(decoder=True), total)
            kwargs.update(past_key_values=cache, attention_mask=_env.to_torch(full_mask))
        else:
            kwargs.update(attention_mask=_env.to_torch(mask))
        if self._takes_positions:
            kwargs["position_ids"] = _env.to_torch(positions)
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.module(input_ids=_env.to_torch(ids), **kwargs)
        cache = out.past_key_values if self.kind == "static" else _own_cache(out)
        return _env.to_jax(cache), _env.to_jax(out.logits)[:, -1].astype(jnp.float32)

    def _prefill_encoder_decoder(self, ids, mask, start, decoder_mask, total: int):
        # start: [B, 1] the decoder start token; decoder_mask: [B, L]
        from transformers import EncoderDecoderCache

        encoder = self.module.get_encoder()(input_ids=_env.to_torch(ids), attention_mask=_env.to_torch(mask))
        config = self.config.get_text_config(decoder=True)
        cache = EncoderDecoderCache(_caches.static_cache(config, total), _caches.static_cache(config, ids.shape[1]))
        encoder = (_env.to_jax(encoder.last_hidden_state), mask)
        out = self.module(**self._encoder_decoder_inputs(encoder, start, decoder_mask, cache))
        return encoder, _env.to_jax(out.past_key_values), _env.to_jax(out.logits)[:, -1].astype(jnp.float32)

    @staticmethod
    def _encoder_decoder_inputs(encoder, token, decoder_mask, cache) -> dict:
        from transformers.modeling_outputs import BaseModelOutput

        hidden, encoder_mask = encoder  # [B, P, H], [B, P]
        return dict(
            encoder_outputs=BaseModelOutput(last_hidden_state=_env.to_torch(hidden)),
            attention_mask=_env.to_torch(encoder_mask),
            decoder_input_ids=_env.to_torch(token),
            decoder_attention_mask=_env.to_torch(decoder_mask),
            past_key_values=cache,
            use_cache=True,
        )

    def _recompute_logits(self, sequence, full_mask, index):
        positions = jnp.maximum(jnp.cumsum(full_mask, axis=1) - 1, 0)
        kwargs = {"attention_mask": _env.to_torch(full_mask), "use_cache": False}
        if self._takes_positions:
            kwargs["position_ids"] = _env.to_torch(positions)
        out = self.module(input_ids=_env.to_torch(sequence), **kwargs)
        logits = _env.to_jax(out.logits)  # [B, L, V]
        return jax.lax.dynamic_index_in_dim(logits, index, axis=1, keepdims=False).astype(jnp.float32)

    # -- traced: decode loop -----------------------------------------------------

    def _windows(self, offset: int, total: int) -> tuple[int, ...]:
        """The cache lengths that the decode loop attends over in turn: a quarter and a half of
        the cache (in whole `_CACHE_MULTIPLE`s) where they hold more than the prompt, then all of it.

        Attention reads every slot of the cache it is given, filled or not: at batch 8 the
        150M benchmark model spent 1.4 ms of its 17.5 ms step on attention over 192 slots, of
        which 17 to 144 are filled. Each window is a loop of its own in the one program, so
        early tokens attend over a short cache: the batch-8 step fell to 16.1-16.6 ms, and from
        23.8 to 21.2 ms for 1008 new tokens. The program holds a copy of the step per window,
        which costs compile time once per shape (about 1 s a window at 150M on this CPU), so
        there are at most three.
        """
        if self.kind != "static" or self.encoder_decoder:
            return (total,)
        parts = {_round_up(total // share, _CACHE_MULTIPLE) for share in (4, 2)}
        return (*sorted(window for window in parts if offset < window < total), total)

    def _decode_n_tokens(self, params, state, limit, *, offset: int, settings: GenerationSettings,
                         windows: tuple[int, ...]) -> dict:
        self.trace_counts["decode"] += 1
        if len(windows) > 1 and not _caches.windowable(state["cache"]):
            windows = windows[-1:]
        for window in windows[:-1]:
            # The steps whose token's keys land in the window's slots: its columns [0, window).
            # A window whose steps are over runs no step, and its slots go back unchanged.
            full = state["cache"]
            state = self._decode_loop(params, {**state, "cache": _caches.window(full, window)},
                                      jnp.minimum(limit, window - offset + 1), offset=offset, settings=settings)
            state = {**state, "cache": _caches.written_back(full, state["cache"])}
        return self._decode_loop(params, state, limit, offset=offset, settings=settings)

    def _decode_loop(self, params, state, limit, *, offset: int, settings: GenerationSettings) -> dict:
        def running(state):
            return (state["step"] < limit) & ~jnp.all(state["done"])

        leaves, treedef = jax.tree_util.tree_flatten(state["cache"])
        shapes = [jnp.shape(leaf) for leaf in leaves]
        window = _caches.slots(state["cache"]) or state["mask"].shape[1]

        def unsqueezed(cache):
            flat = jax.tree_util.tree_leaves(cache)
            return jax.tree_util.tree_unflatten(treedef, [jnp.reshape(leaf, shape) for leaf, shape in zip(flat, shapes)])

        def step(state):
            slot = offset + state["step"] - 1  # where the last sampled token sits
            state = {**state, "cache": unsqueezed(state["cache"])}
            with self._bound(params):
                if self.kind == "recompute" and not self.encoder_decoder:
                    logits = self._recompute_logits(state["sequence"], state["mask"], slot)
                    cache = None
                else:
                    cache, logits = self._decode_one_token(state, slot, window)
            return _choose({**state, "cache": _caches.squeezed(cache)}, logits, offset, settings)

        state = jax.lax.while_loop(running, step, {**state, "cache": _caches.squeezed(state["cache"])})
        return {**state, "cache": unsqueezed(state["cache"])}

    def _decode_one_token(self, state, slot, window: int):
        # token: [B, 1], the last sampled token; position: [B, 1]; window: the cache's length
        token = jax.lax.dynamic_slice_in_dim(state["sequence"], slot, 1, axis=1)
        cache = _env.to_torch(state["cache"])
        if self.encoder_decoder:
            out = self.module(**self._encoder_decoder_inputs(state["encoder"], token, state["mask"], cache))
            return _env.to_jax(out.past_key_values), _env.to_jax(out.logits)[:, -1].astype(jnp.float32)
        kwargs = {"use_cache": True}
        if self.kind == "static":
            kwargs.update(past_key_values=cache, attention_mask=_env.to_torch(state["mask"][:, :window]))
        else:
            kwargs.update(_own_cache_argument(self.module, cache))
        if self._takes_positions:
            kwargs["position_ids"] = _env.to_torch(state["next_position"][:, None] - 1)
        out = self.module(input_ids=_env.to_torch(token), **kwargs)
        new_cache = out.past_key_values if self.kind == "static" else _own_cache(out)
        return _env.to_jax(new_cache), _env.to_jax(out.logits)[:, -1].astype(jnp.float32)

    @contextlib.contextmanager
    def _bound(self, params):
        # An op with no lowering is named, with the submodule that called it.
        with _compile.explain_errors(self.module, self._module_names):
            with _compile.bound(self.module, params, self.model.aliases, _env.env().prng_key) as environment:
                yield environment


def _host(array: jax.Array) -> np.ndarray:
    """The whole of `array` on this host, also when other processes hold some of its rows."""
    if array.is_fully_addressable or array.is_fully_replicated:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _needs_seen(settings: GenerationSettings) -> bool:
    return settings.sampling.repetition_penalty != 1.0


def _own_cache(out):
    for field in ("past_key_values", "cache_params"):
        if getattr(out, field, None) is not None:
            return getattr(out, field)
    raise HfjaxError(f"{type(out).__name__} returned no cache (past_key_values / cache_params) with use_cache=True")


def _own_cache_argument(module, cache) -> dict:
    name = "cache_params" if _accepts(module, "cache_params") else "past_key_values"
    return {name: cache}


def _processed(logits, state: dict, end, settings: GenerationSettings):
    """`logits` [B, V] after transformers' processors that come before repetition penalty and
    sampling, in its order. The rows so far are `state["sequence"]`'s columns [first_column, end)."""
    step, vocab_size = state["step"], logits.shape[-1]
    vocab = jnp.arange(vocab_size)
    sequence, first = state["sequence"], state["first_column"]
    if settings.sequence_bias:  # transformers' first processor; bad_words_ids are -inf biases
        logits = logits + _sampling.sequence_bias(sequence, first, end, settings.sequence_bias, vocab_size)
    if settings.no_repeat_ngram_size:
        banned = _sampling.ngram_bans(sequence, first, end, settings.no_repeat_ngram_size, vocab_size)
        logits = jnp.where(banned, -jnp.inf, logits)
    if settings.eos_token_ids:  # min_new_tokens and min_length
        held = jnp.isin(vocab, jnp.asarray(settings.eos_token_ids)) & (step < state["least"])
        logits = jnp.where(held[None, :], -jnp.inf, logits)
    # As transformers' forced-token processors: the forced token scores 0 and every other -inf,
    # whatever the processors before had done to them.
    if settings.forced_bos_token_id is not None:
        forced = jnp.where(vocab == settings.forced_bos_token_id, 0.0, -jnp.inf)
        logits = jnp.where(step == 0, forced[None, :], logits)
    if settings.forced_eos_token_ids:
        forced = jnp.where(jnp.isin(vocab, jnp.asarray(settings.forced_eos_token_ids)), 0.0, -jnp.inf)
        logits = jnp.where(step == state["budget"] - 1, forced[None, :], logits)
    if settings.suppress_tokens:
        logits = jnp.where(jnp.isin(vocab, jnp.asarray(settings.suppress_tokens))[None, :], -jnp.inf, logits)
    if settings.begin_suppress_tokens:
        at_begin = (step == settings.begin_suppress_step) & jnp.isin(vocab, jnp.asarray(settings.begin_suppress_tokens))
        logits = jnp.where(at_begin[None, :], -jnp.inf, logits)
    return logits


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _kept(state: dict, logits, scores) -> dict:
    """`state` with this step's raw logits and processed scores [B, V] written into the
    [B, T, V] buffers that return_dict_in_generate asked for (None where it did not)."""
    kept = {}
    for name, values in (("logits", logits), ("scores", scores)):
        if state[name] is not None:
            kept[name] = jax.lax.dynamic_update_slice_in_dim(state[name], values[:, None, :], state["step"], axis=1)
    return {**state, **kept}


def _choose(state: dict, logits, offset: int, settings: GenerationSettings) -> dict:
    """Samples the next token of every row from `logits` [B, V] and appends it to the state."""
    if settings.beam is not None:
        return _choose_beams(state, logits, offset, settings)
    key, draw = jax.random.split(jax.random.wrap_key_data(state["key"]))
    scores = _sampling.process_logits(_processed(logits, state, offset + state["step"], settings), state["seen"],
                                      settings.sampling)  # [B, V]
    state = _kept(state, logits, scores)
    token = _sampling.pick(scores, draw, settings.sampling).astype(jnp.int32)  # [B]
    token = jnp.where(state["done"], settings.pad_token_id, token)
    slot = offset + state["step"]
    sequence = jax.lax.dynamic_update_slice_in_dim(state["sequence"], token[:, None], slot, axis=1)
    done = state["done"]
    if settings.eos_token_ids:
        done = done | jnp.isin(token, jnp.asarray(settings.eos_token_ids))
    return _advanced(state, sequence, token, slot, state["seen"], done=done, key=jax.random.key_data(key))


def _advanced(state: dict, sequence, token, slot, seen, **changes) -> dict:
    """`state` once `token` [B] sits at column `slot` of `sequence` [B, L]: attended to, at the
    next position, in the rows' `seen` tokens [B, V] (or None), one step on; plus `changes`."""
    mask = jax.lax.dynamic_update_slice_in_dim(state["mask"], jnp.ones_like(token)[:, None], slot, axis=1)
    return {
        **state,
        **changes,
        "sequence": sequence,
        "mask": mask,
        "next_position": state["next_position"] + 1,
        "seen": None if seen is None else _sampling.update_seen(seen, token),
        "step": state["step"] + 1,
    }


def _choose_beams(state: dict, logits, offset: int, settings: GenerationSettings) -> dict:
    """One beam search step from `logits` [B*K, V]; the cache and `seen` follow the new beams' parents."""
    end = offset + state["step"]
    # transformers' beam search processes log-probabilities, not logits.
    log_probs = _processed(jax.nn.log_softmax(logits, axis=-1), state, end, settings)
    log_probs = _sampling.process_logits(log_probs, state["seen"], settings.sampling)
    beams, sequence, parents, keep_going = _beam.step(
        state["beams"], log_probs, state["sequence"], end, state["step"], state["budget"], settings.eos_token_ids, settings.beam
    )
    rows = parents.shape[0]

    def follow(leaf):  # the cache's rows are the beams: each takes its parent's
        return leaf[parents] if jnp.ndim(leaf) and leaf.shape[0] == rows else leaf

    token = jax.lax.dynamic_index_in_dim(sequence, end, axis=1, keepdims=False)  # [B*K] each beam's new token
    seen = None if state["seen"] is None else state["seen"][parents]
    return _advanced(
        state, sequence, token, end, seen,
        cache=jax.tree_util.tree_map(follow, state["cache"]),
        beams=beams,
        done=jnp.broadcast_to(~keep_going, state["done"].shape),
    )
