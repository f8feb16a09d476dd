"""`hfjax serve` through real clients: the official openai package, curl, headless Chromium, a load test.

Three servers run in processes of their own, started as soon as the suite is collected
(`start_in_background`), so that their start overlaps the rest of the suite:
  main     a tiny Llama, 8 slots: answers, streaming, errors, the chat page, the load test
  small    the same model, 1 slot, a queue of 1 and an API key: 401, 429, and SIGTERM (last)
  encoder  a tiny BERT: /v1/embeddings
Answers are checked against `Model.generate_text` (greedy) and PyTorch (embeddings).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import transformers

import background
import hfjax
from hfjax import serving, testing, tolerances

fastapi = pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install openai")
httpx = pytest.importorskip("httpx", reason="httpx is a test dependency: pip install httpx")
prometheus_parser = pytest.importorskip(
    "prometheus_client.parser", reason="the serve extra is not installed: pip install 'hfjax[serve]'"
)

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
README_DIR = "/tmp/hfjax-readme"


def _readme_serve() -> dict[str, str | list[str]]:
    """The README's Serve section, in the order a user runs it: the python line that writes the
    checkpoint, the `hfjax serve` line, the curl lines after it (wait for /health, then ask), and
    the python block."""
    section = README.read_text().split("\n## Serve\n", 1)[1].split("\n## ", 1)[0]
    lines = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[0].splitlines()
    serve = next(i for i, line in enumerate(lines) if line.startswith("hfjax serve"))
    return {
        "checkpoint": next(line for line in lines[:serve] if line.startswith("python -c ")),
        "serve": lines[serve],
        "curl": [line for line in lines[serve + 1 :] if line.startswith("curl ")],
        "python": re.findall(r"```python\n(.*?)```", section, flags=re.S)[0],
    }


# The main server is the README's own command, so its examples run against it.
_SERVE_FLAGS = shlex.split(_readme_serve()["serve"].rstrip(" &"))
NAME = _SERVE_FLAGS[_SERVE_FLAGS.index("--served-model-name") + 1]
LENGTH = int(_SERVE_FLAGS[_SERVE_FLAGS.index("--max-model-len") + 1])
ENCODER, KEY = "tiny-bert", "test-key"
SERVERS = background.Servers("hfjax-serve-test-")


def start_in_background() -> None:
    """Writes the checkpoints and starts the three servers (once)."""
    if SERVERS.started:
        return
    # The README's own line writes the checkpoint that its `hfjax serve MODEL ...` line serves.
    exec(shlex.split(_readme_serve()["checkpoint"].replace(README_DIR, str(SERVERS.directory)))[2], {})
    llama = pathlib.Path(_SERVE_FLAGS[2].replace(README_DIR, str(SERVERS.directory)))
    bert = testing.save_tiny_checkpoint("bert", SERVERS.directory / "bert", task="feature-extraction")
    readme_flags = _SERVE_FLAGS[3:]
    port = readme_flags.index("--port")
    SERVERS.launch("main", llama, *readme_flags[:port], *readme_flags[port + 2 :])
    common = ("--max-model-len", str(LENGTH), "--served-model-name", NAME)
    SERVERS.launch("small", llama, *common, "--max-batch", "1", "--max-queue", "1", "--api-key", KEY, model_flag=True)
    SERVERS.launch("encoder", bert, "--served-model-name", ENCODER, model_flag=True)


@pytest.fixture(scope="module")
def servers():
    start_in_background()
    yield SERVERS.wait()
    SERVERS.stop()


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=servers["main"] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(servers):
    return hfjax.load(SERVERS["main"]["checkpoint"])


CONVERSATIONS = [
    [{"role": "user", "content": " ".join(["Tell me about the river"] * (1 + i % 5))}]
    + (
        [{"role": "assistant", "content": "It ran past the mill."}, {"role": "user", "content": "And then?"}]
        if i % 3 == 0
        else []
    )
    for i in range(12)
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def expected(model):
    """Model.generate_text's greedy answers to CONVERSATIONS (one batch)."""
    return model.generate_text(CONVERSATIONS, max_new_tokens=NEW_TOKENS, do_sample=False)


