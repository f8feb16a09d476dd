"""How many sequence slots an engine runs, and how long each is: from a memory budget for the KV
cache, as vLLM sizes its cache from `--gpu-memory-utilization` or `--kv-cache-memory`, not from a
fixed batch."""

from __future__ import annotations

import dataclasses
import os

import jax

from .. import bridge, generation
from .._errors import ServingError

# Slots when nothing else bounds them: an accelerator runs many rows per step for nearly the cost of
# one; on the CPU each row costs, and more rows mean more programs to compile.
MOST_SLOTS = {"accelerator": 256, "cpu": 64}
ACCELERATOR_SHARE = 0.8  # of the device memory free after the weights
CPU_SHARE, CPU_MOST = 0.25, 4 * 2**30  # of the free RAM, at most 4 GiB
DEFAULT_LENGTH = 2048  # cache columns per slot where the config names no context


@dataclasses.dataclass(frozen=True)
class Sizing:
    """What an engine chose: S slots of max_model_len tokens, and why."""

    slots: int
    max_model_len: int
    bytes_per_slot: int
    budget: int  # bytes for the KV cache
    budget_source: str  # where the budget came from, for the startup line

    def describe(self) -> str:
        total = self.slots * self.bytes_per_slot
        return (
            f"{self.slots} sequence slots x {self.max_model_len} tokens: KV cache {_size(total)} "
            f"({_size(self.bytes_per_slot)} a slot) of a {_size(self.budget)} budget ({self.budget_source})"
        )


def size_engine(model, *, max_num_seqs: int | None, max_model_len: int | None, kv_cache_memory: int | None) -> Sizing:
    """The slots and cache length for `model`: max_model_len (default: the model's context), and as
    many slots as the budget holds, at most max_num_seqs (default: 256 on an accelerator, 64 on the CPU).

    Raises:
      ServingError: a value out of range, or a budget that holds no slot, naming what to pass.
    """
    for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                        ("kv_cache_memory", kv_cache_memory)):  # fmt: skip
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ServingError(f"Engine: {name}={value!r}; pass a whole number >= 1")
    context = bridge.context_length(model.module.config.get_text_config(decoder=True))
    if max_model_len is None:
        max_model_len = context or DEFAULT_LENGTH
    if context is not None and max_model_len > context:
        raise ServingError(
            f"Engine: max_model_len={max_model_len} is beyond the model's context of {context} tokens "
            f"(config.max_position_embeddings); pass max_model_len<={context}"
        )
    generation.check_supported(model)
    per_slot = generation.SlotModel(model, 1, max_model_len).bytes_per_slot()
    if kv_cache_memory is not None:
        budget, source = kv_cache_memory, "kv_cache_memory"
    else:
        budget, source = default_budget()
    kind = "cpu" if jax.default_backend() == "cpu" else "accelerator"
    most = max_num_seqs if max_num_seqs is not None else MOST_SLOTS[kind]
    slots = min(most, budget // per_slot)
    if slots < 1:
        raise ServingError(
            f"Engine: a KV cache budget of {_size(budget)} ({source}) holds no slot of max_model_len={max_model_len} "
            f"tokens ({_size(per_slot)} each); pass a smaller max_model_len or kv_cache_memory>={per_slot}"
        )
    return Sizing(slots, max_model_len, per_slot, budget, source)


def default_budget() -> tuple[int, str]:
    """(bytes for the KV cache, where that figure comes from) on the device JAX runs on."""
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return int(free * ACCELERATOR_SHARE), f"{ACCELERATOR_SHARE:.0%} of {device.device_kind}'s free memory"
    available = _available_ram()
    share = min(CPU_MOST, int(available * CPU_SHARE))
    return share, f"a quarter of the {_size(available)} of free RAM, at most {_size(CPU_MOST)}"


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _size(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"
