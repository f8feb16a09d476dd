"""`hfjax serve` compiles every program it runs before /health answers: a mixed load after it (prompt
lengths up to max_model_len, 1 to more than the slots' concurrent clients, n, logprobs, stop strings,
structured outputs, streams, chat and completions) compiles nothing, counted by the server's own
/metrics; with speculative decoding (prompt lookup) too."""

from __future__ import annotations

import concurrent.futures
import re

import numpy as np
import pytest

import background
from hfjax import testing

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install openai")
httpx = pytest.importorskip("httpx", reason="httpx is a test dependency: pip install httpx")
prometheus_parser = pytest.importorskip(
    "prometheus_client.parser", reason="the serve extra is not installed: pip install 'hfjax[serve]'"
)

NAME, SLOTS, LENGTH = "tiny-llama", 6, 256  # windows of 128 and 256 columns; decode rows 1 and 6
SERVERS = background.Servers("hfjax-serve-programs-test-")


def start_in_background() -> None:
    if SERVERS.started:
        return
    llama = testing.save_tiny_checkpoint("llama", SERVERS.directory / "llama")
    flags = ("--served-model-name", NAME, "--max-model-len", str(LENGTH), "--max-num-seqs", str(SLOTS))
    SERVERS.launch("main", llama, *flags)
    speculative = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}'
    SERVERS.launch("speculative", llama, *flags, "--speculative-config", speculative)


@pytest.fixture(scope="module")
def urls():
    start_in_background()
    yield SERVERS.wait()
    SERVERS.stop()


@pytest.fixture
def url(urls):
    return urls["main"]


def _metric(url: str, name: str) -> float:
    families = prometheus_parser.text_string_to_metric_families(httpx.get(url + "/metrics").text)
    return next(s.value for family in families for s in family.samples if s.name == name)


def _ids(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 400, length).tolist()


def _requests(client) -> list:
    """Calls of every kind, each returning (finish reasons, completion tokens)."""
    calls = []
    for i, length in enumerate((3, 20, 60, 127, 129, 200, LENGTH - 20)):
        budget = min(16, LENGTH - length)
        completion = dict(model=NAME, prompt=_ids(length, i), max_tokens=budget, temperature=(0, 0.8)[i % 2])
        if i % 3 == 0:
            completion.update(logprobs=3)
        if i % 3 == 1:
            completion.update(n=3, seed=i)
        if i % 2:
            completion.update(stop=["w", "e"])

        def complete(completion=completion, stream=i % 2 == 1):
            if not stream:
                answer = client.completions.create(**completion)
                return [c.finish_reason for c in answer.choices], answer.usage.completion_tokens
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **completion))
            reasons = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
            return reasons, chunks[-1].usage.completion_tokens

        calls.append(complete)
    for i in range(4):
        words = " ".join(["Tell me about the river and the mill"] * (1 + 4 * i))
        chat = dict(model=NAME, messages=[{"role": "user", "content": words}], max_tokens=12, temperature=0)
        if i % 2:
            chat.update(logprobs=True, top_logprobs=5, n=2, stop=["the"])
        if i == 1:  # structured outputs: each token's mask comes from the host, into the same programs
            chat.update(extra_body={"structured_outputs": {"choice": ["river", "mill", "sea"]}})
        if i == 2:
            chat.update(response_format={"type": "json_object"})

        def talk(chat=chat, stream=i >= 2):
            if not stream:
                answer = client.chat.completions.create(**chat)
                return [c.finish_reason for c in answer.choices], answer.usage.completion_tokens
            chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **chat))
            reasons = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
            return reasons, chunks[-1].usage.completion_tokens

        calls.append(talk)
    return calls


@pytest.mark.parametrize("server", ["main", "speculative"])
def test_a_mixed_load_after_health_compiles_nothing(urls, server):
    url = urls[server]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    before = _metric(url, "hfjax_compilations_total")
    assert before >= _metric(url, "hfjax_programs_held")  # the count holds the programs' own compiles
    calls = _requests(client)
    results = [call() for call in calls]  # one client
    for clients in (2, SLOTS, 2 * SLOTS):  # up to the slots, and more (a queue)
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            results += list(pool.map(lambda call: call(), calls * (1 + clients // len(calls))))
    assert all(reasons and set(reasons) <= {"stop", "length"} and tokens > 0 for reasons, tokens in results)
    assert _metric(url, "hfjax_compilations_total") == before


def test_metrics_report_the_programs_held_and_their_memory(url):
    # 4 prefill programs (one row and 4 rows over 128 and 256 columns) and 2 short ones (the whole
    # rest of short prompts, 32 tokens a row of one and 4 rows over 128 columns: --prefill-chunk is 64),
    # decode programs of 1 and 6 rows over each window (where the decode reads its rows of the cache in
    # place, the one window of all 256 columns, as the kernel stops at each row's position; else 128
    # and 256), the swap of two slots' cached prefixes, and the token choice after a prefill of one row
    # and of 4.
    log = SERVERS.log("main")
    decode = re.findall(r"(?:compiled|loaded) the decode program for (\d+) rows x (\d+) columns", log)
    windows = {int(columns) for _, columns in decode}
    assert {int(rows) for rows, _ in decode} == {1, SLOTS} and windows in ({LENGTH}, {128, LENGTH})
    assert re.search(rf"(?:compiled|loaded) the swap program for 2 rows x {LENGTH} columns", log)
    choose = re.findall(r"(?:compiled|loaded) the choose program for (\d+) rows \(", log)
    assert sorted(int(rows) for rows in choose) == [1, 4]
    short = re.findall(r"(?:compiled|loaded) the short prefill program for (\d+) rows x (\d+) columns", log)
    assert sorted((int(rows), int(columns)) for rows, columns in short) == [(1, 128), (4, 128)]
    assert _metric(url, "hfjax_programs_held") == 4 + 2 + len(decode) + 1 + 2 == 6 + 2 * len(windows) + 1 + 2
    assert _metric(url, "hfjax_programs_memory_bytes") > 0
