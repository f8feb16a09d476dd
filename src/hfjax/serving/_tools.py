"""Tool calls read out of a chat answer: vLLM's parsers, by vLLM's names (`--tool-call-parser`), and
the checkpoint's own `response_template` through transformers' `tokenizer.parse_response`.

The request's side: `tools_of` (the tools, checked), `parser_for` (tool_choice: the parser that
reads the answer, or None), `message_with_tool_calls` (an assistant message's calls, their
arguments read into objects for the chat template); a problem is a FieldError naming the field.

A parser reads the whole answer and finds the calls, or none (then the answer is content, as it is
where a call's JSON is malformed). While an answer streams, `ToolParser.held_from` says where text
that could still become a call begins, so that only the text before it streams as content.

Example:
    >>> PARSERS["hermes"].parse('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', "", [])
    Calls(content=None, calls=(('f', '{"x": 1}'),))
"""

from __future__ import annotations

import ast
import dataclasses
import json
import secrets
from collections.abc import Callable

from ._text import cut_start


@dataclasses.dataclass(frozen=True)
class Calls:
    """The tool calls of an answer: the text outside them (None: none) and (name, arguments as JSON text)."""

    content: str | None
    calls: tuple[tuple[str, str], ...]


class FieldError(ValueError):
    """A request's tool field (`param`) that is not as OpenAI's API has it: the server's 400."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class Malformed(ValueError):
    """An answer that starts like a tool call but is not one: it is content."""


@dataclasses.dataclass(frozen=True)
class ToolParser:
    """How one model family writes tool calls.

    `read(text)` gives the calls or raises Malformed (or ValueError, TypeError: JSON and AST errors);
    `starts` are the texts a call begins with, anywhere in the answer or, where `leading`, only at its
    start (after white space); `special_markers`: a start is a special token, so the answer is decoded
    with special tokens kept (as vLLM's `adjust_request` does for these parsers).
    """

    name: str
    read: Callable[[str, str, list], Calls | None]  # (answer, prompt, tools)
    starts: tuple[str, ...]
    leading: bool
    special_markers: bool
    schema: dict | None = None  # the JSON Schema the answer is constrained to (a forced tool_choice)

    def parse(self, text: str, prompt: str, tools: list) -> Calls | None:
        """The answer's calls, or None where it holds none (a malformed call included)."""
        try:
            found = self.read(text, prompt, tools)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        return found if found is not None and found.calls else None

    def held_from(self, text: str, sent: int) -> int:
        """Where the text that could still be (the start of) a tool call begins in `text`, an answer of
        which `sent` characters have streamed as content: len(text) where none could."""
        if self.leading:
            body = text.lstrip()
            if sent > len(text) - len(body):  # content has streamed: no call can lead any more
                return len(text)
            if not body or any(body.startswith(s) or s.startswith(body) for s in self.starts):
                return 0
            return len(text)
        found = [i for i in (text.find(s, sent) for s in self.starts) if i >= 0]
        if found:
            return min(found)
        cut = cut_start(text, len(text), self.starts)  # a start cut off at the end
        return max(len(text) - cut, sent) if cut else len(text)


PARSERS: dict[str, ToolParser] = {}


def _parser(name: str, *starts: str, leading: bool = False, special_markers: bool = False):
    def register(read):
        if name in PARSERS:
            raise ValueError(f"tool call parser {name!r} is registered twice")
        PARSERS[name] = ToolParser(name, lambda text, prompt, tools: read(text), starts, leading, special_markers)
        return read

    return register


def _call(name, arguments) -> tuple[str, str]:
    if not isinstance(name, str) or not name:
        raise Malformed(f"a tool call names no function: {name!r}")
    if isinstance(arguments, str):  # arguments already written as JSON text
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise Malformed(f"a tool call's arguments are not an object: {arguments!r}")
    return name, json.dumps(arguments, ensure_ascii=False)


def _named(item) -> tuple[str, str]:
    """A call written as {"name": ..., "arguments": {...}} (Llama's "parameters" too)."""
    if not isinstance(item, dict):
        raise Malformed(f"a tool call is not an object: {item!r}")
    if "arguments" in item:
        return _call(item.get("name"), item["arguments"])
    if "parameters" in item:
        return _call(item.get("name"), item["parameters"])
    raise Malformed(f"a tool call has no arguments: {item!r}")


@_parser("hermes", "<tool_call>", special_markers=True)
def _hermes(text: str) -> Calls | None:
    """Hermes 2 Pro, Qwen 2.5 and Qwen 3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    blocks (the last one may be unclosed); the content is the text before the first."""
    start, end = "<tool_call>", "</tool_call>"
    first = text.find(start)
    if first < 0:
        return None
    calls, at = [], first
    while at >= 0:
        close = text.find(end, at)
        body = text[at + len(start) : close if close >= 0 else len(text)]
        calls.append(_named(json.loads(body)))
        at = text.find(start, close) if close >= 0 else -1
    return Calls(text[:first] or None, tuple(calls))


@_parser("llama3_json", "<|python_tag|>", "{", leading=True)
def _llama3_json(text: str) -> Calls | None:
    """Llama 3.x: JSON objects {"name": ..., "parameters": {...}} at the start of the answer, after
    `<|python_tag|>` where the model writes it, separated by ";"."""
    body = text.lstrip().removeprefix("<|python_tag|>").lstrip()
    if not body.startswith("{"):
        return None
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body) and body[at] == "{":
        item, at = decoder.raw_decode(body, at)
        calls.append(_named(item))
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return Calls(None, tuple(calls))


