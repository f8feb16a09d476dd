"""`hfjax serve` as scripts written for `vllm serve` drive it: vLLM's flags, request fields and endpoints.

Three servers run in processes of their own, started as soon as the suite is collected:
  chat     a tiny Llama whose chat template reads `enable_thinking` (as Qwen3's does), sized by
           --kv-cache-memory with --gpu-memory-utilization beside it
  quiet    the same model with --disable-log-requests, --disable-log-stats, --no-enable-prefix-caching
  encoder  a tiny BERT whose config.json names its Matryoshka dimensions, --uvicorn-log-level warning
References: transformers' tokenizer and chat template, PyTorch's embeddings, the openai client.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import time

import numpy as np
import pytest
import torch
import transformers

import background
import hfjax
from hfjax import cli, serving, testing, tolerances

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install openai")
httpx = pytest.importorskip("httpx", reason="httpx is a test dependency: pip install httpx")

NAME, ENCODER, LENGTH = "tiny-think", "tiny-matryoshka", 128
MATRYOSHKA = [16, 32, 64]
# The tiny template with Qwen3's switch: enable_thinking=false writes an empty thinking block.
THINKING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
ACCESS_LINE = re.compile(r'^INFO: +127\.0\.0\.1:\d+ - "POST /v1/chat/completions HTTP/1\.1" 200 OK$', re.M)
STATS_LINE = re.compile(
    r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
    r"Running: \d+ reqs, Waiting: \d+ reqs"
)
SERVERS = background.Servers("hfjax-serve-vllm-test-")


def _thinking_llama(path: pathlib.Path) -> pathlib.Path:
    testing.save_tiny_checkpoint("llama", path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def start_in_background() -> None:
    """Writes the checkpoints and starts the three servers (once)."""
    if SERVERS.started:
        return
    llama = _thinking_llama(SERVERS.directory / "llama")
    bert = testing.save_tiny_checkpoint(
        "bert", SERVERS.directory / "bert", task="feature-extraction", matryoshka_dimensions=MATRYOSHKA
    )
    sizing = ("--max-model-len", str(LENGTH), "--max-num-seqs", "4", "--served-model-name", NAME)
    SERVERS.launch("chat", llama, *sizing, "--kv-cache-memory", "64MiB", "--gpu-memory-utilization", "0.5")
    quiet = ("--disable-log-requests", "--disable-log-stats", "--no-enable-prefix-caching")
    SERVERS.launch("quiet", llama, *sizing, *quiet)
    SERVERS.launch("encoder", bert, "--served-model-name", ENCODER, "--uvicorn-log-level", "warning")


@pytest.fixture(scope="module")
def servers():
    start_in_background()
    yield SERVERS.wait()
    SERVERS.stop()


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=servers["chat"] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(servers):
    return transformers.AutoTokenizer.from_pretrained(SERVERS["chat"]["checkpoint"])


def _post(url: str, body) -> httpx.Response:
    return httpx.post(url, json=body, timeout=120)


CHAT = [{"role": "user", "content": "Tell me about the river"}]


def test_chat_template_kwargs_reach_the_chat_template(servers, client, tokenizer):
    # The reference: transformers' own apply_chat_template with the variable, then the server's greedy
    # completion of exactly those tokens.
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert text.endswith("<think>\n\n</think>\n\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    answer = client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=8, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert answer.usage.prompt_tokens == len(ids)
    want = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
    assert answer.choices[0].message.content == want.choices[0].text
    plain = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1, temperature=0)
    plain_text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert plain.usage.prompt_tokens == len(tokenizer(plain_text, add_special_tokens=False)["input_ids"]) < len(ids)
    url = servers["chat"] + "/v1/chat/completions"
    for kwargs in ("enable_thinking=false", ["enable_thinking"], {"tokenize": True}):
        background.openai_400(
            _post(url, {"model": NAME, "messages": CHAT, "chat_template_kwargs": kwargs}), "chat_template_kwargs"
        )


def test_tokenize_and_detokenize_answer_as_the_tokenizer(servers, tokenizer):
    url = servers["chat"]
    text = "The river ran quietly past the old mill."
    ids = tokenizer(text)["input_ids"]
    got = _post(url + "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert got == {
        "count": len(ids), "max_model_len": LENGTH, "tokens": ids, "token_strs": tokenizer.convert_ids_to_tokens(ids)
    }  # fmt: skip
    bare = _post(url + "/tokenize", {"model": NAME, "prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"] and bare["token_strs"] is None
    # A chat's tokens are the prompt /v1/chat/completions reads (its usage counts them).
    chat_text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    chat = _post(
        url + "/tokenize", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    ).json()  # fmt: skip
    assert chat["tokens"] == tokenizer(chat_text, add_special_tokens=False)["input_ids"]
    answer = _post(
        url + "/v1/chat/completions",
        {"model": NAME, "messages": CHAT, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}},
    ).json()
    assert answer["usage"]["prompt_tokens"] == chat["count"]
    closing = [*CHAT, {"role": "assistant", "content": "It ran"}]
    continued = _post(
        url + "/tokenize", {"messages": closing, "add_generation_prompt": False, "continue_final_message": True}
    ).json()
    want = tokenizer.apply_chat_template(closing, continue_final_message=True, tokenize=False)
    assert continued["tokens"] == tokenizer(want, add_special_tokens=False)["input_ids"]
    assert _post(url + "/detokenize", {"model": NAME, "tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    for path, body, param in [
        ("/tokenize", {"text": text}, "text"),
        ("/tokenize", {"model": 5, "prompt": text}, "model"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": closing, "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {"messages": "hi"}, "messages"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [len(tokenizer)]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ]:
        background.openai_400(_post(url + path, body), param)
    unknown = _post(url + "/tokenize", {"model": "other", "prompt": text})  # as vLLM: a model not served is a 404
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found", unknown.text


def test_version_and_one_models_entry(servers, client):
    url = servers["chat"]
    assert httpx.get(url + "/version").json() == {"version": hfjax.__version__}
    listed = httpx.get(url + "/v1/models").json()["data"][0]
    assert httpx.get(url + f"/v1/models/{NAME}").json() == listed
    model = client.models.retrieve(NAME)
    assert (model.id, model.object, model.owned_by) == (NAME, "model", "hfjax")
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("gpt-4")
    assert error.value.body["param"] == "model" and error.value.body["code"] == "model_not_found"
    assert "gpt-4" in error.value.body["message"] and NAME in error.value.body["message"]


def test_dimensions_truncate_a_matryoshka_models_embeddings_and_normalise_them(servers):
    texts = ["a cat sat on the mat", "the quick brown fox jumps over the lazy dog"]
    path = SERVERS["encoder"]["checkpoint"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    module = transformers.AutoModel.from_pretrained(path).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = module(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)  # [N, 64]
    encoder = openai.OpenAI(base_url=servers["encoder"] + "/v1", api_key="unused", max_retries=0)
    tolerance = tolerances.for_family("bert")
    for dimensions in (16, 64):
        want = torch.nn.functional.normalize(pooled[:, :dimensions], dim=-1).numpy()
        answer = encoder.embeddings.create(model=ENCODER, input=texts, dimensions=dimensions)
        got = np.array([d.embedding for d in answer.data], np.float32)
        np.testing.assert_allclose(got, want, atol=tolerance.atol, err_msg=tolerance.why)
    url = servers["encoder"] + "/v1/embeddings"
    for dimensions in (24, 0, "16"):
        background.openai_400(_post(url, {"model": ENCODER, "input": texts, "dimensions": dimensions}), "dimensions")
    message = background.openai_400(_post(servers["chat"] + "/v1/embeddings", {"model": NAME, "input": texts, "dimensions": 8}),
                        "dimensions")  # fmt: skip
    assert "Matryoshka" in message
    assert "INFO:" not in SERVERS.log("encoder"), "--uvicorn-log-level warning: no access or start-up lines"


def _prefix_hits(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(r"^hfjax_prefix_cache_hit_tokens_total (\S+)$", text, re.M).group(1))


def _wait_for(pattern: re.Pattern, name: str, after: int, timeout: float = 60) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = pattern.search(SERVERS.log(name), after)
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(
        f"{name} server logged no {pattern.pattern!r} in {timeout} s: {SERVERS.log(name)[after:][-2000:]}"
    )


def test_access_and_stats_lines_and_the_flags_that_quiet_them(servers):
    system = [{"role": "system", "content": "You answer about rivers, mills and the sea. " * 3}]
    body = {"messages": system + CHAT, "max_tokens": 4, "temperature": 0, "model": NAME}
    marks = {name: len(SERVERS.log(name)) for name in ("chat", "quiet")}
    hits = {name: _prefix_hits(servers[name]) for name in ("chat", "quiet")}
    for name in ("chat", "quiet"):
        for _ in range(2):  # the second finds the first's keys in its free slot, where prefix caching is on
            assert _post(servers[name] + "/v1/chat/completions", body).status_code == 200
    _wait_for(ACCESS_LINE, "chat", marks["chat"])
    _wait_for(STATS_LINE, "chat", marks["chat"])  # within a stats interval of the requests
    time.sleep(11)  # one more interval of the quiet server's
    quiet = SERVERS.log("quiet")[marks["quiet"] :]
    assert "HTTP/1.1" not in quiet and "throughput" not in quiet, quiet
    assert _prefix_hits(servers["chat"]) > hits["chat"]
    assert _prefix_hits(servers["quiet"]) == hits["quiet"]


def test_gpu_memory_utilization_sizes_the_cache_unless_kv_cache_memory_is_given(servers, tmp_path):
    assert "64.00 MiB budget (kv_cache_memory; gpu_memory_utilization=0.5 not used)" in SERVERS.log("chat")
    model = hfjax.load(SERVERS["chat"]["checkpoint"])
    engine = serving.Engine(model, max_model_len=LENGTH, gpu_memory_utilization=1.0)
    with open("/proc/meminfo") as meminfo:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo}
    total, in_use = fields["MemTotal"], fields["MemTotal"] - fields["MemAvailable"]
    # The RAM in use drifts while other processes run: a twentieth of the machine's either way.
    assert abs(engine.sizing.budget - (total - in_use)) < total / 20, (engine.sizing.budget, total, in_use)
    assert "gpu_memory_utilization=1.0 of the RAM" in engine.sizing.describe()
    for fraction in (0.0, 1.5, True):
        with pytest.raises(hfjax.ServingError, match=rf"gpu_memory_utilization={fraction!r} is out of range"):
            serving.Engine(model, gpu_memory_utilization=fraction)
    with pytest.raises(hfjax.ServingError, match=r"gpu_memory_utilization=1e-09 of the RAM .* pass a larger fraction"):
        serving.Engine(model, gpu_memory_utilization=1e-9)


@pytest.mark.parametrize("value", ["0", "1.5", "most"])
def test_gpu_memory_utilization_out_of_range_is_one_line(value, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["serve", "M", "--gpu-memory-utilization", value])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"argument --gpu-memory-utilization: {value!r} is out of range; pass a fraction in (0, 1]" in err, err


# ---- --quantization ----------------------------------------------------------------------------


def _shard_plan(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["shard-plan", *argv]) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def gptq(tmp_path_factory):
    import quantized_checkpoints as written

    base = testing.save_tiny_checkpoint("llama", tmp_path_factory.mktemp("base"))
    path, _ = written.gptq_checkpoint(base, tmp_path_factory.mktemp("gptq"), group_size=32, act_order=False)
    return base, path


def test_quantization_names_the_checkpoints_method_or_quantizes_on_load(gptq):
    # The plan of every tensor (dtype, shape, bytes) as hfjax.load would read it.
    base, path = gptq
    as_is = _shard_plan("--model", str(path))
    assert "int32" in as_is or "uint8" in as_is
    for method in ("gptq", "gptq_marlin"):
        assert _shard_plan("--model", str(path), "--quantization", method) == as_is
    for mode in ("fp8", "int8"):
        assert _shard_plan("--model", str(base), "--quantization", mode) == _shard_plan(
            "--model", str(base), "--quantize", mode
        )


@pytest.mark.parametrize(
    ("which", "flags", "named"),
    [
        ("gptq", ["--quantization", "awq"], ["--quantization awq", "gptq", "quant_method"]),
        ("gptq", ["--quantization", "fp8"], ["--quantization fp8", "gptq"]),
        ("gptq", ["--quantization", "bitsandbytes"], ["bitsandbytes", "gptq, gptq_marlin, fp8, compressed-tensors"]),
        ("base", ["--quantization", "awq"], ["--quantization awq", "not quantized"]),
        ("base", ["--quantization", "fp8", "--quantize", "int8"], ["--quantization fp8", "--quantize int8"]),
    ],
)
def test_a_quantization_that_is_not_the_checkpoints_is_one_line(gptq, which, flags, named, capsys):
    path = gptq[1] if which == "gptq" else gptq[0]
    code = cli.main(["serve", str(path), *flags])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("hfjax serve: ") and all(word in err for word in named), err


def test_metrics_count_requests_by_route_not_by_the_path_a_client_sent(servers):
    url = servers["quiet"]
    for path in ("/v1/models/first-unknown", "/v1/models/second-unknown", "/no/such/path", "/or/this/one"):
        assert httpx.get(url + path).status_code == 404
    metrics = httpx.get(url + "/metrics").text
    assert re.search(r'hfjax_http_requests_total\{code="404",endpoint="/v1/models/\{model_id:path\}"\} 2\.0', metrics)
    assert re.search(r'hfjax_http_requests_total\{code="404",endpoint="other"\} 2\.0', metrics)
    assert "unknown" not in metrics and "/no/such/path" not in metrics
