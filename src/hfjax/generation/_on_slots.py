"""`Model.generate` on the continuous-batching core (`_slots.py`): every row admitted at once, as
one prefill chunk, then decoded to its end, so that one-shot generation and `hfjax serve` run the
same programs.

    SlotRuns.takes(plan, settings, inputs)   whether a call can run on the slot core
    SlotRuns.generate(...)                   the call's new tokens, as `Generator.generate` gives them

A call runs here when the slot core carries out everything it asks: a decoder-only model with a
static KV cache that takes `position_ids`, or builds ALiBi by key (Bloom, MPT), or looks positions
up in a table that counts from its cache's length (Blenderbot's and Marian's causal LMs, each row's
positions shifted by its left pads, which transformers counts) (full or sliding-window attention; a
model `Generator` recomputes without a cache whose forward takes transformers' static cache all the
same: GPT-Neo, CTRL), or a recurrent state, or both, in separate layers or in one (Mamba, hybrids,
Zamba, Falcon-H1: `SlotState.recurrent`, each prompt prefilled whole, never speculated; beams take
their parents' states), or no cache a slot can hold (GPT-1, RecurrentGemma: each step runs a row's
tokens whole; RecurrentGemma's layers read a prompt's left pads, which its programs lay before each
row, so its batches padded elsewhere or with several pad tokens are `Generator`'s), prompts padded
anywhere (laid out as left padding: `_core_layout`, the images' per-token inputs with them), images
where it builds the model's masks (`takes_images`; the prefill chunk of every row's whole prompt takes
them; beams and drafts decode at the multimodal rope's positions; a draft model does not read them),
weights on one device or
on a mesh (of one process or several), and a model that reads no values of its data; or an
encoder-decoder whose decoder takes each row's positions (`_encoder_slots`: Whisper, BART, T5,
Marian, Blenderbot), speculating by prompt lookup only: its prefill reads the encoder's input and
the decoder prompt, and the slots keep the cross-attention keys and values (and a token encoder's
ids, the n-grams encoder_no_repeat_ngram_size bans). `Generator` runs the rest. Beam search runs its own
programs over the same cache (`_slot_beams`; an encoder-decoder's beams over their slots' cross
keys), from the slot prefill's logits. A row that has stopped runs
on pad tokens until every row has, as transformers feeds it, so the processed scores and raw
logits that `output_scores` / `output_logits` keep are transformers' for every row and step.
A constrained call (structured outputs) decodes one step per program call: between two, each row's
matcher (`_grammar`) takes its token and fills the row's mask of the tokens allowed next; a row
whose grammar is complete may then only choose EOS.
The processors that read the tokens so far (n-gram bans, sequence biases, forced and suppressed
tokens) run here as `HistoryRules`, over each row's tokens as transformers' input_ids hold them
(the caller's pads first).

Rows are the plan's rows, in its order, with the same PRNG keys (the seed with the row's index
folded in) and positions (a prompt's first real token at 0), so a call gives the tokens
`Generator` gives. The decode runs over the cache in the windows `_planning.windows` names, one
program call per window (each stops as soon as every row has produced an EOS token); a streamer
gets its tokens every `_planning.STREAM_CHUNK` steps.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import bridge, parallel
from .._errors import DataDependentError, GenerationError
from . import _encoder_slots, _grammar, _multimodal, _planning, _rows, _stops
from ._encoder_slots import EncoderDecoderSlotModel, SpeculativeEncoderDecoderSlotModel
from ._recurrent import hybrid_model, recurrent_model
from ._settings import GenerationSettings
from ._slot_beams import BeamCarry, SlotBeams
from ._slot_programs import SlotPrograms
from ._slots import SlotModel, check_supported, position_source, reads_pads, recomputed
from ._speculative_slots import SpeculativeSlotModel


def _left_padded(mask: np.ndarray) -> bool:
    """Whether each row of `mask` [B, S] is zeros, then ones (the slot prefill's layout)."""
    count = mask.sum(axis=1, keepdims=True)
    return bool(np.array_equal(mask, np.arange(mask.shape[1])[None, :] >= mask.shape[1] - count))


def _core_layout(plan: _planning.BatchPlan) -> tuple[_planning.BatchPlan, np.ndarray | None]:
    """(`plan` with each row's real tokens moved, in their order, to the right end of its prompt
    columns (the slot prefill's layout; positions then count from a row's first real token), where
    the caller padded them anywhere else; the columns each row takes them from, [rows, size] int,
    or None where the plan is already so)."""
    if _left_padded(plan.mask):
        return plan, None
    order = np.argsort(plan.mask, axis=1, kind="stable")  # each row's pad columns, then its real ones
    moved = dataclasses.replace(
        plan, ids=np.take_along_axis(plan.ids, order, axis=1), mask=np.take_along_axis(plan.mask, order, axis=1)
    )
    return moved, order


def _pad_token(plan: _planning.BatchPlan) -> int | None:
    """The one token that pads `plan`'s left-padded prompts (0 where none is padded), or None where they
    are padded elsewhere or with several tokens."""
    if not _left_padded(plan.mask):
        return None
    tokens = np.unique(plan.ids[plan.mask == 0])
    return int(tokens[0]) if len(tokens) == 1 else 0 if len(tokens) == 0 else None


def _pads_laid(plan: _planning.BatchPlan) -> tuple[int, int]:
    """(the most pads a row of `plan` has, its pad token): what a model whose layers read them lays
    before each row (`SlotModel.lay_pads`; (0, 0) where no row is padded)."""
    if plan.mask.all():
        return 0, 0
    return plan.size, _pad_token(plan)


def _moved(arrays: dict, order: np.ndarray) -> dict:
    """`arrays` (images' prefill inputs) with those laid out along the prompt columns (token types
    [rows, size], multimodal rope positions [3, rows, size]: integers) taken from the columns `order`
    [rows, size] names."""
    moved = {}
    for name, value in arrays.items():
        value = np.asarray(value)
        if np.issubdtype(value.dtype, np.integer) and value.shape[-2:] == order.shape and value.ndim in (2, 3):
            value = np.take_along_axis(value, np.broadcast_to(order, value.shape), axis=-1)
        moved[name] = value
    return moved


class SlotRuns:
    """`Model.generate` calls on the slot core, for one `Generator` (whose program cache they share)."""

    def __init__(self, generator):
        self.generator = generator
        self.model = generator.model
        adapter = generator.adapter
        self.encoder_decoder = adapter.encoder_decoder
        try:
            if self.encoder_decoder:  # a decoder that takes each row's positions (`_encoder_slots`)
                _encoder_slots.check_encoder_decoder(self.model)
                self.possible, self.attends, self.recurrent = True, True, False
            else:
                check_supported(self.model)  # a static KV cache of full or sliding-window attention layers, or states
                pure = recurrent_model(self.model.module)  # (Mamba: positions do not reach its state)
                # (Bloom and MPT: positions from the key columns; Blenderbot's and Marian's causal LMs: a table)
                # (RoFormer, TrOCR, RWKV: no positions given, each run numbered from its first column)
                self.possible = position_source(self.model.module) is not None or pure or recomputed(self.model)
                self.attends = not pure  # some layers keep keys and values, cut into windows
                self.recurrent = pure or hybrid_model(self.model.module)  # a state per slot
        except GenerationError:
            self.possible = self.recurrent = False
            self.attends = True
        # RecurrentGemma's layers read a prompt's left pads: its slot models lay them before it (`SlotModel.pad_room`)
        self.reads_pads = self.possible and reads_pads(self.model)
        # Whether calls with prefill inputs (True: images) or without them (False) were found to read values
        # of the model's data (`DataDependentError`): those calls run on `Generator`, which guards them.
        self.reads_data: set[bool] = set()
        self._models: dict[tuple, SlotModel] = {}
        self._programs: dict[tuple, SlotPrograms] = {}
        self._beams: dict[tuple, SlotBeams] = {}
        self._grammars: dict[tuple, _grammar.Grammars] = {}  # per (logits' width, EOS tokens)

    def takes(self, plan: _planning.BatchPlan, settings: GenerationSettings, inputs) -> bool:
        """Whether this call runs on the slot core (the module docstring says which do)."""
        if not self.possible or bool(inputs) in self.reads_data:
            return False
        # (pads its slots do not lay before a prompt: of several tokens. Right pads go before the prompt,
        # as for every model: `_core_layout`)
        if self.reads_pads and _pad_token(_core_layout(plan)[0]) is None:
            return False
        if inputs and (self.encoder_decoder or self.recurrent or not takes_images(self.model.module, inputs, settings)):
            return False
        if self.recurrent and settings.speculation is not None:  # a state cannot take back rejected drafts
            return False
        if self.encoder_decoder:  # (drafts by prompt lookup; a draft model would need cross slots of its own)
            return settings.speculation is None or settings.speculation.method == "ngram"
        return True  # (prompts padded anywhere: laid out as the prefill takes them, `_core_layout`)

    def generate(
        self,
        ids: np.ndarray,
        plan: _planning.BatchPlan,
        settings: GenerationSettings,
        compiled: GenerationSettings,
        *,
        seed: int,
        streamer,
        constraint: _grammar.Constraint | None = None,
        lora: np.ndarray | None = None,
        draft=None,
        inputs: _multimodal.PrefillInputs | None = None,
    ) -> tuple[np.ndarray, float, dict[str, jax.Array]] | None:
        """(new tokens int32 [prompts * num_return_sequences, T], padded with pad_token_id after a
        row's EOS (beam search: each prompt's best finished sequences, best first, `fill_token_id`
        after each one's end); the seconds to the first token (beam search: to the prefill's
        logits); {"scores", "logits": [rows, T, V] float32} that output_scores and output_logits ask
        for; speculation's (drafted tokens, accepted tokens, target forwards), zeros without it), or
        None where the model turned out to read values of its data (then `Generator` runs the call). `constraint`: what every row's answer must be (see the module's docstring). `lora`: int32
        [prompts], each prompt's LoRA adapter slot (None: the model holds none). `draft`: the draft model
        (an hfjax Model) where `settings.speculation` drafts with one. `inputs`: the prompts' images,
        laid out for `plan` (its rows and prompt bucket), which the prefill takes."""
        start = time.perf_counter()
        rows, max_new_tokens = plan.rows, settings.max_new_tokens
        precision = bridge.resolve_precision(self.model.matmul_precision)
        # An encoder-decoder's prefill is its decoder prompt, after the encoder reads the plan's ids (the
        # prefill's `inputs`, as images are a decoder's).
        order = None
        if not self.encoder_decoder:
            plan, order = _core_layout(plan)
        arrays, prompt_ids, width = None, plan.ids, plan.size
        if self.encoder_decoder:
            arrays, prompt_ids, width = self._encoder_inputs(plan), plan.decoder_prompt, plan.offset
        lengths = np.full(rows, width, np.int32) if self.encoder_decoder else plan.mask.sum(axis=1).astype(np.int32)
        features = compiled.features
        if settings.min_new_tokens and settings.eos_token_ids:  # EOS held back for the first min_new_tokens
            features = dataclasses.replace(features, held_back=settings.eos_token_ids)
        features = dataclasses.replace(features, history=compiled.history_rules())
        matchers = None
        if constraint is not None:
            try:
                grammars = self._grammars_for(plan, settings)
            except DataDependentError:
                self.reads_data.update((False, True))
                return None
            features = dataclasses.replace(features, mask_words=grammars.words)
            caller = plan.prompts * plan.per_prompt  # the rows past them pad the plan to its devices
            matchers = [grammars.matcher(constraint) for _ in range(caller)]
        kept = tuple(name for name in ("scores", "logits") if getattr(settings, f"output_{name}"))
        beam = settings.beam
        if beam is not None:  # the search starts from the prefill's raw logits
            kept = ("logits",)
        programs = self._programs_for(plan, features, settings, kept, precision, draft)
        # The rules that read the tokens so far see transformers' input_ids: the caller's pads, then the row.
        pads = 0 if self.encoder_decoder else plan.size - plan.first_column - lengths
        sampling = settings.row_sampling(
            rows, _rows.key_data(seed), lengths=lengths, pads=pads, mask_words=features.mask_words
        )
        sampling.key = _ROW_KEYS(sampling.key)  # each row's index folded in
        if lora is not None:  # each prompt's rows (num_return_sequences of them) run on its adapter
            sampling.lora[: plan.prompts * plan.per_prompt] = np.repeat(lora, plan.per_prompt)
        if inputs is not None:  # images: one prefill chunk of every row's whole prompt takes them
            if inputs.position_shift is not None:
                sampling.rope_delta[:] = inputs.position_shift
            arrays = {**inputs.model_inputs, **{name: np.asarray(values) for name, values in inputs.static}}
            if order is not None:  # (the images' per-token inputs follow their tokens)
                arrays = {**arrays, **_moved(inputs.model_inputs, order)}
        allowed = sampling.allowed  # [rows, W] int32 on the host, where the call is constrained
        if matchers is not None:
            sampling.constrained[: len(matchers)] = True
            for row, matcher in enumerate(matchers):
                matcher.fill(allowed[row])
        every = np.ones(rows, bool)
        # Beam search takes no token from the prefill: its rows' next tokens come from the search.
        last = every if beam is None else np.zeros(rows, bool)
        sampling, which, prompts, starts, counts, every, last, no, arrays = self._to_device(
            (
                sampling,
                np.arange(rows, dtype=np.int32),
                prompt_ids,
                np.zeros(rows, np.int32),
                lengths,
                every,
                last,
                np.False_,
                arrays,
            )
        )
        try:  # the state's shapes come from an abstract run of the model, which may read its data too
            state = programs.slot_model.empty_state(features)
            # The prefill's window: the prompts' columns, the only ones it reads and writes.
            state, chosen = programs.prefill(
                state, sampling, which, prompts, starts, counts, last, every, no, window=width, inputs=arrays
            )
        except DataDependentError:  # a text prompt's trace reads it with images too; images' own reads stay theirs
            self.reads_data.update((True,) if inputs is not None else (False, True))
            return None
        if beam is not None:
            return self._search(state, sampling, chosen.logits[:, 0], lengths, plan, settings, features, start)
        first = parallel.to_host(chosen.token)[:, 0]
        ttft = time.perf_counter() - start
        if streamer is not None:
            streamer.put(torch.as_tensor(ids.astype(np.int64)))
            streamer.put(torch.as_tensor(first[: plan.prompts * plan.per_prompt].astype(np.int64)))
        stops, pad = settings.eos_token_ids, settings.pad_token_id
        if matchers is not None:
            sampling = self._constrained(sampling, matchers, allowed, first[:, None], np.zeros(rows, bool))
        done = _stops.stopped(first, stops)
        produced = [first[:, None]]  # each call's tokens, pad_token_id after a row's stop
        drafts = np.zeros(3, np.int64)  # speculation's drafted and accepted tokens, and the target's forwards
        kept_values = {name: [getattr(chosen, name)] for name in kept}  # each call's [rows, steps, V]
        steps, position = 1, int(lengths.max())
        # A streamer re-enters the decode every few tokens: windows cut at each entry would copy more
        # than they save, so it attends over the whole cache (as `Generator`).
        # (Mamba's states have no columns to cut: one window)
        windows = _planning.windows(plan.offset, plan.total) if streamer is None and self.attends else (plan.total,)
        for window in windows:
            while steps < max_new_tokens and not done.all() and position < window:
                count = min(max_new_tokens - steps, window - position)
                if matchers is not None:  # the next mask needs this step's token
                    count = 1
                if streamer is not None:
                    count = min(count, _planning.STREAM_CHUNK)
                try:
                    state, chosen = programs.decode(
                        state, sampling, every, np.int32(count), no,
                        decoding_rows=rows, window=window, logprobs=False,
                    )  # fmt: skip
                except DataDependentError:
                    self.reads_data.update((False, True))
                    return None
                ran = int(parallel.to_host(chosen.ran))
                if chosen.made is not None:  # a speculative chunk: each row made `ran` tokens or stopped
                    going = ~done[: plan.prompts * plan.per_prompt]
                    drafts += [
                        int(parallel.to_host(chosen.drafted)[: len(going)][going].sum()),
                        int(parallel.to_host(chosen.accepted)[: len(going)][going].sum()),
                        int(parallel.to_host(chosen.rounds)),
                    ]
                for name, values in kept_values.items():
                    values.append(getattr(chosen, name)[:, :ran])
                tokens = np.where(done[:, None], pad, _padded(parallel.to_host(chosen.token)[:, :ran], stops, pad))
                if matchers is not None:
                    sampling = self._constrained(sampling, matchers, allowed, tokens, done)
                produced.append(tokens)
                done |= _stops.stopped(tokens, stops).any(axis=1)
                steps, position = steps + ran, position + ran
                if streamer is not None:
                    for token in tokens[: plan.prompts * plan.per_prompt].T:
                        streamer.put(torch.as_tensor(token.astype(np.int64)))
        if streamer is not None:
            streamer.end()
        kept_values = {name: parallel.to_host(jnp.concatenate(values, axis=1)) for name, values in kept_values.items()}
        caller = plan.prompts * plan.per_prompt  # the rows past the plan's padding to the "data" devices
        new = np.concatenate(produced, axis=1)[:caller].astype(np.int32)
        return new, ttft, kept_values, tuple(int(n) for n in drafts)

    def _search(self, state, sampling, logits, lengths, plan, settings: GenerationSettings, features, start: float):
        """Beam search from the prefill's `logits` [rows, V] (`_slot_beams`) of prompts of `lengths` [rows]
        tokens; returns as `generate`."""
        beam, max_new_tokens = settings.beam, settings.max_new_tokens
        width = plan.total - plan.offset  # the new tokens' columns: at least max_new_tokens
        carry = _FIRST_CARRY(logits, max_new_tokens, width=width, settings=beam)
        jax.block_until_ready(carry)
        ttft = time.perf_counter() - start
        key = (plan.rows, plan.total, features, beam, settings.eos_token_ids)
        if key not in self._beams:
            self._beams[key] = SlotBeams(
                self._models[self._model_key(plan)], features=features, settings=beam, eos=settings.eos_token_ids,
                cache=self.generator.programs,
            )  # fmt: skip
        beams = self._beams[key]
        prompt_lengths = self._to_device(lengths)
        steps, position = 0, int(lengths.max())  # the tokens chosen, the column the next one takes
        for window in _planning.windows(plan.offset, plan.total):
            while steps < max_new_tokens and position < window and bool(parallel.to_host(carry.going)):
                count = np.int32(min(max_new_tokens - steps, window - position))
                try:
                    state, carry = beams.search(state, sampling, carry, prompt_lengths, count, window=window)
                except DataDependentError:
                    self.reads_data.update((False, True))
                    return None
                ran = int(parallel.to_host(carry.step)) - steps
                steps, position = steps + ran, position + ran
        # Each prompt's best finished sequences, best first, as long as the longest returned one.
        returned = settings.num_return_sequences
        finished = parallel.to_host(carry.beams.finished).reshape(plan.padded_prompts, beam.num_beams, width)
        length = int(parallel.to_host(carry.beams.finished_length)[: plan.prompts, :returned].max())
        new = finished[: plan.prompts, :returned, :length]
        return new.reshape(plan.prompts * returned, -1).astype(np.int32), ttft, {}, (0, 0, 0)

    def _grammars_for(self, plan: _planning.BatchPlan, settings: GenerationSettings) -> _grammar.Grammars:
        """The compiled constraints for masks as wide as the model's logits, ending at the call's EOS tokens."""
        width = self._slot_model(plan).shapes()[1]
        key = (width, settings.eos_token_ids)
        if key not in self._grammars:
            self._grammars[key] = _grammar.Grammars(
                self.model.tokenizer, vocab_size=width, eos_token_ids=settings.eos_token_ids
            )
        return self._grammars[key]

    def _constrained(self, sampling, matchers, allowed: np.ndarray, tokens: np.ndarray, done: np.ndarray):
        """`sampling` (on the device) with the masks of the rows' next tokens, once each row's matcher
        has taken in its `tokens` [rows, T] (rows `done` before them take nothing)."""
        for row, matcher in enumerate(matchers):
            if done[row]:
                continue
            for token in tokens[row]:
                if not matcher.consume(token):
                    raise GenerationError(
                        f"Model.generate: row {row} chose token {int(token)}, which its grammar does not allow "
                        f"({matcher.error}); report it with this message"
                    )
            matcher.fill(allowed[row])  # (a complete grammar allows EOS alone)
        # (a copy: on the CPU the device array may share the host's memory, which the next step rewrites)
        return dataclasses.replace(sampling, allowed=self._to_device(allowed.copy()))

    def _to_device(self, tree):
        """Host arrays for the programs, in one call (a few milliseconds less per call than one each); on
        a mesh over several processes, each as one array over the mesh (`parallel.place_rows`)."""
        mesh = self.model.mesh
        if mesh is not None and jax.process_count() > 1:
            return jax.tree_util.tree_map(lambda array: parallel.place_rows(mesh, array), tree)
        return jax.device_put(tree)

    def _encoder_inputs(self, plan: _planning.BatchPlan) -> dict[str, np.ndarray]:
        """The encoder's inputs of an encoder-decoder's prefill: its main input [rows, ...] (features as
        float32), and for token ids their mask [rows, size]."""
        main = self.model.module.main_input_name
        if main != "input_ids":
            return {main: plan.ids.astype(np.float32)}
        inputs = {main: plan.ids, "attention_mask": plan.mask}
        if plan.ngram_source is not None:  # (encoder_no_repeat_ngram_size's n-grams)
            inputs[_encoder_slots.NGRAM_SOURCE] = plan.ngram_source
        return inputs

    def _model_key(self, plan: _planning.BatchPlan) -> tuple:
        # (an encoder-decoder's slots hold encoder outputs as long as the plan's padded prompts; a model
        # that reads its pads lays up to the plan's prompt width of them, of the caller's pad token)
        if self.reads_pads:
            return (plan.rows, plan.total, *_pads_laid(plan))
        return (plan.rows, plan.total, plan.size) if self.encoder_decoder else (plan.rows, plan.total)

    def _with_pads(self, slot_model: SlotModel, plan: _planning.BatchPlan) -> SlotModel:
        if self.reads_pads:
            slot_model.lay_pads(*_pads_laid(plan))
        return slot_model

    def _slot_model(self, plan: _planning.BatchPlan) -> SlotModel:
        key = self._model_key(plan)
        if key not in self._models:
            if self.encoder_decoder:  # (token inputs: as long as the plan's padded prompts)
                self._models[key] = EncoderDecoderSlotModel(self.model, plan.rows, plan.total, plan.size)
            else:
                self._models[key] = self._with_pads(SlotModel(self.model, plan.rows, plan.total), plan)
        return self._models[key]

    def _programs_for(
        self,
        plan: _planning.BatchPlan,
        features,
        settings: GenerationSettings,
        kept: tuple[str, ...],
        precision,
        draft=None,
    ) -> SlotPrograms:
        model_key = self._model_key(plan)
        self._slot_model(plan)
        if settings.speculation is not None:  # the slot model that drafts (with `draft`, where given)
            model_key = (*model_key, settings.speculation, None if draft is None else id(draft))
            if model_key not in self._models and self.encoder_decoder:
                self._models[model_key] = SpeculativeEncoderDecoderSlotModel(
                    self.model, plan.rows, plan.total, plan.size, settings.speculation
                )
            elif model_key not in self._models:
                self._models[model_key] = self._with_pads(
                    SpeculativeSlotModel(self.model, plan.rows, plan.total, settings.speculation, draft=draft), plan
                )
        stops, pad = settings.eos_token_ids, settings.pad_token_id
        width = plan.offset if self.encoder_decoder else plan.size  # the prefill's tokens: the decoder's prompt
        key = (*model_key, width, plan.size, features, stops, pad, kept, precision)
        if key not in self._programs:
            self._programs[key] = SlotPrograms(
                self._models[model_key], prefill_chunk=width, steps=plan.total - plan.offset,
                features=features, stop_tokens=stops, pad_token=pad, kept=kept, cache=self.generator.programs,
            )  # fmt: skip
        return self._programs[key]


def takes_images(module, inputs, settings: GenerationSettings | None = None) -> bool:
    """Whether the slot core can prefill `module` with `inputs` (names of its prefill-only inputs):
    its masks' bidirectional blocks are known (`_multimodal.BIDIRECTIONAL_BLOCKS`) where it reads
    token_type_ids, and `settings` (Model.generate's) drafts with no draft model (which would read
    the images' placeholder tokens without the images)."""
    if _multimodal.BLOCK_SOURCES & set(inputs) and module.config.model_type not in _multimodal.BIDIRECTIONAL_BLOCKS:
        return False
    # A config that asks for bidirectional attention (Gemma 4's and its kin's "vision") where the table
    # has no rule for it: transformers' masks differ from the slots' causal ones.
    bidirectional = getattr(module.config.get_text_config(), "use_bidirectional_attention", None)
    if bidirectional and _multimodal.blocks_of(module) is None:
        return False
    return settings is None or settings.speculation is None or settings.speculation.method != "draft_model"


# [R, 2] uint32 key data with each row's index folded in, as one program (eagerly: 4 ms a call).
_ROW_KEYS = jax.jit(_rows.row_keys)
# Beam search's carry after the prefill, as one program, placed as the prefill's logits are.
_FIRST_CARRY = jax.jit(BeamCarry.first, static_argnames=("width", "settings"))


def _padded(tokens: np.ndarray, stops: tuple[int, ...], pad: int) -> np.ndarray:
    """`tokens` [R, T] with every token after a row's first stop token set to `pad`."""
    stopping = _stops.stopped(tokens, stops)
    after = (np.cumsum(stopping, axis=1) - stopping) > 0  # a stop token itself stays
    return np.where(after, pad, tokens).astype(np.int32)
