"""The OpenAI-compatible HTTP API of `hfjax serve`, a FastAPI application around one `Engine`.

Endpoints: POST /v1/chat/completions, /v1/completions, /v1/embeddings, and vLLM's /tokenize and
/detokenize; GET /v1/models, /v1/models/{id}, /health, /version, /metrics (Prometheus' text format,
written by prometheus_client), / (the chat page); with LoRA adapters loadable at run time, vLLM's
POST /v1/load_lora_adapter and /v1/unload_lora_adapter (`_models.py`). Errors answer in OpenAI's
shape {"error": {"message", "type", "param", "code"}}: 400 for a bad request (FastAPI's 422 is never
used: bodies are read and checked here), 401 for a missing or wrong API key, 404 for an unknown
model or a path not served, 405 for a method not served, 429 for a full queue, 500 for a failure of
the server's own (its traceback in the log).
"""

# FastAPI reads the endpoints' annotations (Request) at run time: no `from __future__ import annotations`.

import asyncio
import base64
import contextlib
import dataclasses
import importlib.resources
import json
import secrets
import time
from collections.abc import Callable

import numpy as np

from .. import bridge
from .._embed import pooling_config
from .._errors import GenerationError, HfjaxError
from .._version import __version__
from ..generation import ConstraintError, LimitError
from ..generation import processed as generation_processed
from . import _audio, _media, _protocol, _tools
from ._media import MediaPolicy
from ._metrics import Metrics, StatsLine
from ._models import ServedModels
from ._protocol import ApiError
from ._requests import Event, QueueFullError, default_sampling
from ._scheduler import Engine
from ._text import TokenText


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
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    metrics = engine.metrics if engine is not None else Metrics(0)
    tokenizer = model.tokenizer
    media = media or MediaPolicy()
    takes_images = engine is not None and engine.takes_images
    max_model_len = engine.max_model_len if engine is not None else None
    context = max_model_len or bridge.context_length(model.config) or tokenizer.model_max_length
    token_text = TokenText(tokenizer) if engine is not None else None
    # What a request without temperature gets; the chat page starts its field at it and sends it.
    default_temperature = default_sampling(model)["temperature"] if engine is not None else 1.0
    served = ServedModels(
        model, served_model_name, root=str(model.path) if model.path is not None else served_model_name,
        max_model_len=max_model_len, lora=enable_lora, parents=lora_parents, metrics=metrics,
    )  # fmt: skip
    auto_tools = None
    if enable_auto_tool_choice or tool_call_parser is not None:
        parser = _tools.tool_call_parser(tool_call_parser, tokenizer)
        auto_tools = parser if enable_auto_tool_choice else None
    # Matryoshka's truncated embeddings are normalised again where the model normalises its own.
    normalizes = pooling_config(model.path)[1]
    if tokenizer is not None:  # (without one, Model.embed answers that it has none)
        longest = _protocol.longest_token(tokenizer)
        embed_length = bridge.context_length(model.config) or tokenizer.model_max_length  # where Model.embed cuts

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

    async def read_json(request: Request):
        return _protocol.parse_body(await request.body())

    def needs_engine(endpoint: str) -> Engine:
        if engine is None:
            raise ApiError(
                400, f"{served_model_name!r} is an encoder ({model.task}); it answers /v1/embeddings, not {endpoint}",
                param="model", code="model_not_supported",
            )  # fmt: skip
        return engine

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": served.cards()}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str):
        return served.card(model_id)

    if enable_lora and runtime_lora_updating:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            name, path = _protocol.lora_request(await read_json(request), load=True)
            return PlainTextResponse(await served.load(name, path))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            name, _ = _protocol.lora_request(await read_json(request), load=False)
            return PlainTextResponse(served.unload(name))

    @app.get("/version")
    async def version():
        return {"version": __version__}

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

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        texts, encoding, dimensions = _protocol.embedding_request(await read_json(request), served.names())
        for i, text in enumerate(texts if tokenizer is not None else ()):
            field = f"input[{i}]" if len(texts) > 1 else "input"
            _protocol.check_length(text, field, embed_length, longest, f"the model's context of {embed_length}")

        def embed():  # [N, H], and the tokens read
            vectors = np.asarray(model.embed(texts), np.float32)
            return vectors, sum(len(ids) for ids in tokenizer(texts, verbose=False)["input_ids"])

        try:
            vectors, tokens = await asyncio.get_running_loop().run_in_executor(None, embed)
        except HfjaxError as error:  # a model that embeds no text
            raise ApiError(400, str(error), param="model", code="model_not_supported") from None
        if dimensions is not None:  # Matryoshka: the first values, normalised again where the model normalises
            _protocol.check_dimensions(dimensions, model.config, vectors.shape[1], served_model_name)
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
            "object": "list", "data": data, "model": served_model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }  # fmt: skip

    _audio.add_route(app, model, engine, served.names())

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        running = needs_engine("/v1/chat/completions")
        body = await read_json(request)
        parts = _media.image_parts(body, media, takes_images=takes_images)
        # A vision-language model's chat template is its processor's (it places the image tokens).
        template = model.processor.apply_chat_template if takes_images else tokenizer.apply_chat_template
        generation = _protocol.chat_request(
            body, served.names(),
            lambda messages, **kwargs: template(messages, add_generation_prompt=True, tokenize=False, **kwargs),
            tool_parser=auto_tools,
        )  # fmt: skip
        images = None
        if parts:
            pictures = await _media.load_images(parts, media)

            def process():  # the processor's outputs for the prompt: its ids with the image tokens, pixels, ...
                return generation_processed(model.processor, [generation.prompt], [pictures])

            images = await asyncio.get_running_loop().run_in_executor(None, process)
        return await _answer(request, running, generation, chat=True, images=images)

    @app.post("/v1/completions")
    async def completions(request: Request):
        running = needs_engine("/v1/completions")
        generation = _protocol.completion_request(await read_json(request), served.names())
        return await _answer(request, running, generation, chat=False)

    async def _answer(
        request: Request, running: Engine, generation: _protocol.Generation, *, chat: bool, images: dict | None = None
    ):
        if images is not None:  # the processor tokenized the prompt, each image's tokens in it
            ids = [int(t) for t in images.pop("input_ids")[0]]
            images.pop("attention_mask", None)
        elif isinstance(generation.prompt, str):
            _protocol.check_length(
                generation.prompt, generation.prompt_field, running.max_model_len, longest,
                f"the server's max_model_len={running.max_model_len}",
            )  # fmt: skip
            # A chat prompt holds its template's own special tokens.
            # verbose=False: a prompt too long for the context is the 400 below, not a log line.
            ids = tokenizer(generation.prompt, add_special_tokens=not chat, verbose=False)["input_ids"]
        else:
            ids = generation.prompt
        _protocol.check_token_ids(
            generation, getattr(running.model.config.get_text_config(decoder=True), "vocab_size", None)
        )
        loop = asyncio.get_running_loop()
        if generation.constraint is not None:  # compiled off the event loop (kept: submit finds it)
            try:
                await loop.run_in_executor(None, lambda: running.grammars().compile(generation.constraint))
            except ConstraintError as error:
                field = generation.constraint_field
                raise _protocol.invalid(field, f"{field}: {error}") from None
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        submitted = []
        # From here to the last submit nothing awaits: an adapter unloaded meanwhile was refused here.
        name = generation.model
        adapter = served.start(name, len(generation.params))
        try:
            for index, params in enumerate(generation.params):

                def listener(event: Event, index=index):
                    if event.finish_reason is not None:  # the request's last event: off its adapter
                        served.finished(name)
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))

                submitted.append(
                    running.submit(ids, dataclasses.replace(params, adapter=adapter), listener, images=images)
                )
        except BaseException as error:  # the requests not submitted are not running on the adapter
            served.finished(name, len(generation.params) - len(submitted))
            for done in submitted:
                running.cancel(done)
            if isinstance(error, QueueFullError):
                raise ApiError(429, str(error), code="rate_limit_exceeded") from None
            if isinstance(error, LimitError):
                raise _protocol.limit_error(error, generation) from None
            if isinstance(error, GenerationError):
                raise _protocol.invalid(generation.prompt_field, str(error)) from None
            raise
        answer = _Answer(name, chat, len(generation.params), len(ids), token_text, generation)

        def cancel_all():
            for done in submitted:
                if not done.finished:
                    running.cancel(done)

        if generation.stream:

            async def chunks():
                try:
                    opening = "".join(answer.opening())  # chat's role deltas, at once as vLLM's
                    if opening:
                        yield opening
                    while not answer.done:
                        # One write per wake-up: a chunk's tokens (of every choice) arrive together, and
                        # the client still reads one server-sent event per token.
                        index, event = await events.get()
                        texts = list(answer.stream(index, event))
                        while not answer.done and not events.empty():
                            index, event = events.get_nowait()
                            texts.extend(answer.stream(index, event))
                        if texts:
                            yield "".join(texts)
                    if generation.include_usage:
                        yield answer.usage_chunk()
                    yield "data: [DONE]\n\n"
                finally:
                    cancel_all()

            return StreamingResponse(chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            while not answer.done:
                try:
                    index, event = await asyncio.wait_for(events.get(), timeout=0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        return JSONResponse({}, status_code=499)
                    continue
                answer.collect(index, event)
        finally:
            cancel_all()
        return answer.whole()

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


class _Answer:
    """One chat or completion answer, built from the engine's events of its n choices.

    A stream sends one event per token, as vLLM's does (a decode chunk's tokens arrive together):
    the token's text, or "" where the text is held back (a partial UTF-8 character, the start of a
    possible stop string) to arrive with the token that releases it; its log-probabilities; and on
    the answer's last token the finish_reason. An EOS token that ends the answer has an event of its
    own, with the text held back until then. A cancelled answer ends with an event without a token.

    A chat answer read for tool calls (`generation.tool_parser`) streams its content until the text
    could be the start of a call (the parser's `held_from`); the rest is held back to the end, where
    the calls found go out as OpenAI's `delta.tool_calls` (each call's id, type and name, then its
    arguments) and finish_reason "tool_calls", or, where none is found, the held text as content.
    """

    def __init__(
        self, model: str, chat: bool, choices: int, prompt_tokens: int, token_text: TokenText,
        generation: _protocol.Generation,
    ):  # fmt: skip
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.generation = generation
        self.content_sent = [0] * choices  # characters of each choice's text streamed as content
        self.model, self.chat, self.token_text = model, chat, token_text
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.text = [""] * choices
        self.ids: list[list[int]] = [[] for _ in range(choices)]  # the answer's tokens so far
        self.logprobs: list[list[dict] | None] = [None] * choices  # one entry per token (`_entry`)
        self.token_chars = [0] * choices  # characters of the logprobs' token texts so far (text_offset)
        self.finish: list[str | None] = [None] * choices
        self.completion_tokens = [0] * choices

    @property
    def done(self) -> bool:
        return all(reason is not None for reason in self.finish)

    def _record(self, index: int, event: Event) -> list[dict] | None:
        """Adds the event to choice `index`; returns its tokens' log-probability entries (None: not asked)."""
        entries = None if event.logprobs is None else []
        for token, logprob in zip(event.token_ids, event.logprobs or [None] * len(event.token_ids)):
            if logprob is not None:
                entries.append(self._entry(logprob, self.ids[index]))
            self.ids[index].append(token)
        if event.eos and event.logprobs is not None:  # the EOS token's, last
            entries.append(self._entry(event.logprobs[-1], self.ids[index]))
        self.text[index] += event.text
        if entries is not None:
            self.logprobs[index] = self.logprobs[index] or []
            self.logprobs[index].extend(entries)
            self.token_chars[index] += sum(len(e["token"]) for e in entries)
        self.completion_tokens[index] = event.completion_tokens
        if event.finish_reason is not None:
            self.finish[index] = "stop" if event.finish_reason in ("stop", "cancelled") else event.finish_reason
            if event.finish_reason == "error":
                raise ApiError(500, "the engine failed while generating this answer; see the server's log")
        return entries

    def collect(self, index: int, event: Event) -> None:
        self._record(index, event)

    def usage(self) -> dict:
        completion = sum(self.completion_tokens)
        return {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }  # fmt: skip

    def _entry(self, logprob, before: list[int]) -> dict:
        """One token's log-probabilities in OpenAI's chat shape: its text after the answer's tokens
        `before` (`TokenText.text_of`), its own bytes, and the same of its alternatives."""

        def entry(token_id: int, value: float) -> dict:
            text = self.token_text.text_of(token_id, before)
            return {"token": text, "logprob": value, "bytes": list(self.token_text.bytes_of(token_id))}

        return {**entry(logprob.token_id, logprob.logprob), "top_logprobs": [entry(t, v) for t, v in logprob.top]}

    def _chat_logprobs(self, entries: list[dict] | None) -> dict | None:
        return None if entries is None else {"content": entries}

    @staticmethod
    def _completion_logprobs(entries: list[dict] | None, offset: int) -> dict | None:
        """The completions endpoint's shape; `offset`: the characters of the answer's tokens before these."""
        if entries is None:
            return None
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{top["token"]: top["logprob"] for top in e["top_logprobs"]} for e in entries],
            "text_offset": offsets,
        }

    def _envelope(self, choices: list, *, chunk: bool) -> dict:
        kind = ("chat.completion" + (".chunk" if chunk else "")) if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _tool_calls(self, index: int) -> _tools.Calls | None:
        """The tool calls of choice `index`'s finished answer (None: none, or not read for them)."""
        parser = self.generation.tool_parser if self.chat else None
        if parser is None:
            return None
        return parser.parse(self.text[index], self.generation.prompt, self.generation.tools or [])

    def whole(self) -> dict:
        choices = []
        for i, text in enumerate(self.text):
            if self.chat:
                message, finish = {"role": "assistant", "content": text}, self.finish[i]
                calls = self._tool_calls(i)
                if calls is not None:  # as vLLM: "tool_calls" however the answer ended
                    message = {"role": "assistant", "content": calls.content, "tool_calls": _tools.openai_calls(calls)}
                    finish = "tool_calls"
                choice = {
                    "index": i, "message": message, "logprobs": self._chat_logprobs(self.logprobs[i]),
                    "finish_reason": finish,
                }  # fmt: skip
            else:
                choice = {
                    "index": i, "text": text, "logprobs": self._completion_logprobs(self.logprobs[i], 0),
                    "finish_reason": self.finish[i],
                }  # fmt: skip
            choices.append(choice)
        return {**self._envelope(choices, chunk=False), "usage": self.usage()}

    @staticmethod
    def _sse(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    def opening(self):
        if self.chat:
            for i in range(len(self.text)):
                delta = {"role": "assistant", "content": ""}
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                yield self._sse(self._envelope([choice], chunk=True))

    def stream(self, index: int, event: Event):
        """The server-sent events of one engine event: one per token, and one for text held back to the
        end where no token carries it."""
        offset = self.token_chars[index]
        entries = self._record(index, event)
        finish = self.finish[index]
        parts = [
            (piece, None if entries is None else [entries[i]], None) for i, piece in enumerate(event.pieces)
        ]  # (text, logprob entries, finish_reason)
        if event.eos or (not parts and (event.tail or finish is not None)):
            parts.append((event.tail, entries[len(event.pieces) :] if entries and event.eos else None, finish))
        elif event.tail or finish is not None:
            text, token_entries, _ = parts[-1]
            parts[-1] = (text + event.tail, token_entries, finish)
        parser = self.generation.tool_parser if self.chat else None
        end = len(self.text[index]) - len(event.text)  # where this event's text begins in the answer
        for text, token_entries, reason in parts:
            end += len(text)
            if parser is not None:  # stream the content up to where a tool call could begin
                answer, sent = self.text[index][:end], self.content_sent[index]
                text = answer[sent : max(parser.held_from(answer, sent), sent)]
                self.content_sent[index] = sent + len(text)
                if reason is not None:
                    yield from self._stream_calls(index, text, token_entries, reason)
                    continue
            if self.chat:
                delta = {"content": text} if text or reason is None else {}
                choice = {
                    "index": index, "delta": delta, "logprobs": self._chat_logprobs(token_entries),
                    "finish_reason": reason,
                }  # fmt: skip
            else:
                choice = {
                    "index": index, "text": text, "logprobs": self._completion_logprobs(token_entries, offset),
                    "finish_reason": reason,
                }  # fmt: skip
                offset += sum(len(e["token"]) for e in token_entries or [])
            yield self._sse(self._envelope([choice], chunk=True))

    def _stream_calls(self, index: int, text: str, token_entries: list[dict] | None, reason: str):
        """The last events of a chat answer read for tool calls: its last content, then the calls found
        (each call's id, type and name, then its arguments) and finish_reason "tool_calls", or the text
        held back as content and the answer's own finish_reason."""
        calls = self._tool_calls(index)
        held = self.text[index][self.content_sent[index] :]
        if calls is not None:
            held = (calls.content or "")[self.content_sent[index] :]
        text += held
        self.content_sent[index] += len(held)

        def chunk(delta: dict, entries=None, finish=None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": self._chat_logprobs(entries), "finish_reason": finish}
            return self._sse(self._envelope([choice], chunk=True))

        if calls is None:
            yield chunk({"content": text} if text else {}, token_entries, reason)
            return
        if text or token_entries is not None:
            yield chunk({"content": text}, token_entries)
        for k, call in enumerate(_tools.openai_calls(calls)):
            function = call["function"]
            opening = {
                "index": k,
                "id": call["id"],
                "type": "function",
                "function": {"name": function["name"], "arguments": ""},
            }
            yield chunk({"tool_calls": [opening]})
            yield chunk({"tool_calls": [{"index": k, "function": {"arguments": function["arguments"]}}]})
        self.finish[index] = "tool_calls"
        yield chunk({}, finish="tool_calls")

    def usage_chunk(self) -> str:
        return self._sse({**self._envelope([], chunk=True), "usage": self.usage()})
