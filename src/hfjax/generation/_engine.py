"""The generation engine: prefill compiled per prompt-length bucket, then the whole decode loop as
ONE XLA program of `while_loop`s with the choice of each token inside it.

Stages (gpt-fast's names):
  prefill          the prompt, padded to a bucket, fills the past (the adapter's cache) and the
                   first new token is chosen;
  decode_n_tokens  a `jax.lax.while_loop` over one-token steps that stops when every row has
                   produced an EOS or the step limit is reached. Its state is donated, so the
                   cache is updated in place. A streamer runs it in chunks. Unstreamed, a
                   decoder's static cache is attended in growing windows (`_planning.windows`):
                   one loop per window, in the same program.

A call that the continuous-batching core carries out runs on it instead (`_on_slots.SlotRuns`:
decoder-only, a static KV cache, prompts padded anywhere, images, ...;
encoder-decoders whose decoder takes each row's positions, `_encoder_slots`; beam search as a program
family of its own over the slot cache, `_slot_beams`), with the programs `hfjax serve` runs;
`Generator`'s own programs below run the rest.

`Generator` drives the parts, each of which another front end (a server's slots, a trainer's
evaluation) can drive too:
  _planning.plan_batch   prompts padded and laid out (a pure function)
  _adapters              how the model keeps its past: `prefill` and `step` per cache kind
  _state.DecodeState     the loop's state, a pytree dataclass with named fields
  _choose                transformers' logits processors, sampling, beam search steps
  _programs.ProgramCache the compiled programs, in memory and on disk

The backend's hook (`hfjax._backend.active()`) decides the layout the loop carries its cache in.
On a mesh the batch is split over its "data" axis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import _backend, bridge, parallel
from .. import lora as _lora
from .._errors import DataDependentError, GenerationError
from . import _caches, _choose, _multimodal, _planning, _programs, _rows, _sampling
from ._adapters import adapter_for, check_generated
from ._beam import initial as initial_beams
from ._grammar import Constraint
from ._on_slots import SlotRuns
from ._settings import GenerationSettings
from ._slots import check_supported
from ._state import DecodeState, field_slices, read

# Why a constrained call cannot run: the mask is applied on the slot core only.
_NOT_CONSTRAINABLE = (
    "Model.generate: structured outputs (json_schema, regex, choice, grammar, response_format) run on the slot "
    "core, which takes decoder-only models with a static KV cache and position_ids, and the image inputs "
    "whose masks it builds; {}"
)


# Why a speculative call cannot run: the drafts are verified on the slot core only.
_NOT_SPECULABLE = (
    "Model.generate: {0} (speculative decoding) runs on the slot core, which takes decoder-only models with a "
    "static KV cache and position_ids, and images where it drafts with no draft model; {1}; leave it out"
)


def check_draft(model, draft, *, name: str = "Model.generate: assistant_model") -> None:
    """Raises GenerationError where `draft` cannot draft for `model` on the slot core, saying why;
    `name` is how the caller's argument reads in the message."""
    check_supported(draft)
    if not adapter_for(draft.module).takes_positions:
        raise GenerationError(
            f"{name} {type(draft.module).__name__} takes no position_ids, which the slot core "
            "gives each row; pass a draft model that takes them"
        )
    width, own = (m.module.config.get_text_config(decoder=True).vocab_size for m in (draft, model))
    if width != own:
        raise GenerationError(
            f"{name} has a vocabulary of {width} tokens and the model {own}; pass a draft "
            "model with the model's tokenizer"
        )
    if draft.mesh is not model.mesh:
        raise GenerationError(
            f"{name} is on another mesh than the model; load it with the model's mesh "
            "(hfjax.load(path, mesh=model.mesh))"
        )


