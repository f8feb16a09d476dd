"""Generation settings: transformers' `generate` arguments and generation_config.json, merged
and checked on the host into one frozen `GenerationSettings`.

Precedence is transformers': keyword arguments, then a `generation_config` passed to the
call, then the checkpoint's generation_config.json. A setting that changes which tokens
transformers would produce is either carried out in the compiled program or refused with
an error that names it and where it came from; none is dropped silently. Settings that
only shape transformers' own machinery (`use_cache`, `cache_implementation`, the beam-only
`length_penalty` while `num_beams` is 1, ...) are accepted and have no effect here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import numpy as np

from .._errors import GenerationError
from ._beam import BeamSettings
from ._rows import HistoryRules, RowSampling, SamplingFeatures
from ._speculative import Speculation


def _real(name: str, value, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise GenerationError(f"{name}={value!r} is not a finite number; {fix}")
    return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How to pick the next token; the defaults pick the most likely token (greedy).

    Args:
        do_sample: draw from the processed distribution instead of taking its argmax.
        temperature: divide the logits by this (sampling only); must be > 0 when sampling.
        top_k: keep the k most likely tokens, and any tied with the k-th (sampling only); 0 is off.
        top_p: keep the fewest most likely tokens whose probabilities add up to top_p or
            more (sampling only); 1.0 is off.
        min_p: drop tokens less likely than min_p times the most likely one (sampling only);
            0.0 is off.
        repetition_penalty: divide positive logits (multiply negative ones) of tokens already
            in the sequence by this, in both modes; 1.0 is off.
        presence_penalty: subtract this from the logits of tokens the answer already holds, in
            both modes (OpenAI's); 0.0 is off.
        frequency_penalty: subtract this times how often the answer holds a token from its logit
            (OpenAI's); 0.0 is off.

    Frozen and hashable, so it can be a static argument of `jax.jit`.

    Example:
        >>> SamplingConfig(do_sample=True, temperature=0.7, top_p=0.9)
        SamplingConfig(do_sample=True, temperature=0.7, top_k=0, top_p=0.9, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        if not isinstance(self.do_sample, (bool, np.bool_)):
            raise GenerationError(
                f"do_sample={self.do_sample!r} is not a bool; pass True to sample or False for greedy decoding"
            )
        temperature = _real(
            "temperature", self.temperature, "pass a value such as 0.7, or 1.0 to leave logits unscaled"
        )
        if temperature < 0 or (temperature == 0 and self.do_sample):
            greedy = " If you want greedy decoding, pass do_sample=False." if temperature == 0 else ""
            raise GenerationError(
                f"temperature={self.temperature!r} must be strictly positive when do_sample=True; "
                f"pass a value such as 0.7, or 1.0 to leave logits unscaled.{greedy}"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise GenerationError(
                f"top_k={self.top_k!r} is not a non-negative integer; pass a value such as 50, or 0 to turn top-k off"
            )
        top_p = _real("top_p", self.top_p, "pass a value in (0, 1] such as 0.9, or 1.0 to turn top-p off")
        if not 0 < top_p <= 1:
            raise GenerationError(
                f"top_p={self.top_p!r} is outside (0, 1]; pass a value such as 0.9, or 1.0 to turn top-p off"
            )
        min_p = _real("min_p", self.min_p, "pass a value in [0, 1] such as 0.05, or 0.0 to turn min-p off")
        if not 0 <= min_p <= 1:
            raise GenerationError(
                f"min_p={self.min_p!r} is outside [0, 1]; pass a value such as 0.05, or 0.0 to turn min-p off"
            )
        penalty = _real(
            "repetition_penalty", self.repetition_penalty, "pass a value such as 1.2, or 1.0 to turn the penalty off"
        )
        if penalty <= 0:
            raise GenerationError(
                f"repetition_penalty={self.repetition_penalty!r} must be strictly positive; "
                "pass a value such as 1.2 (above 1 discourages repeats), or 1.0 to turn the penalty off"
            )
        penalties = {}
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name), f"pass a value in [-2, 2] such as 0.5, or 0.0 to turn {name} off")
            if not -2 <= value <= 2:
                raise GenerationError(
                    f"{name}={getattr(self, name)!r} is outside [-2, 2]; pass a value such as 0.5, or 0.0 to turn it off"
                )
            penalties[name] = value
        # Plain Python scalars, so equal settings hash and print the same however they were given.
        for name, value in (
            ("do_sample", bool(self.do_sample)),
            ("temperature", temperature),
            ("top_k", int(self.top_k)),
            ("top_p", top_p),
            ("min_p", min_p),
            ("repetition_penalty", penalty),
            *penalties.items(),
        ):
            object.__setattr__(self, name, value)


# (token ids, bias): the bias is added to the last id's score when the sequence so far ends
# with the other ids (transformers' sequence_bias; bad_words_ids are biases of -inf).
SequenceBias = tuple[tuple[int, ...], float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationSettings:
    """Everything that shapes a generation program. Hashable: it is a static jit argument."""

    # The most new tokens a row takes (checked against the prompt and the context by `check_limits`);
    # None in a program's settings (`program_settings`), which take it as an argument.
    max_new_tokens: int | None
    min_new_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    # pad_token_id was set (by an argument or a config), not taken from eos or the fallback 0; a
    # mask is then inferred from it (transformers' rule). Not part of any program.
    pad_token_given: bool = dataclasses.field(default=False, compare=False)
    decoder_start_token_id: int | None = None  # encoder-decoders: the decoder's first token
    forced_bos_token_id: int | None = None  # the first new token (BART-style checkpoints)
    forced_eos_token_ids: tuple[int, ...] = ()  # forced as the max_new_tokens-th new token
    sequence_bias: tuple[SequenceBias, ...] = ()
    no_repeat_ngram_size: int = 0
    encoder_no_repeat_ngram_size: int = 0  # n-grams of the encoder's input (a decoder's: its prompt)
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    begin_suppress_step: int = 0  # the new token at which begin_suppress_tokens apply
    num_return_sequences: int = 1  # rows returned per prompt
    beam: BeamSettings | None = None  # beam search, or None for greedy decoding and sampling
    return_dict_in_generate: bool = False  # a Generate*Output instead of the token ids
    output_scores: bool = False  # keep each new token's processed scores
    output_logits: bool = False  # keep each new token's raw logits
    sampling: SamplingConfig = SamplingConfig()
    # What a program compiles of the token choice (`program_settings` sets it, and the sampling
    # values and single-token biases go to the program as per-row arrays instead); None: unset.
    features: SamplingFeatures | None = None
    # Speculative decoding (prompt lookup), or None: one token per step.
    speculation: Speculation | None = None
    # A program's token buffer: the new-token columns after the prompt's, at least any call's
    # max_new_tokens it runs (`program_settings` sets it); None: unset.
    buffer_tokens: int | None = None

    def single_token_biases(self) -> dict[int, float]:
        """{token id: bias} of the sequence biases of one token (OpenAI's logit_bias; transformers'
        bad_words_ids of one token are biases of -inf), summed where an id repeats."""
        biases: dict[int, float] = {}
        for ids, value in self.sequence_bias:
            if len(ids) == 1:
                biases[ids[0]] = biases.get(ids[0], 0.0) + value
        return biases

    def program_features(self) -> SamplingFeatures:
        """What a program for these settings compiles of the token choice."""
        return SamplingFeatures.of([self.sampling], bias_slots=len(self.single_token_biases()))

    def history_rules(self) -> HistoryRules | None:
        """The processors of these settings that read a row's tokens so far or count its new tokens, or
        None where there are none (a decoder's: encoder_no_repeat_ngram_size reads its prompt)."""
        rules = HistoryRules(
            sequence_bias=tuple(bias for bias in self.sequence_bias if len(bias[0]) > 1),
            no_repeat_ngram_size=self.no_repeat_ngram_size,
            prompt_ngram_size=self.encoder_no_repeat_ngram_size,
            forced_bos_token_id=self.forced_bos_token_id,
            forced_eos_token_ids=self.forced_eos_token_ids,
            suppress_tokens=self.suppress_tokens,
            begin_suppress_tokens=self.begin_suppress_tokens,
            begin_suppress_step=self.begin_suppress_step if self.begin_suppress_tokens else 0,
        )
        return None if rules == HistoryRules() else rules

    def row_sampling(
        self,
        rows: int,
        key: np.ndarray,
        vocab_size: int | None = None,
        *,
        bias_slots: int | None = None,
        held_slots: int = 0,
        stop_token_ids: tuple[int, ...] = (),
        lengths: np.ndarray | None = None,
        pads: np.ndarray | int = 0,
        mask_words: int = 0,
    ) -> RowSampling:
        """These settings for `rows` rows, each with PRNG key data `key` [2] uint32 (a program folds
        each row's index into it), and `bias_slots` single-token biases (default: as many as the
        settings hold).

        On the slot core, `lengths` [R] gives each row's prompt tokens (its first new token's
        position), from which the EOS hold-back of min_new_tokens and the `HistoryRules` count, and
        `pads` [R] the pads before the row in transformers' input_ids (which those rules read).
        With `held_slots`, each row holds its own tokens back (`RowSampling.held_ids`): the EOS
        tokens and vLLM's `stop_token_ids` (a server's rows; else the program holds EOS back).
        `mask_words`: the width of the rows' allowed-token bitmasks (`SamplingFeatures.mask_words`)."""
        row = (self.sampling, self.single_token_biases(), key)
        slots = len(row[1]) if bias_slots is None else bias_slots
        sampling = RowSampling.build(
            [row] * rows, vocab_size=vocab_size, bias_slots=slots, held_slots=held_slots, mask_words=mask_words
        )
        held_ids = (*self.eos_token_ids, *(stop_token_ids if self.min_new_tokens else ())) if held_slots else ()
        if len(held_ids) > held_slots:
            raise GenerationError(
                f"stop_token_ids holds {len(stop_token_ids)} tokens beside {len(self.eos_token_ids)} end-of-sequence "
                f"tokens, more than the {held_slots} a row holds back for min_tokens; pass fewer stop_token_ids"
            )
        sampling.held_ids[:, : len(held_ids)] = held_ids
        if lengths is not None:
            lengths = np.asarray(lengths, np.int32)
            held = self.min_new_tokens if self.eos_token_ids or held_ids else 0
            sampling.min_position = np.where(held > 0, lengths + np.int32(held), 0).astype(np.int32)
            sampling.pads = np.broadcast_to(np.asarray(pads, np.int32), (rows,)).copy()
            sampling.first_new = lengths
            sampling.max_new_tokens = np.full(rows, self.max_new_tokens, np.int32)
        return sampling


# transformers' arguments that hfjax carries out, read from the merged settings.
_SUPPORTED = (
    "max_new_tokens",
    "max_length",
    "min_new_tokens",
    "min_length",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "sequence_bias",
    "suppress_tokens",
    "begin_suppress_tokens",
    "eos_token_id",
    "pad_token_id",
    "decoder_start_token_id",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "num_return_sequences",
    "num_beams",
    "length_penalty",
    "early_stopping",
    "return_dict_in_generate",
    "output_scores",
    "output_logits",
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
    "num_assistant_tokens",
)


def _set(value) -> bool:
    return value is not None and value is not False


def _sampling_only(test):
    return lambda value, sampling: sampling and test(value)


# transformers' settings that would change the tokens and that hfjax does not carry out:
# name -> (whether the value is in effect, given do_sample; what it asks for; the value that turns it off).
_UNSUPPORTED = {
    "num_beams": (lambda v, s: s and v is not None and v > 1, "beam sampling (do_sample=False gives beam search)", 1),
    "num_beam_groups": (lambda v, s: v is not None and v > 1, "group beam search", 1),
    "force_words_ids": (lambda v, s: _set(v), "constrained beam search", None),
    "constraints": (lambda v, s: _set(v), "constrained beam search", None),
    "penalty_alpha": (lambda v, s: v is not None and v > 0, "contrastive search", None),
    "dola_layers": (lambda v, s: _set(v), "DoLa decoding", None),
    "guidance_scale": (lambda v, s: v is not None and v != 1, "classifier-free guidance", None),
    "encoder_repetition_penalty": (
        lambda v, s: v is not None and v != 1,
        "a repetition penalty on the encoder's tokens",
        1.0,
    ),
    "exponential_decay_length_penalty": (lambda v, s: _set(v), "an EOS boost that grows with length", None),
    "remove_invalid_values": (lambda v, s: bool(v), "replacing inf and NaN scores", False),
    "watermarking_config": (lambda v, s: _set(v), "watermarking", None),
    "typical_p": (_sampling_only(lambda v: v is not None and v < 1), "typical sampling", 1.0),
    "epsilon_cutoff": (_sampling_only(lambda v: v is not None and 0 < v < 1), "epsilon sampling", 0.0),
    "eta_cutoff": (_sampling_only(lambda v: v is not None and 0 < v < 1), "eta sampling", 0.0),
    "top_h": (_sampling_only(_set), "top-H sampling", None),
    "token_healing": (lambda v, s: bool(v), "token healing", False),
    "stop_strings": (lambda v, s: _set(v), "stopping at strings (pass their token ids as eos_token_id)", None),
    "max_time": (lambda v, s: _set(v), "a time limit", None),
    "assistant_early_exit": (lambda v, s: _set(v), "self-speculative decoding", None),
    "output_attentions": (lambda v, s: bool(v), "returning attentions", False),
    "output_hidden_states": (lambda v, s: bool(v), "returning hidden states", False),
}

# transformers' `generate` arguments that are not generation settings; hfjax takes none of them.
_CALL_ONLY = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_tokenizer",
    "tokenizer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "use_model_defaults",
)


