"""Text generation on JAX: the engine behind `Model.generate` (and, later, a server's batches).

Parts, one concern each (docs/architecture.md describes the engine's internal API):
    _settings.py   transformers' generation arguments and generation_config.json, merged and
                   checked into one frozen, hashable `GenerationSettings`
    _planning.py   batch planning: padding to buckets and devices, buffer lengths, cache windows
    _adapters.py   how a model keeps its past while decoding, one adapter per cache kind
    _state.py      `DecodeState`, the decode loop's state as a pytree dataclass
    _choose.py     logits processors, sampling or a beam step, the state moved on by a token
    _sampling.py   temperature, top-k / top-p / min-p, repetition penalty, n-gram bans, biases
    _beam.py       beam search steps as transformers runs them
    _caches.py     the static KV cache, cut into windows
    _programs.py   the one program cache: in memory, and on disk as `jax.export` blobs
    _engine.py     `Generator`, which drives them for `Model.generate`
    _multimodal.py prefill-only model inputs (images), multimodal rope positions
    _vision_chat.py `chat_with_images`: conversations with images through a processor

Public names: `GenerationSettings`, `GenerationStats`, `chat_with_images`.
"""

from ._engine import GenerationStats
from ._settings import GenerationSettings
from ._vision_chat import chat_with_images

__all__ = ["GenerationSettings", "GenerationStats", "chat_with_images"]