@_parser("mistral", "[TOOL_CALLS]", special_markers=True)
def _mistral(text: str) -> Calls | None:
    """Mistral: `[TOOL_CALLS]` and a JSON list of {"name": ..., "arguments": {...}}; the content is the
    text before it."""
    marker = text.find("[TOOL_CALLS]")
    if marker < 0:
        return None
    items = json.loads(text[marker + len("[TOOL_CALLS]") :])
    items = items if isinstance(items, list) else [items]
    return Calls(text[:marker] or None, tuple(_named(item) for item in items))


@_parser("pythonic", "[", leading=True)
def _pythonic(text: str) -> Calls | None:
    """Llama 3.2 and 4, ToolACE: the whole answer a Python list of calls with keyword arguments of
    literal values, `[get_weather(city='SF'), get_time()]`, read with `ast` (nothing runs)."""
    tree = ast.parse(text.strip(), mode="eval").body
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for item in tree.elts:
        if not isinstance(item, ast.Call) or not isinstance(item.func, ast.Name) or item.args:
            raise Malformed(f"not a call with keyword arguments: {ast.unparse(item)}")
        if any(keyword.arg is None for keyword in item.keywords):
            raise Malformed(f"a call unpacks its arguments: {ast.unparse(item)}")
        arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in item.keywords}
        calls.append(_call(item.func.id, arguments))
    return Calls(None, tuple(calls))


def response_template_parser(tokenizer) -> ToolParser | None:
    """The checkpoint's own parser: transformers' `tokenizer.parse_response` with the tokenizer's
    `response_template` (from its tokenizer_config.json), or None where it has none. It reads the
    answer after the prompt, whose end may open a field; a streamed answer is held back whole."""
    if getattr(tokenizer, "response_template", None) is None or not hasattr(tokenizer, "parse_response"):
        return None

    def read(text: str, prompt: str, tools: list) -> Calls | None:
        try:
            message = tokenizer.parse_response(text, prefix=prompt, tools=tools or None)
        except Exception as error:  # noqa: BLE001 - its parsers raise what they raise on text not in their format
            raise Malformed(f"the response_template does not read the answer: {error}") from error
        calls = []
        for item in message.get("tool_calls") or []:
            function = item.get("function", item) if isinstance(item, dict) else None
            if not isinstance(function, dict):
                raise Malformed(f"a tool call is not an object: {item!r}")
            calls.append(_call(function.get("name"), function.get("arguments", {})))
        content = message.get("content")
        return Calls(content if isinstance(content, str) and content else None, tuple(calls))

    # "" starts every text: a streamed answer is held whole, as no start of a call is known.
    return ToolParser("response_template", read, ("",), True, True)


def tool_call_parser(name: str | None, tokenizer) -> ToolParser:
    """The parser `hfjax serve --enable-auto-tool-choice [--tool-call-parser NAME]` uses.

    Raises:
        ValueError: an unknown name, or none given and the tokenizer has no response_template.
    """
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"--tool-call-parser {name}: unknown parser; pass one of {', '.join(PARSERS)}")
        return PARSERS[name]
    parser = response_template_parser(tokenizer)
    if parser is None:
        raise ValueError(
            "--enable-auto-tool-choice needs --tool-call-parser NAME (one of "
            f"{', '.join(PARSERS)}): the checkpoint's tokenizer has no response_template to parse its answers with"
        )
    return parser


def message_with_tool_calls(message: dict, i: int) -> dict:
    """An assistant message's tool_calls checked, each call's arguments (JSON text in OpenAI's API) read
    into an object, as chat templates (and vLLM) expect them; its content may be null."""
    content, calls = message.get("content"), message["tool_calls"]
    if content is not None and not isinstance(content, str):
        raise FieldError(f"messages[{i}].content", f"messages[{i}].content={content!r}: pass a string or null")
    if not isinstance(calls, list):
        raise FieldError(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls={calls!r}: pass a list of tool calls")
    read = []
    for j, call in enumerate(calls):
        field = f"messages[{i}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise FieldError(
                field, f'{field}={call!r}: pass {{"id", "type": "function", "function": {{"name", "arguments"}}}}'
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError) as error:  # (JSONDecodeError, an integer of too many digits)
                raise FieldError(
                    f"{field}.function.arguments",
                    f"{field}.function.arguments is not JSON ({error}); pass the arguments as a JSON object as text",
                ) from None
        if not isinstance(arguments, dict):
            raise FieldError(
                f"{field}.function.arguments", f"{field}.function.arguments={arguments!r}: pass a JSON object"
            )
        read.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "content": content, "tool_calls": read}