@functools.cache
def _setting_names() -> frozenset[str]:
    from transformers import GenerationConfig

    return frozenset(GenerationConfig().to_dict())


def check_names(names) -> None:
    """Raises for a keyword that transformers' `generate` would not take as a setting, or that
    hfjax cannot take (its callbacks, an assistant model)."""
    for name in names:
        if name in _CALL_ONLY:
            raise GenerationError(
                f"Model.generate({name}=...): hfjax compiles the whole decode loop and does not call back into Python "
                f"per token, so it does not take {name}; the settings it takes: {', '.join(_SUPPORTED)}"
            )
        if name not in _setting_names():
            raise TypeError(
                f"Model.generate() got an unexpected keyword argument {name!r}; it takes transformers' generation "
                f"settings, of which hfjax carries out: {', '.join(_SUPPORTED)}"
            )


def resolve_settings(
    model,
    prompt_length: int,
    generation_config=None,
    *,
    decoder_prompt_length: int = 1,
    assistant: bool = False,
    **overrides,
) -> GenerationSettings:
    """Merges the checkpoint's generation_config.json, a `generation_config` and keyword
    overrides (transformers' names) into `GenerationSettings`.

    `prompt_length` is the width of the (padded) input_ids, from which transformers counts
    `max_length` and `min_length` in a decoder; an encoder-decoder's decoder starts from
    `decoder_prompt_length` tokens (its decoder_input_ids, or the decoder start token). `assistant`:
    the call drafts with a draft model (transformers' assistant_model), `num_assistant_tokens` at a time.
    """
    check_names(overrides)
    values, where = _merged(model, generation_config, overrides)
    do_sample = values.get("do_sample")
    if not isinstance(do_sample, (bool, np.bool_)) and do_sample is not None:
        raise GenerationError(
            f"do_sample={do_sample!r}{where('do_sample')} is not a bool; pass True to sample or False for greedy decoding"
        )
    do_sample = bool(do_sample)
    for name, (in_effect, what, off) in _UNSUPPORTED.items():
        if in_effect(values.get(name), do_sample):
            fix = f"leave {name} out" if where(name) == "" else f"pass {name}={off!r} to override it"
            raise GenerationError(
                f"{name}={values[name]!r}{where(name)} asks for {what}, which hfjax's generate does not do; {fix}"
            )

    def count(name: str, least: int, default: int = 0) -> int:
        value = values.get(name)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
            raise GenerationError(f"{name}={value!r}{where(name)} must be an integer >= {least}")
        return int(value)

    def token_ids(name: str) -> tuple[int, ...]:
        return _token_ids(name, values.get(name), where(name))

    decoder_length = decoder_prompt_length if getattr(model.config, "is_encoder_decoder", False) else prompt_length
    max_new_tokens = values.get("max_new_tokens")
    if max_new_tokens is None:
        max_length = count("max_length", least=1, default=20)
        max_new_tokens = max_length - decoder_length
        if max_new_tokens < 1:
            raise GenerationError(
                f"max_length={max_length}{where('max_length')} counts the prompt's {decoder_length} tokens and leaves "
                f"no room for new tokens; pass max_new_tokens=N, or max_length above {decoder_length}"
            )
    eos = token_ids("eos_token_id")
    pad = values.get("pad_token_id")
    if pad is None:
        pad = eos[0] if eos else 0
    forced_bos = values.get("forced_bos_token_id")
    decoder_start = values.get("decoder_start_token_id")
    if decoder_start is None:
        decoder_start = getattr(model.config, "decoder_start_token_id", None)
    if decoder_start is None and getattr(model.config, "is_encoder_decoder", False):
        decoder_start = values.get("bos_token_id")  # transformers' fallback (e.g. mBART, LongT5 configs)
    suppressed = token_ids("suppress_tokens")
    forced_eos = token_ids("forced_eos_token_id")
    forced_tokens = {
        "forced_bos_token_id": () if forced_bos is None else (forced_bos,),
        "forced_eos_token_id": forced_eos,
    }
    for name, forced in forced_tokens.items():
        if forced and set(forced) <= set(suppressed):
            # transformers refuses this too: every score would be -inf at the forced step.
            raise GenerationError(
                f"suppress_tokens={list(suppressed)}{where('suppress_tokens')} suppresses {name}="
                f"{forced[0] if len(forced) == 1 else list(forced)}{where(name)}, the only token allowed where it is forced; "
                "remove it from one of them"
            )
    count_returned = count("num_return_sequences", least=1, default=1)
    num_beams = count("num_beams", least=1, default=1)
    if count_returned > num_beams and not do_sample:
        choices = (
            "num_beams >= num_return_sequences" if num_beams > 1 else "do_sample=True to draw several, or num_beams"
        )
        raise GenerationError(
            f"num_return_sequences={count_returned}{where('num_return_sequences')}: greedy decoding returns "
            f"{num_beams} sequence{'s' if num_beams > 1 else ''} per prompt; pass {choices}, or num_return_sequences=1"
        )
    vocab = getattr(model.config.get_text_config(decoder=True), "vocab_size", None)
    as_dict = bool(values.get("return_dict_in_generate"))
    # As in transformers, scores and logits are kept only for a returned dict.
    kept = {name: as_dict and bool(values.get(name)) for name in ("output_scores", "output_logits")}
    if num_beams > 1 and any(kept.values()):
        name = next(name for name, on in kept.items() if on)
        raise GenerationError(
            f"{name}=True{where(name)} with num_beams={num_beams}: hfjax keeps scores and logits for greedy decoding and "
            "sampling only; pass num_beams=1, or leave it out"
        )
    speculation = _speculation(values, where, num_beams, assistant)
    return GenerationSettings(
        speculation=speculation,
        return_dict_in_generate=as_dict,
        **kept,
        max_new_tokens=max_new_tokens,
        # transformers blocks EOS until both minimums are met: they are one limit on new tokens.
        min_new_tokens=max(count("min_new_tokens", least=0), count("min_length", least=0) - decoder_length),
        eos_token_ids=eos,
        pad_token_id=int(pad),
        pad_token_given=values.get("pad_token_id") is not None,
        decoder_start_token_id=None if decoder_start is None else int(decoder_start),
        forced_bos_token_id=forced_bos,
        forced_eos_token_ids=forced_eos,
        sequence_bias=(
            _sequence_bias(values.get("sequence_bias"), where("sequence_bias"), vocab)
            + _bad_words(values.get("bad_words_ids"), where("bad_words_ids"), vocab, eos)
        ),
        no_repeat_ngram_size=count("no_repeat_ngram_size", least=0),
        encoder_no_repeat_ngram_size=count("encoder_no_repeat_ngram_size", least=0),
        suppress_tokens=suppressed,
        begin_suppress_tokens=token_ids("begin_suppress_tokens"),
        # transformers suppresses them when the decoder's input is as long as it started,
        # one token later when a forced first token follows a 1-token decoder input.
        begin_suppress_step=1 if decoder_length == 1 and forced_bos is not None else 0,
        num_return_sequences=count_returned,
        beam=None if num_beams == 1 else _beam_settings(values, where, num_beams, pad, eos),
        sampling=_sampling(values, do_sample),
    )


