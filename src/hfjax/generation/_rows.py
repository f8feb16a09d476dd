"""Each row's sampling settings as arrays, so that rows with different settings share one program.

`Model.generate` gives every row of a call the same settings; a server's slots each hold a
request of its own. Either way the program takes one `RowSampling` of per-row arrays (R rows),
and a static `SamplingFeatures` says which parts of the token choice it compiles at all:

    RowSampling       temperature, top-k, top-p, min-p, repetition / presence / frequency
                      penalties, single-token logit biases, the position before which held-back
                      tokens (the program's, and the row's own) are not chosen, where the row's
                      answer starts and ends, the tokens a constrained row may choose next
                      (a bitmask a grammar on the host fills), the LoRA adapter it runs
                      with, its multimodal rope's shift, and a PRNG key, one row each
    SamplingFeatures  which of those any row may use (hashable: part of a program's key), and
                      `HistoryRules`: generate's processors that read the tokens so far

Rows of temperature 0 take the most likely token (transformers' do_sample=False): the warpers
(temperature, top-k, top-p, min-p) do not apply to them, the penalties and biases do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from .._errors import GenerationError

# Single-token biases a server's row may carry (OpenAI's logit_bias); a row holds them sparsely.
MAX_LOGIT_BIAS = 64
# vLLM's stop_token_ids that a server's row holds back under min_tokens, beside its EOS tokens.
MAX_HELD_STOP_TOKENS = 16
# The most likely tokens of a sampling row that top-k and top-p read first (`lax.top_k`, a
# partial sort): a row whose kept tokens lie among them never selects over its whole vocabulary.
TOP_CANDIDATES = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class HistoryRules:
    """`Model.generate`'s processors that read each row's tokens so far or count its new tokens, in
    transformers' order (static: part of a program's key; a server compiles its checkpoint's
    generation_config.json's, the same for every request)."""

    sequence_bias: tuple[tuple[tuple[int, ...], float], ...] = ()  # biases of two or more tokens
    no_repeat_ngram_size: int = 0
    prompt_ngram_size: int = 0  # a decoder's encoder_no_repeat_ngram_size: n-grams of its prompt
    forced_bos_token_id: int | None = None  # where the row holds one token
    forced_eos_token_ids: tuple[int, ...] = ()  # as the max_new_tokens-th new token
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    begin_suppress_step: int = 0  # the new token at which begin_suppress_tokens apply

    @property
    def reads_tokens(self) -> bool:
        """Whether a rule reads the tokens themselves (a program then keeps each row's in its state)."""
        return bool(self.sequence_bias or self.no_repeat_ngram_size or self.prompt_ngram_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingFeatures:
    """Which parts of the token choice a program compiles (any row may use them)."""

    sampling: bool = False  # some row draws (temperature > 0)
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    repetition: bool = False  # transformers' repetition penalty: prompt and answer tokens
    presence: bool = False  # OpenAI's presence and frequency penalties: answer tokens
    bias_slots: int = 0  # single-token biases per row (0: none)
    # The stop tokens a row does not choose before its `min_position` (`_stops.hold_back`), one of:
    # the same for every row, compiled in (Model.generate's EOS under min_new_tokens); or each row's
    # own, `held_slots` of them (`RowSampling.held_ids`: a server's, each request's EOS tokens and
    # vLLM's stop_token_ids under min_tokens); 0: none.
    held_back: tuple[int, ...] = ()
    held_slots: int = 0
    history: HistoryRules | None = None  # Model.generate's processors that read the tokens so far
    # int32 words of each row's allowed-token bitmask (`RowSampling.allowed`): ceil(V / 32) where rows
    # may be constrained to a grammar (structured outputs), else 0: no mask is compiled.
    mask_words: int = 0
    # How many of a sampling row's most likely tokens top-k and top-p read first; rows whose
    # kept tokens lie further down select over their whole vocabulary (`_sampling.process_logits`).
    candidates: int = TOP_CANDIDATES

    def __post_init__(self):
        if self.held_back and self.held_slots:
            raise GenerationError(
                f"SamplingFeatures: held_back={self.held_back} and held_slots={self.held_slots}; the stop tokens held "
                "back are every row's (held_back) or each row's own (held_slots), so pass one of them"
            )

    def held_ids(self, rows: RowSampling):
        """The stop tokens the rows hold back before their `min_position` (`_stops.hold_back`'s ids): the
        compiled-in tuple, or each row's own [R, H] int32; () where none are."""
        if self.held_back:
            return self.held_back
        return rows.held_ids if self.held_slots else ()

    @classmethod
    def of(cls, configs: Sequence, bias_slots: int = 0) -> SamplingFeatures:
        """What these settings (`SamplingConfig`s) use, and nothing more."""
        sampling = [c for c in configs if c.do_sample]
        return cls(
            sampling=bool(sampling),
            top_k=any(c.top_k > 0 for c in sampling),
            top_p=any(c.top_p < 1.0 for c in sampling),
            min_p=any(c.min_p > 0.0 for c in sampling),
            repetition=any(c.repetition_penalty != 1.0 for c in configs),
            presence=any(c.presence_penalty != 0.0 or c.frequency_penalty != 0.0 for c in configs),
            bias_slots=bias_slots,
        )

    @classmethod
    def every(cls) -> SamplingFeatures:
        """Everything a server's request may ask for."""
        return cls(
            sampling=True, top_k=True, top_p=True, min_p=True, repetition=True, presence=True, bias_slots=MAX_LOGIT_BIAS
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowSampling:
    """How each of R rows picks its next token (numpy arrays on the host, jax.Arrays in programs)."""

    temperature: np.ndarray  # [R] float32; 0: the most likely token (transformers' do_sample=False)
    top_k: np.ndarray  # [R] int32; 0: off
    top_p: np.ndarray  # [R] float32; 1: off
    min_p: np.ndarray  # [R] float32; 0: off
    repetition_penalty: np.ndarray  # [R] float32; 1: off
    presence_penalty: np.ndarray  # [R] float32; 0: off
    frequency_penalty: np.ndarray  # [R] float32; 0: off
    bias_ids: np.ndarray  # [R, K] int32: token ids of single-token biases; past the vocabulary where unused
    bias_values: np.ndarray  # [R, K] float32
    min_position: np.ndarray  # [R] int32: the first position whose token may be a held-back one; 0: off
    held_ids: np.ndarray  # [R, H] int32: the row's own held-back tokens; past the vocabulary where unused
    # Where `SamplingFeatures.history` rules count from (0 where a program has none): the pads before
    # the row's first token in transformers' input_ids, the position of its first new token, and its
    # max_new_tokens (forced_eos_token_id's step is the last of them).
    pads: np.ndarray  # [R] int32
    first_new: np.ndarray  # [R] int32
    max_new_tokens: np.ndarray  # [R] int32
    # [R, W] int32, W = `SamplingFeatures.mask_words`: bit j of word i set where token 32i + j may come
    # next (llguidance's layout), read only in rows that are `constrained` ([R] bool).
    allowed: np.ndarray
    constrained: np.ndarray
    lora: np.ndarray  # [R] int32: the row's LoRA adapter slot (`hfjax.lora`); -1: the base alone
    # [R] int32: added to the row's decode positions in the model's rope (multimodal rope's delta
    # between the next rope position and the prompt's token count, `_multimodal`); 0: none
    rope_delta: np.ndarray
    key: np.ndarray  # [R, 2] uint32: each row's PRNG key data (the last field)

    @classmethod
    def build(
        cls,
        rows: Sequence[tuple[object, dict[int, float], np.ndarray]],
        *,
        vocab_size: int | None,
        bias_slots: int,
        held_slots: int = 0,
        mask_words: int = 0,
    ) -> RowSampling:
        """From (a `SamplingConfig`, {token id: bias}, key data [2] uint32) per row; ids are checked against
        `vocab_size` where it is known. No row holds a token back (`held_ids` unused, `min_position` 0)
        nor is constrained (`allowed` [R, mask_words] all ones)."""
        count = len(rows)
        unused = np.iinfo(np.int32).max if vocab_size is None else vocab_size  # an id past the logits: dropped
        bias_ids = np.full((count, bias_slots), unused, np.int32)
        bias_values = np.zeros((count, bias_slots), np.float32)
        for row, (_, biases, _) in enumerate(rows):
            if len(biases) > bias_slots:
                raise GenerationError(
                    f"logit_bias holds {len(biases)} tokens; pass at most {bias_slots} (a program holds that many per row)"
                )
            for slot, (token, value) in enumerate(sorted(biases.items())):
                if token < 0 or (vocab_size is not None and token >= vocab_size):
                    raise GenerationError(
                        f"logit_bias names token {token}, outside the vocabulary [0, {vocab_size}); pass ids the "
                        "tokenizer gives"
                    )
                bias_ids[row, slot], bias_values[row, slot] = token, value

        def column(name: str, dtype) -> np.ndarray:
            return np.asarray([getattr(config, name) for config, _, _ in rows], dtype)

        return cls(
            temperature=np.asarray([c.temperature if c.do_sample else 0.0 for c, _, _ in rows], np.float32),
            top_k=column("top_k", np.int32),
            top_p=column("top_p", np.float32),
            min_p=column("min_p", np.float32),
            repetition_penalty=column("repetition_penalty", np.float32),
            presence_penalty=column("presence_penalty", np.float32),
            frequency_penalty=column("frequency_penalty", np.float32),
            bias_ids=bias_ids,
            bias_values=bias_values,
            min_position=np.zeros(count, np.int32),
            held_ids=np.full((count, held_slots), unused, np.int32),
            pads=np.zeros(count, np.int32),
            first_new=np.zeros(count, np.int32),
            max_new_tokens=np.zeros(count, np.int32),
            allowed=np.full((count, mask_words), -1, np.int32),
            constrained=np.zeros(count, bool),
            lora=np.full(count, -1, np.int32),
            rope_delta=np.zeros(count, np.int32),
            key=np.stack([np.asarray(key, np.uint32) for _, _, key in rows]).reshape(count, 2),
        )

    @classmethod
    def empty(
        cls, count: int, *, vocab_size: int | None, bias_slots: int, held_slots: int = 0, mask_words: int = 0
    ) -> RowSampling:
        """R rows that take the most likely token, with nothing else on."""
        unused = np.iinfo(np.int32).max if vocab_size is None else vocab_size

        def filled(value, dtype, shape=(count,)):
            return np.full(shape, value, dtype)

        return cls(
            temperature=filled(0.0, np.float32), top_k=filled(0, np.int32), top_p=filled(1.0, np.float32),
            min_p=filled(0.0, np.float32), repetition_penalty=filled(1.0, np.float32),
            presence_penalty=filled(0.0, np.float32), frequency_penalty=filled(0.0, np.float32),
            bias_ids=filled(unused, np.int32, (count, bias_slots)), bias_values=filled(0.0, np.float32, (count, bias_slots)),
            min_position=filled(0, np.int32), held_ids=filled(unused, np.int32, (count, held_slots)),
            pads=filled(0, np.int32), first_new=filled(0, np.int32),
            max_new_tokens=filled(0, np.int32), allowed=filled(-1, np.int32, (count, mask_words)),
            constrained=filled(False, bool), lora=filled(-1, np.int32),
            rope_delta=filled(0, np.int32), key=filled(0, np.uint32, (count, 2)),
        )  # fmt: skip

    def leaves(self) -> tuple:
        """The arrays in field order: plain containers, which `jax.export` keeps (`RowSampling(*leaves)`)."""
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self))

    def set_row(self, row: int, other: RowSampling) -> None:
        """Writes `other`'s one row into row `row` (host arrays, in place)."""
        for field in dataclasses.fields(self):
            getattr(self, field.name)[row] = getattr(other, field.name)[0]


def row_keys(keys):
    """[R, 2] uint32 key data: each row's key with its row index folded in (inside a program), so
    that rows given one seed draw apart."""
    fold = jax.vmap(lambda key, row: jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(key), row)))
    return fold(keys, jax.numpy.arange(keys.shape[0], dtype=jax.numpy.uint32))


def key_data(seed: int) -> np.ndarray:
    """[2] uint32: the PRNG key data of a seed, as `jax.random.key_data(jax.random.key(seed))` gives it
    with 64-bit types off (the seed's low 32 bits), without running a program."""
    return np.asarray([0, int(seed) & 0xFFFFFFFF], np.uint32)
