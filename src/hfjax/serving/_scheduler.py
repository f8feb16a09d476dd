"""`Engine`: continuous batching's host side, and the engine thread that schedules its chunks.

The engine thread repeats: admit waiting requests into free slots; run one prefill chunk of the
oldest requests still reading their prompt (where the oldest has images: its whole prompt, alone);
run one decode chunk of every decoding slot; hand each
request its new tokens, text and log-probabilities; free the slots of requests that finished (EOS,
a stop string, max_tokens) or were cancelled. A running stream therefore waits at most one prefill
chunk between two decode chunks. While only decoding goes on, the next decode chunk is sent before
the last one's tokens come back, so the host's work on one chunk overlaps the device's on the next.

A request may be constrained (structured outputs, `SamplingParams.constraint`): its slot's row holds
a bitmask of the tokens its grammar allows next, which the token choice applies on the device. The
host's matcher (`generation.Grammars`) fills it at admission, for the token the prefill's last chunk
chooses, and after each token it takes in; so while a decoding row is constrained, a decode chunk
runs one step. While only decoding goes on, the matchers take in a chunk's tokens and fill the next
masks as soon as it is done, the next chunk goes, and the text and events of the first are made
while the device runs it. The answer ends ("stop") where its grammar is complete.

The device side is generation's slot core (`generation.SlotModel`, `SlotPrograms`): a chunk
attends over the fewest columns that hold its rows (windows of 128, 512, 2048, ... columns, the
last max_model_len) and runs the fewest rows that hold every decoding slot (1, 4, 16, ... rows, the
last the slots). That set of programs is fixed when the engine is built and compiled before it
starts (`_compiler.py`): no request waits for a compile.

Parts: this module (`Engine`: its public face, and the thread's schedule: what runs next and how
many steps a decode chunk takes), `_queue.py` (the waiting requests: submit, cancel, admission,
finishing), `_table.py` (the slots' row state), `_calls.py` (the programs' arguments, the prefill and
decode calls, the cache state), `_delivery.py` (chosen tokens into text, events and stops),
`_metrics.py` (counters), `_requests.py` (SamplingParams, Request, Event), `_sizing.py` (slots and
cache length from a memory budget), `_compiler.py` (the programs: their set, compiled before the
engine starts).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from .. import generation
from .._errors import GenerationError, ServingError
from ._calls import Chunk, CoreCalls, constrained
from ._compiler import PREFILLS, SHORT_WIDTH, SMALLEST_WINDOW, WIDTH_GROWTH, Compiler, engine_grid, geometric
from ._delivery import Delivery
from ._media import fixed_image_example
from ._metrics import Metrics
from ._queue import RequestQueue
from ._requests import Event, Request, SamplingParams, joined
from ._sizing import Sizing, size_engine
from ._table import SlotTable
from ._text import TextStream

MOVE_SHARE = 16  # a cached prefix moves between slots where that saves reading max_model_len / this tokens


class Engine:
    """Continuous batching of a causal LM over slots of one static KV cache (a recurrent model's: of
    its states, each prompt prefilled whole).

    Args:
        model: a `hfjax.Model` with a tokenizer: a decoder-only causal LM, or an encoder-decoder the slot
            core runs (`generation.check_supported`: Whisper, BART, T5, Marian, ...), whose requests carry their
            encoder's inputs.
        max_num_seqs: the most requests decoded together (sequence slots); default: as many as the
            cache's memory holds, at most 256 on an accelerator and 64 on the CPU (`_sizing.py`).
            (`max_batch` is taken as its old name.)
        max_model_len: cache columns per slot, prompt plus new tokens of one request at most.
            Default: the model's context.
        kv_cache_memory: bytes for the KV cache; default: a share of the device's free memory (80% on
            an accelerator; on the CPU a quarter of the free RAM, at most 4 GiB).
        gpu_memory_utilization: vLLM's sizing, where kv_cache_memory is not given: the KV cache takes
            this fraction, in (0, 1], of the device's memory less what is in use when the engine is
            built (the weights); the device's memory is what JAX may allocate on an accelerator, the
            machine's RAM on the CPU (less the RAM every process uses).
        max_queue: requests waiting for a slot beyond which `submit` raises QueueFullError.
        decode_steps: decode steps per program call (a chunk) of every slot; requests join and leave
            between chunks.
        max_decode_steps: the most steps of a chunk of fewer rows (whose steps cost less), while nothing
            waits, reads its prompt or has just left: decode_steps x (slots' rows / the chunk's rows), at
            most this many. Default 8 x decode_steps; decode_steps keeps every chunk at decode_steps.
        prefill_chunk: prompt tokens per prefill call; a long prompt takes several, between decode chunks
            (a turn reads up to prefill_rows x 4 x prefill_chunk prompt tokens before its decode chunk).
            (A model with recurrent layers reads each prompt whole, in a chunk as wide as the prefill
            program's window.)
        prefill_rows: prompts whose next chunk one prefill call reads together (the oldest first).
        prefix_reuse: start a prompt in the free slot whose cache holds the longest prefix of it (a
            system prompt, earlier turns of a chat), reading only the rest.
        progress: called with a line for each step of `start`'s compiles (the CLI prints them).
        speculation: `generation.Speculation`: decode in rounds that draft k tokens per row (prompt
            lookup, or `draft`, a model of the same vocabulary and mesh with its own cache in the same
            slots) and verify them in one forward (`generation.SpeculativeSlotModel`); the same
            tokens, fewer forwards. A constrained row decodes one token a chunk, so it drafts none.

    Example:
        >>> engine = Engine(hfjax.load(path)).start()
        >>> engine.generate([ids], SamplingParams(max_tokens=16, temperature=0))
    """

    def __init__(
        self,
        model,
        *,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float | None = None,
        max_queue: int = 256,
        decode_steps: int = 4,
        max_decode_steps: int | None = None,
        prefill_chunk: int = 32,
        prefill_rows: int = 4,
        prefix_reuse: bool = True,
        max_batch: int | None = None,
        progress: Callable[[str], None] | None = None,
        speculation: generation.Speculation | None = None,
        draft=None,
    ):
        if max_batch is not None and max_num_seqs is None:
            max_num_seqs = max_batch
        for name, value in (("max_queue", max_queue), ("decode_steps", decode_steps), ("prefill_chunk", prefill_chunk),
                            ("prefill_rows", prefill_rows)):  # fmt: skip
            _check_count(name, value)
        if max_decode_steps is None:
            max_decode_steps = 8 * decode_steps
        _check_count("max_decode_steps", max_decode_steps)
        if max_decode_steps < decode_steps:
            raise ServingError(
                f"Engine: max_decode_steps={max_decode_steps!r}; pass a whole number >= decode_steps={decode_steps}"
            )
        if model.tokenizer is None:
            raise ServingError(f"Engine: {model.source} has no tokenizer; serve a checkpoint with tokenizer files")
        if draft is not None:
            generation.check_draft(model, draft, name="Engine: the draft model")
        self.model = model
        self.tokenizer = model.tokenizer
        self.sizing: Sizing = size_engine(
            model, max_num_seqs=max_num_seqs, max_model_len=max_model_len, kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization, draft=draft,
        )  # fmt: skip
        self.max_num_seqs, self.max_model_len = self.sizing.slots, self.sizing.max_model_len
        self.decode_steps, self.max_decode_steps, self.prefill_chunk = decode_steps, max_decode_steps, prefill_chunk
        self.prefill_rows = min(prefill_rows, self.max_num_seqs)
        # Prompt tokens a turn of the engine reads before its next decode chunk: the widest prefill call's
        # (`prefill_width`); several calls of short prompts, one of long ones (`_read_prompts`).
        self.turn_tokens = self.prefill_rows * WIDTH_GROWTH * prefill_chunk
        # Every request's settings come over the checkpoint's generation_config.json: its processors
        # that read the tokens so far (n-gram bans, biases of several tokens, forced and suppressed
        # tokens) are the same for every request, so the programs compile them in, as they compile
        # Each row holds its own EOS tokens and stop_token_ids back where its min_tokens (or the
        # checkpoint's min_new_tokens) asks (vLLM holds both back).
        # (As for a prompt of several tokens: one of a single token may move begin_suppress_tokens
        # after a forced_bos_token_id, which `submit` refuses.)
        checkpoint = SamplingParams(max_tokens=1).settings(model, prompt_length=2)
        self.eos_token_ids = checkpoint.eos_token_ids
        # An encoder-decoder's slots also hold its cross-attention keys and values; its requests carry
        # their encoder's inputs (`submit`), read by the prefill, which no other request's prefix can stand for.
        self.encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
        if self.encoder_decoder:
            prefix_reuse = False
        slot_model = generation.slot_model(model, self.max_num_seqs, self.max_model_len)
        if speculation is not None and slot_model.recurrent:
            raise ServingError(
                f"Engine: speculative decoding ({speculation.method}) with {type(model.module).__name__}, whose "
                "recurrent state cannot take back rejected drafts; serve it without --speculative-config"
            )
        if speculation is not None:  # (an encoder-decoder's drafts by prompt lookup, verified over its cross keys)
            slot_model = generation.slot_model(
                model, self.max_num_seqs, self.max_model_len, speculation=speculation, draft=draft
            )
        # A recurrent model's slot holds the state after its whole prompt, not a prefix of it: each
        # prompt is prefilled whole, in one chunk as wide as the prefill program's window.
        self.recurrent = slot_model.recurrent
        vocab_size = slot_model.shapes()[1]  # the logits' width
        self.features = dataclasses.replace(
            generation.SamplingFeatures.every(),
            held_slots=len(checkpoint.eos_token_ids) + generation.MAX_HELD_STOP_TOKENS,
            history=checkpoint.history_rules(),
            mask_words=generation.bitmask_words(vocab_size),
        )
        if self.features.history is not None and self.features.history.reads_tokens:
            prefix_reuse = False  # a reused prefix's tokens are not read again into the row's history
        if self.recurrent:
            prefix_reuse = False  # a state holds no prefix of its prompt apart
        self.metrics = Metrics(self.max_num_seqs, 0 if speculation is None else speculation.num_speculative_tokens)
        programs = generation.SlotPrograms(
            slot_model, prefill_chunk=prefill_chunk, steps=max_decode_steps, features=self.features, choose_apart=True
        )
        grid = engine_grid(
            self.max_model_len, self.max_num_seqs, self.prefill_rows, attends=slot_model.attends,
            in_place=slot_model.reads_cache_in_place(),
            # (not a recurrent model's whole prompts, nor an encoder-decoder's, whose prefill runs its encoder)
            short=prefill_chunk > SHORT_WIDTH and not (self.recurrent or self.encoder_decoder),
        )  # fmt: skip
        image_example = fixed_image_example(model.processor) if self.takes_images else None
        if image_example is not None:
            shortest = len(image_example[0])
            grid["image"] = [(1, w) for w in geometric(SMALLEST_WINDOW, self.max_model_len) if w >= shortest]
        # Cached prefixes move between free slots (`SlotTable.assign`) where one saves reading at least
        # max_model_len / MOVE_SHARE prompt tokens: two rows trade places in about the time the prefill
        # reads half of that (0.10-0.12 s for rows of 8192 columns, 8 layers of 8 heads x 32, where the
        # 20m Llama's prefill reads some 2,400 tokens/s).
        move_tokens = self.max_model_len // MOVE_SHARE if prefix_reuse and self.max_num_seqs > 1 else 0
        if move_tokens:
            grid["swap"] = [(2, self.max_model_len)]
        # The token after a prefill: one program per row count, whatever the window (`choose_apart`).
        grid["choose"] = [(rows, 0) for rows in sorted({rows for kind in PREFILLS for rows, _ in grid.get(kind, [])})]
        self.compiler = Compiler(programs, grid, progress=progress)
        self.table = SlotTable(
            self.max_num_seqs, vocab_size=vocab_size, bias_slots=self.features.bias_slots,
            held_slots=self.features.held_slots, mask_words=self.features.mask_words, prefix_reuse=prefix_reuse,
            row_counts=sorted({rows for rows, _ in self.compiler.grid["decode"]}), move_tokens=move_tokens,
        )  # fmt: skip
        self._grammars: generation.Grammars | None = None  # made at the first constraint
        self._grammars_lock = threading.Lock()
        self._slot_model = slot_model
        self._queue = RequestQueue(self.table, self.metrics, max_queue)
        self._calls = CoreCalls(
            slot_model, self.compiler, self.table, self.metrics, features=self.features,
            max_model_len=self.max_model_len, prefill_chunk=prefill_chunk, encoder_decoder=self.encoder_decoder,
            image_example=image_example,
        )  # fmt: skip
        self._delivery = Delivery(self.table, self.metrics, self._queue)
        self._thread: threading.Thread | None = None

    # -- the caller's side ------------------------------------------------------------

    @property
    def max_batch(self) -> int:
        """The slots (`max_num_seqs`'s old name)."""
        return self.max_num_seqs

    @property
    def program_counts(self) -> dict[str, int]:
        """Programs prepared per kind in this process, traced or read from disk."""
        return self.compiler.programs.counts

    @property
    def takes_images(self) -> bool:
        """Whether the model reads images with its prompts (a vision-language model with a processor)
        and the slot core builds its prefill masks for the inputs its processor makes
        (`generation.takes_images`: bidirectional image blocks it knows, or none)."""
        module, processor = self.model.module, self.model.processor
        if not hasattr(module, "get_image_features") or processor is None:
            return False
        return generation.takes_images(module, getattr(processor, "model_input_names", ()))

    @property
    def running(self) -> int:
        return self.table.occupied

    @property
    def waiting(self) -> int:
        return len(self._queue.waiting)

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped the engine thread (every request after it is refused); None while
        it runs, or where it stopped cleanly."""
        return self._queue.error

    @property
    def max_queue(self) -> int:
        """Requests waiting for a slot beyond which `submit` raises QueueFullError."""
        return self._queue.max_queue

    def start(self) -> Engine:
        """Allocates the cache, compiles every program the engine will run (`warm_up`), and starts
        the engine thread (idempotent)."""
        if self._thread is None:
            with generation.reads_no_data(self.model):
                self.warm_up()
            self._thread = threading.Thread(target=self._run, name="hfjax-engine", daemon=True)
            self._thread.start()
        return self

    def warm_up(self) -> None:
        """Allocates the cache and compiles (or reads from the compilation cache) every program of the
        engine's set, a `progress` line each; `start` calls it, and does nothing more on a second call."""
        self._calls.warm_up()
        self.metrics.hold_programs(self.compiler.held, self.compiler.memory)

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stops the threads: after finishing every queued and running request (drain), or at once."""
        self._queue.stop(drain=drain)
        if self._thread is not None:
            self._thread.join(timeout)

    def check_prompt(self, prompt: list[int], params: SamplingParams) -> int:
        """The request's max_tokens (where unset: what the prompt leaves of max_model_len). Raises
        GenerationError when a prompt's token lies outside the vocabulary, and `generation.LimitError`
        when max_tokens, min_tokens and the prompt do not fit a slot, naming which."""
        if not prompt:
            raise GenerationError("the prompt is empty; pass at least one token")
        max_tokens = generation.check_limits(
            len(prompt), params.max_tokens, context=self.max_model_len, min_new_tokens=params.min_tokens,
            names=generation.LimitNames("max_tokens", "min_tokens", context=f"max_model_len={self.max_model_len}"),
        )  # fmt: skip
        outside = next((t for t in prompt if not 0 <= t < self.table.vocab_size), None)
        if outside is not None:
            raise GenerationError(
                f"the prompt holds token id {outside}, outside the vocabulary [0, {self.table.vocab_size}); "
                "pass ids the tokenizer gives"
            )
        return max_tokens

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        listener: Callable[[Event], None],
        *,
        images: dict | None = None,
        inputs: dict | None = None,
    ) -> Request:
        """Queues a prompt (token ids); `listener` gets an Event after each chunk, on the engine thread.
        `images`: the processor's other outputs for a prompt with images (pixel_values, ...: host arrays
        [1, ...]; `prompt` is its input_ids, image tokens included), for a model that reads them
        (`takes_images`); its prefill is one chunk of the whole prompt. An encoder-decoder's prompt is
        its decoder's (Whisper's prefix), with `inputs` its encoder's ({name: array} of one row, as
        `EncoderDecoderSlotModel.encoder_inputs` gives them); without `inputs`, the prompt is a token
        encoder's input and the decoder starts from its start token.

        Raises:
            GenerationError: the prompt, max_tokens and min_tokens do not fit max_model_len
                (`generation.LimitError`), a setting is out of range, or `params.adapter` names a slot that
                holds no LoRA adapter.
            QueueFullError: max_queue requests are waiting already.
            ServingError: the engine has stopped, or failed.
        """
        prompt_tokens = len(prompt)
        if self.encoder_decoder and inputs is None:
            inputs, prompt = self.encoder_inputs(prompt), [self._decoder_start(params)]
        params = dataclasses.replace(params, max_tokens=self.check_prompt(prompt, params))
        if images is not None and not self.takes_images:
            raise GenerationError(
                f"{type(self.model.module).__name__} reads no images; send text only, or serve a vision-language model"
            )
        settings = params.settings(self.model, prompt_length=len(prompt))
        if settings.history_rules() != self.features.history:
            raise GenerationError(
                f"this request's {len(prompt)}-token prompt changes the processors of {self.model.source}'s "
                "generation_config.json (begin_suppress_tokens after forced_bos_token_id); send a longer prompt"
            )
        text = TextStream(
            self.tokenizer, params.stop, min_tokens=params.min_tokens or 0,
            skip_special_tokens=params.skip_special_tokens,
        )  # fmt: skip
        matcher = None if params.constraint is None else self.grammars().matcher(params.constraint)
        request = Request(
            list(prompt), params, settings, listener, text, matcher, self._adapter(params.adapter), images=images
        )
        request.inputs, request.prompt_tokens = inputs, prompt_tokens
        self._queue.put(request, started=self._thread is not None)
        return request

    def _decoder_start(self, params: SamplingParams) -> int:
        """The decoder's first token, as `Model.generate` resolves it (`GenerationSettings.decoder_start_token_id`:
        the generation_config's decoder_start_token_id, else the config's, else its BOS token)."""
        start = params.settings(self.model, prompt_length=1).decoder_start_token_id
        if start is None:
            raise GenerationError(
                f"{self.model.source} sets neither decoder_start_token_id nor bos_token_id, so its decoder has no "
                "first token; set one in its generation_config.json"
            )
        return start

    def _adapter(self, index: int):
        """The model's LoRA adapter in slot `index` (None for -1, the base alone).

        Raises:
            GenerationError: no adapter is loaded in that slot.
        """
        if index == -1:
            return None
        adapter = next((a for a in self.model.adapters.values() if a.index == index), None)
        if adapter is None:
            loaded = {a.index: name for name, a in self.model.adapters.items()}
            raise GenerationError(
                f"adapter={index}: no LoRA adapter is loaded in that slot (loaded: {loaded or 'none'}); pass the "
                "index of one of Model.adapters, or -1 for the base alone"
            )
        return adapter

    def grammars(self) -> generation.Grammars:
        """The checkpoint's tokenizer's compiled constraints (made at the first call). A server compiles
        a request's constraint here (`compile`) off its event loop, before `submit` makes its matcher.

        Raises:
            ConstraintError: llguidance is not installed, or the checkpoint has no EOS token.
        """
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = generation.Grammars(
                    self.tokenizer, vocab_size=self.table.vocab_size, eos_token_ids=self.eos_token_ids
                )
            return self._grammars

    def cancel(self, request: Request) -> None:
        """Drops a request (its client left): at once from the queue, from a slot at the next chunk boundary."""
        self._queue.cancel(request)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], *, images: list | None = None
    ) -> list[Event]:
        """Runs prompts (token ids) together and waits: one Event per prompt with all of its tokens and text.
        `images`: per prompt, its images' processor outputs or None (`submit`'s)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        images = images or [None] * len(prompts)
        if len(params) != len(prompts):
            raise ServingError(
                f"Engine.generate: {len(prompts)} prompts and {len(params)} SamplingParams; pass one per prompt"
            )
        results: list[list[Event]] = [[] for _ in prompts]
        done = threading.Semaphore(0)

        def listener(kept: list[Event]):
            def call(event: Event):
                kept.append(event)
                if event.finish_reason is not None:
                    done.release()

            return call

        for prompt, p, kept, pictures in zip(prompts, params, results, images):
            self.submit(prompt, p, listener(kept), images=pictures)
        for _ in prompts:
            while not done.acquire(timeout=1.0):
                self._queue.check_failed()
        return [joined(events) for events in results]

    def encoder_inputs(self, ids: list[int]) -> dict[str, np.ndarray]:
        """A token encoder's inputs for a prompt of `ids`: input_ids and attention_mask [E] int32, padded on
        the right to the slots' encoder length E (max_model_len)."""
        if self._slot_model.features_input:
            raise GenerationError(
                f"{self.model.source} reads audio features, not a text prompt; send its audio to "
                "/v1/audio/transcriptions"
            )
        length = self._slot_model.encoder_length
        if len(ids) > length:
            raise GenerationError(
                f"the prompt has {len(ids)} tokens, more than the encoder's max_model_len={length}; shorten it"
            )
        padded, mask = np.full(length, self.tokenizer.pad_token_id or 0, np.int32), np.zeros(length, np.int32)
        padded[: len(ids)], mask[: len(ids)] = ids, 1
        return {"input_ids": padded, "attention_mask": mask}

    def image_width(self, length: int) -> int:
        """The columns of the one-chunk prefill of a prompt of `length` tokens with images: the smallest
        of the engine's windows (128, 512, 2048, ..., max_model_len) that holds it."""
        return self._calls.image_width(length)

    # -- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        queue = self._queue
        try:
            while True:
                with queue.held():
                    queue.release_cancelled()
                    queue.admit()
                    if not any(self.table.requests):
                        if queue.stopping:
                            return
                        queue.idle()
                        continue
                # Cached prefixes that admitting requests moved (`SlotTable.assign`: only this thread admits)
                moves, self.table.moves = self.table.moves, []
                self._calls.swap(moves)
                reading = self.table.reading()
                if reading and reading[0].images is not None:  # prompts with images: a chunk of its own each,
                    # as many as one prefill call takes rows before the next decode chunk, so the decode
                    # chunks run with the newcomers' rows beside the others
                    for request in [r for r in reading[: self.prefill_rows] if r.images is not None]:
                        self._delivery.first_tokens([request], *self._calls.prefill_images(request))
                elif reading:
                    self._read_prompts(reading)
                chunk = self._dispatch() if self.table.decoding() else None
                while chunk is not None:
                    # The next chunk goes to the device before this one's tokens come back, so the
                    # host's work on them (text, events, the server's sends) overlaps its compute.
                    # Not while a request waits, reads its prompt or left, nor around a slot that
                    # frees: a new request would wait for that chunk too.
                    ahead = None
                    if self._steady(chunk):
                        if constrained(chunk.requests):  # the next masks need this chunk's tokens
                            self._delivery.advance(chunk)
                        ahead = self._dispatch()
                    self._delivery.collect(chunk)
                    chunk = ahead
        except BaseException as error:  # noqa: BLE001 (handed to every waiting caller)
            queue.fail(error)
            raise

    def _read_prompts(self, reading: list[Request]) -> None:
        """The next chunk of each prompt without images being read, oldest first, in prefill calls of
        `prefill_rows` rows, until this turn has read `turn_tokens` (as many as the widest call reads):
        short prompts that came together all get their first tokens before the next decode chunk, while
        a long prompt still reads one chunk a turn, between the decoding rows' chunks, and no turn holds
        those back longer than one wide call does."""
        before, read = self.metrics.prompt_tokens_read, set()
        while requests := [r for r in reading if r.images is None and id(r) not in read][: self.prefill_rows]:
            read.update(id(r) for r in requests)
            self._delivery.first_tokens(requests, *self._calls.prefill(requests))
            if self.metrics.prompt_tokens_read - before >= self.turn_tokens:
                return
            reading = self.table.reading()

    def _steady(self, chunk: Chunk) -> bool:
        """Whether the next decode chunk can go before `chunk` is delivered (see `_run`); where a row
        is constrained, once its matcher has taken in this chunk's token (`Delivery.advance`)."""
        if not self._only_decoding() or self._queue.stopping or self._queue.since_freed < 2:
            return False  # (a slot freed by the chunk before: its client's next request is likely on its way)
        if any(r is not None and r.cancelled for r in self.table.requests):
            return False
        if any(r.scheduled >= r.settings.max_new_tokens for r in chunk.requests.values()):
            return False
        return bool(self.table.decoding())

    def _only_decoding(self) -> bool:
        """Nothing waits for a slot and no slot reads its prompt."""
        return not self._queue.waiting and not self.table.reading()

    def _dispatch(self) -> Chunk:
        """Sends the next decode chunk of every decoding slot to the device and returns at once. It
        runs `_chunk_steps` steps, or fewer: as many as the request that needs most still needs; one
        where a row is constrained (its next mask needs this step's token)."""
        requests = self.table.decoding()
        most = max((r.settings.max_new_tokens - r.scheduled for r in requests.values()), default=self.decode_steps)
        rows = self.table.decode_rows(max(requests))
        steps = 1 if constrained(requests) else min(self._chunk_steps(rows), most)
        chunk = self._calls.decode(requests, rows, steps)
        self._queue.since_freed += 1
        self._queue.unclaimed = 0
        return chunk

    def _chunk_steps(self, rows: int) -> int:
        """decode_steps; or, for a chunk of fewer rows than the slots while nothing waits or reads its
        prompt and no request left in the chunk before without another coming in since (its client's
        next request is likely on its way, and would wait for this chunk), decode_steps times as many
        as the slots' rows are to the chunk's, max_decode_steps at most: a lone request makes fewer
        round trips (each chunk's tokens wake the server's event loop and the client), and a
        newcomer waits no longer than a chunk of every slot takes."""
        if self._queue.unclaimed or not self._only_decoding():
            return self.decode_steps
        return min(self.max_decode_steps, self.decode_steps * max(1, self.max_num_seqs // rows))


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ServingError(f"Engine: {name}={value!r}; pass a whole number >= 1")