# Tokens a draft model drafts per round where num_assistant_tokens is unset (transformers starts at 20
# and adapts the number between calls; a compiled round verifies a fixed number).
ASSISTANT_TOKENS = 5


def _speculation(values: dict, where, num_beams: int, assistant: bool) -> Speculation | None:
    """transformers' prompt lookup (prompt_lookup_num_tokens, max_matching_ngram_size) or assisted
    generation (an assistant model, num_assistant_tokens) as a `Speculation`."""
    k = values.get("prompt_lookup_num_tokens")
    if assistant:
        if k is not None:
            raise GenerationError(
                f"prompt_lookup_num_tokens={k}{where('prompt_lookup_num_tokens')} with assistant_model: pass one "
                "drafter, the assistant model or prompt lookup"
            )
        drafted = values.get("num_assistant_tokens")
        drafted = ASSISTANT_TOKENS if drafted is None else drafted
        if isinstance(drafted, bool) or not isinstance(drafted, numbers.Integral) or drafted < 1:
            raise GenerationError(
                f"num_assistant_tokens={drafted!r}{where('num_assistant_tokens')} must be an integer >= 1, e.g. 5"
            )
        if num_beams > 1:
            raise GenerationError(
                f"assistant_model with num_beams={num_beams}{where('num_beams')}: speculative decoding drafts for one "
                "sequence per row, not for beam search; pass num_beams=1, or leave assistant_model out"
            )
        return Speculation(method="draft_model", num_speculative_tokens=int(drafted))
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise GenerationError(
            f"prompt_lookup_num_tokens={k!r}{where('prompt_lookup_num_tokens')} must be an integer >= 1, e.g. 3"
        )
    if num_beams > 1:
        raise GenerationError(
            f"prompt_lookup_num_tokens={k}{where('prompt_lookup_num_tokens')} with num_beams={num_beams}"
            f"{where('num_beams')}: speculative decoding drafts for one sequence per row, not for beam search; pass "
            "num_beams=1, or leave prompt_lookup_num_tokens out"
        )
    longest = values.get("max_matching_ngram_size")
    longest = 2 if longest is None else longest  # transformers' default
    if isinstance(longest, bool) or not isinstance(longest, numbers.Integral) or longest < 1:
        raise GenerationError(
            f"max_matching_ngram_size={longest!r}{where('max_matching_ngram_size')} must be an integer >= 1, e.g. 2"
        )
    return Speculation(method="ngram", num_speculative_tokens=int(k), prompt_lookup_max=int(longest))


