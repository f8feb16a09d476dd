"""The routes that generate through the engine: POST /v1/chat/completions and /v1/completions, and the
path they share (`respond`): tokenize, check, submit each choice, then stream or collect the events.
"""

# FastAPI reads the endpoints' annotations (Request) at run time: no `from __future__ import annotations`.

import asyncio
import dataclasses

from .._errors import GenerationError
from ..generation import ConstraintError, LimitError
from ..generation import processed as generation_processed
from . import _media, _protocol
from ._answer import Answer
from ._media import MediaPolicy
from ._protocol import ApiError
from ._requests import Event, QueueFullError
from ._routes import Service, read_json
from ._scheduler import Engine
from ._text import TokenText


def add_completion_routes(app, service: Service, *, media: MediaPolicy, auto_tools: object | None) -> None:
    """POST /v1/chat/completions (with images for a vision-language model, read under `media`; answers
    read for tool calls with `auto_tools`, a `_tools` parser, where given) and POST /v1/completions."""
    from fastapi import Request

    model, engine = service.model, service.engine
    takes_images = engine is not None and engine.takes_images
    token_text = TokenText(model.tokenizer) if engine is not None else None

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        running = service.needs_engine("/v1/chat/completions")
        body = await read_json(request)
        parts = _media.image_parts(body, media, takes_images=takes_images)
        # A vision-language model's chat template is its processor's (it places the image tokens).
        template = model.processor.apply_chat_template if takes_images else model.tokenizer.apply_chat_template
        generation = _protocol.chat_request(
            body, service.served.names(),
            lambda messages, **kwargs: template(messages, add_generation_prompt=True, tokenize=False, **kwargs),
            tool_parser=auto_tools,
        )  # fmt: skip
        images = None
        if parts:
            pictures = await _media.load_images(parts, media)

            def process():  # the processor's outputs for the prompt: its ids with the image tokens, pixels, ...
                return generation_processed(model.processor, [generation.prompt], [pictures])

            images = await asyncio.get_running_loop().run_in_executor(None, process)
        return await respond(service, request, running, generation, token_text, chat=True, images=images)

    @app.post("/v1/completions")
    async def completions(request: Request):
        running = service.needs_engine("/v1/completions")
        generation = _protocol.completion_request(await read_json(request), service.served.names())
        return await respond(service, request, running, generation, token_text, chat=False)


async def respond(
    service: Service, request, running: Engine, generation: _protocol.Generation, token_text: TokenText, *,
    chat: bool, images: dict | None = None,
):  # fmt: skip
    """The response to a checked chat or completion request: its prompt tokenized (or the processor's
    ids, with `images`) and checked, its constraint compiled, one `Engine.submit` per choice, then a
    server-sent event stream or the whole answer (`_answer.Answer`); a 499 where the client left."""
    from fastapi.responses import JSONResponse, StreamingResponse

    tokenizer, served = service.tokenizer, service.served
    if images is not None:  # the processor tokenized the prompt, each image's tokens in it
        ids = [int(t) for t in images.pop("input_ids")[0]]
        images.pop("attention_mask", None)
    elif isinstance(generation.prompt, str):
        _protocol.check_length(
            generation.prompt, generation.prompt_field, running.max_model_len, service.longest,
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

            submitted.append(running.submit(ids, dataclasses.replace(params, adapter=adapter), listener, images=images))
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
        if running.failure is not None:  # the engine failed since needs_engine looked
            raise _protocol.engine_failed(running.failure) from None
        raise
    answer = Answer(name, chat, len(generation.params), len(ids), token_text, generation)

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
                    # One write per wake-up: a chunk's tokens (of every choice) arrive together, one
                    # server-sent event per choice.
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