def _chat(client, conversation, *, stream=False, **kwargs):
    call = dict(model=NAME, messages=conversation, max_tokens=NEW_TOKENS, temperature=0, **kwargs)
    if not stream:
        return client.chat.completions.create(**call).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **call)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_openai_chat_answers_equal_generate_text_streamed_or_not(client, expected):
    answer = client.chat.completions.create(model=NAME, messages=CONVERSATIONS[0], max_tokens=NEW_TOKENS, temperature=0)
    assert answer.choices[0].message.content == expected[0]
    assert answer.usage.completion_tokens <= NEW_TOKENS
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(
            model=NAME, messages=CONVERSATIONS[0], max_tokens=NEW_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected[0]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_12_concurrent_chats_get_the_answers_they_get_alone(client, expected):
    with concurrent.futures.ThreadPoolExecutor(len(CONVERSATIONS)) as pool:
        answers = list(
            pool.map(lambda i: _chat(client, CONVERSATIONS[i], stream=i % 2 == 1), range(len(CONVERSATIONS)))
        )
    assert answers == expected


def test_n_logprobs_seed_and_stop(client, expected):
    answer = client.chat.completions.create(
        model=NAME, messages=CONVERSATIONS[1], max_tokens=8, temperature=0.8, seed=5, n=3, logprobs=True, top_logprobs=2
    )
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for choice in answer.choices:
        content = choice.logprobs.content
        assert 1 <= len(content) <= 8 and all(len(t.top_logprobs) == 2 for t in content)
        assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    again = client.chat.completions.create(
        model=NAME, messages=CONVERSATIONS[1], max_tokens=8, temperature=0.8, seed=5, n=3
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in answer.choices]
    stop = expected[2][3:5]
    stopped = _chat(client, CONVERSATIONS[2], stop=[stop])
    assert stopped == expected[2][: expected[2].index(stop)]


def test_openai_completions_of_token_ids_with_logprobs(client, model, expected):
    # The chat prompt as token ids: the completion continues it as the chat does.
    text = model.tokenizer.apply_chat_template(CONVERSATIONS[4], add_generation_prompt=True, tokenize=False)
    prompt = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, logprobs=3)
    assert answer.choices[0].text == expected[4]
    logprobs = answer.choices[0].logprobs
    # As in vLLM, usage and logprobs count an EOS token that ends the answer too (its text is "").
    assert len(logprobs.tokens) == answer.usage.completion_tokens == len(logprobs.token_logprobs)
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    if answer.choices[0].finish_reason == "stop":
        assert logprobs.tokens[-1] == model.tokenizer.eos_token
    streamed = list(
        client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True,
                                  logprobs=3, stream_options={"include_usage": True})
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed[:-1]) == expected[4]
    # A chunk's tokens arrive in one event: each token's entry once, in order, offsets running on.
    events = [c.choices[0].logprobs for c in streamed[:-1]]
    assert [t for e in events for t in e.tokens] == logprobs.tokens
    assert [o for e in events for o in e.text_offset] == logprobs.text_offset
    assert [p for e in events for p in e.token_logprobs] == pytest.approx(logprobs.token_logprobs, abs=1e-5)
    assert streamed[-1].usage.completion_tokens == answer.usage.completion_tokens


def _answer_ids(model, conversation, new_tokens: int) -> list[int]:
    """Model.generate's greedy tokens answering `conversation`, cut before EOS."""
    text = model.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    prompt = np.array([model.tokenizer(text, add_special_tokens=False)["input_ids"]], np.int32)
    ids = np.asarray(model.generate(prompt, max_new_tokens=new_tokens, do_sample=False))[0, prompt.shape[1] :].tolist()
    eos = model.tokenizer.eos_token_id
    return ids[: ids.index(eos)] if eos in ids else ids


