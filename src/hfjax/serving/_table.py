"""The engine's row state on the host: which request holds each slot, what each slot's cache holds,
each slot's settings, and the device copies of the small arrays the programs take."""

from __future__ import annotations

import secrets

import jax.numpy as jnp
import numpy as np

from .. import generation
from ._requests import Request


class SlotTable:
    """S slots: their requests, positions, cached tokens and sampling settings (host arrays).
    `row_counts`: the rows a decode chunk may run (its programs' row counts), ascending, the last `slots`.
    `move_tokens`: the fewest cached tokens worth moving between slots (`assign`); 0: never moved."""

    def __init__(
        self,
        slots: int,
        *,
        vocab_size: int,
        bias_slots: int,
        held_slots: int,
        mask_words: int,
        prefix_reuse: bool,
        row_counts: list[int],
        move_tokens: int = 0,
    ):
        self.slots = slots
        self.row_counts = row_counts
        self.prefix_reuse = prefix_reuse
        self.move_tokens = move_tokens if prefix_reuse else 0
        # Pairs of free slots that are to trade what they hold (`assign`), in order, before any
        # call runs on them: the engine hands them to `CoreCalls.swap`, and empties the list.
        self.moves: list[tuple[int, int]] = []
        self._released = [0] * slots  # when each slot was last freed (a count of releases): 0, never
        self._releases = 0
        self.requests: list[Request | None] = [None] * slots
        self.cached: list[list[int]] = [[] for _ in range(slots)]  # token ids whose keys each row holds
        # The LoRA adapter those keys were computed with (None: the base): a prefix is reused only by a
        # request of the same adapter, as loaded then (an adapter loaded again is another object).
        self.cached_adapter: list[object | None] = [None] * slots
        self.positions = np.zeros(slots, np.int32)  # each slot's last token's position, as the device has it
        self.rows = generation.RowSampling.empty(
            slots, vocab_size=vocab_size, bias_slots=bias_slots, held_slots=held_slots, mask_words=mask_words
        )
        self.vocab_size, self.bias_slots, self.held_slots = vocab_size, bias_slots, held_slots
        self.mask_words = mask_words
        self.copies = DeviceCopies()

    @property
    def occupied(self) -> int:
        return sum(request is not None for request in self.requests)

    def free(self) -> bool:
        return None in self.requests

    def decoding(self) -> dict[int, Request]:
        """{slot: request} of the slots whose request decodes."""
        return {slot: r for slot, r in enumerate(self.requests) if r is not None and r.decoding}

    def reading(self) -> list[Request]:
        """The requests still reading their prompt, oldest first."""
        return sorted((r for r in self.requests if r is not None and r.reading), key=lambda r: r.arrived)

    def decode_rows(self, highest: int) -> int:
        """The rows a decode chunk runs while `highest` is the highest slot in it: slots 0..highest,
        in the buckets of `row_counts` (the chunk's programs are compiled per bucket)."""
        return next(rows for rows in self.row_counts if rows > highest)

    def assign(self, request: Request) -> int:
        """Puts `request` in a free slot among those that widen the decode chunk no more than the
        lowest free slot would (low slots keep decode chunks small: a chunk runs the rows up to the
        highest busy slot, in buckets): the one whose cached tokens share the longest prefix with its
        prompt, else the one whose cache is worth least (`_worth`), else the lowest; returns the slot.
        A reused prefix is not read again (at least the last prompt token runs, for the logits of the
        first new token); with a repetition penalty the whole prompt is read, which its history needs.
        Only keys of the request's own LoRA adapter (or of the base, for a request of the base) are
        reused. The row runs with the request's adapter.

        Where `move_tokens` > 0, the free slots past the chunk hold prefixes too, as a store: a prefix
        there at least `move_tokens` longer than the best within reach trades places with the chosen
        slot's (`moves`), and a chosen slot whose cache is worth keeping first trades with the free slot
        there worth least (unless the request reuses `move_tokens` of it or more), so that a finished
        request's prompt outlives the next request in its slot
        (vLLM's prefix cache keeps a freed block until its memory is needed)."""
        free = [slot for slot, held in enumerate(self.requests) if held is None]
        busy = [slot for slot, held in enumerate(self.requests) if held is not None]
        widest = self.decode_rows(max([*busy, free[0]]))
        near = [slot for slot in free if slot < widest]
        far = [slot for slot in free if slot >= widest]
        reuse = self.prefix_reuse and request.settings.sampling.repetition_penalty == 1.0 and request.images is None

        def shared(slot: int) -> int:  # prompt tokens whose keys the slot holds and it reuses
            same = reuse and self.cached_adapter[slot] is request.adapter
            return _common_prefix(self.cached[slot], request.prompt) if same else 0

        slot = max(near, key=lambda s: (shared(s), -self._worth(s), -s))
        if far and self.move_tokens:
            stored = max(far, key=lambda s: (shared(s), -s))
            spare = min(far, key=lambda s: (self._worth(s), s))
            if shared(stored) - shared(slot) >= self.move_tokens:
                self._swap(slot, stored)
            elif shared(slot) < self.move_tokens and self._worth(spare) < self._worth(slot):
                self._swap(slot, spare)
        reused = min(shared(slot), len(request.prompt) - 1)
        request.prefilled = request.started = reused
        request.slot = slot
        self.requests[slot] = request
        self.cached[slot] = []
        seed = request.params.seed if request.params.seed is not None else secrets.randbits(32)
        row = request.settings.row_sampling(
            1, generation.key_data(seed), self.vocab_size, bias_slots=self.bias_slots, held_slots=self.held_slots,
            stop_token_ids=request.params.stop_token_ids, lengths=[len(request.prompt)], mask_words=self.mask_words,
        )  # fmt: skip
        self.rows.set_row(slot, row)
        self.rows.lora[slot] = request.params.adapter
        if request.matcher is not None:  # the first token's mask: the prefill's last chunk chooses it
            self.rows.constrained[slot] = True
            request.matcher.fill(self.rows.allowed[slot])
        return slot

    def constrain(self, request: Request) -> None:
        """Fills the mask of the tokens the request's grammar allows next into its slot's row."""
        request.matcher.fill(self.rows.allowed[request.slot])

    def release(self, request: Request) -> None:
        """Frees the request's slot, remembering what its cache holds for certain: the prompt read
        so far and every new token fed back (all but the last kept one, which a chunk may or may not
        have run)."""
        slot = request.slot
        self.requests[slot] = None
        fed = request.text.ids[:-1] if request.prefilled == len(request.prompt) else []
        # (an image's tokens hold keys of that image: no prompt with the same placeholder tokens reuses them)
        self.cached[slot] = request.prompt[: request.prefilled] + fed if request.images is None else []
        self.cached_adapter[slot] = request.adapter
        self.positions[slot] = 0
        self.rows.constrained[slot] = False
        self._releases += 1
        self._released[slot] = self._releases

    def _worth(self, slot: int) -> int:
        """How much the keys a free slot holds are worth keeping: 0 for fewer than `move_tokens` tokens
        (or where nothing moves), else when the slot was last freed (the least recently used is worth least)."""
        if not self.move_tokens or len(self.cached[slot]) < self.move_tokens:
            return 0
        return self._released[slot]

    def _swap(self, a: int, b: int) -> None:
        """Free slots a and b trade what their caches hold: here, and on the device (`moves`)."""
        self.moves.append((a, b))
        for kept in (self.cached, self.cached_adapter, self._released):
            kept[a], kept[b] = kept[b], kept[a]

    def sampling(self) -> generation.RowSampling:
        """The slots' settings as device arrays (sent only when the host's have changed)."""
        return generation.RowSampling(*(self.copies(f"rows.{i}", array) for i, array in enumerate(self.rows.leaves())))


class DeviceCopies:
    """Device copies of the engine's small host arrays (settings, the decoding slots, ...), each sent
    again only when the host's array has changed since: in a steady decode a chunk sends nothing."""

    def __init__(self):
        self._sent: dict[str, tuple[np.ndarray, object]] = {}

    def __call__(self, name: str, host: np.ndarray):
        kept = self._sent.get(name)
        if kept is None or kept[0].shape != np.shape(host) or not np.array_equal(kept[0], host):
            copy = np.array(host, copy=True)  # (the device array may share its memory: never changed)
            kept = self._sent[name] = (copy, jnp.asarray(copy))
        return kept[1]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
