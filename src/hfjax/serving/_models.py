"""The model names a server answers to: its base model's and, with LoRA on (`hfjax serve
--enable-lora`), the adapters loaded beside it, as vLLM serves them.

A request's `model` picks the weights it runs with: the base's name the base alone, an adapter's name
the base with that adapter (its slot in the model, `SamplingParams.adapter`). Adapters are loaded at
start (the CLI's --lora-modules) and, where the server allows it, at run time (vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter). An unloaded adapter's name is refused to new
requests at once, and its slot is freed (`Model.delete_adapter`) only once the requests running on it
have finished, so that its arrays are rewritten after the last of them; the unload's answer does not
wait for that. Loads and deletes run one at a time on a thread of their own: off the event loop, and
never two writers of the model's adapters at once.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping

from .._errors import LoadError
from ._metrics import Metrics
from ._protocol import ApiError, invalid, unknown_model

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Served:
    index: int  # the adapter's slot (`hfjax.lora.Adapter.index`)
    path: str
    parent: str  # the base name /v1/models gives as its parent
    created: int


class ServedModels:
    """The base model's name and its LoRA adapters' (`lora=True`): the /v1/models cards, each request's
    adapter slot, the requests running on each adapter, and loading and unloading at run time.

    Args:
        model: the served `hfjax.Model`; with `lora`, its adapters (`Model.adapters`) are served by name.
        base: the base model's served name.
        root: what /v1/models gives as the base's `root` (its checkpoint).
        max_model_len: the base's card's `max_model_len` (None: left out).
        lora: serve the model's adapters, and load and unload them.
        parents: {adapter name: the base name its card gives as `parent`} (vLLM's base_model_name of a
            --lora-modules entry); default: `base`.
        metrics: counts requests per model name and the adapters loaded.
    """

    def __init__(
        self, model, base: str, *, root: str, max_model_len: int | None, lora: bool,
        parents: Mapping[str, str] | None = None, metrics: Metrics,
    ):  # fmt: skip
        self.model, self.base, self.lora, self.metrics = model, base, lora, metrics
        self.created = int(time.time())
        self._base_card = {"id": base, "object": "model", "created": self.created, "owned_by": "hfjax", "root": root,
                           "parent": None}  # fmt: skip
        if max_model_len is not None:
            self._base_card["max_model_len"] = max_model_len
        self._lock = threading.Lock()  # the engine thread ends requests; the event loop starts them
        self._served: dict[str, _Served] = {}
        self._loading: set[str] = set()
        self._draining: set[str] = set()  # unloaded, not yet deleted: requests still run on them
        self._running: collections.Counter[str] = collections.Counter()
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hfjax-adapters") if lora else None
        for name, adapter in (model.adapters if lora else {}).items():
            self._served[name] = _Served(adapter.index, adapter.path, (parents or {}).get(name, base), self.created)
        self._count_loaded()

    def names(self) -> tuple[str, ...]:
        """The names requests may give as `model`: the base's first, then the adapters' in load order."""
        with self._lock:
            return (self.base, *self._served)

    def cards(self) -> list[dict]:
        """/v1/models' entries, as vLLM's: the base, then each adapter with its `root` (the directory it
        was loaded from) and `parent` (the base)."""
        with self._lock:
            served = list(self._served.items())
        cards = [{"id": name, "object": "model", "created": s.created, "owned_by": "hfjax"} for name, s in served]
        return [self._base_card] + [{**card, "root": s.path, "parent": s.parent} for card, (_, s) in zip(cards, served)]

    def card(self, name: str) -> dict:
        """/v1/models/{name}'s entry; a 404 (`unknown_model`) for a name not served."""
        for card in self.cards():
            if card["id"] == name:
                return card
        raise unknown_model(name, self.names())

    def start(self, name: str, requests: int) -> int:
        """The adapter slot that `requests` engine requests asking for model `name` run with (-1: the
        base alone), counted as running on it until `finished` is called for each; a 404 where `name`
        is no longer served (unloaded since the request was read)."""
        with self._lock:
            served = self._served.get(name)
            if served is None and name != self.base:
                raise unknown_model(name, (self.base, *self._served))
            if served is not None:
                self._running[name] += requests
        self.metrics.count_model_request(name)
        return -1 if served is None else served.index

    def finished(self, name: str, requests: int = 1) -> None:
        """`requests` of those `start` counted for `name` have ended (on any thread); the last one on an
        unloaded adapter frees its slot."""
        if name == self.base:
            return
        with self._lock:
            self._running[name] -= requests
            idle = self._running[name] <= 0
            if idle:
                del self._running[name]
            delete = idle and name in self._draining
        if delete:
            self._writer.submit(self._delete, name)

    async def load(self, name: str, path: str) -> str:
        """Loads the adapter at `path` as `name` (vLLM's /v1/load_lora_adapter); its answer text.

        Raises:
            ApiError: 400 for a name served, loading or still being unloaded, or an adapter the model
                cannot load (the model's reason: no such directory, a rank above the reserved one, no
                free slot, ...).
        """
        with self._lock:
            taken = (
                "is the base model's" if name == self.base
                else "has already been loaded" if name in self._served
                else "is being loaded by another request" if name in self._loading
                else "is being unloaded; requests on it still run" if name in self._draining
                else None
            )  # fmt: skip
            if taken is not None:
                raise invalid("lora_name", f"lora_name={name!r} {taken}; pass another name")
            self._loading.add(name)
        try:
            future = self._writer.submit(self.model.load_adapter, path, name)
            adapter = await asyncio.wrap_future(future)
        except LoadError as error:
            raise invalid("lora_path", f"lora_path={path!r} cannot be loaded as {name!r}: {error}") from None
        finally:
            with self._lock:
                self._loading.discard(name)
        with self._lock:
            self._served[name] = _Served(adapter.index, adapter.path, self.base, int(time.time()))
        self._count_loaded()
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> str:
        """Stops serving adapter `name` (vLLM's /v1/unload_lora_adapter) and frees its slot once the
        requests running on it have finished (at once where none runs); its answer text.

        Raises:
            ApiError: 404 for a name that is not a loaded adapter.
        """
        with self._lock:
            if self._served.pop(name, None) is None:
                loaded = ", ".join(map(repr, self._served)) or "none"
                raise ApiError(
                    404, f"lora_name={name!r} is not a loaded adapter (loaded: {loaded})", param="lora_name",
                    kind="NotFoundError", code="model_not_found",
                )  # fmt: skip
            self._draining.add(name)
            idle = self._running[name] <= 0
        if idle:
            self._writer.submit(self._delete, name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _delete(self, name: str) -> None:  # on the writer thread
        try:
            self.model.delete_adapter(name)
        except Exception:  # noqa: BLE001 - no caller waits: the server's log gets it
            _log.exception("hfjax serve: the unloaded LoRA adapter %r could not be deleted", name)
        with self._lock:
            self._draining.discard(name)
        self._count_loaded()

    def _count_loaded(self) -> None:
        if self.lora:
            self.metrics.adapters_loaded = len(self.model.adapters)

    def close(self) -> None:
        """Waits for the loads and deletes under way, and stops their thread."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