def test_a_stream_sends_a_chunks_tokens_together_and_usage_counts_the_answers_tokens(client, model):
    """As vLLM: the answer ends at the token whose text completes a stop string (the engine decodes
    past it in chunks); usage and logprobs count exactly those tokens; a stream sends the tokens that
    arrive together (a decode chunk's) in one event, with their logprobs, as vLLM merges the deltas its
    client has not read yet, and the finish_reason on the last."""
    conversation = CONVERSATIONS[6]
    ids = _answer_ids(model, conversation, NEW_TOKENS)
    texts = [model.tokenizer.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]
    stop = texts[4][-2:]
    count = next(k for k, text in enumerate(texts) if stop in text)
    assert len(ids) >= 8 and count >= 2, "the answer is too short for the check to mean anything"
    call = dict(
        model=NAME, messages=conversation, max_tokens=NEW_TOKENS, temperature=0, stop=[stop], logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    whole = client.chat.completions.create(**call)
    content = whole.choices[0].logprobs.content
    assert whole.usage.completion_tokens == len(content) == count and whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].message.content == texts[-1][: texts[-1].index(stop)]
    assert "".join(t.token for t in content) == texts[count]
    assert b"".join(bytes(t.bytes) for t in content) == texts[count].encode()
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **call))
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].logprobs
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == count
    events = [chunk.choices[0] for chunk in chunks[1:-1]]
    assert [e.finish_reason for e in events] == [None] * (len(events) - 1) + ["stop"]
    # (each token's own; a chunk's program may round a log-probability differently in the last bit)
    per_event = [e.logprobs.content for e in events]
    assert max(len(e) for e in per_event) > 1, "a decode chunk's tokens should arrive in one event"
    per_token = [t for e in per_event for t in e]
    assert len(per_token) == count
    for got, want in zip(per_token, content):
        assert (got.token, got.bytes, [t.token for t in got.top_logprobs]) == (
            want.token, want.bytes, [t.token for t in want.top_logprobs]
        )  # fmt: skip
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
    assert "".join(e.delta.content or "" for e in events) == whole.choices[0].message.content
    streamed = list(client.completions.create(model=NAME, prompt="The river", max_tokens=12, temperature=0,
                                              stream=True, logprobs=0, extra_body={"ignore_eos": True}))  # fmt: skip
    assert sum(len(c.choices[0].logprobs.tokens) for c in streamed) == 12
    assert [c.choices[0].finish_reason for c in streamed] == [None] * (len(streamed) - 1) + ["length"]


def test_logprobs_give_each_tokens_own_bytes_where_tokens_split_a_character(client, model):
    """OpenAI's `bytes` are the token's own, so a character split over tokens joins again; its text
    (vLLM's `token`) comes with the token that completes it: "" before, in a stream too."""
    emoji = "\U0001f600"
    ids = model.tokenizer(emoji, add_special_tokens=False)["input_ids"]
    assert len(ids) == 4 and all(model.tokenizer.decode([i]) == "\ufffd" for i in ids)
    # Each biased a little less than the one before, and a presence penalty on those chosen: in order.
    bias = {str(token): 100 - i / 2 for i, token in enumerate(ids)}
    call = dict(model=NAME, max_tokens=4, temperature=0, logit_bias=bias, presence_penalty=2.0)
    whole = client.completions.create(prompt="river", logprobs=1, **call)
    assert whole.choices[0].text == emoji and whole.usage.completion_tokens == 4
    assert whole.choices[0].logprobs.tokens == ["", "", "", emoji]
    streamed = list(client.completions.create(prompt="river", stream=True, **call))
    # (events whose text is all held back, without logprobs asked, say nothing and are not sent)
    assert [c.choices[0].text for c in streamed] == [emoji]
    chat = client.chat.completions.create(messages=CONVERSATIONS[0], logprobs=True, top_logprobs=1, **call)
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].message.content == emoji
    assert [bytes(t.bytes) for t in content] == [emoji.encode()[i : i + 1] for i in range(4)]
    assert all(len(t.top_logprobs) == 1 and t.top_logprobs[0].bytes for t in content)


def test_a_request_without_temperature_samples_at_1_as_in_vllm_and_openai(client, servers):
    """The tiny checkpoint's generation_config.json sets no temperature: a request without one samples
    at OpenAI's 1 (vLLM's order: the request, the file's sampling values, OpenAI's), so n=2 differs.
    The chat page starts its temperature field at that value and sends it."""
    call = dict(model=NAME, messages=CONVERSATIONS[7], max_tokens=24, n=2, extra_body={"ignore_eos": True})
    first, second = (c.message.content for c in client.chat.completions.create(**call).choices)
    assert first != second
    first, second = (c.message.content for c in client.chat.completions.create(temperature=0, **call).choices)
    assert first == second  # the negative control: greedy answers agree
    page = httpx.get(servers["main"] + "/").text
    assert re.search(r'<input id="temperature"[^>]* value="1"', page), page


def _torch_embeddings(path, texts):
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    module = transformers.AutoModel.from_pretrained(path).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = module(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()


def test_openai_embeddings_equal_pytorch(servers):
    client = openai.OpenAI(base_url=servers["encoder"] + "/v1", api_key="unused", max_retries=0)
    texts = ["a cat sat on the mat", "dogs", "the quick brown fox jumps over the lazy dog"]
    want = _torch_embeddings(SERVERS["encoder"]["checkpoint"], texts)
    tolerance = tolerances.for_family("bert")
    for encoding in ({}, {"encoding_format": "float"}):  # unless told, the client asks for base64 and decodes it
        answer = client.embeddings.create(model=ENCODER, input=texts, **encoding)
        got = np.array([d.embedding for d in answer.data], np.float32)
        np.testing.assert_allclose(got, want, atol=tolerance.atol, err_msg=tolerance.why)
    assert answer.usage.prompt_tokens > len(texts)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=ENCODER, messages=[{"role": "user", "content": "hi"}])
    assert error.value.body["param"] == "model"