@dataclasses.dataclass
class GenerationStats:
    """Timings of the last `generate` call (seconds), for --stats and benchmarks."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    time_to_first_token: float = 0.0
    total: float = 0.0
    compiled: bool = False
    # Speculative decoding's (prompt_lookup_num_tokens; else 0): the drafted tokens the target
    # verified, those it accepted, and its forwards in the decode (one per round)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    target_forwards: int = 0

    @property
    def tokens_per_second(self) -> float:
        decode = self.total - self.time_to_first_token
        return (self.new_tokens - 1) / decode if self.new_tokens > 1 and decode > 0 else float("nan")


@dataclasses.dataclass(frozen=True)
class PrefillArguments:
    """What a prefill program takes besides the weights (B rows, P prompt columns), the same for every
    call of one program's key: arrays, never recompiled for other values."""

    ids: jax.Array  # [B, P] int32, padded (an encoder that takes features: its main input)
    mask: jax.Array  # [B, P] int32
    rows: tuple  # `RowSampling.leaves()` [B]: each row's sampling settings, every key the call's seed
    max_new_tokens: jax.Array  # [] int32: this call's max_new_tokens
    least: jax.Array  # [] int32: this call's min_new_tokens
    first_column: jax.Array  # [] int32: where transformers' rows start in the buffer
    decoder_prompt: jax.Array | None  # encoder-decoders' [B, offset] int32 first decoder tokens, else None
    extra: tuple | _multimodal.PrefillInputs | None = None  # the prefill's other model inputs (images)
    ngram_source: jax.Array | None = None  # `BatchPlan.ngram_source`

    def leaves(self) -> tuple:
        """The fields in order: plain containers, which jax.export keeps (`PrefillArguments(*leaves)`)."""
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self))


