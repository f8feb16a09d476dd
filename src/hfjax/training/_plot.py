"""The loss curve as a PNG: with matplotlib where it is installed, else drawn here and written with zlib."""

from __future__ import annotations

import pathlib
import struct
import zlib

import numpy as np

_WIDTH, _HEIGHT, _MARGIN = 640, 360, 24


def loss_curve(history: list[dict], path: pathlib.Path) -> pathlib.Path:
    """Writes the training loss (and eval loss, where measured) against the step to `path`."""
    steps = [h["step"] for h in history]
    losses = [h["loss"] for h in history]
    evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
    except ImportError:
        _write_png(path, _draw(steps, losses, evals))
        return path
    figure = Figure(figsize=(6.4, 3.6))
    axes = figure.subplots()
    axes.plot(steps, losses, label="train loss")
    if evals:
        axes.plot(*zip(*evals), "o-", label="eval loss")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.legend()
    figure.savefig(path, dpi=100)
    return path


def _draw(steps, losses, evals) -> np.ndarray:
    # uint8 [H, W, 3]: white, axes in grey, the training loss in blue, eval points in orange.
    image = np.full((_HEIGHT, _WIDTH, 3), 255, np.uint8)
    image[_HEIGHT - _MARGIN, _MARGIN : _WIDTH - _MARGIN] = 128
    image[_MARGIN : _HEIGHT - _MARGIN, _MARGIN] = 128
    values = [v for v in losses + [e for _, e in evals] if np.isfinite(v)]
    if not steps or not values:
        return image
    low, high = min(values), max(values)
    first, last = min(steps), max(steps)

    def xy(step, value):
        x = _MARGIN + (step - first) / max(last - first, 1) * (_WIDTH - 2 * _MARGIN - 1)
        y = _HEIGHT - _MARGIN - (value - low) / max(high - low, 1e-12) * (_HEIGHT - 2 * _MARGIN - 1)
        return int(round(x)), int(round(y))

    points = [xy(s, v) for s, v in zip(steps, losses) if np.isfinite(v)]
    for (x0, y0), (x1, y1) in zip(points, points[1:] or points):
        for t in np.linspace(0.0, 1.0, max(abs(x1 - x0), abs(y1 - y0), 1) + 1):
            image[int(round(y0 + t * (y1 - y0))), int(round(x0 + t * (x1 - x0)))] = (31, 119, 180)
    for s, v in evals:
        x, y = xy(s, v)
        image[max(y - 2, 0) : y + 3, max(x - 2, 0) : x + 3] = (255, 127, 14)
    return image


def _write_png(path: pathlib.Path, image: np.ndarray) -> None:
    height, width, _ = image.shape
    raw = b"".join(b"\x00" + image[row].tobytes() for row in range(height))  # filter 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    )
