"""Tool calling in `hfjax serve`, as vLLM's: `tools` rendered by the chat template, tool_choice "auto"
answers read into OpenAI's `tool_calls` by a parser (`--tool-call-parser`, vLLM's names) or by the
tokenizer's response_template, tool_choice "none" answers left as text.

The servers serve a tiny Llama whose weights make greedy decoding write a fixed answer: its layers
add nothing (o_proj and down_proj are zero), so each next token depends on the current one alone,
and its embeddings and lm_head chain the tokens of ANSWER after the generation prompt's last token
(PLAIN comes second, and is the answer where a logit_bias takes ANSWER's first token away). The
tool call markers of ANSWER are special tokens.
  tools     --enable-auto-tool-choice --tool-call-parser hermes
  manual    no tool flags: tool_choice "none" only
  template  --enable-auto-tool-choice alone, the tokenizer's response_template reading the answers
References: json.loads of the calls written into the answer, transformers' apply_chat_template, the
openai client.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import tokenizers
import torch
import transformers

import background
from hfjax import cli, serving, testing

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install openai")
httpx = pytest.importorskip("httpx", reason="httpx is a test dependency: pip install httpx")

NAME, LENGTH = "tiny-tools", 1024
# Hermes-style: the tools in a system turn, an assistant's calls as <tool_call> blocks, tool results as a user turn.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nTools:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>{{ eos_token }}\n{% endif %}'
    "{% for message in messages %}{% if message.role == 'tool' %}<|user|>\n<tool_response>{{ message.tool_call_id }}: "
    "{{ message.content }}</tool_response>{{ eos_token }}\n{% else %}<|{{ message.role }}|>\n"
    "{% if message.content %}{{ message.content }}{% endif %}{% for call in message.tool_calls or [] %}"
    '<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>'
    "{% endfor %}{{ eos_token }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
ANSWER = (
    "Let me look that up.", "<tool_call>", json.dumps({"name": CALLS[0][0], "arguments": CALLS[0][1]}),
    "</tool_call>\n<tool_call>", json.dumps({"name": CALLS[1][0], "arguments": CALLS[1][1]}), "</tool_call>",
)  # fmt: skip
PLAIN = "It is sunny in Paris."
# transformers' response_template for the template above (the shape of its Qwen entry).
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },  # fmt: skip
        "content": {"close_pattern": r"\s*</s>", "content": "text"},
    },
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} of a place",
            "parameters": {"type": "object", "properties": {key: {"type": "string"} for key in arguments}},
        },
    }
    for name, arguments in CALLS
]
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
SERVERS = background.Servers("hfjax-serve-tools-test-")


def _scripted_llama(path: pathlib.Path) -> pathlib.Path:
    """A tiny Llama whose greedy answer to any chat prompt is ANSWER's tokens, then EOS (see above)."""
    testing.save_tiny_checkpoint("llama", path, max_position_embeddings=LENGTH)  # the tiny tokenizer's JSON is long
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, model_max_length=LENGTH)
    tokenizer.add_tokens([*ANSWER[0::2], PLAIN])
    # The markers are special tokens (as in Hermes 2 Pro's tokenizer): the parser reads them only because
    # the server decodes the answer with special tokens kept.
    markers = [tokenizers.AddedToken(marker, special=True, normalized=False) for marker in ANSWER[1::2]]
    tokenizer.add_tokens(markers, special_tokens=True)
    tokenizer.chat_template = TEMPLATE
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    chain = [tokenizer.convert_tokens_to_ids("<|assistant|>"), *tokenizer.convert_tokens_to_ids(list(ANSWER))]
    plain = tokenizer.convert_tokens_to_ids(PLAIN)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings, head = model.model.embed_tokens.weight, model.lm_head.weight  # [V, 64] each
        head.zero_()
        for k, token in enumerate([*chain, plain]):  # one hidden dimension per token of the chain
            embeddings[token] = 0
            embeddings[token, k] = 1
        for token, after in zip(chain, [*chain[1:], tokenizer.eos_token_id]):
            head[after] += 10 * embeddings[token]
        head[plain] += 5 * embeddings[chain[0]]  # second after the prompt
        head[tokenizer.eos_token_id] += 10 * embeddings[plain]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def start_in_background() -> None:
    """Writes the checkpoints and starts the three servers (once)."""
    if SERVERS.started:
        return
    llama = _scripted_llama(SERVERS.directory / "llama")
    templated = shutil.copytree(llama, SERVERS.directory / "templated")
    tokenizer = transformers.AutoTokenizer.from_pretrained(templated)
    tokenizer.response_template = RESPONSE_TEMPLATE
    tokenizer.save_pretrained(templated)
    common = ("--max-model-len", str(LENGTH), "--max-num-seqs", "2", "--served-model-name", NAME)
    SERVERS.launch("tools", llama, *common, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    SERVERS.launch("manual", llama, *common)
    SERVERS.launch("template", templated, *common, "--enable-auto-tool-choice")


@pytest.fixture(scope="module")
def servers():
    start_in_background()
    yield SERVERS.wait()
    SERVERS.stop()


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(servers):
    return transformers.AutoTokenizer.from_pretrained(SERVERS["tools"]["checkpoint"])


def _post(url: str, body) -> httpx.Response:
    return httpx.post(url, json=body, timeout=120)


# ------------------------------------------------------------------ the parsers, on their models' formats

# (parser, answer, content, calls): calls None where the answer is content (no call, or a malformed one).
EXAMPLES = [
    # Qwen 2.5's format, as its chat template asks for it
    ("hermes", '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
     "</tool_call>", None, [("get_current_temperature", {"location": "San Francisco, CA, USA"})]),
    ("hermes", "I'll check both.\n" + "".join(ANSWER[1:]), "I'll check both.\n", CALLS),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}', None, [CALLS[1]]),  # unclosed
    ("hermes", "The weather is fine.", "The weather is fine.", None),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": }\n</tool_call>', None, None),
    ("hermes", '<tool_call>\n{"arguments": {"zone": "CET"}}\n</tool_call>', None, None),  # no name
    # Llama 3.1's JSON format, with and without <|python_tag|>, several calls separated by ";"
    ("llama3_json", '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": '
     '"Fahrenheit"}}', None, [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
     '{"name": "get_time", "arguments": {"zone": "CET"}}', None, CALLS),
    ("llama3_json", "Paris is sunny today.", "Paris is sunny today.", None),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "CET"}', None, None),
    ("llama3_json", '{"city": "Paris"}', None, None),  # JSON, but not a call
    # Mistral's [TOOL_CALLS] and a JSON list
    ("mistral", '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": '
     '"celsius"}}]', None, [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
     '{"name": "get_time", "arguments": {"zone": "CET"}}]', "Sure. ", CALLS),
    ("mistral", "No tools needed.", "No tools needed.", None),
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "CET"}', None, None),
    # the pythonic format of Llama 3.2 and 4: literals only
    ("pythonic", "[get_weather(city='San Francisco', metric='celsius'), get_weather(city='Seattle', metric='celsius')]",
     None, [("get_weather", {"city": "San Francisco", "metric": "celsius"}),
            ("get_weather", {"city": "Seattle", "metric": "celsius"})]),
    ("pythonic", "[get_weather(city='Paris', unit='celsius'), get_time(zone='CET')]", None, CALLS),
    ("pythonic", "[get_time(zone=__import__('os').getcwd())]", None, None),  # not a literal: nothing runs
    ("pythonic", "[get_time('CET')]", None, None),  # positional
    ("pythonic", "[1, 2, 3]", None, None),
    ("pythonic", "It is noon in Paris.", "It is noon in Paris.", None),
]  # fmt: skip


