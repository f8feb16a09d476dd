"""The engine's one program cache: compiled programs kept per key, in memory and on disk.

JAX's persistent compilation cache (`hfjax.set_cache_dir`) skips XLA's compile, but a new
process still has to trace the torch model through torchax to learn what to compile: about
0.2 s per program for a 150M-parameter Llama, most of a warm start's time to first token.
`ProgramCache` keeps each traced program as a `jax.export` blob beside JAX's own entries, with
metadata (where the state's named fields lie in its flat list of leaves), so that a new process
runs it without tracing.

A program is found again by a digest of everything that shapes it: hfjax's source, the
versions of the libraries that trace it, the backend and what its hook adds, the model's class
and config, its parameters' names, shapes and dtypes, and the program's own key. A blob that
cannot be read is ignored, and the program is traced as if it were absent.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib
import tempfile
from collections.abc import Callable

import jax

from .. import _backend, _compilation_cache, bridge

_SUFFIX = ".hfjax-program"  # JAX's cache only lists its own "*-cache" files
_HEADER_BYTES = 8  # little-endian length of the JSON metadata that precedes the blob


@functools.cache
def _source_digest() -> str:
    """sha256 of hfjax's own source: a changed lowering must not reuse an old program."""
    digest = hashlib.sha256()
    root = pathlib.Path(__file__).parent.parent
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _versions() -> dict[str, str | None]:
    versions = {}
    for name in ("jax", "jaxlib", "torch", "torchax", "transformers"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def model_fingerprint(module, params: dict, aliases: dict) -> dict:
    """What a model contributes to its programs' digests (its weights' values do not)."""
    config = module.config.to_dict()
    config.pop("_name_or_path", None)  # the same checkpoint copied elsewhere traces the same
    cls = type(module)
    backend = _backend.active()
    return {
        "hfjax": _source_digest(),
        "versions": _versions(),
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "backend_hook": [backend.name, backend.fingerprint()],
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "config": json.dumps(config, sort_keys=True, default=repr),
        "params": sorted((name, list(a.shape), str(a.dtype)) for name, a in params.items()),
        "aliases": sorted(aliases.items()),
    }


def single_device(params: dict) -> bool:
    """Whether every parameter lives on one device: exported programs are kept only for those."""
    return all(len(a.sharding.device_set) == 1 for a in params.values() if isinstance(a, jax.Array))


@dataclasses.dataclass
class Program:
    """A compiled program and what its trace recorded for the host (`metadata`, read after the
    program was traced: at once for one read from disk or exported, after the first call otherwise)."""

    run: Callable
    _metadata: dict | Callable[[], dict]

    @property
    def metadata(self) -> dict:
        if callable(self._metadata):
            self._metadata = self._metadata()
        return self._metadata


class ProgramCache:
    """Programs per key (a tuple whose first item names the stage, e.g. "prefill"): kept from an
    earlier call, read from disk, or traced now. `loaded` counts programs read from disk per
    stage; `traced` counts traces of the model, which the traced functions record themselves
    (an abstract trace for a state's structure counts too)."""

    def __init__(self, fingerprint: dict | None):
        self._fingerprint = fingerprint  # None: nothing is kept on disk (weights over several devices)
        self._programs: dict[tuple, Program] = {}
        self.traced: collections.Counter = collections.Counter()
        self.loaded: collections.Counter = collections.Counter()

    def __contains__(self, key: tuple) -> bool:
        return key in self._programs

    def keys(self) -> list[tuple]:
        return list(self._programs)

    def get(self, key: tuple, function: Callable, args: tuple, *, metadata: Callable[[], dict], donate=()) -> Program:
        """The program for `key`. `function` is traced with `args` when the program is neither
        kept nor on disk; `metadata()` is called once it has been traced, and kept with it."""
        if key in self._programs:
            return self._programs[key]
        path = self._path(key)
        found = _read(path) if path is not None else None
        if found is not None:
            exported, kept = found
            self.loaded[key[0]] += 1
            program = Program(bridge.jit_program(exported.call, stage=key[0], donate_argnums=donate), kept)
        elif path is not None:
            checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in _backend.active().custom_calls()]
            exported = jax.export.export(jax.jit(function), disabled_checks=checks)(*args)
            kept = metadata()
            # Running the read-back copy here too makes both processes compile the same module,
            # so the second one finds it in JAX's compilation cache.
            exported = _write(path, exported, kept)
            program = Program(bridge.jit_program(exported.call, stage=key[0], donate_argnums=donate), kept)
        else:
            program = Program(bridge.jit_program(function, stage=key[0], donate_argnums=donate), metadata)
        self._programs[key] = program
        return program

    def path(self, key: tuple) -> pathlib.Path | None:
        """Where the program for `key` is kept on disk (None while nothing is kept)."""
        return self._path(key)

    def _path(self, key: tuple) -> pathlib.Path | None:
        root = _compilation_cache.directory()
        if root is None or self._fingerprint is None:
            return None
        text = json.dumps({**self._fingerprint, "program": repr(key)}, sort_keys=True, default=repr)
        return root / f"{hashlib.sha256(text.encode()).hexdigest()}{_SUFFIX}"


def _read(path: pathlib.Path) -> tuple[jax.export.Exported, dict] | None:
    if not path.is_file():
        return None
    try:
        data = path.read_bytes()
        size = int.from_bytes(data[:_HEADER_BYTES], "little")
        metadata = json.loads(data[_HEADER_BYTES : _HEADER_BYTES + size])
        return jax.export.deserialize(bytearray(data[_HEADER_BYTES + size :])), metadata
    except (OSError, ValueError, RuntimeError):
        # Truncated by a killed writer, or from a jax whose format differs: trace instead.
        return None


def _write(path: pathlib.Path, exported: jax.export.Exported, metadata: dict) -> jax.export.Exported:
    blob = exported.serialize()
    header = json.dumps(metadata).encode()
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            f.write(len(header).to_bytes(_HEADER_BYTES, "little") + header + blob)
        os.replace(f.name, path)  # atomic: a concurrent reader sees all or nothing
    except OSError:
        pass  # a read-only cache directory only costs the next process a trace
    return jax.export.deserialize(blob)
