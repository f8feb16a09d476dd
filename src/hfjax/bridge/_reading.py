"""Safetensors files -> host arrays: headers read by hand, tensors read on a pool of threads.

`read_header` gives each tensor's dtype, shape and byte range; `Reader` reads tensors (or a
device's block of one) into new host buffers, a large tensor in several chunks at once, a bounded
number of bytes ahead of the caller. Nothing here knows about models or devices (`_loading` does).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import math
import mmap
import os
import pathlib
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np

from .. import _dtypes
from .._errors import LoadError

_ALIGN = 64  # XLA's CPU client adopts a host buffer aligned to this without copying it
_MAPPED = 2**20  # buffers from this size on are fresh mappings with their pages made up front
_CHUNK = 16 * 2**20  # one read call: a large tensor is read by several threads at once
_THREADS = min(16, max(4, os.cpu_count() or 1))
_MAX_HEADER = 100 * 2**20  # the safetensors format's own bound


@dataclasses.dataclass(frozen=True)
class Stored:
    """One tensor of a safetensors file: what it holds and where its bytes are."""

    file: pathlib.Path
    key: str
    dtype: np.dtype  # numpy's, or ml_dtypes' (bfloat16, float8_*)
    shape: tuple[int, ...]
    start: int  # byte offset of its data in the file
    nbytes: int


def read_header(file: pathlib.Path) -> dict[str, Stored]:
    """{key: Stored} of a safetensors file, in the header's order, from its header alone."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size <= _MAX_HEADER:
            raise LoadError(f"hfjax.load: {str(file)!r} is not a safetensors file (header size {size})")
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise LoadError(f"hfjax.load: {str(file)!r} has a damaged safetensors header") from None
    stored = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        name = _dtypes.SAFETENSORS.get(info["dtype"])
        if name is None:
            raise LoadError(
                f"hfjax.load: the tensor {key!r} in {str(file)!r} has dtype {info['dtype']!r}, which hfjax cannot read; "
                f"it reads {', '.join(_dtypes.SAFETENSORS)}"
            )
        dtype = np.dtype(jnp.dtype(name))
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise LoadError(
                f"hfjax.load: the tensor {key!r} in {str(file)!r} spans {end - begin} bytes where its shape "
                f"{shape} and dtype {name} need {math.prod(shape) * dtype.itemsize}; the file is damaged"
            )
        stored[key] = Stored(file, key, dtype, shape, 8 + size + begin, end - begin)
    return stored


class Reader:
    """Reads stored tensors into new host buffers (numpy, 64-byte aligned) on a pool of threads,
    a large tensor in several chunks at once, with at most `window` bytes read ahead of the one
    the caller is placing. Use as a context manager."""

    def __init__(self, window: int):
        self.window = window
        self._pool = concurrent.futures.ThreadPoolExecutor(_THREADS, thread_name_prefix="hfjax-load")
        self._fds: dict[pathlib.Path, int] = {}

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in self._fds.values():
            os.close(fd)

    def stream(self, entries: list[tuple[str, Stored]]) -> Iterator[tuple[str, Stored, np.ndarray]]:
        """(name, stored, array) for each entry, in order, the next ones read meanwhile."""
        pending: collections.deque = collections.deque()
        ahead = 0
        for name, stored in entries:
            while pending and ahead + stored.nbytes > self.window:
                ahead -= pending[0][1].nbytes
                yield self._finish(*pending.popleft())
            pending.append((name, stored, *self._start(stored)))
            ahead += stored.nbytes
        while pending:
            yield self._finish(*pending.popleft())

    def read(self, stored: Stored) -> np.ndarray:
        """The whole tensor, [*stored.shape] of stored.dtype."""
        return self._finish(None, stored, *self._start(stored))[2]

    def block(self, stored: Stored, bounds: tuple[tuple[int, int], ...]) -> concurrent.futures.Future:
        """A future of the block ((start, stop) per axis) as a new array of stored.dtype."""
        return self._pool.submit(self._read_block, stored, bounds)

    def _fd(self, file: pathlib.Path) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return self._fds[file]

    def _start(self, stored: Stored) -> tuple[np.ndarray, list]:
        buffer = _host_buffer(stored.nbytes)  # uint8 [nbytes]
        fd = self._fd(stored.file)
        futures = [
            self._pool.submit(_read_into, fd, buffer[at : at + _CHUNK], stored.start + at, stored)
            for at in range(0, stored.nbytes, _CHUNK)
        ]
        return buffer, futures

    @staticmethod
    def _finish(name, stored: Stored, buffer: np.ndarray, futures: list) -> tuple[str, Stored, np.ndarray]:
        for future in futures:
            future.result()
        return name, stored, buffer.view(stored.dtype).reshape(stored.shape)

    def _read_block(self, stored: Stored, bounds: tuple[tuple[int, int], ...]) -> np.ndarray:
        shape = tuple(stop - start for start, stop in bounds)
        split = [axis for axis, (start, stop) in enumerate(bounds) if (start, stop) != (0, stored.shape[axis])]
        itemsize = stored.dtype.itemsize
        if not split or (len(split) == 1 and math.prod(stored.shape[: split[0]]) == 1):
            # one run of bytes: rows of the first axis it splits, all later axes whole
            first = split[0] if split else 0
            row = math.prod(stored.shape[first + 1 :]) * itemsize
            offset = bounds[first][0] * row if split else 0
            buffer = _host_buffer(math.prod(shape) * itemsize)
            _read_into(self._fd(stored.file), buffer, stored.start + offset, stored)
            return buffer.view(stored.dtype).reshape(shape)
        # Scattered runs (a split along a later axis): copied out of a read-only mapping of the tensor.
        raw = np.dtype(f"u{itemsize}")
        whole = np.memmap(stored.file, raw, "r", offset=stored.start, shape=stored.shape)
        block = _host_buffer(math.prod(shape) * itemsize).view(raw).reshape(shape)
        np.copyto(block, whole[tuple(slice(start, stop) for start, stop in bounds)])
        del whole
        return block.view(stored.dtype)


def _read_into(fd: int, buffer: np.ndarray, offset: int, stored: Stored) -> None:
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count <= 0:
            raise LoadError(
                f"hfjax.load: {str(stored.file)!r} ends inside the tensor {stored.key!r}; the file is truncated"
            )
        done += count


def _host_buffer(nbytes: int) -> np.ndarray:
    """uint8 [nbytes], starting at a multiple of _ALIGN bytes.

    A large one is a fresh private anonymous mapping whose pages the kernel makes in one call
    (MAP_POPULATE): faulting them in one at a time while reading took longer than the read
    itself, and numpy's own large buffers (advised onto 2 MB pages) longer still (docs/architecture.md).
    """
    if nbytes >= _MAPPED and hasattr(mmap, "MAP_ANONYMOUS"):
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), np.uint8)
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes]
