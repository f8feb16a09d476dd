"""Hostile request bodies against `hfjax serve`: whatever a client sends, the answer is never a 5xx,
and every error is in OpenAI's shape, a 400 naming the field.

Two servers run in processes of their own, started as soon as the suite is collected:
  lm       a tiny Llama (--max-model-len 64): /v1/chat/completions, /v1/completions, /v1/embeddings
  encoder  a tiny BERT: /v1/embeddings (and a 400 for the others)
Hypothesis draws the bodies (derandomized, so every run sends the same ones): requests of the right
shape with fields mutated (wrong types, lone UTF-16 surrogates, NaN and Infinity, huge and negative
numbers, deep nesting, empty values, unknown fields), arbitrary JSON, and bytes that are not JSON.
Afterwards both servers answer a greedy request as they did before, and their logs hold no traceback.
The explicit cases below are the 500s users found, and a taken --port.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types

import pytest

import background
from hfjax import testing

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
httpx = pytest.importorskip("httpx", reason="httpx is a test dependency: pip install httpx")
hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is a test dependency: pip install hypothesis")
st = hypothesis.strategies

NAME, ENCODER, LENGTH, VOCAB = "tiny-llama", "tiny-bert", 64, 512
CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"  # vLLM's
SERVERS = background.Servers("hfjax-serve-fuzz-")

# The fields each endpoint reads (OpenAI's, vLLM's, and those hfjax takes only at their no-op value).
_SAMPLING = [
    "model", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "seed", "stop", "n", "stream", "stream_options", "ignore_eos", "min_tokens", "stop_token_ids",
    "user", "metadata", "tools", "tool_choice", "response_format", "structured_outputs", "echo", "best_of",
    "skip_special_tokens",
]  # fmt: skip
FIELDS = {
    CHAT: ["messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", *_SAMPLING],
    COMPLETIONS: ["prompt", "max_tokens", "logprobs", "suffix", *_SAMPLING],
    EMBEDDINGS: ["input", "model", "encoding_format", "user"],
    TOKENIZE: [
        "model",
        "prompt",
        "messages",
        "add_special_tokens",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
        "return_token_strs",
        "tools",
    ],
    DETOKENIZE: ["model", "tokens"],
}


def start_in_background() -> None:
    """Writes the checkpoints and starts the two servers (once)."""
    if SERVERS.started:
        return
    llama = testing.save_tiny_checkpoint("llama", SERVERS.directory / "llama")
    bert = testing.save_tiny_checkpoint("bert", SERVERS.directory / "bert", task="feature-extraction")
    SERVERS.launch("lm", llama, "--served-model-name", NAME, "--max-model-len", str(LENGTH), "--max-batch", "4")
    SERVERS.launch("encoder", bert, "--served-model-name", ENCODER)


GREEDY = {"model": NAME, "prompt": "The river ran past the mill", "max_tokens": 6, "temperature": 0}
EMBED = {"model": ENCODER, "input": ["The river ran past the mill", "and the children watched"]}


def _reference_answers(client: httpx.Client) -> tuple[str, list]:
    """The lm server's greedy text of GREEDY and the encoder's embeddings of EMBED."""
    text = client.post(SERVERS["lm"]["url"] + COMPLETIONS, json=GREEDY).json()["choices"][0]["text"]
    vectors = [d["embedding"] for d in client.post(SERVERS["encoder"]["url"] + EMBEDDINGS, json=EMBED).json()["data"]]
    return text, vectors


@pytest.fixture(scope="module")
def http():
    """.client (httpx, kept alive), .urls by server, and .before: `_reference_answers` at the start."""
    start_in_background()
    urls = SERVERS.wait()
    with httpx.Client(timeout=120) as client:
        yield types.SimpleNamespace(client=client, urls=urls, before=_reference_answers(client))
    SERVERS.stop()


def _post(http, server: str, path: str, content: bytes) -> httpx.Response:
    return http.client.post(http.urls[server] + path, content=content, headers={"content-type": "application/json"})


def _check_answer(answer: httpx.Response, path: str, body) -> None:
    """No 5xx; an error is OpenAI's {"error": {...}}, a 400 naming the body or a field of it or of
    the endpoint (or a value inside one: "messages[0].content")."""
    assert answer.status_code < 500, f"{answer.status_code} for {body!r:.300}: {answer.text[:500]}"
    if answer.status_code == 200:
        if answer.headers["content-type"].startswith("application/json") and path not in (TOKENIZE, DETOKENIZE):
            assert "object" in answer.json()
        return
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
    if answer.status_code == 400:
        assert error["type"] == "invalid_request_error", error
        param = error["param"]
        fields = ["body", *FIELDS[path], *(body if isinstance(body, dict) else ())]
        assert isinstance(param, str) and any(param == f or param.startswith((f + ".", f + "[")) for f in fields), error


# -- strategies -----------------------------------------------------------------------------------

# Lone halves of UTF-16 surrogate pairs: JSON's "\ud800" reads as a Python str that no tokenizer takes.
_SURROGATE = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])
_TEXT = st.lists(st.one_of(st.characters(), _SURROGATE), max_size=12).map("".join)
_NUMBER = st.one_of(
    st.integers(),
    st.sampled_from([0, -1, 1, 2**31, 2**31 - 1, 2**63, -(2**63), 10**9, 10**30, -(10**30), VOCAB, VOCAB - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
)
_SCALAR = st.one_of(st.none(), st.booleans(), _NUMBER, _TEXT, st.sampled_from(["", [], {}]))
# min_size=1: empty containers come from _SCALAR (and hypothesis tells a recursion by its non-empty ones).
_JSON = st.recursive(
    _SCALAR,
    lambda inner: st.lists(inner, min_size=1, max_size=4) | st.dictionaries(_TEXT, inner, min_size=1, max_size=4),
    max_leaves=12,
)


def _nested(depth: int, inner: str = "list"):
    value = 1
    for _ in range(depth):
        value = [value] if inner == "list" else {"a": value}
    return value


_HOSTILE = st.one_of(
    _JSON,
    st.builds(_nested, st.integers(50, 200), st.sampled_from(["list", "dict"])),
    st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=8),  # token ids, out of range too
    st.dictionaries(st.integers(-5, 2**33).map(str), _NUMBER, max_size=70),  # logit_bias-shaped
    st.integers(1, 5).map(lambda n: "river " * 10**n),  # long strings
)
_WORDS = st.lists(st.sampled_from("the river ran past old mill and children watched".split()), min_size=1, max_size=8)
_PLAIN = st.one_of(_WORDS.map(" ".join), st.text(min_size=1, max_size=12))  # valid Unicode (emoji, CJK, ...)


def _message(text):
    return st.fixed_dictionaries({"role": st.just("user"), "content": text})


_OPTIONAL = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 40),
    "n": st.integers(1, 2),
    "seed": st.integers(0, 2**32),
    "stop": st.lists(_PLAIN, max_size=2),
    "presence_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
    "stream": st.booleans(),
}
_TOOL = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": _PLAIN.filter(bool)}, optional={
        "description": _PLAIN, "parameters": st.just({"type": "object", "properties": {"city": {"type": "string"}}}),
    })}
)  # fmt: skip


def _valid(path: str, model: str = NAME):
    """Requests hfjax serves: each should answer 200."""
    if path == EMBEDDINGS:
        return st.fixed_dictionaries(
            {"model": st.just(model), "input": st.one_of(_PLAIN, st.lists(_PLAIN, min_size=1, max_size=3))}
        )
    if path == DETOKENIZE:
        return st.fixed_dictionaries(
            {"tokens": st.lists(st.integers(0, VOCAB - 1), max_size=8)}, optional={"model": st.just(model)}
        )
    if path == TOKENIZE:
        flags = {name: st.booleans() for name in ("add_special_tokens", "return_token_strs")}
        return st.one_of(
            st.fixed_dictionaries({"prompt": _PLAIN}, optional={"model": st.just(model), **flags}),
            st.fixed_dictionaries(
                {"messages": st.lists(_message(_PLAIN), min_size=1, max_size=2)},
                optional={"model": st.just(model), "add_generation_prompt": st.booleans(), **flags},
            ),
        )
    prompt = (
        {"messages": st.lists(_message(_PLAIN), min_size=1, max_size=1)}
        if path == CHAT
        else {"prompt": st.one_of(_PLAIN, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))}
    )
    optional = _OPTIONAL if path == COMPLETIONS else {**_OPTIONAL, "tools": st.lists(_TOOL, max_size=2)}
    return st.fixed_dictionaries(
        {"model": st.just(model), "max_tokens": st.integers(1, 3), **prompt}, optional=optional
    ).map(
        lambda body: {**body, "tool_choice": "none"} if body.get("tools") else body  # "auto" needs the server's flag
    )


@st.composite
def _mutated(draw, path: str, model: str):
    body = dict(draw(_valid(path, model)))
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.one_of(st.sampled_from(FIELDS[path]), _TEXT))
        kind = draw(st.sampled_from(["replace", "delete", "inside"]))
        if kind == "delete":
            body.pop(field, None)
        elif kind == "inside" and (path == CHAT or "messages" in body):  # within a message
            key = draw(st.sampled_from(["role", "content", "name", "type", "text", "tool_calls", "tool_call_id"]))
            value = draw(
                st.one_of(_HOSTILE, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _HOSTILE})))
            )
            messages = body.get("messages")
            first = messages[0] if isinstance(messages, list) and messages and isinstance(messages[0], dict) else {}
            body["messages"] = [{"role": "user", **first, key: value}]
        elif kind == "inside":  # within a list of prompts or inputs
            name = {COMPLETIONS: "prompt", TOKENIZE: "prompt", DETOKENIZE: "tokens"}.get(path, "input")
            body[name] = [draw(_PLAIN), draw(_HOSTILE)]
        else:
            body[field] = draw(_HOSTILE)
    return body


def _encoded(draw, body) -> bytes:
    """JSON text of `body` (NaN and Infinity as Python writes them), escaped or as UTF-8 whose lone
    surrogates come through as the bytes that encode them (not UTF-8)."""
    ascii_only = draw(st.booleans())
    return json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@st.composite
def bodies(draw, path: str, model: str = NAME):
    """(what was sent, its bytes): a mutated request, arbitrary JSON, or bytes that are no JSON object.
    Two lone surrogates drawn side by side may make a pair, one character, as JSON reads them."""
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "json", "bytes", "deep", "cut"]))
    if kind == "bytes":
        raw = draw(st.binary(max_size=64))
        return raw, raw
    if kind == "deep":  # deeper than json.dumps writes: the text itself
        depth = draw(st.integers(60, 6000))
        raw = (f'{{"model": "{model}", "x": ' + "[" * depth + "]" * depth + "}").encode()
        return {"model": model, "x": f"{depth} lists, one in the other"}, raw
    body = draw(_mutated(path, model)) if kind in ("mutated", "cut") else draw(_JSON)
    raw = _encoded(draw, body)
    if kind == "cut":
        raw = raw[: draw(st.integers(0, max(len(raw) - 1, 0)))]
        return raw, raw
    return json.loads(json.dumps(body)), raw  # as the server reads it: "\\ud800\\udc00" is one character


# HFJAX_FUZZ_EXAMPLES: more bodies per endpoint than CI's, for a run by hand.
_FUZZ = hypothesis.settings(
    max_examples=int(os.environ.get("HFJAX_FUZZ_EXAMPLES", "400")),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)


@pytest.mark.parametrize(
    "server, path, model",
    [
        ("lm", CHAT, NAME), ("lm", COMPLETIONS, NAME), ("lm", EMBEDDINGS, NAME), ("encoder", EMBEDDINGS, ENCODER),
        ("lm", TOKENIZE, NAME), ("lm", DETOKENIZE, NAME),
    ],
)  # fmt: skip
def test_hostile_bodies_get_no_5xx_and_errors_in_openais_shape(http, server, path, model):
    @_FUZZ
    @hypothesis.given(drawn=bodies(path, model))
    def check(drawn):
        body, raw = drawn
        _check_answer(_post(http, server, path, raw), path, body)

    check()


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_causal_lms_endpoints_on_an_encoder_answer_400_for_any_body(http, path):
    @hypothesis.settings(_FUZZ, max_examples=40)
    @hypothesis.given(drawn=bodies(path, ENCODER))
    def check(drawn):
        body, raw = drawn
        _check_answer(_post(http, "encoder", path, raw), path, body)

    check()


@pytest.mark.parametrize(
    "server, path, model",
    [("lm", CHAT, NAME), ("lm", COMPLETIONS, NAME), ("encoder", EMBEDDINGS, ENCODER), ("lm", TOKENIZE, NAME),
     ("lm", DETOKENIZE, NAME)],
)  # fmt: skip
def test_valid_requests_answer_200(http, server, path, model):
    """The other side of the checks above: what hfjax serves is not refused (a lone surrogate is
    refused, an emoji's pair is not)."""

    @hypothesis.settings(_FUZZ, max_examples=60)
    @hypothesis.given(body=_valid(path, model))
    def check(body):
        answer = _post(http, server, path, json.dumps(body).encode())
        assert answer.status_code == 200, f"{body!r}: {answer.text[:500]}"
        if not body.get("stream"):
            expected = {CHAT: "chat.completion", COMPLETIONS: "text_completion", EMBEDDINGS: "list"}.get(path)
            assert expected is None or answer.json()["object"] == expected

    check()


HUGE = "river " * (10**7 // 6)  # 10 MB
# The 500s users found, and bodies that are no JSON object: each a 400 naming the field.
_REGRESSIONS = [
    (
        "lm",
        CHAT,
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\ud800"}]}',
        "messages[0].content",
    ),
    ("lm", COMPLETIONS, b'{"model": "tiny-llama", "prompt": "a\\udfff", "max_tokens": 2}', "prompt"),
    ("lm", EMBEDDINGS, b'{"model": "tiny-llama", "input": "\\ud800"}', "input"),
    ("encoder", EMBEDDINGS, b'{"model": "tiny-bert", "input": ["ok", "\\udc00"]}', "input[1]"),
    ("lm", CHAT, b"[" * 5000 + b"]" * 5000, "body"),
    ("lm", COMPLETIONS, b'{"model": "tiny-llama", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "body"),
    ("lm", COMPLETIONS, b"[]", "body"),
    ("lm", CHAT, b'"x"', "body"),
    ("lm", CHAT, b"null", "body"),
    ("encoder", EMBEDDINGS, b"1", "body"),
    ("lm", COMPLETIONS, b"\xff\xfe\xfa not utf-8", "body"),
    ("lm", COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "temperature": NaN}', "temperature"),
    ("lm", COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "top_p": Infinity}', "top_p"),
    ("lm", COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "seed": ' + b"9" * 5000 + b"}", "body"),
    ("lm", COMPLETIONS, {"model": NAME, "prompt": "hi", "max_tokens": 10**30}, "max_tokens"),
    ("lm", COMPLETIONS, {"model": NAME, "prompt": "hi", "n": 10**9}, "n"),
    ("lm", COMPLETIONS, {"model": NAME, "prompt": HUGE}, "prompt"),
    ("lm", CHAT, {"model": NAME, "messages": [{"role": "user", "content": HUGE}]}, "messages"),
    ("encoder", EMBEDDINGS, {"model": ENCODER, "input": HUGE}, "input"),
    ("encoder", EMBEDDINGS, {"model": ENCODER, "input": ["river"] * 3000}, "input"),
    ("lm", COMPLETIONS, {"model": NAME, "prompt": [1, 2, VOCAB], "max_tokens": 2}, "prompt"),
    ("lm", COMPLETIONS, {"model": NAME, "prompt": [1, -5], "max_tokens": 2}, "prompt"),
    ("lm", COMPLETIONS, {"model": NAME, "prompt": [1, 2**40], "max_tokens": 2}, "prompt"),
    ("lm", COMPLETIONS, {"model": NAME, "prompt": "hi", "logit_bias": {str(i): 1 for i in range(65)}}, "logit_bias"),
    ("lm", COMPLETIONS, {"model": NAME, "prompt": "hi", "logit_bias": {str(i): 1 for i in range(10**5)}}, "logit_bias"),
    ("lm", COMPLETIONS, {"model": NAME, "prompt": "hi", "logit_bias": {"-3": 1}}, "logit_bias"),
    ("lm", COMPLETIONS, {"model": NAME, "prompt": "hi", "stop_token_ids": [2**40]}, "stop_token_ids"),
    (
        "lm",
        CHAT,
        {"model": NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages[0].content[0].text",
    ),
]


@pytest.mark.parametrize(
    "server, path, body, param", _REGRESSIONS, ids=[f"{i}-{p}" for i, (_, _, _, p) in enumerate(_REGRESSIONS)]
)
def test_bodies_that_answered_500_answer_400_naming_the_field(http, server, path, body, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    answer = _post(http, server, path, raw)
    assert answer.status_code == 400, answer.text[:500]
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert len(error["message"]) < 300 and "\n" not in error["message"], error


def test_unknown_paths_and_methods_answer_in_openais_shape(http):
    for method, path, status in (("POST", "/v1/nothing", 404), ("GET", COMPLETIONS, 405)):
        answer = http.client.request(method, http.urls["lm"] + path)
        assert answer.status_code == status
        assert answer.json()["error"]["type"] == "invalid_request_error"
        assert path in answer.json()["error"]["message"]


def test_an_unexpected_error_is_a_500_in_openais_shape(checkpoint, monkeypatch):
    """The last line of defence (none of the bodies above reaches it): an exception the endpoint does
    not expect answers OpenAI's shape, type internal_server_error, not Starlette's plain text."""
    from fastapi.testclient import TestClient

    import hfjax
    from hfjax import serving

    encoder = hfjax.load(checkpoint("bert", task="feature-extraction"))

    def embed(texts):
        raise RuntimeError("a failure of the server's own")

    monkeypatch.setattr(encoder, "embed", embed)
    app = serving.build_app(encoder, served_model_name=ENCODER, engine=None)
    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.post(EMBEDDINGS, json={"model": ENCODER, "input": "hi"})
    assert answer.status_code == 500
    assert answer.json() == {
        "error": {
            "message": "the server failed on this request (RuntimeError); see the server's log",
            "type": "internal_server_error", "param": None, "code": None,
        }
    }  # fmt: skip


def test_a_taken_port_is_refused_in_one_line_before_the_model_loads(checkpoint):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "hfjax.cli", "serve", str(checkpoint("llama")), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    assert done.returncode != 0
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    # One line, and nothing of the loading (hfjax serve's lines about the KV cache and compiles).
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"hfjax serve: --port {port}: 127.0.0.1:{port} is already in use"), lines
    assert "pass another port, such as --port " in lines[0]


def test_the_servers_answer_as_before_and_logged_no_traceback(http):
    """After everything above: the same greedy text and embeddings as at the start (no request has
    left the engine or the model in another state), and no exception in either server's log (read
    first, so that a failed engine shows its traceback here)."""
    for name in SERVERS:
        assert "Traceback" not in SERVERS.log(name) and "Exception" not in SERVERS.log(name), SERVERS.log(name)[-3000:]
    assert _reference_answers(http.client) == http.before
