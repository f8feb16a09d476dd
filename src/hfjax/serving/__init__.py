"""Serving: continuous batching on generation's slot core, and `hfjax serve`'s OpenAI HTTP API.

Parts, one concern each (docs/architecture.md, "Continuous batching", describes the design):
    _requests.py   `SamplingParams` (a request's settings, mapped onto Model.generate's), `Request`,
                   `Event`, `QueueFullError`
    _sizing.py     slots and cache length from a memory budget
    _table.py      the slots' row state on the host: requests, positions, cached prefixes, settings
    _compiler.py   the programs: their set (rows x windows), all compiled before the engine starts
    _scheduler.py  `Engine`: the public face, and the engine thread's schedule of prefill and decode chunks
    _queue.py      the requests waiting for a slot: submit, cancel, admission, finishing
    _calls.py      the engine's calls into the slot core: programs' arguments, prefill and decode chunks run
    _delivery.py   chosen tokens handed to their requests: text, log-probabilities, events, stops
    _text.py       incremental detokenising and stop strings (`TextStream`); tokens' own bytes (`TokenText`)
    _metrics.py    counters, gauges and latency histograms (prometheus_client), and vLLM's stats line
    _protocol.py   OpenAI request bodies checked into engine calls; OpenAI-shaped errors
    _tools.py      tool calls read out of chat answers: vLLM's parsers by name, or the tokenizer's own
    _media.py      chat requests' images (OpenAI image_url parts: data:, file:, http(s) URLs) read and checked
    _models.py     the model names a server answers to: the base's and its LoRA adapters' (vLLM's
                   --lora-modules, /v1/load_lora_adapter), each request's adapter slot
    _app.py        the FastAPI application assembled: lifespan, the API key gate, OpenAI-shaped errors, routes
                   (needs the `serve` extra: pip install "hfjax[serve]")
    _routes.py     the routes answered on the host: /health, /v1/models, /version, /metrics, the chat page,
                   /tokenize, /detokenize, LoRA loading, /v1/embeddings; `Service`, what every route reads
    _routes_completions.py  /v1/chat/completions and /v1/completions: submit each choice, stream or collect
    _answer.py     `Answer`: a chat or completion answer in OpenAI's shapes, whole or as server-sent events
    _audio.py      /v1/audio/transcriptions for a speech-to-text checkpoint
    static/        the chat page served at GET /

The device side (the slot cache, the prefill and decode programs, the token choice) is
`hfjax.generation`'s, the same core as Model.generate's.

Public names: `Engine`, `SamplingParams`, `Event`, `QueueFullError`, `TOOL_CALL_PARSERS` ({vLLM's name:
its `ToolParser`}), `tool_call_parser` (the parser `hfjax serve --enable-auto-tool-choice` uses), and
`MediaPolicy` (what a request's images may be), and `build_app` (the web application; it imports FastAPI when called, so the package imports without the
`serve` extra).
"""

import types

from ._media import MediaPolicy
from ._requests import Event, QueueFullError, SamplingParams
from ._scheduler import Engine
from ._tools import PARSERS, ToolParser, tool_call_parser

TOOL_CALL_PARSERS = types.MappingProxyType(PARSERS)

__all__ = [
    "TOOL_CALL_PARSERS",
    "Engine",
    "Event",
    "MediaPolicy",
    "QueueFullError",
    "SamplingParams",
    "ToolParser",
    "build_app",
    "tool_call_parser",
]


def build_app(model, **options):
    """The FastAPI application of `hfjax serve` (`_app.build_app`'s arguments); needs the serve extra."""
    from ._app import build_app as build

    return build(model, **options)
