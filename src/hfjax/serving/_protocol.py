"""OpenAI request bodies checked into engine calls, and the OpenAI shape of errors and answers.

Every field a request may carry is listed here: those hfjax carries out (the sampling ones are
mapped onto Model.generate's settings by `SamplingParams`), those it accepts only at their no-op
value (e.g. `echo: false`), and none else: any other field is refused with a 400 that names it, never
ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import sys

from .._errors import GenerationError
from ..generation import TOP_LOGPROBS, Constraint, LimitError
from . import _structured, _tools
from ._requests import SamplingParams, logit_bias_problem, stop_token_ids_problem
from ._tools import ToolParser


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {
            400: "invalid_request_error",
            401: "invalid_request_error",
            404: "invalid_request_error",
            429: "rate_limit_exceeded",
        }.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def engine_failed(failure: BaseException) -> ApiError:
    """The 503 of a server whose engine thread failed with `failure`."""
    return ApiError(
        503, f"the engine failed ({failure!r}) and answers no more requests; restart the server (its log holds "
        "the traceback)", code="engine_failed",
    )  # fmt: skip


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


_MAX_DEPTH = 64  # levels of nesting in a request body (OpenAI's requests nest a few)
_MAX_INPUTS = 2048  # texts in one /v1/embeddings request, OpenAI's limit
_TOO_DEEP = f"the request body nests deeper than {_MAX_DEPTH} levels; nest at most {_MAX_DEPTH}"
_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def parse_body(raw: bytes):
    """A request body read as JSON and checked as a whole: a 400 on "body" where it is not JSON or
    nests deeper than _MAX_DEPTH levels, and one naming the field that holds NaN or Infinity (which
    Python's json reads, JSON has not) or a string that is not Unicode text (a lone UTF-16 surrogate,
    such as "\\ud800", which no tokenizer reads)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise invalid("body", _TOO_DEEP) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise invalid("body", f"the request body is not valid JSON: {error}") from None
    except ValueError:  # Python's limit on the digits of an integer it reads
        raise invalid(
            "body",
            f"the request body holds an integer of over {sys.get_int_max_str_digits()} digits; send smaller numbers",
        ) from None
    _check_values(body)
    return body


def _check_values(body) -> None:
    stack = [(body, ())]
    while stack:
        value, where = stack.pop()
        if len(where) > _MAX_DEPTH:
            raise invalid("body", _TOO_DEEP)
        if isinstance(value, str):
            _check_text(value, _field(where))
        elif isinstance(value, float) and not math.isfinite(value):
            field = _field(where)
            raise invalid(field, f"{field}={value}: JSON has no NaN or Infinity; send a finite number")
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, f"a key of {_field(where)}")
                stack.append((item, (*where, key)))
        elif isinstance(value, list):
            stack.extend((item, (*where, i)) for i, item in enumerate(value))


def _field(where: tuple) -> str:
    """The path of a value in the body, as errors name it: "messages[0].content" ("body": the whole)."""
    if not where:
        return "body"
    head = where[0] if isinstance(where[0], str) else f"body[{where[0]}]"
    return head + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in where[1:])