@pytest.mark.parametrize(("name", "answer", "content", "calls"), EXAMPLES)
def test_each_parser_reads_its_format(name, answer, content, calls):
    found = serving.TOOL_CALL_PARSERS[name].parse(answer, "", [])
    if calls is None:
        assert found is None  # the answer stays content, whole
        return
    assert found.content == content
    assert [(call_name, json.loads(arguments)) for call_name, arguments in found.calls] == calls


@pytest.mark.parametrize(
    ("name", "text", "held"),
    [
        ("hermes", "Let me look.<tool_call>{", len("Let me look.")),
        ("hermes", "Let me look.<tool", len("Let me look.")),  # the marker may be arriving
        ("hermes", "Let me look. <b>", len("Let me look. <b>")),
        ("mistral", "Sure. [TOOL_", len("Sure. ")),
        ("llama3_json", '  {"name', 0),
        ("llama3_json", "<|python", 0),
        ("llama3_json", "Sunny {", len("Sunny {")),  # a call only leads the answer
        ("pythonic", "[get_", 0),
        ("pythonic", "It is [", len("It is [")),
    ],
)
def test_a_stream_holds_back_what_could_start_a_call(name, text, held):
    assert serving.TOOL_CALL_PARSERS[name].held_from(text, 0) == held


def test_the_cli_offers_the_parsers_of_the_registry(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "MODEL", "--tool-call-parser", "nonsense"])
    offered = re.search(r"invalid choice: 'nonsense' \(choose from (.*)\)", capsys.readouterr().err).group(1)
    assert [name.strip("' ") for name in offered.split(",")] == list(serving.TOOL_CALL_PARSERS)


# ------------------------------------------------------------------ through the servers


