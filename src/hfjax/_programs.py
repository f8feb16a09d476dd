"""Generation programs kept on disk, so that a new process skips tracing the model.

JAX's persistent compilation cache (`hfjax.set_cache_dir`) skips XLA's compile, but a new
process still has to trace the torch model through torchax to learn what to compile: about
0.2 s per program for a 150M-parameter Llama, most of a warm start's time to first token.
`ProgramStore` keeps each traced program as a `jax.export` blob beside JAX's own entries.

A program is found again by a digest of everything that shapes it: hfjax's source, the
versions of the libraries that trace it, the backend, the model's class and config, its
parameters' names, shapes and dtypes, and the program's own key (shapes and settings).
A blob that cannot be read is ignored, and the program is traced as if it were absent.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib
import tempfile

import jax

from . import _cpu_kernels

_SUFFIX = ".hfjax-program"  # JAX's cache only lists its own "*-cache" files
_HEADER_BYTES = 8  # little-endian length of the JSON metadata that precedes the blob


@functools.cache
def _source_digest() -> str:
    """sha256 of hfjax's own source: a changed lowering must not reuse an old program."""
    digest = hashlib.sha256()
    root = pathlib.Path(__file__).parent
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


def directory() -> pathlib.Path | None:
    """Where programs are kept: JAX's compilation cache directory, or None while it is off."""
    if not jax.config.jax_enable_compilation_cache or not jax.config.jax_compilation_cache_dir:
        return None
    return pathlib.Path(jax.config.jax_compilation_cache_dir)


def model_fingerprint(model) -> dict:
    """What a model contributes to its programs' digests (its weights' values do not)."""
    config = model.config.to_dict()
    config.pop("_name_or_path", None)  # the same checkpoint copied elsewhere traces the same
    module = type(model.module)
    return {
        "hfjax": _source_digest(),
        "versions": _versions(),
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        # Built and registered here, before a program that calls it is read back from disk.
        "cpu_kernels": _cpu_kernels.library() if jax.default_backend() == "cpu" else None,
        "class": f"{module.__module__}.{module.__qualname__}",
        "config": json.dumps(config, sort_keys=True, default=repr),
        "params": sorted((name, list(a.shape), str(a.dtype)) for name, a in model.params.items()),
        "aliases": sorted(model.aliases.items()),
    }


def single_device(params: dict) -> bool:
    """Whether every parameter lives on one device: exported programs are kept only for those."""
    return all(len(a.sharding.device_set) == 1 for a in params.values() if isinstance(a, jax.Array))


class ProgramStore:
    """Exported programs on disk, keyed by a model fingerprint and a per-program key."""

    def __init__(self, fingerprint: dict):
        self._fingerprint = fingerprint

    def _path(self, key) -> pathlib.Path | None:
        root = directory()
        if root is None:
            return None
        text = json.dumps({**self._fingerprint, "program": repr(key)}, sort_keys=True, default=repr)
        return root / f"{hashlib.sha256(text.encode()).hexdigest()}{_SUFFIX}"

    def load(self, key) -> tuple[jax.export.Exported, dict] | None:
        """(program, metadata) saved under `key`, or None."""
        path = self._path(key)
        if path is None or not path.is_file():
            return None
        try:
            data = path.read_bytes()
            size = int.from_bytes(data[:_HEADER_BYTES], "little")
            metadata = json.loads(data[_HEADER_BYTES : _HEADER_BYTES + size])
            return jax.export.deserialize(bytearray(data[_HEADER_BYTES + size :])), metadata
        except (OSError, ValueError, RuntimeError):
            # Truncated by a killed writer, or from a jax whose format differs: trace instead.
            return None

    def save(self, key, exported: jax.export.Exported, metadata: dict) -> jax.export.Exported:
        """Writes the program and returns it as a later process will read it back.

        Running the read-back copy here too makes both processes compile the same module,
        so the second one finds it in JAX's compilation cache.
        """
        blob = exported.serialize()
        header = json.dumps(metadata).encode()
        path = self._path(key)
        if path is not None:
            try:
                with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
                    f.write(len(header).to_bytes(_HEADER_BYTES, "little") + header + blob)
                os.replace(f.name, path)  # atomic: a concurrent reader sees all or nothing
            except OSError:
                pass  # a read-only cache directory only costs the next process a trace
        return jax.export.deserialize(blob)