def test_openai_embeddings_of_a_causal_lm_are_its_last_tokens_final_hidden_state(client):
    texts = ["a cat sat on the mat", "dogs", "the quick brown fox jumps over the lazy dog"]
    path = SERVERS["main"]["checkpoint"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    module = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    want = []
    for text in texts:  # each alone, unpadded: the last token's hidden state after the final norm
        with torch.no_grad():
            hidden = module(**tokenizer([text], return_tensors="pt"), output_hidden_states=True).hidden_states[-1]
        want.append(torch.nn.functional.normalize(hidden[0, -1], dim=-1).numpy())
    answer = client.embeddings.create(model=NAME, input=texts, encoding_format="float")
    tolerance = tolerances.for_family("llama")
    got = np.array([d.embedding for d in answer.data], np.float32)
    np.testing.assert_allclose(got, np.array(want), atol=tolerance.atol, err_msg=tolerance.why)


def test_models_health_metrics_and_the_page(servers):
    url = servers["main"]
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == NAME
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/metrics").headers["content-type"].startswith("text/plain")
    samples = {name for name, _ in _metrics(url)}
    for name in ("hfjax_time_to_first_token_seconds_bucket", "hfjax_inter_token_latency_seconds_count",
                 "hfjax_num_requests_waiting", "hfjax_batch_occupancy", "hfjax_prompt_tokens_total"):  # fmt: skip
        assert name in samples, name
    page = httpx.get(url + "/").text
    assert "<title>hfjax chat</title>" in page and 'rel="icon" href="/favicon.svg"' in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "the page loads nothing from elsewhere"
    for path in ("/favicon.svg", "/favicon.ico"):
        icon = httpx.get(url + path)
        assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml", path
        assert icon.text.startswith("<svg ")


def test_two_apps_in_one_process_keep_their_own_metrics(tmp_path):
    """Each server's metrics live in a registry of its own: a second app in the process neither collides
    with the first (prometheus_client refuses a name registered twice) nor counts its requests."""
    from fastapi.testclient import TestClient

    encoder = hfjax.load(testing.save_tiny_checkpoint("bert", tmp_path / "bert", task="feature-extraction"))
    first, second = (TestClient(serving.build_app(encoder, served_model_name=ENCODER, engine=None)) for _ in range(2))
    for client, times in ((first, 2), (second, 1)):
        for _ in range(times):
            assert client.get("/v1/models").status_code == 200
    for client, times in ((first, 2), (second, 1)):
        families = prometheus_parser.text_string_to_metric_families(client.get("/metrics").text)
        requests = [s for f in families for s in f.samples if s.name == "hfjax_http_requests_total"]
        assert [s.value for s in requests if s.labels["endpoint"] == "/v1/models"] == [times]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread's traceback
def test_a_failed_engine_answers_503_on_health_and_every_generating_route(tmp_path):
    """Where the engine thread fails, the request in flight gets a 500, and /health and every route
    that generates a 503 in OpenAI's shape naming the failure (a supervisor restarts the server, as
    it restarts vLLM's on a dead engine); the routes that do not generate still answer."""
    from fastapi.testclient import TestClient

    model = hfjax.load(testing.save_tiny_checkpoint("llama", tmp_path / "llama"))
    engine = serving.Engine(model, max_num_seqs=2, max_model_len=128, prefill_chunk=16, progress=lambda line: None)
    engine.start()  # (each program runs once there: the decode breaks after it)

    def broken(*args, **kwargs):
        raise RuntimeError("a decode program that fails")

    engine.compiler.programs.decode = broken
    body = {"model": NAME, "prompt": "the river", "max_tokens": 4}
    with TestClient(serving.build_app(model, served_model_name=NAME, engine=engine)) as client:
        assert client.get("/health").status_code == 200
        in_flight = client.post("/v1/completions", json=body)
        assert in_flight.status_code == 500 and "the engine failed" in in_flight.json()["error"]["message"]
        for method, path, sent in (
            ("GET", "/health", None), ("POST", "/v1/completions", body),
            ("POST", "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}),
        ):  # fmt: skip
            answer = client.request(method, path, json=sent)
            assert answer.status_code == 503, path
            error = answer.json()["error"]
            assert error["code"] == "engine_failed" and "a decode program that fails" in error["message"], path
        assert client.post("/tokenize", json={"model": NAME, "prompt": "the river"}).status_code == 200


BAD = [
    ("chat", b"{not json", "body"),
    ("chat", {"model": NAME}, "messages"),
    ("completions", {"model": NAME, "max_tokens": 4}, "prompt"),
    ("chat", {"model": 4, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("chat", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ("chat", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, "max_tokens"),
    ("chat", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": LENGTH - 2}, "max_tokens"),
    ("chat", {"model": NAME, "messages": [{"role": "user", "content": "river " * LENGTH}]}, "messages"),
    ("completions", {"model": NAME, "prompt": "river " * LENGTH}, "prompt"),
    ("chat", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": 2.5}, "temperature"),
    ("chat", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ("chat", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ("chat", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 30}, "top_logprobs"),
    (
        "chat",
        {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 2.5},
        "frequency_penalty",
    ),
    (
        "chat",
        {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        "tools[0]",
    ),
    ("completions", {"model": NAME, "prompt": "hi", "echo": True}, "echo"),
    ("completions", {"model": NAME, "prompt": "hi", "include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("completions", {"model": NAME, "prompt": "hi", "skip_special_tokens": False}, "skip_special_tokens"),
    ("completions", {"model": NAME, "prompt": "hi", "top_k": -2}, "top_k"),
    ("completions", {"model": NAME, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"model": NAME, "prompt": "hi", "logit_bias": {"word": 5}}, "logit_bias"),
    ("completions", {"model": NAME, "prompt": "hi", "logit_bias": {"7": 101}}, "logit_bias"),
    ("completions", {"model": NAME, "prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"),
    ("completions", {"model": NAME, "prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("chat", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "min_tokens": LENGTH}, "min_tokens"),
    ("completions", {"model": NAME, "prompt": "hi", "stop_token_ids": [3, -1]}, "stop_token_ids"),
    ("completions", {"model": NAME, "prompt": "hi", "stop_token_ids": "3"}, "stop_token_ids"),
    (
        "completions",
        {"model": NAME, "prompt": "hi", "stop_token_ids": list(range(17)), "min_tokens": 2},
        "stop_token_ids",
    ),
    ("completions", {"model": NAME, "prompt": "hi", "stop_token_ids": [99999]}, "stop_token_ids"),
    (
        "chat",
        {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999": 5}},
        "logit_bias",
    ),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), BAD, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(BAD)])
def test_bad_requests_get_an_openai_400_naming_the_field(servers, endpoint, body, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    path = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}[endpoint]
    answer = httpx.post(servers["main"] + path, content=content, headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"] or param == "body", error["message"]


def test_the_openai_client_raises_bad_request_with_the_field(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], presence_penalty=3.0)
    assert error.value.status_code == 400 and error.value.body["param"] == "presence_penalty"


HI = [{"role": "user", "content": "hi"}]
# Each length past a limit, as the openai client sends it: (endpoint, arguments, the param of the 400, its message).
OVER_LIMITS = [
    (
        "chat",
        {"messages": HI, "max_completion_tokens": LENGTH},
        "max_completion_tokens",
        rf"max_completion_tokens={LENGTH}, ",
    ),
    ("chat", {"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens", r"max_completion_tokens=0 must be"),
    ("chat", {"messages": HI, "max_tokens": LENGTH}, "max_tokens", rf"max_tokens={LENGTH}, \d+ in all"),
    (
        "chat",
        {"messages": HI, "max_tokens": -5},
        "max_tokens",
        r"max_tokens=-5 must be a positive integer; pass one in",
    ),
    ("chat", {"messages": HI, "max_tokens": 4, "extra_body": {"min_tokens": 5}}, "min_tokens", r"min_tokens=5 is more"),
    (
        "chat",
        {"messages": HI, "extra_body": {"min_tokens": LENGTH}},
        "min_tokens",
        rf"min_tokens={LENGTH} is more than",
    ),
    (
        "chat",
        {"messages": HI, "extra_body": {"min_tokens": -1}},
        "min_tokens",
        r"min_tokens=-1 must be an integer >= 0",
    ),
    (
        "chat",
        {"messages": [{"role": "user", "content": "river " * LENGTH}]},
        "messages",
        r"the prompt \(messages\) has",
    ),
    (
        "completions",
        {"prompt": [5] * LENGTH, "max_tokens": 1},
        "prompt",
        r"the prompt \(prompt\) has \d+ tokens; max_model",
    ),
    ("completions", {"prompt": [5] * 8, "max_tokens": LENGTH - 7}, "max_tokens", rf"pass max_tokens<={LENGTH - 8}"),
]


@pytest.mark.parametrize(
    ("endpoint", "arguments", "param", "message"),
    OVER_LIMITS,
    ids=[f"{e}-{p}-{i}" for i, (e, _, p, _) in enumerate(OVER_LIMITS)],
)
def test_lengths_past_a_limit_are_a_400_on_the_field_the_client_sent(client, endpoint, arguments, param, message):
    """max_tokens / max_completion_tokens, min_tokens and the prompt against --max-model-len: one check in
    the engine, answered by the openai client's BadRequestError on the request's own field."""
    create = {"chat": client.chat.completions.create, "completions": client.completions.create}[endpoint]
    with pytest.raises(openai.BadRequestError) as raised:
        create(model=NAME, **arguments)
    error = raised.value.body
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and re.search(message, error["message"]) and "\n" not in error["message"], error


def test_sampling_fields_beyond_openais_act_as_in_transformers_and_vllm(client, model):
    """repetition_penalty (vLLM's extra field) answers as transformers' repetition_penalty does in
    Model.generate_text; logit_bias and ignore_eos force a token the length of the budget; min_tokens
    holds EOS back as min_new_tokens does; stop_token_ids end the answer with the token, as vLLM's."""
    settings = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "repetition_penalty": 1.5}
    want = model.generate_text([CONVERSATIONS[5]], **settings)[0]
    assert _chat(client, CONVERSATIONS[5], extra_body={"repetition_penalty": 1.5}) == want
    assert want != _chat(client, CONVERSATIONS[5])  # the penalty changes this answer, so the check can fail
    token = model.tokenizer.eos_token_id
    forced = client.completions.create(
        model=NAME, prompt="river", max_tokens=6, temperature=0, logit_bias={str(token): 100},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert forced.usage.completion_tokens == 6 and forced.choices[0].finish_reason == "length"
    # vLLM's min_tokens: EOS, favoured at every step, is held back for 4 tokens, as transformers'
    # min_new_tokens holds it.
    held = client.completions.create(
        model=NAME, prompt="river", max_tokens=6, temperature=0, logit_bias={str(token): 100},
        extra_body={"min_tokens": 4},
    )  # fmt: skip
    want = model.generate_text(
        ["river"], max_new_tokens=6, do_sample=False, min_new_tokens=4, sequence_bias={(token,): 100.0}
    )[0]  # fmt: skip
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"
    assert held.choices[0].text == want
    # vLLM's stop_token_ids: the answer ends with the first of them it generates, that token included.
    alone = model.generate(
        model.tokenizer(["river"], return_tensors="np")["input_ids"], max_new_tokens=6, do_sample=False
    )[0, -6:].tolist()
    third = alone[2]
    assert model.tokenizer.eos_token_id not in alone[:3], (
        "the answer ends before its third token: the check proves nothing"
    )
    ended = client.completions.create(
        model=NAME, prompt="river", max_tokens=6, temperature=0, extra_body={"stop_token_ids": [third]}
    )
    count = alone.index(third) + 1
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == count < 6
    assert ended.choices[0].text == model.tokenizer.decode(alone[:count], skip_special_tokens=True)
    # min_tokens holds stop_token_ids back as it holds EOS (vLLM's): favoured at every step, the stop
    # token ends the answer right after the first 3 tokens, as transformers' min_new_tokens with it as EOS.
    held = client.completions.create(
        model=NAME, prompt="river", max_tokens=6, temperature=0, logit_bias={str(third): 100},
        extra_body={"stop_token_ids": [third], "min_tokens": 3, "ignore_eos": True},
    )  # fmt: skip
    want = model.generate_text(
        ["river"], max_new_tokens=6, do_sample=False, min_new_tokens=3, eos_token_id=[third],
        sequence_bias={(third,): 100.0},
    )[0]  # fmt: skip
    assert held.usage.completion_tokens == 4 and held.choices[0].finish_reason == "stop"
    assert held.choices[0].text == want
    # vLLM's detokenizing fields at their defaults (which some clients send) change nothing.
    defaults = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False}
    stopped = client.completions.create(
        model=NAME, prompt="river", max_tokens=6, temperature=0, extra_body={"stop_token_ids": [third], **defaults}
    )
    assert stopped.choices[0].text == ended.choices[0].text


def test_curl_streams_server_sent_events(servers, expected):
    body = {"model": NAME, "messages": CONVERSATIONS[3], "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    out = subprocess.run(
        ["curl", "-sSN", "-H", "Content-Type: application/json", "-d", json.dumps(body),
         servers["main"] + "/v1/chat/completions"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    events = [line for line in out.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == expected[3]
    assert chunks[-1]["usage"]["completion_tokens"] >= 1 and chunks[-2]["choices"][0]["finish_reason"] in (
        "stop",
        "length",
    )


def test_an_api_key_is_required_when_set(servers):
    url = servers["small"] + "/v1"
    with pytest.raises(openai.AuthenticationError) as error:
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    assert error.value.status_code == 401 and error.value.body["code"] == "invalid_api_key"
    missing = httpx.post(url + "/chat/completions", json={"model": NAME, "messages": CONVERSATIONS[0]})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert openai.OpenAI(base_url=url, api_key=KEY, max_retries=0).models.list().data[0].id == NAME
    assert httpx.get(servers["small"] + "/health").status_code == 200


def test_a_full_queue_answers_429(servers):
    client = openai.OpenAI(base_url=servers["small"] + "/v1", api_key=KEY, max_retries=0)
    # 1 slot and a queue of 1 cannot take 3 answers at once: the request is refused whole.
    with pytest.raises(openai.RateLimitError) as error:
        client.chat.completions.create(model=NAME, messages=CONVERSATIONS[0], max_tokens=LENGTH // 2, n=3)
    assert error.value.status_code == 429 and set(error.value.body) == {"message", "type", "param", "code"}
    assert "max_queue=1" in error.value.body["message"]
    assert client.chat.completions.create(model=NAME, messages=CONVERSATIONS[0], max_tokens=4).choices


def _prompt_tokens(model, conversation) -> int:
    text = model.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    return len(model.tokenizer(text, add_special_tokens=False)["input_ids"])


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics read by prometheus_client's parser: {(sample name, sorted (label, value) pairs): value}."""
    families = prometheus_parser.text_string_to_metric_families(httpx.get(url + "/metrics").text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in families for s in family.samples}


def test_load_200_requests_from_32_clients_some_leaving_mid_stream(servers, model, expected):
    url = servers["main"]
    prompt_tokens = [_prompt_tokens(model, c) for c in CONVERSATIONS]
    before = _metrics(url)
    results = []

    async def one(http: httpx.AsyncClient, i: int):
        conversation = i % len(CONVERSATIONS)
        leaves = i % 7 == 3
        body = {"model": NAME, "messages": CONVERSATIONS[conversation], "temperature": 0, "stream": True,
                "max_tokens": LENGTH - prompt_tokens[conversation] if leaves else NEW_TOKENS,
                "stream_options": {"include_usage": True}}  # fmt: skip
        text, usage = "", None
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                usage = chunk.get("usage") or usage
                if chunk["choices"]:
                    text += chunk["choices"][0]["delta"].get("content") or ""
                if leaves and text:
                    break  # the client disconnects mid-stream
        results.append((conversation, leaves, text, usage))

    async def run():
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            queue = asyncio.Queue()
            for i in range(200):
                queue.put_nowait(i)

            async def worker():
                while not queue.empty():
                    await one(http, queue.get_nowait())

            await asyncio.gather(*(worker() for _ in range(32)))

    asyncio.run(run())
    completed = [r for r in results if not r[1]]
    left = [r for r in results if r[1]]
    assert len(results) == 200 and len(left) == 29
    for conversation, _, text, usage in completed:
        assert text == expected[conversation]
        assert usage["prompt_tokens"] == prompt_tokens[conversation]
    deadline = time.monotonic() + 60
    while (after := _metrics(url))[("hfjax_num_requests_running", ())] and time.monotonic() < deadline:
        time.sleep(0.2)  # a request that lost its client leaves at the next chunk boundary

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    for gauge in ("hfjax_num_requests_running", "hfjax_num_requests_waiting", "hfjax_batch_occupancy"):
        assert after[(gauge, ())] == 0, gauge
    assert delta("hfjax_http_requests_total", endpoint="/v1/chat/completions", code="200") == 200
    finished = {r: delta("hfjax_request_success_total", finished_reason=r) for r in ("stop", "length", "cancelled")}
    assert sum(finished.values()) == 200 and finished["cancelled"] <= len(left)
    assert delta("hfjax_prompt_tokens_total") == sum(prompt_tokens[c] for c, *_ in results)
    assert delta("hfjax_generation_tokens_total") >= sum(u["completion_tokens"] for *_, u in completed)
    assert delta("hfjax_time_to_first_token_seconds_count") == 200


def test_the_chat_page_holds_a_conversation_in_headless_chromium(servers, model, tmp_path):
    browser = background.headless_chromium()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    # Three messages in one conversation on the server's 256-token context, with the page's default
    # answer length: the second outgrows the context, so the page leaves the oldest turn out.
    messages = [CONVERSATIONS[5][0]["content"], "And then?", "What did the miller say?"]

    def ask(text: str) -> tuple[str, str]:
        done = len(browser.find_elements(By.CSS_SELECTOR, "[data-done='true']"))
        browser.find_element(By.ID, "input").send_keys(text)
        browser.find_element(By.ID, "send").click()
        WebDriverWait(browser, 120).until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "[data-done='true']")) > done)
        answer = browser.find_elements(By.CSS_SELECTOR, "#messages .message[data-done]")[-1]
        return answer.get_attribute("textContent"), answer.get_attribute("class")

    try:
        browser.get(servers["main"] + "/")
        WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "model").text == NAME)
        temperature = browser.find_element(By.ID, "temperature")
        temperature.clear()
        temperature.send_keys("0")
        answers = [ask(text) for text in messages]
        notes = [note.text for note in browser.find_elements(By.CSS_SELECTOR, ".note.dropped")]
        stats = browser.find_element(By.ID, "stats").text
        browser.save_screenshot(str(tmp_path / "chat.png"))
        browser.find_element(By.ID, "new-chat").click()
        left = browser.find_elements(By.CSS_SELECTOR, "#messages > *")
        again = ask(messages[0])  # the first message of a new conversation, answered as the first was
    finally:
        browser.quit()
    assert all("error" not in kind and text for text, kind in answers), answers
    # The default answer length: 512 tokens at most, and at most half the context.
    assert answers[0][0] == model.generate_text(CONVERSATIONS[5], max_new_tokens=min(512, LENGTH // 2), do_sample=False)
    assert notes and all(f"context of {LENGTH} tokens" in note for note in notes), notes
    assert left == [] and again == answers[0]
    assert re.search(r"\d+ tokens, [\d.]+ tokens/s", stats), stats
    assert (tmp_path / "chat.png").read_bytes()[:4] == b"\x89PNG"


def test_sigterm_finishes_the_answer_in_flight_and_exits_0(servers):
    server = SERVERS["small"]
    body = {"model": NAME, "messages": CONVERSATIONS[0], "temperature": 0, "stream": True, "max_tokens": LENGTH // 2,
            "stream_options": {"include_usage": True}}  # fmt: skip
    lines = []
    with httpx.stream(
        "POST",
        servers["small"] + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    ) as response:
        assert response.status_code == 200
        server["process"].send_signal(signal.SIGTERM)
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][len("data: ") :])["usage"]
    assert usage["completion_tokens"] >= 1
    assert server["process"].wait(timeout=60) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(servers["small"] + "/health", timeout=2)


def test_the_readme_examples_run_against_its_server(servers):
    readme = _readme_serve()
    port = servers["main"].rsplit(":", 1)[1]
    wait, ask = readme["curl"]
    assert "/health" in wait and "--retry-connrefused" in wait, "the README waits for the server before asking"
    up = subprocess.run(wait.replace(":8000", f":{port}"), shell=True, capture_output=True, text=True, timeout=60)
    assert up.returncode == 0 and json.loads(up.stdout) == {"status": "ok"}, up.stderr
    out = subprocess.run(ask.replace(":8000", f":{port}"), shell=True, capture_output=True, text=True, timeout=60)
    answer = json.loads(out.stdout)
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] >= 1, out.stdout
    ran = subprocess.run(
        [sys.executable, "-c", readme["python"].replace(":8000", f":{port}")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr


def test_the_servers_say_no_warning(servers):
    # Quiet by default: what a server prints while it loads, compiles and answers holds no library's note.
    from test_readme import WARNING

    for name in ("main", "encoder"):
        log = SERVERS.log(name)
        assert not WARNING.search(log), f"{name} server: {log[-3000:]}"