def _expected_calls(calls) -> None:
    assert [(call.function.name, json.loads(call.function.arguments)) for call in calls] == CALLS
    assert all(call.id.startswith("chatcmpl-tool-") and call.type == "function" for call in calls)
    assert len({call.id for call in calls}) == len(calls)


@pytest.mark.parametrize("server", ["tools", "template"])
def test_auto_tool_choice_answers_with_tool_calls(servers, server):
    answer = _client(servers[server]).chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=32
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == ANSWER[0]
    _expected_calls(choice.message.tool_calls)


@pytest.mark.parametrize("server", ["tools", "template"])
def test_a_stream_sends_the_same_calls_as_deltas(servers, server):
    stream = _client(servers[server]).chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=32, stream=True
    )
    content, calls, finish = "", {}, []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:  # a call opens with its id, type and name
                assert call.index not in calls and call.function.arguments == ""
                calls[call.index] = {"id": call.id, "type": call.type, "name": call.function.name, "arguments": ""}
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish.append(chunk.choices[0].finish_reason)
    assert content == ANSWER[0]
    assert finish[-1] == "tool_calls" and set(finish[:-1]) == {None}
    assert [(call["name"], json.loads(call["arguments"])) for call in calls.values()] == CALLS
    assert all(call["id"].startswith("chatcmpl-tool-") and call["type"] == "function" for call in calls.values())


def test_an_answer_without_a_call_is_content(servers, tokenizer):
    # A logit_bias takes the call's first token away: the model writes PLAIN instead.
    away = {str(tokenizer.convert_tokens_to_ids(ANSWER[0])): -100}
    client = _client(servers["tools"])
    answer = client.chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=32, logit_bias=away
    )
    assert answer.choices[0].message.content == PLAIN and answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model=NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=32, logit_bias=away, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == PLAIN
    assert not any(c.choices[0].delta.tool_calls for c in chunks) and chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("server", ["tools", "manual"])
def test_tool_choice_none_renders_the_tools_and_leaves_the_answer_as_text(servers, tokenizer, server):
    answer = _client(servers[server]).chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=32
    )
    text = tokenizer.decode(tokenizer.convert_tokens_to_ids(list(ANSWER)), skip_special_tokens=True)
    assert text == "".join(ANSWER[0::2])  # the markers are special tokens
    assert answer.choices[0].message.content == text and answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason == "stop"
    prompt = tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert answer.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def test_a_conversation_with_tool_results_renders_through_the_template(servers, tokenizer):
    client = _client(servers["tools"])
    first = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=32)
    calls = first.choices[0].message.tool_calls
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),  # the calls' arguments as JSON text
        *({"role": "tool", "tool_call_id": call.id, "content": f"{call.function.name}: done"} for call in calls),
    ]
    # The reference: transformers' template with the arguments as objects, as templates read them.
    as_objects = [
        {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                             for c in m["tool_calls"]]} if "tool_calls" in m else m
        for m in history
    ]  # fmt: skip
    text = tokenizer.apply_chat_template(as_objects, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in text and f"<tool_response>{calls[0].id}:" in text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    tokens = _post(servers["tools"] + "/tokenize", {"model": NAME, "messages": history, "tools": TOOLS}).json()
    assert tokens["tokens"] == ids
    second = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, temperature=0, max_tokens=32)
    assert second.usage.prompt_tokens == len(ids)
    _expected_calls(second.choices[0].message.tool_calls)  # (the scripted model always calls)


def test_auto_tool_choice_needs_the_servers_flags(servers):
    url = servers["manual"] + "/v1/chat/completions"
    for body in ({"tools": TOOLS, "tool_choice": "auto"}, {"tools": TOOLS}):  # "auto" is the default with tools
        message = background.openai_400(_post(url, {"model": NAME, "messages": ASK, **body}), "tool_choice")
        assert '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser' in message


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "decides what the answer is; pass it or response_format, not both"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
          "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}}}], "tool_choice": "required"},
         "tools", "llguidance cannot compile"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice",
         "'get_stock', which is not in tools"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", '"none", "auto", "required"'),
        ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
        ({"tools": {"type": "function"}}, "tools", "pass a list"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name",
         "pass the function's name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]", '"type": "function"'),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "city"}}]},
         "tools[0].function.parameters", "JSON Schema object"),
        ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "get_time", "arguments": "{zone"}}]}]},
         "messages[1].tool_calls[0].function.arguments", "not JSON"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "pass true or false"),
    ],
)  # fmt: skip
def test_bad_tool_fields_answer_400_naming_the_field(servers, body, param, says):
    answer = _post(servers["tools"] + "/v1/chat/completions", {"model": NAME, "messages": ASK, **body})
    assert says in background.openai_400(answer, param)


