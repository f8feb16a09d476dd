"""`hfjax serve` of a recurrent model (Mamba 2: a conv and an SSM state per layer and slot), through the
official openai client: greedy completions and chats give `Model.generate`'s tokens and transformers'
generate's; concurrent prompts of different lengths, more than the slots, each get the answer they get
alone (a state leaks into no other slot, and a slot a new request reuses starts from zeros); and no
program compiles after /health. The tiny Mamba 2 checkpoint's answers change token by token (the tiny
Mamba 1's repeat one token, which a lost state would give too)."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import torch
import transformers

import background
import hfjax
from hfjax import generation, testing
from hfjax.serving import Engine, SamplingParams

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install openai")
httpx = pytest.importorskip("httpx", reason="httpx is a test dependency: pip install httpx")
prometheus_parser = pytest.importorskip(
    "prometheus_client.parser", reason="the serve extra is not installed: pip install 'hfjax[serve]'"
)

NAME, SLOTS, LENGTH, NEW_TOKENS = "tiny-mamba2", 2, 256, 10  # prompts of up to 256 tokens: prefill windows 128, 256
SERVERS = background.Servers("hfjax-serve-recurrent-test-")
# Prompts of 3 to 200 tokens: the longest is prefilled whole in a chunk of 256 columns.
PROMPTS = [np.random.default_rng(seed).integers(5, 400, length).tolist() for seed, length in enumerate((3, 40, 200, 9))]


def start_in_background() -> None:
    if SERVERS.started:
        return
    mamba = testing.save_tiny_checkpoint("mamba2", SERVERS.directory / "mamba2")
    SERVERS.launch(
        "main", mamba, "--served-model-name", NAME, "--max-model-len", str(LENGTH), "--max-num-seqs", str(SLOTS)
    )


@pytest.fixture(scope="module")
def url():
    start_in_background()
    yield SERVERS.wait()["main"]
    SERVERS.stop()


@pytest.fixture(scope="module")
def model(url):
    return hfjax.load(SERVERS["main"]["checkpoint"])


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _compilations(url: str) -> float:
    families = prometheus_parser.text_string_to_metric_families(httpx.get(url + "/metrics").text)
    return next(s.value for f in families for s in f.samples if s.name == "hfjax_compilations_total")


def _references(model, prompt: list[int]) -> tuple[str, str]:
    """The text of `prompt`'s greedy NEW_TOKENS new tokens by Model.generate and by transformers' generate."""
    ids = np.asarray([prompt])
    ours = np.asarray(model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False))
    with torch.no_grad():
        theirs = (
            transformers.AutoModelForCausalLM.from_pretrained(model.path)
            .eval()
            .generate(torch.as_tensor(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            .numpy()
        )
    np.testing.assert_array_equal(ours, theirs)
    text = model.tokenizer.decode(ours[0, len(prompt) :].tolist(), skip_special_tokens=True)
    assert len(set(ours[0, len(prompt) :].tolist())) > 3, "the answer repeats itself: the test proves nothing"
    return text, model.tokenizer.decode(theirs[0, len(prompt) :].tolist(), skip_special_tokens=True)


def _complete(client, prompt: list[int]):
    return client.completions.create(
        model=NAME, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]


def test_a_greedy_completion_is_model_generates_and_transformers(client, model):
    for prompt in PROMPTS[:3]:
        ours, theirs = _references(model, prompt)
        answer = _complete(client, prompt)
        assert answer.text == ours == theirs and answer.finish_reason == "length"


def test_a_greedy_chat_is_model_generates_and_transformers(url, client, model):
    messages = [{"role": "user", "content": "Tell me about the river and the mill"}]
    ids = httpx.post(url + "/tokenize", json={"model": NAME, "messages": messages}).json()["tokens"]
    answer = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    ours, theirs = _references(model, ids)
    assert answer.choices[0].message.content == ours == theirs
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == NEW_TOKENS


def test_concurrent_prompts_each_get_their_own_answer_and_compile_nothing(url, client):
    # Twice the slots' prompts at once (twice over): each slot is reused by a new request, whose state
    # must start from zeros, and rows decoding together must not move each other's states.
    alone = [_complete(client, prompt).text for prompt in PROMPTS]
    before = _compilations(url)
    with concurrent.futures.ThreadPoolExecutor(2 * len(PROMPTS)) as pool:
        together = list(pool.map(lambda prompt: _complete(client, prompt).text, PROMPTS * 2))
    assert together == alone * 2
    assert _compilations(url) == before


def test_speculative_decoding_of_a_recurrent_model_is_refused_by_name(model):
    speculation = generation.Speculation(method="ngram", num_speculative_tokens=3)
    with pytest.raises(hfjax.ServingError, match=r"Mamba2ForCausalLM, whose recurrent state cannot take back"):
        Engine(model, max_num_seqs=SLOTS, max_model_len=LENGTH, speculation=speculation)


def test_a_prompt_is_scanned_whole_in_one_prefill_call(model, monkeypatch):
    # A state is scanned from zeros over the chunk it is given, so a recurrent model's prompt is never
    # split: the 200-token prompt runs in the one program whose window (256) holds all of it, and the
    # answer is Model.generate's.
    engine = Engine(model, max_num_seqs=SLOTS, max_model_len=LENGTH)
    calls, prefill = [], engine.compiler.programs.prefill

    def prefilling(*args, window, inputs=None):
        calls.append((window, args[5].tolist()))  # (window, each row's count of prompt tokens)
        return prefill(*args, window=window, inputs=inputs)

    engine.start()  # (each program runs once there, on rows that hold no request)
    monkeypatch.setattr(engine.compiler.programs, "prefill", prefilling)
    try:
        got = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    finally:
        engine.stop()
    assert [(window, counts[0]) for window, counts in calls] == [(256, len(PROMPTS[2]))]
    want = np.asarray(model.generate(np.asarray([PROMPTS[2]]), max_new_tokens=NEW_TOKENS, do_sample=False))
    assert got[0].token_ids == want[0, len(PROMPTS[2]) :].tolist()
