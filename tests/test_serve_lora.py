"""LoRA adapters in `hfjax serve`, as vLLM serves them: --enable-lora and --lora-modules, a request's
`model` naming an adapter, /v1/models, vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, the
per-model metrics and the chat page's model picker, through the official openai client.

One server runs a tiny Llama with three peft adapters loaded at start (ranks 2, 4 and 8, on different
layers, one with rsLoRA), room for a fourth, and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1. The reference is
peft's own model in PyTorch (`PeftModel.from_pretrained`) and transformers' greedy `generate`; every
adapter's factors are random (`testing.save_tiny_adapter`), so that its answers differ from the base's
and from the other adapters' (checked).
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import time

import numpy as np
import pytest
import torch
import transformers

import background
import hfjax
from hfjax import cli, serving, testing, tolerances
from hfjax.cli import serve

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
peft = pytest.importorskip("peft", reason="peft is in the train extra: pip install 'hfjax[train]'")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install openai")
httpx = pytest.importorskip("httpx", reason="httpx is a test dependency: pip install httpx")
prometheus_parser = pytest.importorskip(
    "prometheus_client.parser", reason="the serve extra is not installed: pip install 'hfjax[serve]'"
)

NAME, PARENT, LENGTH, NEW_TOKENS = "tiny-base", "tiny-parent", 128, 12
# {name: `testing.save_tiny_adapter`'s peft.LoraConfig}; the first three load at start, "late" at run time,
# and "wide" has a rank above the server's --max-lora-rank.
ADAPTERS = {
    "terse": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]},
    "wordy": {"r": 4, "lora_alpha": 16, "target_modules": ["o_proj", "gate_proj", "down_proj"]},
    "rs": {"r": 8, "lora_alpha": 8, "use_rslora": True, "target_modules": ["q_proj", "k_proj", "v_proj", "up_proj"]},
    "late": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "up_proj"]},
    "wide": {"r": 16, "lora_alpha": 16, "target_modules": ["q_proj"]},
}
AT_START = ("terse", "wordy", "rs")
PROMPTS = ["The river ran past the mill", "Once upon a time"]
SERVERS = background.Servers("hfjax-serve-lora-test-")


def start_in_background() -> None:
    """Writes the checkpoint and the adapters, and starts the server (once); queues the README's example."""
    background.start(
        "lora-readme", background.python(background.README_SERVE_JOB), seconds=90,
        env={"HFJAX_README": str(README), "HFJAX_README_BLOCK": "--enable-lora"},
    )  # fmt: skip
    if SERVERS.started:
        return
    llama = testing.save_tiny_checkpoint("llama", SERVERS.directory / "llama", max_position_embeddings=LENGTH)
    paths = {
        name: testing.save_tiny_adapter(llama, SERVERS.directory / name, seed=seed, **config)
        for seed, (name, config) in enumerate(ADAPTERS.items())
    }
    modules = [f"terse={paths['terse']}", f"wordy={paths['wordy']}"]
    modules.append(json.dumps({"name": "rs", "path": str(paths["rs"]), "base_model_name": PARENT}))
    SERVERS.launch(
        "lora", llama, "--served-model-name", NAME, "--max-model-len", str(LENGTH), "--max-num-seqs", "8",
        "--enable-lora", "--max-loras", "4", "--max-lora-rank", "8", "--lora-modules", *modules,
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )  # fmt: skip


@pytest.fixture(scope="module")
def url():
    start_in_background()
    yield SERVERS.wait()["lora"]
    SERVERS.stop()


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _path(name: str) -> pathlib.Path:
    return SERVERS.directory / name


@pytest.fixture(scope="module")
def tokenizer(url):
    return transformers.AutoTokenizer.from_pretrained(SERVERS["lora"]["checkpoint"])


