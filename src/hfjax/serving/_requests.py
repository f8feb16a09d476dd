"""A request as the engine takes it: its settings (mapped onto `Model.generate`'s), and what its
listener receives."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from .. import generation
from .._errors import GenerationError, ServingError


class QueueFullError(ServingError):
    """The engine's queue holds max_queue requests already; try again later."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """One request's settings, named as vLLM's SamplingParams and OpenAI's request fields name them.

    A sampling field left None (temperature, top_p, top_k, min_p, repetition_penalty) takes the value
    the checkpoint's generation_config.json sets, else OpenAI's default (`default_sampling`), as
    vLLM does: a request without temperature samples at temperature 1 unless the file sets one (its
    do_sample is not read). `settings(model)` maps the request onto `Model.generate`'s settings, the
    one type the engine runs.

    Args:
        max_tokens: the most tokens to generate (>= 1); None: what the prompt leaves of the engine's
            max_model_len. The engine checks it, and min_tokens, against the prompt (`generation.check_limits`).
        temperature: 0 takes the most likely token (greedy); else sample at this temperature.
        top_p, top_k, min_p: the sampling filters (1.0, 0 and 0.0 are off).
        repetition_penalty: transformers' (prompt and answer tokens); 1.0 is off.
        presence_penalty, frequency_penalty: OpenAI's (answer tokens), in [-2, 2]; 0.0 is off.
        logit_bias: {token id: bias added to its logit} (OpenAI's), at most 64 tokens.
        seed: the sampler's seed (None: a random one); the same seed gives the same tokens.
        stop: strings that end the answer where they first appear (not included in it), as in vLLM
            only where they end after the first min_tokens tokens.
        stop_token_ids: tokens that end the answer when generated, included in it (vLLM's field;
            its text too, unless it is a special token); held back, as EOS is, for the first
            min_tokens tokens (at most 16 of them then).
        min_tokens: the fewest new tokens before an end-of-sequence token may end the answer (vLLM's
            name; transformers' min_new_tokens, whose processor holds EOS back). None: the
            checkpoint's (min_new_tokens, min_length), else 0.
        logprobs: None, or how many most likely alternatives (0..generation.TOP_LOGPROBS) to report beside each token.
        ignore_eos: keep going past the end-of-sequence token.
        skip_special_tokens: leave special tokens' text out of the answer (vLLM's field); False keeps
            it, as a tool call parser needs where its markers are special tokens.
        constraint: what the answer must be (`generation.Constraint`: a JSON schema, any JSON object,
            a regex, a choice, a Lark grammar; vLLM's structured_outputs). The answer ends ("stop") where
            the grammar is complete, or at max_tokens ("length") before.
        adapter: the LoRA adapter this request runs with, by its slot in the model
            (`hfjax.lora.Adapter.index`, one of `Model.adapters`); -1, the default: the base alone.
            A server sets it from the model name the request asks for.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    skip_special_tokens: bool = True
    constraint: generation.Constraint | None = None
    adapter: int = -1

    def __post_init__(self):
        if isinstance(self.adapter, bool) or not isinstance(self.adapter, int) or self.adapter < -1:
            raise GenerationError(
                f"adapter={self.adapter!r}: pass an adapter's slot (Adapter.index), or -1 for the base"
            )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        problem = stop_token_ids_problem(list(self.stop_token_ids), self.min_tokens)
        if problem:
            raise GenerationError(problem)
        if self.logprobs is not None and not 0 <= self.logprobs <= generation.TOP_LOGPROBS:
            raise GenerationError(
                f"logprobs={self.logprobs!r}: pass a number of alternatives in [0, {generation.TOP_LOGPROBS}]"
            )
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        problem = logit_bias_problem(len(self.logit_bias))
        if problem:
            raise GenerationError(problem)

    def vocabulary_problem(self, vocab_size: int | None) -> tuple[str, str] | None:
        """(the field, one line naming the token and the fix) where logit_bias or stop_token_ids names
        a token outside the vocabulary [0, vocab_size) (None: only negative ids are outside); else None."""
        for field, tokens in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
            outside = [t for t in tokens if t < 0 or (vocab_size is not None and t >= vocab_size)]
            if outside:
                return field, (
                    f"{field} names token {outside[0]}, outside the vocabulary [0, {vocab_size}); pass ids the tokenizer gives"
                )
        return None

    def settings(self, model, prompt_length: int) -> generation.GenerationSettings:
        """This request as `Model.generate`'s settings, over the checkpoint's generation_config.json
        (whose min_length counts the prompt's `prompt_length` tokens, as transformers counts it), with
        max_tokens as checked (`Engine.check_prompt` fills it in where it is None).

        Raises:
          GenerationError: a value out of range, naming it.
        """
        arguments = {"max_new_tokens": self.max_tokens, "num_beams": 1}  # beam search is generate's alone
        values = default_sampling(model)
        values.update({name: getattr(self, name) for name in values if getattr(self, name) is not None})
        temperature = values.pop("temperature")
        arguments["do_sample"] = temperature > 0  # temperature 0: the most likely token (greedy)
        if temperature > 0:
            arguments["temperature"] = temperature
        arguments.update(values)
        if self.min_tokens is not None:
            arguments.update(min_new_tokens=self.min_tokens, min_length=0)
        problem = self.vocabulary_problem(getattr(model.config.get_text_config(decoder=True), "vocab_size", None))
        if problem:
            raise GenerationError(problem[1])
        if self.logit_bias:
            arguments["sequence_bias"] = {(int(token),): float(bias) for token, bias in self.logit_bias}
        settings = generation.resolve_settings(model, prompt_length, **arguments)
        if len(self.stop_token_ids) > generation.MAX_HELD_STOP_TOKENS and settings.min_new_tokens:
            raise GenerationError(  # the checkpoint's min_new_tokens (a request's min_tokens is checked on arrival)
                f"stop_token_ids holds {len(self.stop_token_ids)} tokens and the checkpoint's generation_config.json "
                f"sets min_new_tokens={settings.min_new_tokens}; a row holds back at most "
                f"{generation.MAX_HELD_STOP_TOKENS} of them until then; pass fewer, or min_tokens=0"
            )
        sampling = dataclasses.replace(
            settings.sampling, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty
        )
        return dataclasses.replace(
            settings, sampling=sampling, eos_token_ids=() if self.ignore_eos else settings.eos_token_ids
        )


# OpenAI's defaults of the sampling fields, and the values that turn vLLM's extra ones off.
_OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def default_sampling(model) -> dict[str, float]:
    """The sampling values of a request that sets none, by name: the ones the checkpoint's
    generation_config.json sets (temperature, top_p, top_k, min_p, repetition_penalty), else OpenAI's
    defaults. vLLM's order; the file's do_sample is not read, so its temperature is what decides."""
    given = model.generation_config.to_diff_dict()
    return {name: value if given.get(name) is None else given[name] for name, value in _OPENAI_SAMPLING.items()}


def stop_token_ids_problem(ids, min_tokens: int | None) -> str | None:
    """What is wrong with vLLM's stop_token_ids field `ids` beside min_tokens, in one line; else None."""
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return f"stop_token_ids={ids!r}: pass a list of token ids, whole numbers >= 0"
    if min_tokens and len(ids) > generation.MAX_HELD_STOP_TOKENS:
        return (
            f"stop_token_ids holds {len(ids)} tokens with min_tokens={min_tokens}; a row holds back at most "
            f"{generation.MAX_HELD_STOP_TOKENS} of them until min_tokens; pass fewer"
        )
    return None


def logit_bias_problem(count: int) -> str | None:
    """What is wrong with a logit_bias of `count` tokens, in one line; else None."""
    if count > generation.MAX_LOGIT_BIAS:
        return f"logit_bias holds {count} tokens; pass at most {generation.MAX_LOGIT_BIAS}"
    return None


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely (token id, logprob), most likely first


@dataclasses.dataclass
class Event:
    """What a request's listener gets after each chunk: its new tokens, the text each one releases, and
    at the end why it ended.

    A chunk may choose several tokens; `pieces[i]` is the text that `token_ids[i]` releases, "" where
    the text is held back (a partial UTF-8 character, the start of a possible stop string) until a
    later token releases it with its own. `tail` is the text held back until the answer ended (after
    its last token: an EOS token, the length limit, a cancel). The answer's text is that of
    `token_ids` (cut at the token where a stop string ends); an EOS token that ended it (`eos`) has
    no text but counts, as in vLLM: in `completion_tokens` and, last, in `logprobs`.
    """

    token_ids: list[int]
    pieces: list[str]  # one per token id
    logprobs: list[TokenLogprob] | None  # one per token id, then the EOS token's where `eos`
    finish_reason: str | None  # "stop" (EOS or a stop string), "length" (max_tokens), "cancelled"; None: more comes
    prompt_tokens: int
    completion_tokens: int
    tail: str = ""
    eos: bool = False  # an EOS token ended the answer after token_ids

    @property
    def text(self) -> str:
        """The text this event adds to the answer."""
        return "".join(self.pieces) + self.tail


class Request:
    """A prompt in the engine: queued, then in a slot, then finished."""

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        settings: generation.GenerationSettings,
        listener: Callable[[Event], None],
        stream,
        matcher: generation.Matcher | None = None,
        adapter=None,
        images: dict | None = None,
    ):
        self.prompt = prompt
        # The processor's outputs for a prompt with images (pixel_values, ...; host arrays [1, ...]):
        # its prefill reads the whole prompt in one chunk, and no other request reuses its keys.
        self.images = images
        self.prompt_tokens = len(prompt)  # what its usage counts (an encoder-decoder's: its encoder's tokens)
        self.inputs: dict | None = None  # an encoder-decoder's encoder inputs, for its prefill
        self.adapter = adapter  # the `hfjax.lora.Adapter` of `params.adapter` (None: the base alone)
        self.matcher = matcher  # where the answer is constrained: its place in the grammar
        # A constrained request's next token taken in by its matcher before delivery (`Delivery.advance`):
        # whether the grammar allowed it; None where nothing was taken in ahead.
        self.advanced: bool | None = None
        self.params = params
        self.settings = settings
        self.listener = listener
        self.text = stream  # a TextStream: the answer's text, stop strings
        self.arrived = time.perf_counter()
        self.last_token_time: float | None = None
        self.generated = 0
        self.cancelled = False
        self.finished = False
        self.slot: int | None = None
        self.prefilled = 0  # prompt tokens in the slot's cache so far
        self.started = 0  # where this request's prefill began (after a reused prefix)
        self.scheduled = 0  # new tokens that programs run so far will have chosen (delivered or not)

    @property
    def reading(self) -> bool:
        """Its prompt not yet all in its slot's cache."""
        return self.prefilled < len(self.prompt)

    @property
    def decoding(self) -> bool:
        """In a slot, past its prompt, with tokens still to choose."""
        return (
            self.prefilled == len(self.prompt)
            and not (self.finished or self.cancelled)
            and self.scheduled < self.settings.max_new_tokens
        )

    def stops(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where `tokens` [T] end the answer, by generation's stop rule (`generation.stopped`): (an EOS
        token of the settings', which the answer's text leaves out (none with ignore_eos); one of the
        request's stop_token_ids, the answer's last token), each [T] bool."""
        return (
            generation.stopped(tokens, self.settings.eos_token_ids),
            generation.stopped(tokens, self.params.stop_token_ids),
        )


def joined(events: list[Event]) -> Event:
    """One Event holding all of a request's events."""
    logprobs = None if events[0].logprobs is None else [lp for e in events for lp in (e.logprobs or [])]
    last = events[-1]
    return Event(
        [t for e in events for t in e.token_ids],
        [p for e in events for p in e.pieces],
        logprobs,
        last.finish_reason,
        last.prompt_tokens,
        last.completion_tokens,
        "".join(e.tail for e in events),
        last.eos,
    )
