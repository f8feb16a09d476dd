"""Padding sizes: lengths and batch sizes round up to powers of two, so few shapes are compiled."""

from __future__ import annotations


def bucket(size: int, *, smallest: int = 16, limit: int | None = None) -> int:
    """The next power of two >= `size`, at least `smallest`; at most `limit`, but never below `size`.

    Example:
      >>> bucket(20), bucket(3, smallest=1), bucket(300, limit=256)
      (32, 4, 300)
    """
    padded = smallest
    while padded < size:
        padded *= 2
    return max(size, min(padded, limit)) if limit else padded


def round_up(size: int, multiple: int) -> int:
    """The next multiple of `multiple` >= `size`."""
    return -(-size // multiple) * multiple
