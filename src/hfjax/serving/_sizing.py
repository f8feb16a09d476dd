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


def size_engine(
    model,
    *,
    max_num_seqs: int | None,
    max_model_len: int | None,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float | None = None,
    draft=None,
) -> Sizing:
    """The slots and cache length for `model`: max_model_len (default: the model's context), and as
    many slots as the budget holds, at most max_num_seqs (default: 256 on an accelerator, 64 on the CPU).
    The budget is kv_cache_memory bytes where given (gpu_memory_utilization is then not used), else
    `utilization_budget(gpu_memory_utilization)` where that is given, else `default_budget()`. A
    speculative decode's `draft` model keeps its own cache in the same slots: a slot holds both.

    Raises:
      ServingError: a value out of range, or a budget that holds no slot, naming what to pass.
    """
    for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                        ("kv_cache_memory", kv_cache_memory)):  # fmt: skip
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ServingError(f"Engine: {name}={value!r}; pass a whole number >= 1")
    utilization = gpu_memory_utilization
    if utilization is not None and (
        isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1
    ):
        raise ServingError(
            f"Engine: gpu_memory_utilization={utilization!r} is out of range; pass a fraction in (0, 1], such as 0.9"
        )
    decoder = model.module.config.get_text_config(decoder=True)
    # (an encoder-decoder's decoder may count its own: Whisper's max_target_positions)
    context = bridge.context_length(decoder) or getattr(decoder, "max_target_positions", None)
    if max_model_len is None:
        max_model_len = context or DEFAULT_LENGTH
    if context is not None and max_model_len > context:
        raise ServingError(
            f"Engine: max_model_len={max_model_len} is beyond the model's context of {context} tokens "
            f"(config.max_position_embeddings); pass max_model_len<={context}"
        )
    generation.check_supported(model)
    with generation.reads_no_data(model):  # (the slots' shapes come from an abstract run of the model)
        per_slot = sum(
            generation.slot_model(m, 1, max_model_len).bytes_per_slot() for m in (model, draft) if m is not None
        )
    if kv_cache_memory is not None:
        budget, source = kv_cache_memory, "kv_cache_memory"
        if gpu_memory_utilization is not None:
            source += f"; gpu_memory_utilization={gpu_memory_utilization} not used"
    elif gpu_memory_utilization is not None:
        budget, source = utilization_budget(gpu_memory_utilization)
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
    memory = _device_memory()
    if memory is not None:
        total, used, name = memory
        return int((total - used) * ACCELERATOR_SHARE), f"{ACCELERATOR_SHARE:.0%} of {name}'s free memory"
    available = _ram()[1]
    share = min(CPU_MOST, int(available * CPU_SHARE))
    return share, f"a quarter of the {_size(available)} of free RAM, at most {_size(CPU_MOST)}"


def utilization_budget(fraction: float) -> tuple[int, str]:
    """(bytes for the KV cache, where that figure comes from): `fraction` of the device's memory less
    what is in use now (the weights, and on the CPU every process's RAM), as vLLM's
    --gpu-memory-utilization. The device's memory is what JAX may allocate on an accelerator
    (`bytes_limit`), the machine's RAM (MemTotal, in use: MemTotal - MemAvailable) on the CPU.

    Raises:
      ServingError: a fraction that leaves nothing for the cache, naming the sizes and the fix.
    """
    memory = _device_memory()
    if memory is not None:
        total, used, name = memory
        what = f"{name}'s memory"
    else:
        total, available = _ram()
        used, what = total - available, "the RAM"
    budget = int(total * fraction) - used
    if budget < 1:
        raise ServingError(
            f"Engine: gpu_memory_utilization={fraction} of {what} ({_size(total)}) is {_size(int(total * fraction))}, "
            f"less than the {_size(used)} in use already; pass a larger fraction, or kv_cache_memory"
        )
    return budget, f"gpu_memory_utilization={fraction} of {what} ({_size(total)}), less {_size(used)} in use"


def _device_memory() -> tuple[int, int, str] | None:
    """(bytes JAX may allocate, bytes in use, the device's kind) on an accelerator; None on the CPU."""
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"], stats.get("bytes_in_use", 0), device.device_kind


def _ram() -> tuple[int, int]:
    """(total, available) bytes of RAM."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemTotal"].split()[0]) * 1024, int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page


def _size(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"
