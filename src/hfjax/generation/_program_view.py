"""`GenerationPrograms`: a read-only view of the programs `Model.generate` prepared and ran for one model."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._engine import Generator

_STAGES = ("prefill", "decode")


class GenerationPrograms:
    """Which programs `Model.generate` has prepared for one model, and where they ran: the face tests
    (and anyone chasing a recompile) use to see inside the engine, reached as `Model.generation_programs`.

    It holds nothing of its own: every read goes to the model's engine as it is then (`engine()`: the
    model's `Generator`, or None before its first `generate`; `load_adapter` and `reserve_adapters`
    start a new one). Counts are per stage ("prefill", "decode") in this process, and cover the slot
    core's programs too, which share the engine's program cache.

    Example:
      >>> before = model.generation_programs.counts
      >>> model.generate(ids, max_new_tokens=4)
      >>> model.generation_programs.counts == before  # True: no new program was traced or read
    """

    def __init__(self, engine: Callable[[], Generator | None]):
        self._engine = engine

    @property
    def traced(self) -> dict[str, int]:
        """Traces of the model per stage (an abstract trace for a state's structure counts too)."""
        generator = self._engine()
        return dict.fromkeys(_STAGES, 0) if generator is None else generator.trace_counts

    @property
    def loaded(self) -> dict[str, int]:
        """Programs read from disk per stage (`hfjax.set_cache_dir`), not traced."""
        generator = self._engine()
        return dict.fromkeys(_STAGES, 0) if generator is None else generator.load_counts

    @property
    def counts(self) -> dict[str, int]:
        """Programs prepared per stage, traced or read from disk."""
        generator = self._engine()
        return dict.fromkeys(_STAGES, 0) if generator is None else generator.program_counts

    @property
    def on_slot_core(self) -> bool:
        """Whether a call ran on the slot core (the programs `hfjax serve` runs) rather than on the
        engine's own programs: it built slot programs for it."""
        generator = self._engine()
        return generator is not None and bool(generator.slot_runs._programs)

    def keys(self, stage: str | None = None) -> list[tuple]:
        """The keys of the programs held in memory (of `stage` alone, when given), in the order they
        were prepared; a key's first item is its stage."""
        generator = self._engine()
        keys = [] if generator is None else generator.programs.keys()
        return [key for key in keys if stage is None or key[0] == stage]

    def path(self, key: tuple) -> pathlib.Path | None:
        """Where the program for `key` is kept on disk (`hfjax.set_cache_dir`), or None where nothing is
        kept (no cache directory, or weights over several devices)."""
        generator = self._engine()
        return None if generator is None else generator.programs.path(key)

    def specializations(self, stage: str) -> list[dict]:
        """Per program of `stage` whose trace reads values of its data: the values each of its
        compiled variants was built on ({values key: values}), in the order the programs were made."""
        generator = self._engine()
        if generator is None:
            return []
        return [dict(found.built) for key, found in generator._specialized.items() if key[0] == stage]
