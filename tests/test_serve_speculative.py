"""Speculative decoding in `hfjax serve` (`--speculative-config`, vLLM's JSON), through the official
openai client: a prompt-lookup server and a draft-model server answer greedy requests with the plain
server's tokens, text and log-probabilities (and `Model.generate`'s tokens), sample from the plain
server's distribution (a chi-square test with a negative control), report vLLM's spec-decode counters
at /metrics, and a bad --speculative-config is one line before the model loads.

Three servers of one tiny Llama whose logits are scaled up 12x (the tiny checkpoint's are nearly flat,
so that temperature barely changes its distribution and a wrong one would pass): "plain", "ngram"
(prompt lookup, k=3) and "draft" (the same Llama with its logits scaled up 100x, drafting k=3: its
greedy proposals are the target's, and its sampled ones, drawn from a sharper distribution, are both
accepted and rejected; an unrelated draft's are all rejected, and a row whose drafts are all rejected
stops drafting for a few rounds).
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import re
import shutil
import time

import numpy as np
import pytest
import torch
import transformers

import background
import hfjax
from distributions import same_distribution_p
from hfjax import cli, testing
from hfjax.cli import serve

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install openai")
httpx = pytest.importorskip("httpx", reason="httpx is a test dependency: pip install httpx")
prometheus_parser = pytest.importorskip(
    "prometheus_client.parser", reason="the serve extra is not installed: pip install 'hfjax[serve]'"
)

NAME, LENGTH, SLOTS, K = "tiny-llama", 128, 8, 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# Prompts that repeat themselves, of three lengths: their answers repeat too, so the lookup finds drafts.
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [11, 12, 13, 11, 12, 13, 11, 12, 13, 11, 12, 13, 11, 12, 13, 11, 12, 13, 11, 12],
    [40, 41, 42, 43, 44, 40, 41, 42],
    [90, 91, 90, 91, 90],
]
NEW_TOKENS = 24
# Sampling: many seeded requests of one prompt, each 4 new tokens (the first comes from the prefill,
# the other three from the decode's rounds).
SAMPLES, SAMPLED = 256, dict(max_tokens=4, temperature=1.5, extra_body={"top_k": 6, "ignore_eos": True})
P_VALUE = 1e-3  # a fixed-seed chi-square test: a correct sampler passes at this level, a wrong one fails
STATS_LINE = re.compile(
    r"Prefix cache hit rate: [\d.]+%, Draft acceptance rate: [\d.]+%, Mean acceptance length: [\d.]+$", re.M
)
SERVERS = background.Servers("hfjax-serve-speculative-test-")


def _peaked_llama(path, out, factor: float = 12.0):
    """The checkpoint at `path` with its logits scaled up `factor` times, written to `out` with its tokenizer."""
    shutil.copytree(path, out)
    module = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        module.lm_head.weight.mul_(factor)
    module.save_pretrained(out)
    return out


README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def start_in_background() -> None:
    """Writes the checkpoints and starts the three servers (once); queues the README's example."""
    background.start(
        "speculative-readme", background.python(background.README_SERVE_JOB), seconds=60,
        env={"HFJAX_README": str(README), "HFJAX_README_BLOCK": "--speculative-config"},
    )  # fmt: skip
    if SERVERS.started:
        return
    directory = SERVERS.directory
    original = testing.save_tiny_checkpoint("llama", directory / "llama")
    llama = _peaked_llama(original, directory / "peaked")
    draft = _peaked_llama(original, directory / "draft", factor=100.0)
    flags = ("--served-model-name", NAME, "--max-model-len", str(LENGTH), "--max-num-seqs", str(SLOTS))
    SERVERS.launch("plain", llama, *flags)
    # (every decode chunk 4 steps, whatever the load: a request's drafts are the same from one call to the next)
    SERVERS.launch("ngram", llama, *flags, "--max-decode-steps", "4", "--speculative-config", json.dumps(NGRAM))
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    SERVERS.launch("draft", llama, *flags, "--speculative-config", json.dumps(config))


