"""Structured outputs in `hfjax serve`, as vLLM's: `response_format` (json_object, json_schema) and
`structured_outputs` (json, regex, choice, grammar) enforced on the answers of a tiny random Llama at
temperature 1, through the official openai client, on /v1/chat/completions and /v1/completions,
streamed or not, with n > 1 and beside unconstrained requests.

References: `jsonschema` validates every schema answer, `json.loads` parses every object, `re.fullmatch`
matches every regex answer, the choices are a list; the same model unconstrained (the negative
control) writes no answer the schema accepts, and its greedy answer alone is the reference of one
that shares the batch with constrained requests.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import re
import subprocess
import sys

import pytest
import transformers

import background
from hfjax import testing

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
pytest.importorskip("llguidance", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install openai")
httpx = pytest.importorskip("httpx", reason="httpx is a test dependency: pip install httpx")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a test dependency: pip install jsonschema")

NAME, LENGTH = "tiny-structured", 512
SERVERS = background.Servers("hfjax-serve-structured-test-")
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["x", "y"],
    "additionalProperties": False,
}  # fmt: skip
SCHEMA = {
    "type": "object",
    "$defs": {"point": POINT},
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        "kind": {"enum": ["circle", "square"]},
        "at": {"$ref": "#/$defs/point"},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "kind", "at", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "shape", "schema": SCHEMA, "strict": True}}
REGEX = r"[a-z]{2,5}-[0-9]{2}(\.[0-9])?"
CHOICES = ["strongly agree", "agree", "neutral", "disagree", "strongly disagree"]
ASK = [{"role": "user", "content": "Describe a shape."}]
ANSWERS = 100  # sampled answers per kind, in requests of n=10 sent together
MAX_TOKENS = 200  # a schema answer's number may run to many digits


def start_in_background() -> None:
    if SERVERS.started:
        return
    llama = testing.save_tiny_checkpoint("llama", SERVERS.directory / "llama", max_position_embeddings=LENGTH)
    SERVERS.launch("main", llama, "--max-model-len", str(LENGTH), "--max-num-seqs", "16", "--served-model-name", NAME)


@pytest.fixture(scope="module")
def servers():
    start_in_background()
    yield SERVERS.wait()
    SERVERS.stop()


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=servers["main"] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(servers):
    return transformers.AutoTokenizer.from_pretrained(SERVERS["main"]["checkpoint"])


def _chat_answers(client, count=ANSWERS, **fields) -> list:
    """`count` chat choices at temperature 1, in requests of n=10 sent at once (seeds 0, 10, ...)."""

    def one(seed):
        answer = client.chat.completions.create(
            model=NAME, messages=ASK, temperature=1.0, n=10, seed=seed, max_tokens=MAX_TOKENS, **fields
        )
        return answer.choices

    with concurrent.futures.ThreadPoolExecutor(count // 10) as pool:
        return [choice for choices in pool.map(one, range(0, count, 10)) for choice in choices]


def test_every_json_schema_answer_validates(client):
    choices = _chat_answers(client, response_format=JSON_SCHEMA)
    assert len(choices) == ANSWERS
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_the_same_model_unconstrained_writes_nothing_the_schema_accepts(client):
    # The negative control: without the constraint, the tiny random model's answers are not the schema's.
    def valid(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    choices = _chat_answers(client, count=20)
    assert not any(valid(choice.message.content) for choice in choices)


def test_every_json_object_answer_parses(client, tokenizer):
    # The tiny model's strings seldom end on their own; a bias on the quote closes them (the grammar
    # still decides where a quote may go), so the answers fit max_tokens.
    quote = tokenizer.convert_tokens_to_ids('"')
    choices = _chat_answers(client, response_format={"type": "json_object"}, logit_bias={str(quote): 8})
    assert len(choices) == ANSWERS
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


def test_every_regex_answer_matches_on_completions(client):
    def one(seed):
        answer = client.completions.create(
            model=NAME, prompt="The code is", temperature=1.0, n=10, seed=seed, max_tokens=40,
            extra_body={"structured_outputs": {"regex": REGEX}},
        )  # fmt: skip
        return answer.choices

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        choices = [c for choices in pool.map(one, range(0, ANSWERS, 10)) for c in choices]
    assert len(choices) == ANSWERS
    for choice in choices:
        assert re.fullmatch(REGEX, choice.text), choice.text
        assert choice.finish_reason == "stop"


def test_every_choice_answer_is_one_of_the_choices(client):
    choices = _chat_answers(client, extra_body={"structured_outputs": {"choice": CHOICES}})
    answers = [choice.message.content for choice in choices]
    assert len(answers) == ANSWERS and set(answers) <= set(CHOICES)
    assert len(set(answers)) > 1  # sampled, not one fixed answer


def test_a_lark_grammar_is_followed(client):
    grammar = 'start: "(" inner ")"\ninner: "x" | "(" inner ")"'
    choices = _chat_answers(client, count=10, extra_body={"structured_outputs": {"grammar": grammar}})
    for choice in choices:
        assert re.fullmatch(r"(\()+x(\))+", choice.message.content), choice.message.content
        text = choice.message.content
        assert text.count("(") == text.count(")")


def test_an_answer_cut_by_max_tokens_ends_with_length(client):
    answer = client.chat.completions.create(
        model=NAME, messages=ASK, temperature=1.0, n=4, max_tokens=5, response_format=JSON_SCHEMA
    )
    for choice in answer.choices:
        assert choice.finish_reason == "length"
        assert choice.message.content.startswith('{"')  # the schema's start, cut off
        with pytest.raises(ValueError):
            json.loads(choice.message.content)
    assert answer.usage.completion_tokens == 4 * 5


def test_an_unconstrained_request_beside_constrained_ones_keeps_its_greedy_tokens(client):
    def greedy():
        return client.chat.completions.create(model=NAME, messages=ASK, temperature=0, max_tokens=48).choices[0]

    alone = greedy()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(_chat_answers, client, 10, response_format=JSON_SCHEMA) for _ in range(3)]
        beside = pool.submit(greedy)
        for future in constrained:
            for choice in future.result():
                jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        beside = beside.result()
    assert beside.message.content == alone.message.content
    assert beside.finish_reason == alone.finish_reason


def test_a_streamed_answer_validates(client):
    stream = client.chat.completions.create(
        model=NAME, messages=ASK, temperature=1.0, n=3, seed=5, max_tokens=MAX_TOKENS, stream=True,
        response_format=JSON_SCHEMA,
    )  # fmt: skip
    texts, reasons = {}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2] and set(reasons.values()) == {"stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    "field, value, new",
    [
        ("guided_json", SCHEMA, "structured_outputs={'json'"),
        ("guided_regex", REGEX, "structured_outputs={'regex'"),
        ("guided_choice", CHOICES, "structured_outputs={'choice'"),
        ("guided_grammar", "start: /x/", "structured_outputs={'grammar'"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_removed_guided_fields_name_the_new_one(servers, field, value, new, path):
    body = {"model": NAME, "max_tokens": 4, field: value}
    body.update({"messages": ASK} if "chat" in path else {"prompt": "Hi"})
    message = background.openai_400(httpx.post(servers["main"] + path, json=body, timeout=60), field)
    assert new in message


@pytest.mark.parametrize(
    "fields, param, says",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "frob"}}}},
         "response_format", "frob"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "unclosed group"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs", "nowhere"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice=[]"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_object"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "'name' and a 'schema'"),
    ],
)  # fmt: skip
def test_a_constraint_the_engine_cannot_use_is_a_400_naming_the_field(servers, fields, param, says):
    body = {"model": NAME, "max_tokens": 4, "messages": ASK, **fields}
    message = background.openai_400(httpx.post(servers["main"] + "/v1/chat/completions", json=body, timeout=60), param)
    assert says in message


def test_the_readmes_structured_output_example_runs(servers):
    readme = pathlib.Path(__file__).resolve().parent.parent / "README.md"
    section = readme.read_text().split("\n## Serve\n", 1)[1].split("\n## ", 1)[0]
    example = next(
        block for block in re.findall(r"```python\n(.*?)```", section, flags=re.S) if "response_format" in block
    )
    port = servers["main"].rsplit(":", 1)[1]
    ran = subprocess.run(
        [sys.executable, "-c", example.replace(":8000", f":{port}")], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr
    printed = json.loads(ran.stdout)
    assert set(printed) == {"city", "temperature"} and isinstance(printed["temperature"], int)