def _check_text(text: str, field: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        raise invalid(
            field.removeprefix("a key of "),
            f"{field} holds a lone UTF-16 surrogate (\\u{code:04x} at character {error.start}), which is not text; "
            "send valid Unicode",
        ) from None


def longest_token(tokenizer) -> int:
    """The most characters one entry of `tokenizer`'s vocabulary is written with: at least as many as
    the text one token reads (a byte-level token writes each byte as a character)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def check_length(text: str, field: str, tokens: int, longest: int, tokens_name: str) -> None:
    """A 400 naming `field` where `text` has more characters than `tokens` tokens of at most `longest`
    characters each could read: such a text is refused before the tokenizer spends seconds on it."""
    if len(text) > tokens * longest:
        raise invalid(
            field,
            f"{field} holds {len(text)} characters, more than {tokens_name} tokens of at most {longest} characters "
            f"each can hold ({tokens * longest}); send a shorter text",
        )


# Fields accepted only at the value that changes nothing: {field: the values that are no-ops}.
_NO_OP = {
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "reasoning_effort": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "audio": (None,),
    "function_call": (None,),
    "functions": (None,),
    # vLLM's detokenizing fields, which some clients send at their defaults: hfjax's text is theirs
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "include_stop_str_in_output": (None, False),
}
_IDENTIFIERS = ("user", "metadata")  # labels for the caller's own records: they do not change the answer
_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "seed", "stop", "n", "stream", "stream_options", "model", "ignore_eos", "min_tokens",
    "stop_token_ids",
)  # fmt: skip
CHAT_FIELDS = {
    "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "chat_template_kwargs", "tools",
    "tool_choice", "parallel_tool_calls", *_SAMPLING, *_structured.FIELDS
}  # fmt: skip
# apply_chat_template's own arguments, which chat_template_kwargs may not set: its template variables only.
_TEMPLATE_ARGUMENTS = (
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
)  # fmt: skip
COMPLETION_FIELDS = {"prompt", "max_tokens", "logprobs", *_SAMPLING, *_structured.FIELDS}


@dataclasses.dataclass
class Generation:
    """A checked chat or completion request: what to run and how to answer."""

    prompt: str | list[int]  # text (a chat's is its template applied) or token ids
    params: list[SamplingParams]  # one per choice (n)
    stream: bool
    include_usage: bool
    max_tokens_field: str  # "max_tokens" or "max_completion_tokens": the field that set the params' max_tokens
    prompt_field: str  # "messages" or "prompt", named in errors about the prompt's length
    tools: list[dict] | None = None  # the chat's tools, rendered into the prompt by the chat template
    tool_parser: ToolParser | None = None  # reads tool calls out of the answer (tool_choice "auto")
    # what the answer must be (every choice's `SamplingParams.constraint`), and the field that asked
    constraint: Constraint | None = None
    constraint_field: str | None = None
    model: str = ""  # the served model name it asked for: the base's or a LoRA adapter's


def check_fields(body, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise invalid("body", f"the request body is a JSON {_JSON_TYPES.get(type(body), 'null')}; send a JSON object")
    for name, value in body.items():
        if name in allowed or name in _IDENTIFIERS:
            continue
        if name in _NO_OP:
            if value not in _NO_OP[name]:
                raise invalid(name, f"{name}={value!r} is not supported by hfjax serve; leave it out")
            continue
        removed = _structured.removed_field(name)
        if removed:
            raise invalid(name, removed)
        raise invalid(name, f"unknown or unsupported field {name!r}; hfjax serve does not carry it out, leave it out")
    return body


def check_model(body: dict, served: tuple[str, ...]) -> str:
    """The model name the request asks for, one of `served` (the base's first, then its LoRA adapters'):
    a 400 where it is missing or not a string, a 404 (OpenAI's, vLLM's) where no model of that name is served."""
    if "model" not in body:
        raise invalid("model", f"the request has no 'model'; pass model={served[0]!r}")
    name = body["model"]
    if not isinstance(name, str):
        raise invalid("model", f"model={name!r} is not a model name; pass one of {_names(served)}")
    if name not in served:
        raise unknown_model(name, served)
    return name


def unknown_model(name: str, served: tuple[str, ...]) -> ApiError:
    """The 404 for a model name not served: OpenAI's NotFoundError, code model_not_found."""
    return ApiError(
        404,
        f"the model {name!r} does not exist here; this server serves {_names(served)}",
        param="model",
        kind="NotFoundError",
        code="model_not_found",
    )


def _names(served: tuple[str, ...]) -> str:
    return ", ".join(map(repr, served))


def _number(body: dict, name: str, default, low: float, high: float, *, low_open=False, integer=False):
    value = body.get(name)
    if value is None:
        return default
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or (not integer and not math.isfinite(value)):
        raise invalid(name, f"{name}={value!r} is not a {'whole number' if integer else 'number'}")
    if value < low or value > high or (low_open and value == low):
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise invalid(name, f"{name}={value!r} is out of range; pass a value in {bounds}")
    return value


def _whole_number(body: dict, name: str, default):
    """A whole number's type only: its range is checked with the prompt (`generation.check_limits`)."""
    return _number(body, name, default, -math.inf, math.inf, integer=True)


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise invalid("stop", f"stop={stop!r}: pass a non-empty string or a list of at most 4 of them")
    return tuple(stops)


def _stop_token_ids(body: dict, min_tokens: int | None) -> tuple[int, ...]:
    """vLLM's stop_token_ids: token ids that end the answer (kept in it)."""
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    problem = stop_token_ids_problem(ids, min_tokens)
    if problem:
        raise invalid("stop_token_ids", problem)
    return tuple(ids)


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise invalid("logit_bias", f"logit_bias={bias!r}: pass an object mapping token ids to biases in [-100, 100]")
    problem = logit_bias_problem(len(bias))
    if problem:
        raise invalid("logit_bias", problem)
    pairs = []
    for token, value in bias.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            raise invalid(
                "logit_bias", f'logit_bias key {token!r} is not a token id; pass ids such as "50256"'
            ) from None
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not -100 <= value <= 100:
            raise invalid("logit_bias", f"logit_bias[{token!r}]={value!r}: pass a number in [-100, 100]")
        pairs.append((token_id, float(value)))
    return tuple(sorted(pairs))


def _sampling(body: dict, max_tokens: int | None, logprobs: int | None) -> list[SamplingParams]:
    """One SamplingParams per choice (n). A sampling field left out takes the checkpoint's
    generation_config.json, else OpenAI's default, as vLLM does (`SamplingParams.settings`).
    `max_tokens` None: up to the context (the engine fills it in)."""
    temperature = _number(body, "temperature", None, 0.0, 2.0)
    top_p = _number(body, "top_p", None, 0.0, 1.0, low_open=True)
    top_k = _number(body, "top_k", None, -1, 2**31 - 1, integer=True)  # vLLM's -1 and 0 are off
    min_p = _number(body, "min_p", None, 0.0, 1.0)
    repetition = _number(body, "repetition_penalty", None, 0.0, 10.0, low_open=True)
    presence = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    seed = _number(body, "seed", None, 0, 2**63 - 1, integer=True)
    least = _whole_number(body, "min_tokens", None)  # vLLM's field
    n = _number(body, "n", 1, 1, 16, integer=True)
    ignore_eos = body.get("ignore_eos") or False
    if not isinstance(ignore_eos, bool):
        raise invalid("ignore_eos", f"ignore_eos={ignore_eos!r}: pass true or false")
    stops, stop_ids, bias = _stops(body), _stop_token_ids(body, least), _logit_bias(body)
    return [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=None if temperature is None else float(temperature),
            top_p=None if top_p is None else float(top_p),
            top_k=None if top_k is None else max(int(top_k), 0),
            min_p=None if min_p is None else float(min_p),
            repetition_penalty=None if repetition is None else float(repetition),
            presence_penalty=float(presence),
            frequency_penalty=float(frequency),
            logit_bias=bias,
            seed=None if seed is None else (seed + i) % 2**32,
            stop=stops,
            stop_token_ids=stop_ids,
            logprobs=logprobs,
            ignore_eos=ignore_eos,
            min_tokens=least,
        )
        for i in range(n)
    ]