def _beam_settings(values: dict, where, num_beams: int, pad: int, eos: tuple[int, ...]) -> BeamSettings:
    penalty = values.get("length_penalty")
    penalty = 1.0 if penalty is None else penalty
    if isinstance(penalty, bool) or not isinstance(penalty, numbers.Real) or not math.isfinite(penalty):
        raise GenerationError(
            f"length_penalty={penalty!r}{where('length_penalty')} is not a finite number; pass e.g. 1.0"
        )
    early = values.get("early_stopping")
    early = False if early is None else early
    if early not in (True, False, "never"):
        raise GenerationError(f"early_stopping={early!r}{where('early_stopping')} must be True, False or 'never'")
    # transformers fills a finished sequence with the pad token, or with EOS where the pad token is 0.
    fill = (pad or eos[0]) if eos else -1
    return BeamSettings(num_beams=num_beams, length_penalty=float(penalty), early_stopping=early, fill_token_id=fill)


def _merged(model, generation_config, overrides: dict):
    """(settings by name, where(name) -> " (from ...)" or "" for an argument), in transformers' precedence."""
    defaults = model.generation_config
    sources = {}
    if generation_config is not None:
        given = generation_config.to_diff_dict()
        sources.update(dict.fromkeys(given, " (from generation_config)"))
        defaults = type(defaults).from_dict({**defaults.to_dict(), **given})
    values = defaults.to_dict()
    given = {k: v for k, v in overrides.items() if v is not None}
    sources.update(dict.fromkeys(given, ""))
    values.update(given)
    checkpoint = (
        f" (from {model.path}/generation_config.json)" if model.path else " (from the model's generation_config)"
    )
    return values, lambda name: sources.get(name, checkpoint)


