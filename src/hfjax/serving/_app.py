"""The OpenAI-compatible HTTP API of `hfjax serve`, a FastAPI application around one `Engine`:
`build_app` assembles it (lifespan, the API key and request-count gate, OpenAI-shaped errors, routes).

Endpoints: POST /v1/chat/completions, /v1/completions (`_routes_completions.py`), /v1/embeddings, and
vLLM's /tokenize and /detokenize; GET /v1/models, /v1/models/{id}, /health, /version, /metrics
(Prometheus' text format, written by prometheus_client), / (the chat page) (`_routes.py`); POST
/v1/audio/transcriptions (`_audio.py`); with LoRA adapters loadable at run time, vLLM's POST
/v1/load_lora_adapter and /v1/unload_lora_adapter (`_routes.py`, `_models.py`). Errors answer in
OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 for a bad request (FastAPI's 422
is never used: bodies are read and checked by the routes), 401 for a missing or wrong API key, 404 for
an unknown model or a path not served, 405 for a method not served, 429 for a full queue, 500 for a
failure of the server's own (its traceback in the log).
"""

# FastAPI reads the endpoints' annotations (Request) at run time: no `from __future__ import annotations`.

import asyncio
import contextlib
import secrets
from collections.abc import Callable

from . import _audio, _protocol, _tools
from ._media import MediaPolicy
from ._metrics import Metrics, StatsLine
from ._models import ServedModels
from ._protocol import ApiError
from ._routes import Service, add_embedding_routes, add_lora_routes, add_state_routes, add_tokenizer_routes
from ._routes_completions import add_completion_routes
from ._scheduler import Engine


def build_app(
    model,
    *,
    served_model_name: str,
    engine: Engine | None,
    api_key: str | None = None,
    log_stats: Callable[[str], None] | None = None,
    stats_interval: float = 10.0,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    enable_lora: bool = False,
    lora_parents: dict[str, str] | None = None,
    runtime_lora_updating: bool = False,
    media: MediaPolicy | None = None,
):
    """The FastAPI application serving `model` (through `engine` for a causal LM; an encoder
    answers /v1/embeddings only). The engine is started and stopped with the application.
    `enable_lora`: the LoRA adapters the model holds (`Model.reserve_adapters`, `load_adapter`) are
    served by name beside the base: a request's `model` picks one (`_models.ServedModels`);
    `lora_parents`: {adapter name: the base name its /v1/models card gives as parent} (vLLM's
    base_model_name; default: `served_model_name`); `runtime_lora_updating` (vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING) adds /v1/load_lora_adapter and /v1/unload_lora_adapter.
    `log_stats`, where given, is called every `stats_interval` seconds while the engine is busy
    with vLLM's stats line (prompt and generation tokens/s, requests running and waiting).
    `enable_auto_tool_choice`: chat answers are read for tool calls (tool_choice "auto") with the
    parser named `tool_call_parser` (vLLM's names: `_tools.PARSERS`), or without one the tokenizer's
    response_template. `media`: what chat requests' images may be (`_media`: the local path files may
    be read under, the images per prompt), for a vision-language model (its processor prepares them).

    Raises:
        ValueError: an unknown `tool_call_parser`, or none and no response_template to use.
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    metrics = engine.metrics if engine is not None else Metrics(0)
    tokenizer = model.tokenizer
    served = ServedModels(
        model, served_model_name, root=str(model.path) if model.path is not None else served_model_name,
        max_model_len=engine.max_model_len if engine is not None else None, lora=enable_lora, parents=lora_parents,
        metrics=metrics,
    )  # fmt: skip
    auto_tools = None
    if enable_auto_tool_choice or tool_call_parser is not None:
        parser = _tools.tool_call_parser(tool_call_parser, tokenizer)
        auto_tools = parser if enable_auto_tool_choice else None
    service = Service(
        model=model, name=served_model_name, engine=engine, served=served, metrics=metrics,
        longest=_protocol.longest_token(tokenizer) if tokenizer is not None else None,
    )  # fmt: skip

    async def stats_lines():
        stats = StatsLine(metrics)
        while True:
            await asyncio.sleep(stats_interval)
            line = stats.next()
            if line is not None:
                log_stats(line)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if engine is not None:
            engine.start()
        stats_task = asyncio.create_task(stats_lines()) if engine is not None and log_stats is not None else None
        yield
        if stats_task is not None:
            stats_task.cancel()
        if engine is not None:
            # In-flight requests have been answered by now (uvicorn waits for them on SIGTERM).
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)
        served.close()

    app = FastAPI(title="hfjax serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error_response(error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    app.add_middleware(_Gate, api_key=api_key, metrics=metrics, refused=error_response, routes=app.router.routes)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):  # a path or method not served
        return JSONResponse(
            ApiError(
                error.status_code, f"{request.method} {request.url.path}: {error.detail}", kind="invalid_request_error"
            ).body(),
            status_code=error.status_code,
            headers=error.headers,
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        # Starlette raises the error again once this answer is sent: the server's log gets its traceback.
        message = f"the server failed on this request ({type(error).__name__}); see the server's log"
        return error_response(ApiError(500, message, kind="internal_server_error"))

    add_state_routes(app, service)
    if enable_lora and runtime_lora_updating:
        add_lora_routes(app, service)
    add_tokenizer_routes(app, service)
    add_embedding_routes(app, service)
    _audio.add_route(app, model, engine, served.names())
    add_completion_routes(app, service, media=media or MediaPolicy(), auto_tools=auto_tools)
    return app


class _Gate:
    """Checks the API key of /v1/ requests (401 without it) and counts every answer by route and
    status for /metrics (a path that no route serves counts as "other", so that clients cannot add
    labels without bound). Plain ASGI: Starlette's `@app.middleware("http")` passes each streamed
    chunk through extra tasks and memory streams (their frames showed throughout a py-spy profile
    of the event loop at 16 concurrent streams)."""

    def __init__(self, app, *, api_key: str | None, metrics: Metrics, refused, routes: list):
        self.app, self.metrics, self.refused, self.routes = app, metrics, refused, routes
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    def _route(self, scope) -> str:
        from starlette.routing import Match

        for route in self.routes:
            if route.matches(scope)[0] is not Match.NONE:  # PARTIAL: the path, another method
                return route.path
        return "other"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self._route(scope)
        if self.expected is not None and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = self.refused(
                    ApiError(
                        401,
                        "missing or wrong API key; send the header 'Authorization: Bearer <key>' with the key the "
                        "server was started with (--api-key)",
                        code="invalid_api_key",
                    )
                )
                self.metrics.count_request(route, 401)
                await response(scope, receive, send)
                return
        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.count_request(route, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except BaseException:
            if not started:
                self.metrics.count_request(route, 500)
            raise