# Arguments a forced tool_choice holds the answer to: bounded, so that answers at temperature 1 end.
FORCED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "unit", "days"],
        "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["CET", "UTC", "PST"]}}}}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: its arguments are {}
]  # fmt: skip
NO_ARGUMENTS = {"type": "object", "maxProperties": 0}
PARAMETERS = {t["function"]["name"]: t["function"].get("parameters", NO_ARGUMENTS) for t in FORCED_TOOLS}


def _validated(calls) -> list[str]:
    """The calls' names, each call's arguments checked against its function's parameters."""
    jsonschema = pytest.importorskip("jsonschema")
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    return [call.function.name for call in calls]


@pytest.mark.parametrize("name", ["get_weather", "ping"])
def test_a_named_tool_choice_returns_that_call_with_valid_arguments(servers, name):
    # The manual server: a forced tool_choice needs no --enable-auto-tool-choice (as in vLLM).
    answer = _client(servers["manual"]).chat.completions.create(
        model=NAME, messages=ASK, tools=FORCED_TOOLS, tool_choice={"type": "function", "function": {"name": name}},
        temperature=1, max_tokens=128, n=16, seed=0,
    )  # fmt: skip
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert _validated(choice.message.tool_calls) == [name]


def test_a_required_tool_choice_returns_one_call_of_the_tools_with_valid_arguments(servers):
    answer = _client(servers["manual"]).chat.completions.create(
        model=NAME, messages=ASK, tools=FORCED_TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=1, max_tokens=128, n=16, seed=1,
    )  # fmt: skip
    names = []
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls"
        names += _validated(choice.message.tool_calls)
    assert len(names) == 16 and set(names) <= set(PARAMETERS)
    # The negative control: unconstrained, the same sampling writes no call at all.
    free = _client(servers["manual"]).chat.completions.create(
        model=NAME, messages=ASK, tools=FORCED_TOOLS, tool_choice="none", temperature=1, max_tokens=64, n=16, seed=1
    )
    for choice in free.choices:
        try:
            items = json.loads(choice.message.content)
        except ValueError:
            continue
        assert not (isinstance(items, list) and items and all(isinstance(i, dict) and "name" in i for i in items))


def test_a_required_tool_choice_may_return_several_calls(servers):
    answer = _client(servers["manual"]).chat.completions.create(
        model=NAME, messages=ASK, tools=FORCED_TOOLS, tool_choice="required", temperature=1, max_tokens=480, n=4,
        seed=1,
    )  # fmt: skip
    counts = []
    for choice in answer.choices:
        if choice.finish_reason == "length":  # a list still going at max_tokens: its text, unparsed
            assert choice.message.tool_calls is None and choice.message.content.startswith('[{"name": ')
            continue
        assert choice.finish_reason == "tool_calls"
        counts.append(len(_validated(choice.message.tool_calls)))
    assert counts and max(counts) >= 2


def test_parallel_tool_calls_false_keeps_the_first_call_of_auto(servers):
    answer = _client(servers["tools"]).chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=32, parallel_tool_calls=False
    )
    calls = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls"
    assert [(call.function.name, json.loads(call.function.arguments)) for call in calls] == CALLS[:1]


def test_a_required_tool_choice_streams_its_calls_as_deltas(servers):
    stream = _client(servers["manual"]).chat.completions.create(
        model=NAME, messages=ASK, tools=FORCED_TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=1, max_tokens=128, seed=2, stream=True,
    )  # fmt: skip
    calls, finish = {}, []
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.content
        for call in delta.tool_calls or []:
            if call.id is not None:
                calls[call.index] = {"name": call.function.name, "arguments": ""}
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish.append(chunk.choices[0].finish_reason)
    assert finish[-1] == "tool_calls" and calls
    jsonschema = pytest.importorskip("jsonschema")
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


def test_auto_tool_choice_without_a_parser_or_response_template_is_refused_at_start(servers, capsys):
    code = cli.main(["serve", str(SERVERS["tools"]["checkpoint"]), "--enable-auto-tool-choice", "--port",
                     str(background.free_port())])  # fmt: skip
    assert code == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err


def test_the_readmes_tool_calling_example_runs(servers):
    readme = pathlib.Path(__file__).resolve().parent.parent / "README.md"
    section = readme.read_text().split("\n## Serve\n", 1)[1].split("\n## ", 1)[0]
    example = next(block for block in re.findall(r"```python\n(.*?)```", section, flags=re.S) if "tool_calls" in block)
    port = servers["tools"].rsplit(":", 1)[1]
    ran = subprocess.run(
        [sys.executable, "-c", example.replace(":8000", f":{port}")], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [f"{name} {arguments}" for name, arguments in CALLS]  # the scripted calls
