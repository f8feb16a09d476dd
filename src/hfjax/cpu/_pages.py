"""Weights in host memory moved onto 2 MB pages, when asked (HFJAX_HUGE_PAGES=1) and Linux allows it."""

from __future__ import annotations

import ctypes
import functools
import os
import platform

_HUGE_PAGE = 2 << 20
_MADV_COLLAPSE = 25  # Linux 6.1 and later


@functools.cache
def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def huge_pages(arrays) -> int:
    """With HFJAX_HUGE_PAGES=1, moves CPU weights into 2 MB pages where Linux lets a process ask
    for it (MADV_COLLAPSE); returns the bytes moved.

    Decoding reads every weight once per token: on 4 KB pages a page-table walk every 4 KB. On an
    AVX-512 EPYC with hfjax's kernels, 2 MB pages made the 150M benchmark model's decode step 0.94x as
    long at batch 1 and 0.92x at batch 8; on a 2-core AMD VM without them, 52.1 against 53.0
    tokens/s (no gain), while the collapse added 1.1-1.7 s to loading 612 MB (docs/architecture.md).
    So it is opt-in. XLA allocates with 4 KB pages, and the collapse keeps addresses and contents,
    so it is safe on live buffers. Elsewhere (another OS or accelerator, an older kernel,
    transparent huge pages turned off) it does nothing.
    """
    if platform.system() != "Linux" or os.environ.get("HFJAX_HUGE_PAGES", "0") != "1":
        return 0
    moved = 0
    for array in arrays:
        for shard in getattr(array, "addressable_shards", ()):
            buffer = shard.data
            if buffer.device.platform != "cpu" or buffer.nbytes < _HUGE_PAGE:
                continue
            start = buffer.unsafe_buffer_pointer()
            first = -(-start // _HUGE_PAGE) * _HUGE_PAGE  # whole 2 MB pages inside the buffer
            last = (start + buffer.nbytes) // _HUGE_PAGE * _HUGE_PAGE
            # Linux refuses memory that XLA does not own (a numpy buffer an array aliases, say).
            if last > first and _madvise()(first, last - first, _MADV_COLLAPSE) == 0:
                moved += last - first
    return moved