def _peft_greedy(name: str, texts: list[str], tokenizer, *, chat: bool = False) -> list[str]:
    """The greedy answers (NEW_TOKENS at most) to `texts` of peft's model of adapter `name` in PyTorch (NAME:
    the base alone); chat: each text is a user's message, the chat template applied."""
    module = transformers.AutoModelForCausalLM.from_pretrained(SERVERS["lora"]["checkpoint"])
    if name != NAME:
        module = peft.PeftModel.from_pretrained(module, _path(name))
    answers = []
    for text in texts:
        if chat:
            messages = [{"role": "user", "content": text}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=not chat)
        with torch.no_grad():
            out = module.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        answers.append(tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    return answers


@pytest.fixture(scope="module")
def reference(tokenizer) -> dict[str, list[str]]:
    """{model name: the greedy answers to PROMPTS}: peft's model in PyTorch for each adapter, the base
    alone for NAME."""
    answers = {name: _peft_greedy(name, PROMPTS, tokenizer) for name in (NAME, *AT_START, "late")}
    # Each adapter changes the answers, so a request run on the wrong weights cannot pass.
    assert len({tuple(texts) for texts in answers.values()}) == len(answers), answers
    return answers


def _complete(client, model: str, prompt: str, **fields) -> str:
    answer = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, **fields)
    assert answer.model == model
    return answer.choices[0].text


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    families = prometheus_parser.text_string_to_metric_families(httpx.get(url + "/metrics").text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in families for s in family.samples}


def _adapters_loaded(url: str) -> float:
    return _metrics(url)[("hfjax_lora_adapters_loaded", ())]


def _wait_for_adapters(url: str, count: int, timeout: float = 60) -> None:
    """Waits until the model holds `count` adapters (an unloaded one is deleted once its requests end)."""
    deadline = time.monotonic() + timeout
    while _adapters_loaded(url) != count:
        assert time.monotonic() < deadline, f"the server holds {_adapters_loaded(url)} adapters, not {count}"
        time.sleep(0.2)


def test_each_adapter_and_the_base_answer_as_peft_in_one_batch(client, reference):
    asks = [(model, i) for model in (NAME, *AT_START) for i in range(len(PROMPTS))]
    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(lambda ask: _complete(client, ask[0], PROMPTS[ask[1]]), asks))
    assert got == [reference[model][i] for model, i in asks]


def _peft_logprobs(name: str, prompt: str, tokenizer) -> list[float]:
    """The log-probabilities of peft's greedy answer to `prompt` in PyTorch (NAME: the base alone)."""
    module = transformers.AutoModelForCausalLM.from_pretrained(SERVERS["lora"]["checkpoint"])
    if name != NAME:
        module = peft.PeftModel.from_pretrained(module, _path(name))
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = module.generate(
            **ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    new = out.sequences[0, ids["input_ids"].shape[1] :]
    return [float(torch.log_softmax(step[0], -1)[token]) for step, token in zip(out.logits, new)]


def test_each_adapters_log_probabilities_match_pefts_in_one_batch(client, tokenizer):
    models = (NAME, *AT_START)

    def ask(model: str):
        return (
            client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=NEW_TOKENS, temperature=0, logprobs=1)
            .choices[0]
            .logprobs.token_logprobs
        )

    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        got = list(pool.map(ask, models))
    for model, values in zip(models, got):
        want = _peft_logprobs(model, PROMPTS[0], tokenizer)
        assert len(values) == len(want), model
        # A log-probability is a logit less the log-sum-exp of all of them: twice the logits' bound.
        np.testing.assert_allclose(values, want, atol=2 * tolerances.LORA.atol, err_msg=model)