def _stream(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise invalid("stream", f"stream={stream!r}: pass true or false")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise invalid("stream_options", "stream_options is only allowed with stream=true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise invalid("stream_options", f"stream_options={options!r}: only {{'include_usage': bool}} is supported")
    return stream, bool(options.get("include_usage", False))


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None) -> tuple[int | None, str]:
    """(the first of the fields `names` the body sets, or `default`; that field's name)."""
    for name in names:
        if body.get(name) is not None:
            return _whole_number(body, name, None), name
    return default, names[-1]


def template_kwargs(body: dict) -> dict:
    """vLLM's chat_template_kwargs: extra variables for the chat template (e.g. Qwen3's enable_thinking)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise invalid(
            "chat_template_kwargs",
            f'chat_template_kwargs={kwargs!r}: pass an object of template variables, e.g. {{"enable_thinking": false}}',
        )
    for name in kwargs:
        if name in _TEMPLATE_ARGUMENTS:
            raise invalid(
                "chat_template_kwargs",
                f"chat_template_kwargs[{name!r}] is an argument of apply_chat_template, not a template variable; "
                "leave it out",
            )
    return kwargs


def messages_of(body: dict) -> list[dict]:
    """The request's `messages` checked, text content parts joined into one string per message; a
    message with images (`_media.image_parts`' {"type": "image"} parts) keeps its list of parts."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "the request has no 'messages'; pass a list of {'role': ..., 'content': ...}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"messages[{i}]", f"messages[{i}]={message!r}: pass {{'role': ..., 'content': ...}}")
        content = message.get("content")
        if isinstance(content, list):  # the content-parts form: text parts (and images, read before)
            if not all(isinstance(p, dict) and p.get("type") in ("text", "image") for p in content):
                raise invalid(f"messages[{i}].content", "only text and image_url content parts are supported")
            for j, part in enumerate(content):
                if not isinstance(part.get("text", ""), str):
                    field = f"messages[{i}].content[{j}].text"
                    raise invalid(field, f"{field}={part['text']!r}: pass a string")
            if all(p["type"] == "text" for p in content):
                message = {**message, "content": "".join(p.get("text", "") for p in content)}
                messages[i] = message
        if message.get("tool_calls") is not None and message["role"] == "assistant":
            messages[i] = _checked(_tools.message_with_tool_calls, message, i)
        elif not isinstance(message.get("content"), (str, list)):
            raise invalid(f"messages[{i}].content", f"messages[{i}].content={content!r}: pass a string")
    return messages


def rendered(apply_template, messages: list[dict], **kwargs) -> str:
    """`apply_template(messages, **kwargs)`, the prompt text; a template that fails is a 400 on messages."""
    try:
        return apply_template(messages, **kwargs)
    except Exception as error:  # noqa: BLE001 - the template's own message says what is wrong
        raise invalid("messages", f"the chat template could not be applied: {error}") from None


def _checked(check, *args):
    """`check(*args)` of `_tools`, its FieldError an OpenAI 400 naming the field."""
    try:
        return check(*args)
    except _tools.FieldError as error:
        raise invalid(error.param, str(error)) from None


def chat_request(body, served: tuple[str, ...], apply_template, tool_parser: ToolParser | None = None) -> Generation:
    """A /v1/chat/completions body checked; `served`: the model names it may ask for (`check_model`);
    `apply_template(messages, **chat_template_kwargs)` gives the prompt text (with `tools=` where the
    request has tools). `tool_parser`: the server's parser of tool calls (--enable-auto-tool-choice),
    None where it reads none."""
    body = check_fields(body, CHAT_FIELDS)
    model = check_model(body, served)
    messages = messages_of(body)
    kwargs = template_kwargs(body)
    tools = _checked(_tools.tools_of, body)
    parser = _checked(_tools.parser_for, body, tools, tool_parser)
    if tools is not None:
        kwargs = {**kwargs, "tools": tools}
    max_tokens, max_tokens_field = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise invalid("logprobs", f"logprobs={logprobs!r}: pass true or false")
    top = _number(body, "top_logprobs", 0, 0, TOP_LOGPROBS, integer=True)
    if body.get("top_logprobs") is not None and not logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs=true")
    prompt = rendered(apply_template, messages, **kwargs)
    stream, usage = _stream(body)
    params = _sampling(body, max_tokens, top if logprobs else None)
    if parser is not None and parser.special_markers:
        params = [dataclasses.replace(p, skip_special_tokens=False) for p in params]
    generation = Generation(prompt, params, stream, usage, max_tokens_field, "messages", tools, parser, model=model)
    return _constrained(generation, body)


def completion_request(body, served: tuple[str, ...]) -> Generation:
    """A /v1/completions body checked (one prompt: a string or a list of token ids)."""
    body = check_fields(body, COMPLETION_FIELDS)
    model = check_model(body, served)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    is_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not is_ids:
        raise invalid("prompt", "the request has no 'prompt'; pass one non-empty string (or a list of token ids)")
    max_tokens, max_tokens_field = _max_tokens(body, ("max_tokens",), 16)
    logprobs = _number(body, "logprobs", None, 0, TOP_LOGPROBS, integer=True)
    stream, usage = _stream(body)
    generation = Generation(
        prompt, _sampling(body, max_tokens, logprobs), stream, usage, max_tokens_field, "prompt", model=model
    )
    return _constrained(generation, body)


def _constrained(generation: Generation, body: dict) -> Generation:
    """The request with its structured-output fields (`_structured`) read into every choice, or the
    JSON Schema a forced tool_choice ("required", a named function) holds the answer to."""
    constraint, field = _checked(_structured.constraint_of, body)
    forced = generation.tool_parser.schema if generation.tool_parser is not None else None
    if forced is not None:
        if constraint is not None:
            raise invalid(
                field, f"tool_choice={body['tool_choice']!r} decides what the answer is; pass it or {field}, not both"
            )
        try:
            constraint, field = Constraint.json_schema(forced), "tools"
        except GenerationError as error:
            raise invalid(
                "tools", f"tools: a function's parameters are not a schema the engine takes: {error}"
            ) from None
    if constraint is None:
        return generation
    params = [dataclasses.replace(p, constraint=constraint) for p in generation.params]
    return dataclasses.replace(generation, params=params, constraint=constraint, constraint_field=field)


def embedding_request(body, served: tuple[str, ...]) -> tuple[list[str], str, int | None]:
    """A /v1/embeddings body checked: (texts, encoding format "float" or "base64", dimensions or None)."""
    body = check_fields(body, {"input", "model", "encoding_format", "dimensions"})
    check_model(body, served)
    texts = body.get("input")
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise invalid("input", "the request has no 'input'; pass a non-empty string or a list of them")
    if len(texts) > _MAX_INPUTS:
        raise invalid("input", f"input holds {len(texts)} texts; pass at most {_MAX_INPUTS} in one request")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise invalid("encoding_format", f"encoding_format={encoding!r}: pass 'float' or 'base64'")
    return texts, encoding, _number(body, "dimensions", None, 1, 2**31 - 1, integer=True)


def check_dimensions(dimensions: int, config, width: int, served: str) -> None:
    """A 400 naming `dimensions` unless the model was trained for Matryoshka truncation to that many,
    as vLLM reads it from config.json: `matryoshka_dimensions` (the sizes allowed) or `is_matryoshka`."""
    sizes = getattr(config, "matryoshka_dimensions", None)
    if not sizes and not getattr(config, "is_matryoshka", False):
        raise invalid(
            "dimensions",
            f"dimensions={dimensions}: {served!r} is not a Matryoshka model (its config.json has neither "
            "is_matryoshka nor matryoshka_dimensions), so a shorter embedding would lose its meaning; leave "
            "dimensions out",
        )
    if sizes and dimensions not in sizes:
        raise invalid("dimensions", f"dimensions={dimensions}: {served!r} supports dimensions in {list(sizes)}")
    if dimensions > width:
        raise invalid("dimensions", f"dimensions={dimensions} is more than the {width} of {served!r}'s embeddings")


_TOKENIZE_FIELDS = {"model", "add_special_tokens", "return_token_strs"}
_TOKENIZE_CHAT_FIELDS = {*_TOKENIZE_FIELDS, "messages", "add_generation_prompt", "continue_final_message",
                         "chat_template_kwargs", "tools"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Tokenize:
    """A checked /tokenize body (vLLM's): a prompt, or messages to apply the chat template to."""

    prompt: str | None
    messages: list[dict] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    continue_final_message: bool
    template_kwargs: dict  # with `tools` where the request has them
    return_token_strs: bool


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"{name}={value!r}: pass true or false")
    return value


def _optional_model(body: dict, served: tuple[str, ...]) -> None:
    if body.get("model") is not None:
        check_model(body, served)


def tokenize_request(body, served: tuple[str, ...]) -> Tokenize:
    """A /tokenize body checked: {prompt} or {messages, add_generation_prompt, ...}, `model` optional."""
    chat = isinstance(body, dict) and "messages" in body
    body = check_fields(body, _TOKENIZE_CHAT_FIELDS if chat else {*_TOKENIZE_FIELDS, "prompt"})
    _optional_model(body, served)
    strs = _flag(body, "return_token_strs", False)
    if not chat:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise invalid("prompt", "the request has no 'prompt'; pass a string, or 'messages' for a chat")
        return Tokenize(prompt, None, _flag(body, "add_special_tokens", True), False, False, {}, strs)
    generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final = _flag(body, "continue_final_message", False)
    if generation_prompt and continue_final:
        raise invalid(
            "continue_final_message",
            "continue_final_message=true continues the last message, add_generation_prompt=true starts a new one; "
            "pass add_generation_prompt=false with it",
        )
    tools = _checked(_tools.tools_of, body)
    kwargs = template_kwargs(body) if tools is None else {**template_kwargs(body), "tools": tools}
    return Tokenize(
        None, messages_of(body), _flag(body, "add_special_tokens", False), generation_prompt, continue_final,
        kwargs, strs,
    )  # fmt: skip


def detokenize_request(body, served: tuple[str, ...], vocab_size: int) -> list[int]:
    """A /detokenize body checked: its token ids, each in [0, vocab_size)."""
    body = check_fields(body, {"model", "tokens"})
    _optional_model(body, served)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise invalid("tokens", f"tokens={tokens!r}: pass a list of token ids")
    outside = [t for t in tokens if not 0 <= t < vocab_size]
    if outside:
        raise invalid("tokens", f"tokens holds {outside[0]}, outside the vocabulary [0, {vocab_size})")
    return tokens


def lora_request(body, *, load: bool) -> tuple[str, str | None]:
    """A body of vLLM's /v1/load_lora_adapter ({lora_name, lora_path}; load=True) or
    /v1/unload_lora_adapter ({lora_name}) checked: (lora_name, lora_path or None)."""
    names = ("lora_name", "lora_path") if load else ("lora_name",)
    body = check_fields(body, {*names, "load_inplace"} if load else set(names))
    if body.get("load_inplace") not in (None, False):
        raise invalid(
            "load_inplace", f"load_inplace={body['load_inplace']!r}: hfjax serve does not reload an adapter in "
            "place; unload it, then load it again",
        )  # fmt: skip
    for name in names:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            example = '{"lora_name": "mine", "lora_path": "/path/to/adapter"}' if load else '{"lora_name": "mine"}'
            raise invalid(name, f"{name}={value!r}: pass a non-empty string, as in {example}")
    return body["lora_name"], body.get("lora_path")


def check_token_ids(generation: Generation, vocab_size: int | None) -> None:
    """A 400 naming logit_bias or stop_token_ids where one names a token outside the vocabulary."""
    problem = generation.params[0].vocabulary_problem(vocab_size)  # (every choice has the same fields)
    if problem:
        raise invalid(*problem)


def limit_error(error: LimitError, generation: Generation) -> ApiError:
    """The engine's `LimitError` (`generation.check_limits`) as a 400 on the request's own field, in its
    names: max_tokens or max_completion_tokens, min_tokens, or the prompt's (messages, prompt)."""
    param = {"max_new_tokens": generation.max_tokens_field, "min_new_tokens": "min_tokens"}.get(
        error.field, generation.prompt_field
    )
    prompt = f"the prompt ({generation.prompt_field})"
    return invalid(param, error.renamed(max_new_tokens=generation.max_tokens_field, prompt=prompt))
