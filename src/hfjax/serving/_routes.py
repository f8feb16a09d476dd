"""The routes of `hfjax serve` that answer on the host, one function per endpoint group: the server's
state (/health, /v1/models, /version, /metrics, the chat page), LoRA adapters loaded at run time,
vLLM's /tokenize and /detokenize, and /v1/embeddings; and `Service`, what every route reads.

The completions routes are `_routes_completions.py`'s, the transcription route `_audio.py`'s.
"""

# FastAPI reads the endpoints' annotations (Request) at run time: no `from __future__ import annotations`.

import asyncio
import base64
import dataclasses
import importlib.resources

import numpy as np

from .. import bridge
from .._embed import pooling_config
from .._errors import HfjaxError
from .._version import __version__
from . import _protocol
from ._metrics import Metrics
from ._models import ServedModels
from ._protocol import ApiError
from ._requests import default_sampling
from ._scheduler import Engine


@dataclasses.dataclass(frozen=True, kw_only=True)
class Service:
    """What every route reads: the `model` served as `name`, its `engine` (None for an encoder, which
    answers /v1/embeddings only), the names it answers to (`served`), its `metrics`, and `longest`,
    the most characters one token is written with (`_protocol.longest_token`; None without a tokenizer)."""

    model: object
    name: str
    engine: Engine | None
    served: ServedModels
    metrics: Metrics
    longest: int | None

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def needs_engine(self, endpoint: str) -> Engine:
        """The engine; a 400 naming `endpoint` for an encoder, which has none; a 503 where the engine
        failed (`check_engine`)."""
        if self.engine is None:
            raise ApiError(
                400, f"{self.name!r} is an encoder ({self.model.task}); it answers /v1/embeddings, not {endpoint}",
                param="model", code="model_not_supported",
            )  # fmt: skip
        self.check_engine()
        return self.engine

    def check_engine(self) -> None:
        """A 503 where the engine thread failed: the server answers nothing more that generates, and
        says so on /health, so that whatever supervises it restarts it (as vLLM's dead engine does)."""
        failure = None if self.engine is None else self.engine.failure
        if failure is not None:
            raise _protocol.engine_failed(failure)


async def read_json(request):
    """The request's JSON body, checked by `_protocol.parse_body` (a 400 naming what is wrong)."""
    return _protocol.parse_body(await request.body())


def add_state_routes(app, service: Service) -> None:
    """GET /health, /v1/models, /v1/models/{id}, /version, /metrics (Prometheus' text format), and the
    chat page at / with its icon."""
    from fastapi.responses import HTMLResponse, Response

    engine, served, metrics = service.engine, service.served, service.metrics
    takes_images = engine is not None and engine.takes_images
    # What a request without temperature gets; the chat page starts its field at it and sends it.
    default_temperature = default_sampling(service.model)["temperature"] if engine is not None else 1.0

    @app.get("/health")
    async def health():
        service.check_engine()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": served.cards()}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str):
        return served.card(model_id)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/")
    async def page():
        html = importlib.resources.files("hfjax.serving").joinpath("static/index.html").read_text("utf-8")
        html = html.replace("__TAKES_IMAGES__", "true" if takes_images else "false")
        return HTMLResponse(html.replace("__DEFAULT_TEMPERATURE__", f"{default_temperature:g}"))

    @app.get("/favicon.svg")
    @app.get("/favicon.ico")  # where browsers look for it without a <link rel="icon">
    async def favicon():
        icon = importlib.resources.files("hfjax.serving").joinpath("static/favicon.svg").read_bytes()
        return Response(icon, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})


def add_lora_routes(app, service: Service) -> None:
    """vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (`_models.ServedModels`)."""
    from fastapi import Request
    from fastapi.responses import PlainTextResponse

    served = service.served

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        name, path = _protocol.lora_request(await read_json(request), load=True)
        return PlainTextResponse(await served.load(name, path))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        name, _ = _protocol.lora_request(await read_json(request), load=False)
        return PlainTextResponse(served.unload(name))


def add_tokenizer_routes(app, service: Service) -> None:
    """vLLM's POST /tokenize (a prompt, or messages through the chat template) and /detokenize."""
    from fastapi import Request

    tokenizer, served = service.tokenizer, service.served
    engine = service.engine
    max_model_len = engine.max_model_len if engine is not None else None
    context = max_model_len or bridge.context_length(service.model.config) or tokenizer.model_max_length

    @app.post("/tokenize")
    async def tokenize(request: Request):
        asked = _protocol.tokenize_request(await read_json(request), served.names())
        text = asked.prompt
        if asked.messages is not None:
            text = _protocol.rendered(
                tokenizer.apply_chat_template, asked.messages, add_generation_prompt=asked.add_generation_prompt,
                continue_final_message=asked.continue_final_message, tokenize=False, **asked.template_kwargs,
            )  # fmt: skip

        def encode():  # off the event loop: a long text takes the tokenizer seconds
            ids = tokenizer(text, add_special_tokens=asked.add_special_tokens, verbose=False)["input_ids"]
            return ids, tokenizer.convert_ids_to_tokens(ids) if asked.return_token_strs else None

        ids, strs = await asyncio.get_running_loop().run_in_executor(None, encode)
        return {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        ids = _protocol.detokenize_request(await read_json(request), served.names(), len(tokenizer))
        return {"prompt": tokenizer.decode(ids)}


def add_embedding_routes(app, service: Service) -> None:
    """POST /v1/embeddings: `Model.embed` in a worker thread, Matryoshka's `dimensions` cut, floats or
    base64."""
    from fastapi import Request

    model, tokenizer, served, name = service.model, service.tokenizer, service.served, service.name
    # Matryoshka's truncated embeddings are normalised again where the model normalises its own.
    normalizes = pooling_config(model.path)[1]
    if tokenizer is not None:  # (without one, Model.embed answers that it has none)
        embed_length = bridge.context_length(model.config) or tokenizer.model_max_length  # where Model.embed cuts

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        texts, encoding, dimensions = _protocol.embedding_request(await read_json(request), served.names())
        for i, text in enumerate(texts if tokenizer is not None else ()):
            field = f"input[{i}]" if len(texts) > 1 else "input"
            _protocol.check_length(text, field, embed_length, service.longest, f"the model's context of {embed_length}")

        def embed():  # [N, H], and the tokens read
            vectors = np.asarray(model.embed(texts), np.float32)
            return vectors, sum(len(ids) for ids in tokenizer(texts, verbose=False)["input_ids"])

        try:
            vectors, tokens = await asyncio.get_running_loop().run_in_executor(None, embed)
        except HfjaxError as error:  # a model that embeds no text
            raise ApiError(400, str(error), param="model", code="model_not_supported") from None
        if dimensions is not None:  # Matryoshka: the first values, normalised again where the model normalises
            _protocol.check_dimensions(dimensions, model.config, vectors.shape[1], name)
            vectors = vectors[:, :dimensions]  # [N, dimensions]
            if normalizes:
                vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)
        data = []
        for i, vector in enumerate(vectors):
            value = (
                base64.b64encode(vector.astype("<f4").tobytes()).decode() if encoding == "base64" else vector.tolist()
            )
            data.append({"object": "embedding", "index": i, "embedding": value})
        return {
            "object": "list", "data": data, "model": name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }  # fmt: skip