def _chat(client, model: str, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
    assert answer.model == model
    return answer.choices[0].message.content


def test_chat_answers_run_on_the_adapter_named(client, tokenizer):
    for model in (NAME, "rs"):
        assert [_chat(client, model, text) for text in PROMPTS] == _peft_greedy(model, PROMPTS, tokenizer, chat=True)


def test_models_lists_the_base_and_each_adapter_as_vllm_does(client, url):
    cards = httpx.get(url + "/v1/models").json()["data"]
    base = str(SERVERS["lora"]["checkpoint"])
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        (NAME, base, None),
        ("terse", str(_path("terse")), NAME),
        ("wordy", str(_path("wordy")), NAME),
        ("rs", str(_path("rs")), PARENT),  # the JSON form's base_model_name
    ]
    assert all(c["object"] == "model" and c["owned_by"] == "hfjax" for c in cards)
    assert httpx.get(url + "/v1/models/wordy").json() == cards[2]
    assert client.models.retrieve("rs").id == "rs"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_an_unknown_model_is_openais_not_found(client, endpoint):
    with pytest.raises(openai.NotFoundError) as error:
        if endpoint == "chat":
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        else:
            client.completions.create(model="nope", prompt="hi", max_tokens=2)
    body = error.value.body
    assert (body["type"], body["code"], body["param"]) == ("NotFoundError", "model_not_found", "model")
    assert all(repr(name) in body["message"] for name in ("nope", NAME, *AT_START)), body["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_metrics_count_requests_per_model_and_a_prefix_is_reused_by_its_own_adapter(client, url, tokenizer):
    before = _metrics(url)
    for model in (NAME, "wordy"):
        _complete(client, model, PROMPTS[1])
    hits = _metrics(url)[("hfjax_prefix_cache_hit_tokens_total", ())]
    _complete(client, "wordy", PROMPTS[1])  # the prompt's keys under wordy are in a free slot: all but its last
    after = _metrics(url)

    def delta(model: str) -> float:
        key = ("hfjax_lora_requests_total", (("model", model),))
        return after.get(key, 0) - before.get(key, 0)

    assert (delta(NAME), delta("wordy"), delta("terse")) == (1, 2, 0)
    assert after[("hfjax_prefix_cache_hit_tokens_total", ())] - hits == len(tokenizer(PROMPTS[1]).input_ids) - 1
    assert after[("hfjax_lora_adapters_loaded", ())] == len(AT_START)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_load_at_run_time_use_unload_while_a_stream_runs_then_load_again(client, url, reference):
    load = {"lora_name": "late", "lora_path": str(_path("late"))}
    answer = _post(url, "/v1/load_lora_adapter", load)
    assert (answer.status_code, answer.text) == (200, "Success: LoRA adapter 'late' added successfully.")
    assert [c.id for c in client.models.list().data] == [NAME, *AT_START, "late"]
    assert [_complete(client, "late", prompt) for prompt in PROMPTS] == reference["late"]
    # Every slot holds an adapter now, and a name is loaded once.
    for body, param, words in [
        ({"lora_name": "extra", "lora_path": str(_path("late"))}, "lora_path", "slot"),
        (load, "lora_name", "already been loaded"),
        ({"lora_name": "late"}, "lora_path", "lora_path"),
        ({"lora_path": str(_path("late"))}, "lora_name", "lora_name"),
    ]:
        assert words in background.openai_400(_post(url, "/v1/load_lora_adapter", body), param)

    # Unloaded while requests run on it (8 streamed choices, each as long as the context allows): new
    # requests are refused at once, and those running finish on its weights.
    long = {"max_tokens": LENGTH - 16, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(model="late", prompt=PROMPTS[0], **long).choices[0].text
    stream = iter(client.completions.create(model="late", prompt=PROMPTS[0], stream=True, n=8, **long))
    chunks = [next(stream)]
    answer = _post(url, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert (answer.status_code, answer.text) == (200, "Success: LoRA adapter 'late' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        _complete(client, "late", PROMPTS[0])
    assert [c.id for c in client.models.list().data] == [NAME, *AT_START]
    texts, finished = [""] * 8, [None] * 8
    for chunk in chunks + list(stream):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finished[choice.index] = choice.finish_reason or finished[choice.index]
    assert texts == [whole] * 8 and finished == ["length"] * 8

    _wait_for_adapters(url, len(AT_START))
    assert "rank" in background.openai_400(
        _post(url, "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": str(_path("wide"))}), "lora_path"
    )
    missing = background.openai_400(
        _post(url, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(_path("missing"))}), "lora_path"
    )
    assert str(_path("missing")) in missing
    # Its slot, freed, takes the adapter again, which answers as peft's again.
    assert _post(url, "/v1/load_lora_adapter", load).status_code == 200
    assert [_complete(client, "late", prompt) for prompt in PROMPTS] == reference["late"]
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    for name in ("late", NAME):
        answer = _post(url, "/v1/unload_lora_adapter", {"lora_name": name})
        assert answer.status_code == 404 and answer.json()["error"]["param"] == "lora_name", answer.text
    _wait_for_adapters(url, len(AT_START))


def test_the_load_routes_exist_only_with_enable_lora_and_vllms_variable(tmp_path):
    from fastapi.testclient import TestClient

    model = hfjax.load(testing.save_tiny_checkpoint("llama", tmp_path / "llama"))
    for enable_lora, runtime in [(True, False), (False, True), (True, True)]:
        app = serving.build_app(
            model, served_model_name=NAME, engine=None, enable_lora=enable_lora, runtime_lora_updating=runtime
        )
        with TestClient(app) as http:
            for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                answer = http.post(path, json={})
                if enable_lora and runtime:  # the route: an empty body names its field
                    background.openai_400(answer, "lora_name")
                else:
                    assert answer.status_code == 404 and "Not Found" in answer.json()["error"]["message"], answer.text
    for value, allowed in [("1", True), ("true", True), (" TRUE ", True), ("0", False), ("yes", False), ("", False)]:
        assert serve.runtime_lora_updating({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}) is allowed, value
    assert serve.runtime_lora_updating({}) is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-modules", "a=/x"], "--lora-modules a=/x needs --enable-lora; pass --enable-lora"),
        (["--enable-lora", "--lora-modules", "nopath"], "argument --lora-modules: 'nopath' is not NAME=PATH; pass"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], 'needs the strings "name" and "path"'),
        (["--enable-lora", "--lora-modules", "{a=/x"], "'{a=/x' is not valid JSON"),
        (
            ["--enable-lora", "--lora-modules", "a=/x", "b=/y"],
            "--lora-modules names 2 adapters, more than --max-loras=1 holds; pass --max-loras 2",
        ),
        (["--enable-lora", "--max-loras", "2", "--lora-modules", "a=/x", "a=/y"], "names 'a' twice"),
        (["--enable-lora", "--max-lora-rank", "0"], "--max-lora-rank=0 must be at least 1"),
    ],
)
def test_bad_lora_flags_are_one_line_and_exit_code_2(argv, message, capsys):
    try:
        code = cli.main(["serve", "M", *argv, "--port", "0"])
    except SystemExit as exit:  # argparse's own checks
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("hfjax serve: ") and message in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_an_adapter_that_cannot_load_at_start_is_one_line_naming_the_flag(tmp_path, capsys):
    llama = testing.save_tiny_checkpoint("llama", tmp_path / "llama")
    capsys.readouterr()  # (the checkpoint's writing)
    code = cli.main(
        ["serve", str(llama), "--enable-lora", "--lora-modules", f"mine={tmp_path / 'missing'}", "--port", "0"]
    )
    err = capsys.readouterr().err
    assert code == 1 and f"hfjax serve: --lora-modules mine={tmp_path / 'missing'}: " in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_the_chat_pages_picker_sends_the_chosen_adapter(url, client):
    browser = background.headless_chromium()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    try:
        browser.get(url + "/")
        picker = browser.find_element(By.ID, "model")
        WebDriverWait(browser, 30).until(lambda b: len(Select(picker).options) == 1 + len(AT_START))
        listed = [option.get_attribute("value") for option in Select(picker).options]
        Select(picker).select_by_value("wordy")
        temperature = browser.find_element(By.ID, "temperature")
        temperature.clear()
        temperature.send_keys("0")
        browser.find_element(By.ID, "max-tokens").send_keys(str(NEW_TOKENS))
        browser.find_element(By.ID, "input").send_keys(PROMPTS[0])
        browser.find_element(By.ID, "send").click()
        WebDriverWait(browser, 120).until(lambda b: b.find_elements(By.CSS_SELECTOR, "[data-done='true']"))
        answer = browser.find_elements(By.CSS_SELECTOR, "#messages .message[data-done]")[-1]
        text, kind = answer.get_attribute("textContent"), answer.get_attribute("class")
    finally:
        browser.quit()
    assert listed == [NAME, *AT_START]
    assert "error" not in kind and text == _chat(client, "wordy", PROMPTS[0])