@pytest.fixture(scope="module")
def urls():
    start_in_background()
    yield SERVERS.wait()
    SERVERS.stop()


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    families = prometheus_parser.text_string_to_metric_families(httpx.get(url + "/metrics").text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in families for s in family.samples}


def _greedy_batch(url: str) -> list:
    """The prompts at once (one batch of mixed lengths), greedy, with log-probabilities; the last two
    with a stop string and a smaller max_tokens."""
    client = _client(url)

    def one(i: int):
        fields = dict(logprobs=2)
        if i == 2:
            fields["stop"] = [STOP]
        if i == 3:
            fields["max_tokens"] = 7
        fields.setdefault("max_tokens", NEW_TOKENS)
        return client.completions.create(
            model=NAME, prompt=PROMPTS[i], temperature=0, extra_body={"ignore_eos": True}, **fields
        ).choices[0]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


STOP = "\x00"  # replaced by a piece of the plain answer's text (below)


@pytest.fixture(scope="module")
def plain_answers(urls):
    global STOP
    answer = _client(urls["plain"]).completions.create(
        model=NAME, prompt=PROMPTS[2], max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    text = answer.choices[0].text
    STOP = text[len(text) // 2 : len(text) // 2 + 3]  # a stop string inside the answer: it ends early
    return _greedy_batch(urls["plain"])


@pytest.mark.parametrize("server", ["ngram", "draft"])
def test_greedy_answers_are_the_plain_servers_and_model_generates(urls, plain_answers, server):
    before = _metrics(urls[server])
    answers = _greedy_batch(urls[server])
    for plain, answer in zip(plain_answers, answers):
        assert answer.text == plain.text and answer.finish_reason == plain.finish_reason
        assert answer.logprobs.tokens == plain.logprobs.tokens
        np.testing.assert_allclose(answer.logprobs.token_logprobs, plain.logprobs.token_logprobs, atol=1e-4)
        assert [sorted(t) for t in answer.logprobs.top_logprobs] == [sorted(t) for t in plain.logprobs.top_logprobs]
    assert plain_answers[2].finish_reason == "stop" and plain_answers[3].finish_reason == "length"
    after = _metrics(urls[server])

    def grown(name: str) -> float:
        return after[(f"hfjax_spec_decode_{name}_total", ())] - before[(f"hfjax_spec_decode_{name}_total", ())]

    drafts, drafted, accepted = grown("num_drafts"), grown("num_draft_tokens"), grown("num_accepted_tokens")
    assert 0 < drafts <= drafted <= K * drafts and accepted <= drafted, (drafts, drafted, accepted)
    per_position = [
        after[("hfjax_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))] for i in range(K)
    ]
    assert per_position == sorted(per_position, reverse=True)  # a draft's later tokens are kept only after the first
    if server == "ngram":  # the repeating answers' drafts are often right
        assert accepted > 0


def test_greedy_answers_are_model_generates(plain_answers):
    model = hfjax.load(SERVERS["plain"]["checkpoint"])
    tokenizer = model.tokenizer
    for prompt, plain in zip(PROMPTS[:2], plain_answers):
        new = np.asarray(model.generate(np.asarray([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False))
        assert plain.text == tokenizer.decode(new[0, len(prompt) :].tolist(), skip_special_tokens=True)


def test_a_prompt_that_reuses_a_cached_prefix_drafts_from_it(urls):
    # Prompt lookup searches the whole prompt, the prefix a slot held too: sent again (its first 99 tokens
    # reused), a request drafts what it drafted when its prompt was read whole. The 100 tokens of 512
    # hold most tokens of the answer, so the lookup finds drafts.
    url, client = urls["ngram"], _client(urls["ngram"])
    prompt = np.random.default_rng(7).integers(3, 500, 100).tolist()

    def sent():
        names = ("hfjax_spec_decode_num_draft_tokens_total", "hfjax_prefix_cache_hit_tokens_total")
        before = _metrics(url)
        answer = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        after = _metrics(url)
        return answer.choices[0].text, *(after[(name, ())] - before[(name, ())] for name in names)

    (text, drafted, reused), (again, drafted_again, reused_again) = sent(), sent()
    assert (reused, reused_again) == (0, len(prompt) - 1)
    assert again == text and drafted_again == drafted > 0


def test_a_prompt_moved_out_of_the_next_requests_way_keeps_its_draft_models_keys(urls):
    # One request at a time runs in slot 0; the next one moves the last one's keys to a free slot past
    # the decode chunk, the target's and the draft model's alike, and they come back with the prompt:
    # reused, it drafts and has accepted what it did read whole (a draft over another prompt's keys
    # would propose other tokens), and answers the plain server's tokens.
    url, client = urls["draft"], _client(urls["draft"])
    first, other = (np.random.default_rng(seed).integers(3, 500, 40).tolist() for seed in (11, 12))
    names = ("hfjax_prefix_cache_hit_tokens_total", "hfjax_spec_decode_num_draft_tokens_total",
             "hfjax_spec_decode_num_accepted_tokens_total")  # fmt: skip

    def sent(prompt):
        before = _metrics(url)
        answer = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        after = _metrics(url)
        return answer.choices[0].text, *(after[(name, ())] - before[(name, ())] for name in names)

    text, reused, drafted, accepted = sent(first)
    sent(other)
    again, reused_again, drafted_again, accepted_again = sent(first)
    plain = _client(urls["plain"]).completions.create(
        model=NAME, prompt=first, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert (reused, reused_again) == (0, len(first) - 1)
    assert again == text == plain.choices[0].text
    assert (drafted_again, accepted_again) == (drafted, accepted) and accepted > 0


def test_a_constrained_request_gets_the_plain_servers_answer(urls):
    # A constrained row decodes one token a chunk (its next mask needs this one), so it drafts nothing.
    choices = ["river", "mill", "sea", "river mill"]

    def ask(server: str):
        return [
            _client(urls[server]).chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": words}], max_tokens=8, temperature=0,
                extra_body={"structured_outputs": {"choice": choices}},
            ).choices[0].message.content
            for words in ("the river and the mill", "a mill a mill a mill")
        ]  # fmt: skip

    answers = ask("plain")
    assert set(answers) <= set(choices) and ask("ngram") == answers


def _first_tokens(url: str, seeds, **fields) -> np.ndarray:
    """[N, 4] the new tokens of one seeded request per seed (their ids, from the log-probabilities' tokens)."""
    client = _client(url)
    prompt = PROMPTS[1]

    def one(seed: int):
        answer = client.completions.create(
            model=NAME, prompt=prompt, seed=seed, logprobs=0, **{**SAMPLED, **fields}
        ).choices[0]
        return answer.logprobs.tokens

    with concurrent.futures.ThreadPoolExecutor(2 * SLOTS) as pool:
        tokens = list(pool.map(one, seeds))
    return np.asarray(tokens)


def test_prompt_lookup_samples_the_plain_servers_tokens_seed_for_seed(urls):
    seeds = range(16)
    np.testing.assert_array_equal(_first_tokens(urls["ngram"], seeds), _first_tokens(urls["plain"], seeds))


def test_a_draft_models_samples_follow_the_plain_servers_distribution(urls):
    before = _metrics(urls["draft"])
    speculative = _first_tokens(urls["draft"], range(SAMPLES))
    after = _metrics(urls["draft"])
    drafted, accepted = (
        after[(name, ())] - before[(name, ())]
        for name in ("hfjax_spec_decode_num_draft_tokens_total", "hfjax_spec_decode_num_accepted_tokens_total")
    )
    assert 0 < accepted < drafted, "drafts were not both accepted and rejected"
    plain = _first_tokens(urls["plain"], range(SAMPLES, 2 * SAMPLES))  # other draws of the plain decode
    for step in (1, 2, 3):  # the tokens the decode's rounds make (the first comes from the prefill)
        assert same_distribution_p(speculative[:, step], plain[:, step]) > P_VALUE, f"new token {step}"
    # The negative control: the same test tells a distribution that is not the one asked for, at every step
    # (at temperature 0.5 against the requests' 1.5, the third token's p-value was 0.02 in one draw).
    colder = _first_tokens(urls["plain"], range(SAMPLES, 2 * SAMPLES), temperature=0.25)
    assert max(same_distribution_p(speculative[:, s], colder[:, s]) for s in (1, 2, 3)) < P_VALUE


def test_the_stats_line_gives_the_draft_acceptance_rate(urls, plain_answers):
    # Every 10 s after traffic (the greedy test's, or this one's), vLLM's line with its spec-decode part.
    _greedy_batch(urls["ngram"])
    deadline = time.monotonic() + 15
    while not STATS_LINE.search(SERVERS.log("ngram")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert STATS_LINE.search(SERVERS.log("ngram")), SERVERS.log("ngram")[-2000:]
    assert "acceptance" not in SERVERS.log("plain")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{ngram}", "--speculative-config is not JSON"),
        ("[1]", "--speculative-config is not a JSON object"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "n": 1}', "--speculative-config key 'n' is not one"),
        ('{"method": "eagle3", "num_speculative_tokens": 3}', "method 'eagle3' is not carried out by hfjax"),
        ('{"method": "mtp", "num_speculative_tokens": 1}', "method 'mtp' is not carried out by hfjax"),
        ('{"method": "lookahead", "num_speculative_tokens": 3}', "method='lookahead'; pass \"ngram\""),
        ('{"num_speculative_tokens": 3}', 'method=None; pass "ngram"'),
        ('{"method": "ngram"}', 'needs "num_speculative_tokens"'),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0; pass a whole number >= 1"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": "4"}', "prompt_lookup_max='4'"),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 3}',
            "prompt_lookup_min=3 is above prompt_lookup_max=2",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 3, "model": "d"}', 'takes no "model"'),
        ('{"method": "draft_model", "num_speculative_tokens": 3}', 'needs "model"'),
        ('{"model": "d", "num_speculative_tokens": 3, "prompt_lookup_max": 2}', "prompt_lookup_max is for method"),
    ],
)
def test_a_bad_speculative_config_is_one_line_and_exit_code_2(config, message, capsys):
    code = cli.main(["serve", "missing-model", "--speculative-config", config])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("hfjax serve: ") and message in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_vllms_ngram_defaults():
    read = serve.speculative_config
    assert read('{"method": "ngram", "num_speculative_tokens": 3}')[2:4] == (5, 5)
    assert read('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')[2:4] == (4, 4)
    assert read('{"method": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_min": 2}')[2:4] == (2, 2)
    assert read('{"model": "d", "num_speculative_tokens": 2}') == ("draft_model", 2, 5, 5, "d")


def test_a_draft_model_of_another_vocabulary_is_refused_by_name(checkpoint):
    model = hfjax.load(checkpoint("llama"))
    other = checkpoint("llama", vocab_size=640)
    config = serve.speculative_config(json.dumps({"model": str(other), "num_speculative_tokens": 2}))
    draft, problem = serve.load_draft(model, config)
    assert draft is None and problem.startswith(f"--speculative-config model {str(other)!r}"), problem
    assert "tokenizer" in problem or "vocabulary" in problem, problem


def test_the_readmes_speculative_serve_example_runs():
    job = background.finished("speculative-readme", start_in_background)
    assert job.returncode == 0, job.output[-3000:]
    ran = [json.loads(line) for line in job.output.splitlines() if line.startswith('{"command"')]
    assert all(step["returncode"] == 0 for step in ran if step["command"] != "server"), ran  # (the server: stopped)
    health, completion, metrics, draft_health, draft_completion = [s["stdout"] for s in ran if s["command"] == "curl"]
    assert json.loads(health) == {"status": "ok"} and json.loads(draft_health) == {"status": "ok"}
    assert json.loads(completion)["usage"]["completion_tokens"] == 16, completion
    # The draft model's server: the same greedy tokens as the prompt lookup's (both the plain decode's).
    assert json.loads(draft_completion)["choices"][0]["text"] == json.loads(completion)["choices"][0]["text"]
    accepted = re.search(r"^hfjax_spec_decode_num_accepted_tokens_total ([\d.]+)$", metrics, re.M)
    assert accepted and float(accepted.group(1)) > 0, metrics
    from test_readme import WARNING

    for log in (step["log"] for step in ran if step["command"] == "server"):
        assert not WARNING.search(log), log