class Generator:
    """Compiled generation for one model (an object with `module`, `params`, `aliases`, `mesh`)."""

    def __init__(self, model):
        self.model = model
        self.module = model.module
        self.adapter = adapter_for(model.module)
        self.backend = _backend.active()
        on_one_device = _programs.single_device(model.params)
        fingerprint = _programs.model_fingerprint(model.module, model.params, model.aliases) if on_one_device else None
        self.programs = _programs.ProgramCache(fingerprint)
        # Programs pass their state as a flat list of leaves. Per layout (rows, offset, total,
        # settings): the state's tree structure (known once a prefill is traced) and where its
        # named fields lie in the list.
        self._treedefs: dict[tuple, jax.tree_util.PyTreeDef] = {}
        self._slices: dict[tuple, dict] = {}
        self.last_stats = GenerationStats()
        self._module_names = {id(m): n for n, m in model.module.named_modules()}
        # Per program key whose trace reads values of the data (hfjax._specialize): its values.
        self._specialized: dict[tuple, bridge.Specializations] = {}
        self.slot_runs = SlotRuns(self)

    @property
    def trace_counts(self) -> dict[str, int]:
        """Traces of the model per stage in this process (an abstract trace included)."""
        return {stage: self.programs.traced[stage] for stage in ("prefill", "decode")}

    @property
    def load_counts(self) -> dict[str, int]:
        """Programs read from disk per stage in this process."""
        return {stage: self.programs.loaded[stage] for stage in ("prefill", "decode")}

    @property
    def program_counts(self) -> dict[str, int]:
        """Programs prepared per stage in this process, traced or read from disk."""
        return {stage: self.trace_counts[stage] + self.load_counts[stage] for stage in ("prefill", "decode")}

    # -- the host side ----------------------------------------------------------

    def _check_constrainable(self, plan, settings: GenerationSettings, inputs) -> None:
        """Raises GenerationError where a constrained call cannot run on the slot core, saying why."""
        if settings.beam is not None:
            raise GenerationError(
                f"Model.generate: num_beams={settings.beam.num_beams} with a constraint (json_schema, regex, choice, "
                "grammar, response_format); constrain with num_beams=1"
            )
        if self.model.tokenizer is None:
            raise GenerationError(
                f"Model.generate: a constraint needs the tokenizer, and {self.model.source} has none; load a checkpoint "
                "with tokenizer files"
            )
        if not self.slot_runs.takes(plan, settings, inputs):
            raise GenerationError(
                _NOT_CONSTRAINABLE.format(
                    f"this call (a {type(self.module).__name__}, with its inputs) does not run there"
                )
            )

    def _check_speculable(self, plan, settings: GenerationSettings, inputs, constraint, draft) -> None:
        """Raises GenerationError where a speculative call (prompt_lookup_num_tokens, assistant_model)
        cannot run, saying why."""
        k = settings.speculation.num_speculative_tokens
        drafter = f"prompt_lookup_num_tokens={k}" if draft is None else "assistant_model"
        if draft is not None:
            check_draft(self.model, draft)
        if constraint is not None:
            raise GenerationError(
                f"Model.generate: {drafter} with a constraint (json_schema, regex, choice, grammar, "
                "response_format): a constrained row's mask is made on the host after each token, so its drafts "
                "cannot be verified on the device; pass one of them"
            )
        if not self.slot_runs.takes(plan, settings, inputs):
            raise GenerationError(
                _NOT_SPECULABLE.format(
                    drafter, f"this call (a {type(self.module).__name__}, with its inputs) does not run there"
                )
            )

    def generate(
        self,
        ids: np.ndarray,
        mask: np.ndarray,
        settings: GenerationSettings,
        *,
        seed: int,
        streamer=None,
        decoder_prompt: np.ndarray | None = None,
        inputs: dict[str, np.ndarray] | None = None,
        constraint: Constraint | None = None,
        lora: np.ndarray | None = None,
        draft=None,
    ):
        """ids, mask: int32 [B, S], left-padded (an encoder that takes features, not token ids: ids
        float [B, ...], its main input). decoder_prompt: int32 [B, D], an encoder-decoder's first
        decoder tokens (default: the decoder start token). inputs: the prefill's other model inputs
        (`_multimodal`: pixel_values, image_grid_thw, token_type_ids, ...). constraint: what every
        row's answer must be (structured outputs; on the slot core only). lora: int32 [B], each prompt's
        LoRA adapter slot (None: the model holds none). draft: the draft model (an hfjax Model) of
        `settings.speculation` "draft_model". Returns int32
        [B * num_return_sequences, S + T]: the prompt as given, then up to max_new_tokens new tokens
        (for encoder-decoders [.., D + T]: the decoder prompt, then the new tokens); or
        transformers' Generate*Output."""
        start = time.perf_counter()
        check_generated(self.module)
        precision = bridge.resolve_precision(self.model.matmul_precision)  # of this call's programs
        beam = settings.beam
        if beam is not None and streamer is not None:
            raise GenerationError(
                f"num_beams={beam.num_beams} with a streamer: beam search knows its answer only at the end; "
                "stream with num_beams=1"
            )
        plan = _planning.plan_batch(
            ids, mask, settings, encoder_decoder=self.adapter.encoder_decoder,
            pad_to_bucket=self.adapter.pads_prompts and ids.shape == mask.shape,
            data_devices=parallel.data_size(self.model.mesh), decoder_prompt=decoder_prompt,
        )  # fmt: skip
        on_core = self.slot_runs.takes(plan, settings, inputs)
        # (the slot core's beams move a recurrent state to each beam's parent; `Generator`'s do not)
        if beam is not None and not self.adapter.reorders_beams and not on_core:
            raise GenerationError(
                f"num_beams={beam.num_beams}: {type(self.module).__name__} keeps a recurrent state that hfjax does "
                "not reorder between beams; use num_beams=1"
            )
        compiled = _planning.program_settings(settings, plan)
        prepared_before = sum(self.program_counts.values())
        if constraint is not None:
            self._check_constrainable(plan, settings, inputs)
        speculation = settings.speculation
        if speculation is not None:
            self._check_speculable(plan, settings, inputs, constraint, draft)
        extra = None
        if inputs:
            extra = self._prefill_inputs(plan, inputs, ids, lora, precision)
        if on_core:
            ran = self.slot_runs.generate(
                ids, plan, settings, compiled, seed=seed, streamer=streamer, constraint=constraint, lora=lora,
                draft=draft, inputs=extra,
            )  # fmt: skip
            if ran is None and constraint is not None:
                raise GenerationError(
                    _NOT_CONSTRAINABLE.format(f"{type(self.module).__name__} reads values of its data")
                )
            if ran is None and speculation is not None:
                raise GenerationError(
                    _NOT_SPECULABLE.format(
                        "speculative decoding", f"{type(self.module).__name__} reads values of its data"
                    )
                )
            if ran is not None:
                new, ttft, kept, drafts = ran  # the caller's rows: num_return_sequences per prompt
                prompt = np.repeat(ids, settings.num_return_sequences, axis=0).astype(np.int32)
                if self.adapter.encoder_decoder:  # the decoder's prompt, as transformers returns it
                    prompt = plan.decoder_prompt[: new.shape[0]]
                self._stats(mask, new.shape[1], ttft, start, prepared_before, drafts)
                out = jnp.asarray(np.concatenate([prompt, new], axis=1))
                if settings.return_dict_in_generate:
                    out = self._output(out, kept.get, new.shape[0], new.shape[1], beams=beam is not None)
                return out
        batch = plan.prompts * plan.per_prompt  # the rows the caller sees, without beam search
        if streamer is not None:
            streamer.put(torch.as_tensor(ids.astype(np.int64)))

        params = _one_adapter(self.model.params, lora)
        layout = (plan.rows, plan.offset, plan.total, compiled)
        # A streamer re-enters the decode program every few tokens: windows cut and written back
        # at each entry would copy more than they save, so it attends over the whole cache.
        windows = self._windows(plan) if streamer is None else (plan.total,)
        extra_arrays = None if extra is None else (extra.model_inputs, extra.position_shift)  # its static part: the key
        arguments = PrefillArguments(
            ids=self._place(plan.ids),
            mask=self._place(plan.mask),
            rows=tuple(self._place(a) for a in settings.row_sampling(plan.rows, _rows.key_data(seed)).leaves()),
            max_new_tokens=jnp.int32(settings.max_new_tokens),
            least=jnp.int32(settings.min_new_tokens),
            first_column=jnp.int32(plan.first_column),
            decoder_prompt=None if plan.decoder_prompt is None else self._place(plan.decoder_prompt),
            extra=jax.tree_util.tree_map(self._place, extra_arrays),
            ngram_source=None if plan.ngram_source is None else self._place(plan.ngram_source),
        )
        prefill_args = (params, arguments.leaves())  # plain containers, which jax.export keeps
        prefill_function = bridge.under(precision, functools.partial(
            self._prefill_flat, layout=layout, offset=plan.offset, settings=compiled,
            static=() if extra is None else extra.static,
        ))  # fmt: skip
        leaves, fields = self._run_prefill(
            ("prefill", plan.rows, plan.size, plan.total, compiled, precision, *_multimodal.signature(extra)),
            prefill_function, prefill_args, metadata=lambda: {"fields": self._slices[layout]},
        )  # fmt: skip

        def field(name: str) -> np.ndarray:
            return parallel.to_host(read(leaves, fields, name))

        first = field("sequence")[:batch, plan.offset]
        ttft = time.perf_counter() - start
        if streamer is not None:
            streamer.put(torch.as_tensor(first.astype(np.int64)))
        max_new_tokens = settings.max_new_tokens
        decode_function = bridge.under(precision, functools.partial(
            self._decode_flat, layout=layout, offset=plan.offset, settings=compiled, windows=windows,
            trace_prefill=lambda: jax.eval_shape(prefill_function, *prefill_args),
        ))  # fmt: skip
        decode = functools.partial(
            self._run_decode, ("decode", *layout, windows, precision), decode_function, fields=fields
        )  # fmt: skip
        steps = 1
        if streamer is None:
            leaves = decode(params, leaves, jnp.int32(max_new_tokens))
            steps = int(field("step"))
        else:
            while steps < max_new_tokens and not bool(np.all(field("done"))):
                leaves = decode(params, leaves, jnp.int32(min(steps + _planning.STREAM_CHUNK, max_new_tokens)))
                now = int(field("step"))
                for token in field("sequence")[:batch, plan.offset + steps : plan.offset + now].T:
                    streamer.put(torch.as_tensor(token.astype(np.int64)))
                steps = now
            streamer.end()
        returned = settings.num_return_sequences
        if beam is None:
            sequence = field("sequence")[:batch]
            prompt = np.repeat(ids, plan.per_prompt, axis=0)
        else:
            # Each prompt's best finished sequences, best first, as long as the longest returned one.
            finished = field("beams.finished").reshape(plan.padded_prompts, plan.per_prompt, plan.total)
            sequence = finished[: plan.prompts, :returned].reshape(plan.prompts * returned, plan.total)
            steps = int(field("beams.finished_length")[: plan.prompts, :returned].max())
            prompt = np.repeat(ids, returned, axis=0)
        if self.adapter.encoder_decoder:
            prompt = sequence[:, : plan.offset]
        new = sequence[:, plan.offset : plan.offset + steps]
        out = jnp.asarray(np.concatenate([prompt.astype(np.int32), new], axis=1))
        if settings.return_dict_in_generate:
            out = self._output(out, field, batch, steps, beams=beam is not None)
        self._stats(mask, steps, ttft, start, prepared_before)
        return out

    def _stats(
        self, mask: np.ndarray, steps: int, ttft: float, start: float, prepared_before: int, drafts=(0, 0, 0)
    ) -> None:
        drafted, accepted, forwards = drafts
        self.last_stats = GenerationStats(
            prompt_tokens=int(mask.sum()),
            new_tokens=steps,
            time_to_first_token=ttft,
            total=time.perf_counter() - start,
            compiled=sum(self.program_counts.values()) > prepared_before,
            drafted_tokens=drafted,
            accepted_tokens=accepted,
            target_forwards=forwards,
        )

    def _run_prefill(self, key: tuple, function, args: tuple, *, metadata) -> tuple[list, dict]:
        """Runs the prefill program for `key`; returns (the state's leaves, where its fields lie).
        A model that reads values of its data gets the program specialised on this call's values."""
        specialized = self._specialized.get(key)
        if specialized is None:
            try:
                program = self.programs.get(key, function, args, metadata=metadata)
                return program.run(*args), program.metadata["fields"]
            except DataDependentError:
                specialized = self._specialized[key] = bridge.Specializations()

        def run_with(values):
            program = self._specialized_program(key, function, values, args, metadata)
            leaves, observed = program.run(*args)
            return (leaves, program.metadata["fields"]), observed

        def eager():
            self._warn_running_eagerly(specialized, "prefill")
            with jax.disable_jit():  # op by op: every value of the data is at hand
                return function(*args), metadata()["fields"]

        return bridge.run_specialized(
            specialized, run_with, lambda known: bridge.discover_values(function, args, known), eager
        )

    def _run_decode(self, key: tuple, function, params, leaves: list, until, *, fields: dict) -> list:
        """Runs the decode program for `key` up to step `until`; returns the state's leaves. A model
        that reads values of its data in its step gets a loop specialised on the values its first
        step reads, which stops before a token whose values differ; the loop then goes on with the
        program for the values found from there."""
        metadata = lambda: {"fields": fields}  # noqa: E731 (the decode loop's state has the prefill's fields)
        specialized = self._specialized.get(key)
        if specialized is None:
            try:
                return self.programs.get(key, function, (params, leaves, until), metadata=metadata, donate=(1,)).run(
                    params, leaves, until
                )
            except DataDependentError:
                specialized = self._specialized[key] = bridge.Specializations()
        one_step = functools.partial(function, probing=True)
        known = ()  # values found right for the next token
        failed = set()  # keys of the values whose program made no progress from step `at`
        at = None
        while True:
            now = int(read(leaves, fields, "step"))
            if now != at:
                at, failed = now, set()
            if specialized.last is None:
                # A program built earlier whose values agree with those known, else discovery.
                specialized.last = specialized.matching(known, failed)
            if specialized.last is None:
                if specialized.full:
                    self._warn_running_eagerly(specialized, "decode step")
                    with jax.disable_jit():  # op by op: every value of the data is at hand
                        return function(params, leaves, until)
                specialized.add(bridge.discover_values(one_step, (params, leaves, until), known))
                if bridge.values_key(specialized.last) in failed:
                    raise DataDependentError(
                        "values of the data", None, detail="a decode step's guards disagreed with its values"
                    )
            args = (params, leaves, until)
            values = specialized.last
            program = self._specialized_program(key, function, values, args, metadata, donate=(1,))
            leaves, held, observed = program.run(*args)
            if bool(held):
                return leaves
            known = observed[: bridge.first_difference(observed, values) + 1]
            advanced = int(read(leaves, fields, "step")) - at
            if advanced == 0:
                failed.add(bridge.values_key(values))
            elif advanced < 2:
                specialized.short_runs += 1  # values that change with every token: compiling does not pay
            specialized.last = None

    def _warn_running_eagerly(self, specialized: bridge.Specializations, stage: str) -> None:
        what = f"Model.generate: {type(self.module).__name__}'s {stage}"
        bridge.warn_running_eagerly(what, specialized.sites)

    def _specialized_program(
        self, key: tuple, function, values: tuple, args: tuple, metadata, donate=()
    ) -> _programs.Program:
        # `function` traced with `values` handed to the model's reads; it returns its guards too.
        return self.programs.get(
            (*key, "values", bridge.values_key(values)), functools.partial(function, values=values), args,
            metadata=metadata, donate=donate,
        )  # fmt: skip

    def _output(self, sequences, field, batch: int, steps: int, *, beams: bool):
        """transformers' Generate*Output for return_dict_in_generate: the sequences, and per new
        token the [B, V] raw logits and processed scores that output_logits / output_scores asked for."""
        from transformers.generation import utils

        kept = {}
        for name in ("logits", "scores"):
            values = field(name)
            if values is not None:
                values = jnp.asarray(values[:batch, :steps])  # [B, T, V]
                kept[name] = tuple(values[:, t] for t in range(steps))
        encoder_decoder = "EncoderDecoder" if self.adapter.encoder_decoder else "DecoderOnly"
        kind = f"Generate{'Beam' if beams else ''}{encoder_decoder}Output"
        return getattr(utils, kind)(sequences=sequences, **kept)

    def _place(self, array: np.ndarray) -> jax.Array:
        """[B, ...] host array -> device array; on a mesh, rows split over "data" (B divides it)."""
        mesh = self.model.mesh
        if mesh is None:
            return jnp.asarray(array)
        return parallel.place_rows(mesh, array)

    def _windows(self, plan: _planning.BatchPlan) -> tuple[int, ...]:
        if not self.adapter.windowable:
            return (plan.total,)
        return _planning.windows(plan.offset, plan.total)

    # -- traced: flat state in and out ---------------------------------------------

    def _prefill_flat(self, params, arguments: tuple, *, layout, offset, settings, static, values=None):
        # arguments: `PrefillArguments.leaves()`; values: the values of the data the model reads
        # (hfjax._specialize), or None; with them, it returns (leaves, the traced values there: its guards).
        arguments = PrefillArguments(*arguments)
        if arguments.extra is not None:
            arguments = dataclasses.replace(arguments, extra=_multimodal.PrefillInputs(*arguments.extra, static=static))
        replaying = contextlib.nullcontext() if values is None else bridge.replaying(values)
        with replaying as tape:
            state = self._prefill(params, arguments, offset=offset, settings=settings)
        leaves = self._flatten(state, layout)
        return leaves if values is None else (leaves, tape.observed)

    def _decode_flat(
        self, params, leaves, until, *, layout, offset, settings, windows, trace_prefill, values=None, probing=False
    ):
        # values: the values of the data the model's step reads (hfjax._specialize), or None; with
        # them, one loop checks them at every token, and it returns (leaves, whether all held, the
        # traced values of the token it stopped before).
        # probing: one step, outside any loop (for `bridge.discover`).
        if layout not in self._treedefs:
            trace_prefill()  # its program came from disk: trace it abstractly for the state's structure
        self.programs.traced["decode"] += 1
        state = jax.tree_util.tree_unflatten(self._treedefs[layout], leaves)
        if probing:
            self._decode_loop(params, state, until, offset=offset, settings=settings, probing=True)
            return None
        if values is not None:
            state, held, observed = self._decode_loop(
                params, state, until, offset=offset, settings=settings, values=values
            )
            return self._flatten(state, layout), held, observed
        state = self._decode_n_tokens(params, state, until, offset=offset, settings=settings, windows=windows)
        return self._flatten(state, layout)

    def _flatten(self, state: DecodeState, layout: tuple) -> list:
        leaves, self._treedefs[layout] = jax.tree_util.tree_flatten(state)
        self._slices[layout] = field_slices(state)
        return leaves

    # -- traced: prefill ---------------------------------------------------------

    def _prefill(
        self, params, arguments: PrefillArguments, *, offset: int, settings: GenerationSettings
    ) -> DecodeState:
        self.programs.traced["prefill"] += 1
        ids, mask, extra = arguments.ids, arguments.mask, arguments.extra
        batch = ids.shape[0]
        total = offset + settings.buffer_tokens
        if self.adapter.encoder_decoder:
            prompt = arguments.decoder_prompt
            prompt_mask = jnp.ones_like(prompt)
        else:
            prompt, prompt_mask = ids, mask
        fill = settings.pad_token_id if settings.beam is None else settings.beam.fill_token_id
        sequence = jnp.full((batch, total), fill, jnp.int32).at[:, :offset].set(prompt)
        full_mask = jnp.zeros((batch, total), jnp.int32).at[:, :offset].set(prompt_mask)
        with self._bound(params):
            # Static inputs (image grids) stay concrete through the ops the model runs on them.
            evaluate = (
                jax.ensure_compile_time_eval() if extra is not None and extra.static else contextlib.nullcontext()
            )
            with evaluate:
                model_inputs = {} if extra is None else extra.arguments()
                cache, encoder, logits = self.adapter.prefill(ids, mask, sequence, full_mask, offset, model_inputs)
        vocab = logits.shape[-1]
        next_position = jnp.sum(prompt_mask, axis=1).astype(jnp.int32)
        if extra is not None and extra.position_shift is not None:
            next_position = next_position + extra.position_shift

        def buffer(wanted: bool):  # return_dict_in_generate's raw logits or processed scores of each new token
            return jnp.zeros((batch, total - offset, vocab), jnp.float32) if wanted else None

        state = DecodeState(
            cache=cache,
            encoder=encoder,
            sequence=sequence,
            mask=full_mask,
            next_position=next_position,
            seen=_sampling.seen_mask(prompt, prompt_mask, vocab) if settings.features.repetition else None,
            counts=jnp.zeros((batch, vocab), jnp.int32) if settings.features.presence else None,
            done=jnp.zeros((batch,), bool),
            step=jnp.int32(0),
            rows=_rows.RowSampling(*arguments.rows[:-1], key=_rows.row_keys(arguments.rows[-1])),
            max_new_tokens=arguments.max_new_tokens,
            least=arguments.least,
            first_column=arguments.first_column,
            encoder_ids=arguments.ngram_source,
            logits=buffer(settings.output_logits),
            scores=buffer(settings.output_scores),
            beams=None
            if settings.beam is None
            else initial_beams(batch // settings.beam.num_beams, settings.beam, sequence),
        )
        return _choose.choose(state, logits, offset, settings)

    # -- traced: decode loop -----------------------------------------------------

    def _decode_n_tokens(
        self, params, state: DecodeState, until, *, offset: int, settings: GenerationSettings, windows: tuple[int, ...]
    ) -> DecodeState:
        if len(windows) > 1 and not _caches.windowable(state.cache):
            windows = windows[-1:]
        for window in windows[:-1]:
            # The steps whose token's keys land in the window's slots: its columns [0, window).
            # A window whose steps are over runs no step, and its slots go back unchanged.
            full = state.cache
            state = self._decode_loop(
                params,
                state.replace(cache=_caches.window(full, window)),
                jnp.minimum(until, window - offset + 1),
                offset=offset,
                settings=settings,
            )
            state = state.replace(cache=_caches.written_back(full, state.cache))
        return self._decode_loop(params, state, until, offset=offset, settings=settings)

    def _decode_loop(
        self,
        params,
        state: DecodeState,
        until,
        *,
        offset: int,
        settings: GenerationSettings,
        values: tuple | None = None,
        probing: bool = False,
    ):
        # values, probing: as in `_decode_flat`; with values it returns (state, held, observed).
        window = _caches.slots(state.cache) or state.mask.shape[1]
        carried, restore = self.backend.loop_carry(state.cache)

        def running(state: DecodeState):
            return (state.step < until) & ~jnp.all(state.done)

        def step(state: DecodeState) -> DecodeState:
            slot = offset + state.step - 1  # where the last chosen token sits
            token = jax.lax.dynamic_slice_in_dim(state.sequence, slot, 1, axis=1)  # [B, 1]
            with self._bound(params):
                cache, logits = self.adapter.step(state.replace(cache=restore(state.cache)), token, slot, window)
            return _choose.choose(state.replace(cache=self.backend.loop_carry(cache)[0]), logits, offset, settings)

        if probing:
            return step(state.replace(cache=carried))
        if values is None:
            state = jax.lax.while_loop(running, step, state.replace(cache=carried))
            return state.replace(cache=restore(state.cache))

        def guarded_step(carry):
            # A token whose values differ from `values` is thrown away, and the loop stops there
            # with that token's traced values (those up to the first that differs are right).
            state, _, _ = carry
            with bridge.replaying(values) as tape:
                stepped = step(state)
            held = bridge.holds(tape.observed, values)
            observed = [jnp.asarray(seen).astype(value.dtype) for seen, value in zip(tape.observed, values)]
            return jax.tree_util.tree_map(functools.partial(jnp.where, held), stepped, state), held, observed

        start = (state.replace(cache=carried), jnp.bool_(True), [jnp.asarray(value) for value in values])
        state, held, observed = jax.lax.while_loop(lambda carry: running(carry[0]) & carry[1], guarded_step, start)
        return state.replace(cache=restore(state.cache)), held, observed

    def _prefill_inputs(self, plan, inputs: dict, ids, lora, precision) -> _multimodal.PrefillInputs:
        """`inputs` (images) laid out for `plan`, an eager image encoder's output in place of its pixels."""
        if not self.adapter.takes_prefill_inputs:
            raise GenerationError(
                f"Model.generate: {type(self.module).__name__} decodes without a static cache ({self.adapter.kind}), "
                f"so hfjax cannot give it {', '.join(inputs)} at the prefill only; generate in PyTorch"
            )
        if parallel.data_size(self.model.mesh) > 1:
            raise GenerationError(
                f"Model.generate: image inputs ({', '.join(inputs)}) on a mesh with a 'data' axis of "
                f"{parallel.data_size(self.model.mesh)} devices: hfjax does not split them over it yet; use a mesh "
                "with data=1 (the weights may still be split over 'model')"
            )
        with self._bound(_one_adapter(self.model.params, lora)), bridge.products(precision):
            inputs = _multimodal.encode_images_eagerly(self.module, inputs, ids)
        return _multimodal.prefill_inputs(self.module, plan, inputs, ids.shape[1])

    @contextlib.contextmanager
    def _bound(self, params):
        # An op with no lowering is named, with the submodule that called it.
        with bridge.explain_errors(self.module, self._module_names):
            with bridge.bound(self.module, params, self.model.aliases, bridge.prng_key()) as environment:
                yield environment


def _one_adapter(params: dict, lora: np.ndarray | None) -> dict:
    """`params` for a call whose prompts all use the LoRA adapter slot in `lora` (int32 [B]): `Generator`'s
    own programs run one adapter per call; the slot core runs one per row."""
    if lora is None:
        return params
    slots = set(lora.tolist())
    if len(slots) > 1:
        raise GenerationError(
            "Model.generate: adapter= names different adapters per prompt, which this call's engine does not run "
            "(one adapter per call where the slot core does not take the model or its inputs); generate each "
            "adapter's prompts in a call of their own"
        )
    return _lora.with_active(params, slots.pop())
