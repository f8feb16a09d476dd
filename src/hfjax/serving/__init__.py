"""Serving: continuous batching over the generation engine's parts, and `hfjax serve`'s HTTP API.

Parts, one concern each (docs/architecture.md, "Continuous batching", describes the design):
    _slots.py     the device side: a static KV cache of S sequence slots, `SlotLayer` writing each
                  row at its own column, and the two programs (a prefill chunk of one slot, a
                  decode chunk of every slot) with per-row sampling settings
    _engine.py    the host side: `Engine` (queue, slots, the thread that runs the programs),
                  `SamplingParams`, `Event`, `QueueFullError`
    _text.py      incremental detokenising and stop strings (`TextStream`)
    _metrics.py   counters, gauges and latency histograms in Prometheus' text format
    _protocol.py  OpenAI request bodies checked into engine calls; OpenAI-shaped errors
    _app.py       the FastAPI application (needs the `serve` extra: pip install "hfjax[serve]")
    static/       the chat page served at GET /

Public names: `Engine`, `SamplingParams`, `Event`, `QueueFullError`. The web application is
built by `hfjax.serving._app.build_app`, imported only by `hfjax serve`.
"""

from ._engine import Engine, Event, QueueFullError, SamplingParams

__all__ = ["Engine", "Event", "QueueFullError", "SamplingParams"]
