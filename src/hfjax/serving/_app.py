"""The OpenAI-compatible HTTP API of `hfjax serve`, a FastAPI application around one `Engine`.

Endpoints: POST /v1/chat/completions, /v1/completions, /v1/embeddings; GET /v1/models, /health,
/metrics (Prometheus' text format, written by prometheus_client), / (the chat page). Errors answer
in OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 for a bad request (FastAPI's
422 is never used: bodies are read and checked here), 401 for a missing or wrong API key, 429 for a full queue.
"""

# FastAPI reads the endpoints' annotations (Request) at run time: no `from __future__ import annotations`.

import asyncio
import base64
import contextlib
import importlib.resources
import json
import secrets
import time

import numpy as np

from .._errors import GenerationError, HfjaxError
from . import _protocol
from ._metrics import Metrics
from ._protocol import ApiError
from ._requests import Event, QueueFullError, default_sampling
from ._scheduler import Engine
from ._text import TokenText


def build_app(model, *, served_model_name: str, engine: Engine | None, api_key: str | None = None):
    """The FastAPI application serving `model` (through `engine` for a causal LM; an encoder
    answers /v1/embeddings only). The engine is started and stopped with the application."""
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

    metrics = engine.metrics if engine is not None else Metrics(0)
    tokenizer = model.tokenizer
    max_model_len = engine.max_model_len if engine is not None else None
    token_text = TokenText(tokenizer) if engine is not None else None
    # What a request without temperature gets; the chat page starts its field at it and sends it.
    default_temperature = default_sampling(model)["temperature"] if engine is not None else 1.0
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if engine is not None:
            engine.start()
        yield
        if engine is not None:
            # In-flight requests have been answered by now (uvicorn waits for them on SIGTERM).
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    app = FastAPI(title="hfjax serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error_response(error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    app.add_middleware(_Gate, api_key=api_key, metrics=metrics, refused=error_response)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return error_response(error)

    async def read_json(request: Request):
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise _protocol.invalid("body", f"the request body is not valid JSON: {error}") from None

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
        entry = {"id": served_model_name, "object": "model", "created": created, "owned_by": "hfjax"}
        if max_model_len is not None:
            entry["max_model_len"] = max_model_len
        return {"object": "list", "data": [entry]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/")
    async def page():
        html = importlib.resources.files("hfjax.serving").joinpath("static/index.html").read_text("utf-8")
        return HTMLResponse(html.replace("__DEFAULT_TEMPERATURE__", f"{default_temperature:g}"))

    @app.get("/favicon.svg")
    @app.get("/favicon.ico")  # where browsers look for it without a <link rel="icon">
    async def favicon():
        icon = importlib.resources.files("hfjax.serving").joinpath("static/favicon.svg").read_bytes()
        return Response(icon, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        texts, encoding = _protocol.embedding_request(await read_json(request), served_model_name)
        loop = asyncio.get_running_loop()
        try:
            vectors = np.asarray(await loop.run_in_executor(None, model.embed, texts), np.float32)  # [N, H]
        except HfjaxError as error:  # a model that embeds no text
            raise ApiError(400, str(error), param="model", code="model_not_supported") from None
        tokens = sum(len(tokenizer(t, verbose=False)["input_ids"]) for t in texts)
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

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        running = needs_engine("/v1/chat/completions")
        generation = _protocol.chat_request(
            await read_json(request), served_model_name, running.max_model_len,
            lambda messages: tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        )  # fmt: skip
        return await _answer(request, running, generation, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        running = needs_engine("/v1/completions")
        generation = _protocol.completion_request(await read_json(request), served_model_name, running.max_model_len)
        return await _answer(request, running, generation, chat=False)

    async def _answer(request: Request, running: Engine, generation: _protocol.Generation, *, chat: bool):
        if isinstance(generation.prompt, str):
            # A chat prompt holds its template's own special tokens.
            # verbose=False: a prompt too long for the context is the 400 below, not a log line.
            ids = tokenizer(generation.prompt, add_special_tokens=not chat, verbose=False)["input_ids"]
        else:
            ids = generation.prompt
        generation = _protocol.with_budget(generation, len(ids), running.max_model_len)
        _protocol.check_token_ids(
            generation, getattr(running.model.config.get_text_config(decoder=True), "vocab_size", None)
        )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        submitted = []
        try:
            for index, params in enumerate(generation.params):

                def listener(event: Event, index=index):
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))

                submitted.append(running.submit(ids, params, listener))
        except QueueFullError as error:
            for done in submitted:
                running.cancel(done)
            raise ApiError(429, str(error), code="rate_limit_exceeded") from None
        except GenerationError as error:
            for done in submitted:
                running.cancel(done)
            raise _protocol.invalid(generation.prompt_field, str(error)) from None
        answer = _Answer(served_model_name, chat, len(generation.params), len(ids), token_text)

        def cancel_all():
            for done in submitted:
                if not done.finished:
                    running.cancel(done)

        if generation.stream:

            async def chunks():
                try:
                    for text in answer.opening():
                        yield text
                    while not answer.done:
                        index, event = await events.get()
                        for text in answer.stream(index, event):
                            yield text
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
    """Checks the API key of /v1/ requests (401 without it) and counts every answer by path and
    status for /metrics. Plain ASGI: Starlette's `@app.middleware("http")` passes each streamed
    chunk through extra tasks and memory streams (their frames showed throughout a py-spy profile
    of the event loop at 16 concurrent streams)."""

    def __init__(self, app, *, api_key: str | None, metrics: Metrics, refused):
        self.app, self.metrics, self.refused = app, metrics, refused
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.expected is not None and path.startswith("/v1/"):
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
                self.metrics.count_request(path, 401)
                await response(scope, receive, send)
                return
        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.count_request(path, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except BaseException:
            if not started:
                self.metrics.count_request(path, 500)
            raise


class _Answer:
    """One chat or completion answer, built from the engine's events of its n choices.

    A stream sends one event per token, as vLLM's does (a decode chunk's tokens arrive together):
    the token's text, or "" where the text is held back (a partial UTF-8 character, the start of a
    possible stop string) to arrive with the token that releases it; its log-probabilities; and on
    the answer's last token the finish_reason. An EOS token that ends the answer has an event of its
    own, with the text held back until then. A cancelled answer ends with an event without a token.
    """

    def __init__(self, model: str, chat: bool, choices: int, prompt_tokens: int, token_text: TokenText):
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
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

    def whole(self) -> dict:
        choices = []
        for i, text in enumerate(self.text):
            if self.chat:
                choice = {
                    "index": i, "message": {"role": "assistant", "content": text},
                    "logprobs": self._chat_logprobs(self.logprobs[i]), "finish_reason": self.finish[i],
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
        for text, token_entries, reason in parts:
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

    def usage_chunk(self) -> str:
        return self._sse({**self._envelope([], chunk=True), "usage": self.usage()})