def tools_of(body: dict) -> list[dict] | None:
    """The request's `tools` checked: OpenAI's [{"type": "function", "function": {"name", "description",
    "parameters"}}]; None where it has none."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise FieldError(
            "tools", f'tools={tools!r}: pass a list of {{"type": "function", "function": {{"name": ...}}}}'
        )
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise FieldError(
                f"tools[{i}]", f'tools[{i}]={tool!r}: pass {{"type": "function", "function": {{"name": ...}}}}'
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise FieldError(
                f"tools[{i}].function.name", f"tools[{i}].function.name={name!r}: pass the function's name"
            )
        if not isinstance(function.get("description", ""), str):
            field = f"tools[{i}].function.description"
            raise FieldError(field, f"{field}={function['description']!r}: pass a string")
        if not isinstance(function.get("parameters", {}), dict):
            field = f"tools[{i}].function.parameters"
            raise FieldError(field, f"{field}={function['parameters']!r}: pass a JSON Schema object")
    return tools


def parser_for(body: dict, tools: list[dict] | None, auto: ToolParser | None) -> ToolParser | None:
    """The parser that reads the answer's tool calls, or None (tool_choice "none"). As in vLLM,
    tool_choice defaults to "auto" where there are tools, which needs the server's
    --enable-auto-tool-choice; "required" and a named function need no flag: their parser carries the
    JSON Schema the answer is constrained to (`forced`)."""
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls", f"parallel_tool_calls={parallel!r}: pass true or false")
    if choice == "none":
        return None
    one = parallel is False  # at most one call, as OpenAI's API has it
    if tools is None:
        raise FieldError("tool_choice", f"tool_choice={choice!r} needs tools; pass tools, or leave tool_choice out")
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise FieldError(
                "tool_choice", f'tool_choice={choice!r}: pass {{"type": "function", "function": {{"name": ...}}}}'
            )
        named = [tool["function"] for tool in tools if tool["function"]["name"] == name]
        if not named:
            raise FieldError("tool_choice", f"tool_choice names the function {name!r}, which is not in tools")
        return forced(named[0])
    if choice == "required":
        return forced(None, [tool["function"] for tool in tools], one=one)
    if choice != "auto":
        raise FieldError("tool_choice", f'tool_choice={choice!r}: pass "none", "auto", "required" or a named function')
    if auto is None:
        raise FieldError(
            "tool_choice",
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set; start the '
            'server with them, or pass tool_choice="none"',
        )
    return _first_call_only(auto) if one else auto


def _first_call_only(parser: ToolParser) -> ToolParser:
    """`parser` keeping an answer's first call only (parallel_tool_calls false with tool_choice "auto")."""

    def read(text: str, prompt: str, tools: list) -> Calls | None:
        found = parser.read(text, prompt, tools)
        return found if found is None else dataclasses.replace(found, calls=found.calls[:1])

    return dataclasses.replace(parser, read=read)


def _parameters(function: dict) -> dict:
    """A function's arguments schema: its `parameters`, or the empty object where it takes none."""
    return function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}


def forced(function: dict | None, functions: list[dict] = (), *, one: bool = False) -> ToolParser:
    """The parser of a tool_choice the answer is held to, as vLLM holds it: for a named `function`,
    the answer is its arguments, a JSON object valid under its `parameters`; for "required" (function
    None), a non-empty JSON list of {"name": one of `functions`, "parameters": its arguments}, of one
    item where `one`. The whole answer is held back while it streams, then goes out as calls."""
    if function is not None:
        name = function["name"]

        def read_named(text: str, prompt: str, tools: list) -> Calls:
            return Calls(None, (_call(name, json.loads(text)),))

        return ToolParser(f"tool_choice {name}", read_named, ("",), True, False, _parameters(function))
    calls = {
        "type": "array",
        "minItems": 1,
        **({"maxItems": 1} if one else {}),
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": f["name"]}, "parameters": _parameters(f)},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for f in functions
            ]
        },
    }

    def read_required(text: str, prompt: str, tools: list) -> Calls:
        items = json.loads(text)
        if not isinstance(items, list) or not items:
            raise Malformed(f"the answer is not a list of calls: {text!r}")
        return Calls(None, tuple(_named(item) for item in items))

    return ToolParser("tool_choice required", read_required, ("",), True, False, calls)


def call_id() -> str:
    """A tool call's id, in vLLM's form."""
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


def openai_calls(calls: Calls) -> list[dict]:
    """The calls in OpenAI's shape: [{id, type: "function", function: {name, arguments}}]."""
    return [
        {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
        for name, arguments in calls.calls
    ]