def _sampling(values: dict, do_sample: bool) -> SamplingConfig:
    temperature = _number(values.get("temperature"), 1.0)
    requested = dict(
        temperature=temperature,
        top_k=values.get("top_k") or 0,
        top_p=_number(values.get("top_p"), 1.0),
        min_p=_number(values.get("min_p"), 0.0),
    )
    penalty = _number(values.get("repetition_penalty"), 1.0)
    if do_sample:
        return SamplingConfig(do_sample=True, repetition_penalty=penalty, **requested)
    # transformers ignores sampling settings when do_sample=False; so do we, but we still
    # reject values that are invalid whatever the mode, so a typo does not pass silently.
    # Temperature 0 means greedy to transformers users.
    SamplingConfig(do_sample=True, **{**requested, "temperature": 1.0 if temperature == 0 else temperature})
    return SamplingConfig(do_sample=False, repetition_penalty=penalty)


def _number(value, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        return value  # SamplingConfig names the bad value
    return float(value)


def _token_ids(name: str, value, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = [value] if isinstance(value, numbers.Integral) else value
    if isinstance(ids, (str, bytes)) or not all(_is_token_id(i) for i in ids):
        raise GenerationError(f"{name}={value!r}{where} must be a token id or a list of token ids (integers >= 0)")
    return tuple(int(i) for i in ids)


def _is_token_id(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _sequences(name: str, sequences, where: str, vocab: int | None) -> list[tuple[int, ...]]:
    example = "[[12], [7, 9]]"
    if not isinstance(sequences, (list, tuple)) or not sequences:
        raise GenerationError(f"{name}={sequences!r}{where} must be a non-empty list of token id lists, e.g. {example}")
    out = []
    for ids in sequences:
        if not isinstance(ids, (list, tuple)) or not ids or not all(_is_token_id(i) for i in ids):
            raise GenerationError(
                f"{name}={sequences!r}{where}: {ids!r} is not a non-empty list of token ids, e.g. {example}"
            )
        if vocab is not None and max(ids) >= vocab:
            raise GenerationError(
                f"{name}={sequences!r}{where}: token id {max(ids)} is outside the vocabulary of {vocab}"
            )
        out.append(tuple(int(i) for i in ids))
    return out


def _sequence_bias(bias, where: str, vocab: int | None) -> tuple[SequenceBias, ...]:
    if bias is None:
        return ()
    pairs = list(bias.items()) if isinstance(bias, dict) else bias
    shape = "{(token ids): bias} or [[[token ids], bias], ...]"
    if not isinstance(pairs, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise GenerationError(f"sequence_bias={bias!r}{where} must be {shape}")
    sequences = _sequences("sequence_bias", [list(ids) for ids, _ in pairs], where, vocab)
    values = [value for _, value in pairs]
    for value in values:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
            raise GenerationError(
                f"sequence_bias={bias!r}{where}: the bias {value!r} is not a number; it must be {shape}"
            )
    # transformers keeps one bias per sequence, the last one given.
    return tuple(dict(zip(sequences, (float(v) for v in values))).items())


def _bad_words(bad_words, where: str, vocab: int | None, eos: tuple[int, ...]) -> tuple[SequenceBias, ...]:
    if bad_words is None:
        return ()
    sequences = _sequences("bad_words_ids", bad_words, where, vocab)
    # As transformers does: an EOS token alone is not banned, so rows can still end.
    return tuple(dict.fromkeys((ids, -math.inf) for ids in sequences if not (len(ids) == 1 and ids[0] in eos)))
