"""Text generation on JAX: the engine behind `Model.generate`, and the continuous-batching core under `hfjax serve`.

Parts, one concern each (docs/architecture.md describes the engine's internal API):
    _settings.py   transformers' generation arguments and generation_config.json, merged and
                   checked into one frozen, hashable `GenerationSettings`
    _planning.py   batch planning: padding to buckets and devices, buffer lengths, cache windows
    _adapters.py   how a model keeps its past while decoding, one adapter per cache kind
    _state.py      `DecodeState`, the decode loop's state as a pytree dataclass
    _choose.py     the one token choice (`choose_tokens`: biases, processors, penalties, warpers,
                   the pick), and generate's state moved on by a token or a beam step
    _sampling.py   temperature, top-k / top-p / min-p, repetition penalty, n-gram bans, biases
    _beam.py       beam search steps as transformers runs them
    _caches.py     the static KV cache, cut into windows
    _programs.py   the one program cache: in memory, and on disk as `jax.export` blobs
    _rows.py       each row's sampling settings as arrays (`RowSampling`), what a program compiles
                   of the token choice (`SamplingFeatures`)
    _grammar.py    structured outputs on the host: constraints compiled by llguidance, each row's
                   matcher filling its allowed-token bitmask (`Constraint`, `Grammars`)
    _slots.py      the continuous-batching core: a KV cache of S slots, a chunked multi-row
                   prefill and an N-step decode over it (`SlotModel`, `SlotState`, `Chosen`)
    _slot_programs.py `SlotPrograms`: a slot model's prefill and decode programs, compiled per
                   (kind, rows, columns) and kept in the program cache
    _recurrent.py  a recurrent state per slot: which models keep one (Mamba, hybrids), the cache
                   layers that hold a slot's rows of it
    _speculative.py speculative decoding's setting (`Speculation`), its prompt-lookup drafter on the
                   device, how many tokens a round keeps, speculative sampling's rule
    _speculative_slots.py `SpeculativeSlotModel`: the slot core's decode in rounds of drafts
                   verified by one forward (prompt lookup, or a draft model with its own cache)
    _encoder_slots.py encoder-decoders on the slot core: each slot's cross-attention keys and values,
                   written by a prefill that runs the encoder (`EncoderDecoderSlotModel`)
    _on_slots.py   `Model.generate` on the slot core: every row admitted at once, decoded to its end
    _slot_beams.py beam search over the slot cache, a program family of its own
    _engine.py     `Generator`, which runs `Model.generate`: on the slot core where that carries
                   out the call (`_on_slots`), else with its own programs (docs/architecture.md,
                   "Where each kind of model runs")
    _program_view.py `GenerationPrograms`: which programs the engine prepared and where calls ran
                   (`Model.generation_programs`), read-only, for tests
    _limits.py     `check_limits`: max_new_tokens and min_new_tokens against the prompt and the context
    _generate.py   `generate`: `Model.generate`'s arguments checked and resolved into one engine run
    _multimodal.py prefill-only model inputs (images), multimodal rope positions
    _vision_chat.py `chat_with_images`: conversations with images through a processor

Public names, what the rest of hfjax imports: for users, `chat_with_images` (also
`hfjax.chat_with_images`); for `Model`, `Generator`, `generate` and `GenerationPrograms` (the face tests
read the engine through, `Model.generation_programs`); for the CLI, `check_takes_images`, `load_image`,
`encode`, `SamplingConfig`; for the server, the rest (`__all__`): the settings and the length check, the
slot core, speculative decoding, structured outputs, the stop rule, a processor's outputs.
"""

from ._encoder_slots import check_supported, slot_model
from ._engine import Generator, check_draft
from ._generate import generate
from ._grammar import Constraint, ConstraintError, Grammars, Matcher, bitmask_words
from ._limits import LimitError, LimitNames, check_limits
from ._on_slots import takes_images
from ._program_view import GenerationPrograms
from ._rows import MAX_HELD_STOP_TOKENS, MAX_LOGIT_BIAS, RowSampling, SamplingFeatures, key_data
from ._settings import GenerationSettings, SamplingConfig, resolve_settings
from ._slot_programs import SlotPrograms
from ._slots import TOP_LOGPROBS, Chosen, SlotModel, SlotState, reads_no_data
from ._speculative import Speculation
from ._speculative_slots import SpeculativeSlotModel
from ._stops import stopped
from ._vision_chat import chat_with_images, check_takes_images, encode, load_image, processed

__all__ = [
    "Chosen",
    "Constraint",
    "ConstraintError",
    "GenerationPrograms",
    "GenerationSettings",
    "Generator",
    "Grammars",
    "LimitError",
    "LimitNames",
    "MAX_HELD_STOP_TOKENS",
    "MAX_LOGIT_BIAS",
    "Matcher",
    "RowSampling",
    "SamplingConfig",
    "SamplingFeatures",
    "SlotModel",
    "SlotPrograms",
    "SlotState",
    "Speculation",
    "SpeculativeSlotModel",
    "TOP_LOGPROBS",
    "bitmask_words",
    "chat_with_images",
    "check_draft",
    "check_limits",
    "check_supported",
    "check_takes_images",
    "encode",
    "generate",
    "key_data",
    "load_image",
    "processed",
    "reads_no_data",
    "resolve_settings",
    "slot_model",
    "stopped",
    "takes_images",
]