def test_the_server_says_no_warning_and_names_each_adapter_it_loaded(url):
    # Last: what the server printed while it loaded the adapters, compiled and answered holds no library's note.
    from test_readme import WARNING

    log = SERVERS.log("lora")
    assert not WARNING.search(log), log[-3000:]
    assert all(f"LoRA adapter {name} from {_path(name)}" in log for name in AT_START), log[-3000:]


README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_the_readmes_finetune_to_serve_example_runs():
    job = background.finished("lora-readme", start_in_background)
    assert job.returncode == 0, job.output[-3000:]
    ran = [json.loads(line) for line in job.output.splitlines() if line.startswith('{"command"')]
    assert all(step["returncode"] == 0 for step in ran if step["command"] != "server"), ran  # (the server: stopped)
    curls = [step["stdout"] for step in ran if step["command"] == "curl"]
    health, completion, loaded, unloaded = curls
    assert json.loads(health) == {"status": "ok"}
    answer = json.loads(completion)
    assert answer["model"] == "mine" and answer["usage"]["completion_tokens"] >= 1, answer
    assert "again" in loaded and "success" in loaded.lower(), loaded
    assert "again" in unloaded and "success" in unloaded.lower(), unloaded
    from test_readme import WARNING

    log = ran[-1]["log"]
    assert not WARNING.search(log), log
