"""The continuous-batching engine (hfjax.serving.Engine) in this process, against `Model.generate` and
transformers' own processors."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import threading
import time
import types

import jax
import numpy as np
import pytest
import torch
import transformers
from packaging.version import Version

import hfjax
from hfjax import _compilation_cache, bridge, generation
from hfjax.serving import Engine, QueueFullError, SamplingParams, _queue, _text
from hfjax.serving import _compiler as serving_compiler
from hfjax.testing import _tokenizer

# Mixed lengths: some fit one prefill chunk (16 tokens here), some take two or three.
WORDS = (
    "The river ran quietly past the old mill and the children watched the water carry leaves toward the sea "
    "while the baker opened her shop before the sun was up"
).split()
PROMPTS = [" ".join(WORDS[: 1 + (7 * i) % len(WORDS)]) for i in range(16)]
SLOTS, LENGTH, CHUNK, STEPS = 4, 256, 16, 4  # windows of 128 and 256 columns


@pytest.fixture(scope="module")
def model(checkpoint):
    return hfjax.load(checkpoint("llama"))


# What jax compiled during the engine's first request (the `engine` fixture records it).
FIRST_REQUEST_COMPILES: list[str] = []


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    # Programs kept on disk, as `hfjax serve` keeps them (the suite keeps none): the stored path is
    # where the first request compiled again.
    store = tmp_path_factory.mktemp("programs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_compilation_cache, "directory", lambda: store)
        engine = Engine(model, max_num_seqs=SLOTS, max_model_len=LENGTH, prefill_chunk=CHUNK, decode_steps=STEPS)
        engine.warm_up()
    engine.start()
    recording = [True]

    def record(event: str, seconds: float, **kwargs):
        if recording[0] and event.startswith("/jax/core/compile/"):
            FIRST_REQUEST_COMPILES.append(event)

    jax.monitoring.register_event_duration_secs_listener(record)
    engine.generate(_ids(model, PROMPTS[:1]), SamplingParams(max_tokens=STEPS + 2, temperature=0))
    recording[0] = False
    yield engine
    engine.stop()


class _Calls:
    """Records what the engine asks its programs to run (the public `compiler.programs`), in order,
    with the requests' events in between."""

    def __init__(self, engine, monkeypatch):
        self.log = []
        self.logprobs = []  # each decode chunk's: whether it asks its program for log-probabilities
        programs = engine.compiler.programs
        decode, prefill = programs.decode, programs.prefill

        def decoding(state, rows, active, count, want, *, decoding_rows, window, logprobs=True):
            self.log.append(("decode", int(count), decoding_rows, window))
            self.logprobs.append(bool(want))
            return decode(
                state, rows, active, count, want, decoding_rows=decoding_rows, window=window, logprobs=logprobs
            )

        def prefilling(*args, window, inputs=None):
            self.log.append(("prefill", args[2].shape[0], window))
            return prefill(*args, window=window, inputs=inputs)

        monkeypatch.setattr(programs, "decode", decoding)
        monkeypatch.setattr(programs, "prefill", prefilling)

    def listener(self, event):
        self.log.append(("event", len(event.token_ids), event.finish_reason))


def test_the_first_request_after_warm_up_compiles_nothing(engine):
    assert engine.compiler.held == len(engine.compiler) > 0
    assert FIRST_REQUEST_COMPILES == []


def _ids(model, prompts):
    return [model.tokenizer(p)["input_ids"] for p in prompts]


def _generate_alone(model, ids: list[list[int]], max_new_tokens: int, **settings) -> list[list[int]]:
    """Model.generate's tokens of each prompt, cut before its first EOS (one left-padded batch: each
    row gets what its prompt alone would)."""
    width = max(len(i) for i in ids)
    padded = np.array([[0] * (width - len(i)) + i for i in ids], np.int32)
    mask = np.array([[0] * (width - len(i)) + [1] * len(i) for i in ids], np.int32)
    settings = {"do_sample": False, **settings}
    out = np.asarray(model.generate(padded, mask, max_new_tokens=max_new_tokens, **settings))[:, width:]
    rows = []
    for row in out.tolist():
        rows.append(row[: row.index(_tokenizer.EOS_ID)] if _tokenizer.EOS_ID in row else row)
    return rows


def test_greedy_answers_equal_generate_with_16_requests_in_4_slots(model, engine):
    ids = _ids(model, PROMPTS)
    budgets = [6 + (5 * i) % 19 for i in range(len(ids))]  # requests leave at different chunks
    got = engine.generate(ids, [SamplingParams(max_tokens=b, temperature=0) for b in budgets])
    want = _generate_alone(model, ids, max(budgets))
    assert len({len(i) for i in ids}) > 8 and max(len(i) for i in ids) > 2 * CHUNK
    # Chunks attend over windows of 128 of the 256 columns, and over all of them; a decode that reads
    # its rows of the cache in place has the one window, all of them (its attention stops at each row's
    # position).
    assert engine.compiler.grid["decode"][-1] == (SLOTS, LENGTH)
    assert {w for _, w in engine.compiler.grid["decode"]} == _decode_windows(engine)
    assert sorted({w for _, w in engine.compiler.grid["prefill"]}) == [128, 256]
    for prompt, budget, event, reference in zip(PROMPTS, budgets, got, want):
        assert event.token_ids == reference[:budget], prompt
        assert event.finish_reason == ("length" if len(reference) >= budget else "stop"), prompt
        assert event.text == model.tokenizer.decode(reference[:budget], skip_special_tokens=True)
        assert event.prompt_tokens == len(model.tokenizer(prompt)["input_ids"])
    assert engine.running == 0 and engine.waiting == 0


def test_a_long_prompt_is_read_in_wider_chunks_at_a_wider_window_and_equals_generate(model, engine, monkeypatch):
    # A prefill call reads its rows' whole window, so at a wider window each call takes more tokens a
    # row (`prefill_width`): 16 over 128 columns, 32 over 256. A prompt past 128 tokens reads its
    # first 128 in chunks of 16, the rest in chunks of 32, beside a short one; both equal generate,
    # and the programs of those widths were compiled at the start.
    calls, prefill = [], engine.compiler.programs.prefill
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kwargs: compiled.append(event) if event.startswith("/jax/core/compile/") else None
    )

    def prefilling(*args, window, inputs=None):
        calls.append((window, args[3].shape[1]))
        return prefill(*args, window=window, inputs=inputs)

    monkeypatch.setattr(engine.compiler.programs, "prefill", prefilling)
    ids = _ids(model, [" ".join(WORDS * 3), PROMPTS[5]])
    assert 128 + 2 * CHUNK < len(ids[0]) < LENGTH - 8
    got = engine.generate(ids, SamplingParams(max_tokens=8, temperature=0))
    assert compiled == []
    want = _generate_alone(model, ids, 8)
    for event, reference in zip(got, want):
        assert event.token_ids == reference[:8]
    assert {(128, CHUNK), (256, 2 * CHUNK)} == set(calls)
    assert calls.count((256, 2 * CHUNK)) == -(-(len(ids[0]) - 128) // (2 * CHUNK))


def test_a_lone_long_prompt_is_read_on_one_row_at_every_window(model, engine, monkeypatch):
    # The set has one-row prefill programs over every window, tried first: a prompt that nothing else
    # is reading runs no padding rows beside it (`engine_grid`), and its answer is generate's.
    calls, prefill = [], engine.compiler.programs.prefill

    def prefilling(*args, window, inputs=None):
        calls.append((args[3].shape[0], window))
        return prefill(*args, window=window, inputs=inputs)

    monkeypatch.setattr(engine.compiler.programs, "prefill", prefilling)
    ids = _ids(model, [" ".join(WORDS[::-1] * 3)])  # (a prompt no other test reads: no prefix held)
    assert 128 < len(ids[0]) < LENGTH - 8
    got = engine.generate(ids, SamplingParams(max_tokens=6, temperature=0))[0]
    assert got.token_ids == _generate_alone(model, ids, 6)[0][:6]
    assert {window for _, window in calls} == {128, 256} and {rows for rows, _ in calls} == {1}


def test_the_whole_rest_of_short_prompts_is_read_in_a_short_chunk_and_equals_generate(model):
    # With --prefill-chunk wider than SHORT_WIDTH the set holds "short" prefill programs too, of
    # SHORT_WIDTH tokens a row over the smallest window: a chunk runs there where it is the whole
    # rest of each of its rows' prompts (a fresh short prompt; what follows a cached prefix), and in
    # the chunk's width otherwise. Each call's width is recorded; every answer is generate's.
    short = serving_compiler.SHORT_WIDTH
    engine = Engine(model, max_num_seqs=2, max_model_len=128, prefill_chunk=2 * short, decode_steps=STEPS)
    assert engine.compiler.grid["short"] == [(1, 128), (2, 128)]
    engine.start()
    widths, prefill = [], engine.compiler.programs.prefill

    def prefilling(*args, window, inputs=None):
        widths.append((args[3].shape[0], args[3].shape[1]))
        return prefill(*args, window=window, inputs=inputs)

    engine.compiler.programs.prefill = prefilling
    try:
        # (prompts that share no prefix beyond BOS, but `longer`, which is `other` and 6 words)
        phrases = [WORDS[:8], WORDS[::-1][:20], WORDS[10:18], WORDS[5:25], WORDS[5:25] + WORDS[::-1][:6]]
        few, more, few_too, other, longer = _ids(model, [" ".join(words) for words in phrases])
        assert max(len(few), len(few_too), len(longer) - len(other)) <= short
        assert short < min(len(more), len(other)) <= 2 * short
        params = SamplingParams(max_tokens=6, temperature=0)
        calls = []
        for prompts in ([few], [more], [few_too, other], [longer]):
            widths.clear()
            got = engine.generate(prompts, params)
            calls.append(list(widths))
            for event, reference in zip(got, _generate_alone(model, prompts, 6)):
                assert event.token_ids == reference[:6]
        assert calls == [[(1, short)], [(1, 2 * short)], [(2, 2 * short)], [(1, short)]]
        assert engine.metrics.prefix_hit_tokens > len(longer) - short
    finally:
        engine.stop()


def test_a_lone_stream_runs_long_chunks_sent_ahead_and_no_step_past_max_tokens(model, engine, monkeypatch):
    calls = _Calls(engine, monkeypatch)
    ids = _ids(model, PROMPTS[3:4])
    # A chunk of 1 of the 4 slots runs decode_steps x 4 steps (16, under max_decode_steps' 32), but the first one
    # after a slot freed (its client may be about to send another request): decode_steps.
    budget = 1 + 16 + 16 + 3
    done = threading.Event()

    def listener(event):
        calls.listener(event)
        if event.finish_reason:
            done.set()

    engine.submit(ids[0], SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True), listener)
    assert done.wait(120)
    padded = np.array(ids, np.int32)
    want = np.asarray(model.generate(padded, max_new_tokens=budget, do_sample=False, eos_token_id=[]))[0, len(ids[0]) :]
    assert sum(n for kind, n, *_ in calls.log if kind == "event") == budget
    decodes = [entry for entry in calls.log if entry[0] == "decode"]
    counts = [count for _, count, _, _ in decodes]
    assert sum(counts) == budget - 1 and counts[0] in (STEPS, 4 * STEPS), calls.log  # none past max_tokens
    assert counts[1:-1] and all(count == 4 * STEPS for count in counts[1:-1]), calls.log
    assert all(rows == 1 for _, _, rows, _ in decodes)  # one row, not the 4 slots
    # The last chunk went to the device before the one before it was delivered: sent ahead.
    order = [entry[:2] for entry in calls.log if entry[0] in ("decode", "event")]
    last = len(order) - 1 - order[::-1].index(("decode", counts[-1]))
    assert ("event", counts[-2]) in order[last:], calls.log
    assert engine.generate(ids, SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True))[0].token_ids == (
        want.tolist()
    )


def test_a_chunk_runs_decode_steps_while_a_request_waits_or_reads_its_prompt(model, engine, monkeypatch):
    calls = _Calls(engine, monkeypatch)
    long_prompt = np.random.default_rng(3).integers(5, 400, 3 * CHUNK).tolist()
    # One chunk whatever the prefix cache holds (PROMPTS[2], 35 tokens, read in three chunks where
    # no earlier test had left it cached: no decode ran before the long prompt's last chunk).
    short = _ids(model, PROMPTS[:1])[0]
    # Two requests at once: while the long one reads its prompt over three prefill chunks, the short
    # one's decode chunks keep to decode_steps.
    engine.generate([short, long_prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    log = calls.log
    last_prefill = max(i for i, entry in enumerate(log) if entry[0] == "prefill")
    during = [entry[1] for entry in log[:last_prefill] if entry[0] == "decode"]
    assert during and all(count <= STEPS for count in during), log


def test_decode_chunks_compute_log_probabilities_only_while_a_request_asks(model, engine, monkeypatch):
    calls = _Calls(engine, monkeypatch)
    ids = _ids(model, PROMPTS[:2])
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = engine.generate(ids[:1], greedy)[0]
    assert calls.logprobs and not any(calls.logprobs), calls.log
    calls.logprobs.clear()
    both = engine.generate(ids, [greedy, dataclasses.replace(greedy, logprobs=3)])
    assert any(calls.logprobs), calls.log
    assert both[0].token_ids == alone.token_ids and both[0].logprobs is None
    reference = model.generate(np.array(ids[1:], np.int32), max_new_tokens=12, do_sample=False, eos_token_id=[])
    assert both[1].token_ids == np.asarray(reference)[0, len(ids[1]) :].tolist()
    assert len(both[1].logprobs) == 12 and all(len(lp.top) == 3 for lp in both[1].logprobs)
    assert all(lp.top[0][0] == token for lp, token in zip(both[1].logprobs, both[1].token_ids))  # greedy: the top one


def test_max_decode_steps_below_decode_steps_is_refused_by_name(model):
    with pytest.raises(hfjax.ServingError, match=r"max_decode_steps=2; pass a whole number >= decode_steps=4"):
        Engine(model, max_num_seqs=SLOTS, max_model_len=LENGTH, decode_steps=4, max_decode_steps=2)


def test_chunks_that_outgrow_a_window_attend_over_the_next(model, engine, monkeypatch):
    # Prompts of 120-123 tokens: their decode chunks write columns 120-132, across the 128-column
    # window, so the later ones run over 256; the 140-token prompt's last prefill chunk (columns
    # 128-139) too (the decode's one window where it reads in place). Greedy answers equal Model.generate's.
    calls = _Calls(engine, monkeypatch)
    for lengths in ((120, 121, 122, 123), (140,)):
        ids = [np.random.default_rng(n).integers(5, 400, n).tolist() for n in lengths]
        got = engine.generate(ids, [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)] * len(ids))
        for prompt, event in zip(ids, got):
            alone = model.generate(np.array([prompt], np.int32), max_new_tokens=10, min_new_tokens=10, do_sample=False)
            assert event.token_ids == np.asarray(alone)[0, len(prompt) :].tolist()
    assert {window for kind, *_, window in calls.log if kind == "decode"} == _decode_windows(engine)
    assert {window for kind, *_, window in calls.log if kind == "prefill"} == {128, 256}


def test_a_chunk_runs_past_max_model_len_for_a_row_that_ends_there_beside_one_that_goes_on(model, engine, monkeypatch):
    # A 250-token prompt with 6 tokens to go ends at column 256 (max_model_len) while a short prompt
    # decodes on: their shared chunks write past the last column for the long row (its finished
    # steps, dropped), and run over the widest window. Both answers equal Model.generate's.
    calls = _Calls(engine, monkeypatch)
    ids = [np.random.default_rng(n).integers(5, 400, n).tolist() for n in (LENGTH - 6, 5)]
    budgets = (6, 150)
    got = engine.generate(ids, [SamplingParams(max_tokens=b, temperature=0, ignore_eos=True) for b in budgets])
    for prompt, budget, event in zip(ids, budgets, got):
        alone = model.generate(
            np.array([prompt], np.int32), max_new_tokens=budget, min_new_tokens=budget, do_sample=False
        )
        assert (event.token_ids, event.finish_reason) == (np.asarray(alone)[0, len(prompt) :].tolist(), "length")
    assert ("decode", STEPS, SLOTS, LENGTH) in calls.log  # a chunk of both rows at the end of the long one


def test_threads_compiling_the_programs_trace_them_one_at_a_time(model, monkeypatch):
    # The engine compiles its programs on a thread per core (up to 4); XLA's compiles overlap, their
    # traces do not: a trace runs the torch model, and a slot model holds a call's state while it runs
    # (an encoder-decoder's rows' cross keys). Each trace is held long enough for another to come in.
    monkeypatch.setattr(serving_compiler.os, "cpu_count", lambda: 4)
    engine = Engine(model, max_num_seqs=SLOTS, max_model_len=LENGTH, prefill_chunk=CHUNK, decode_steps=STEPS)
    slot_model = engine.compiler.programs.slot_model
    inside, most, lock = [0], [0], threading.Lock()

    def traced(chunk):  # a program's trace runs the slot model's chunk from start to end
        def tracing(*args, **kwargs):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            try:
                time.sleep(0.2)
                return chunk(*args, **kwargs)
            finally:
                with lock:
                    inside[0] -= 1

        return tracing

    monkeypatch.setattr(slot_model, "prefill_chunk", traced(slot_model.prefill_chunk))
    monkeypatch.setattr(slot_model, "decode_chunk", traced(slot_model.decode_chunk))
    threads = set()
    compile_one = engine.compiler._compile

    def recording(*args):
        threads.add(threading.get_ident())
        return compile_one(*args)

    monkeypatch.setattr(engine.compiler, "_compile", recording)
    engine.warm_up()
    assert engine.compiler.held == len(engine.compiler) and len(threads) > 1
    assert most == [1]


def test_decode_chunks_read_their_rows_of_the_whole_cache_where_they_lie(model, monkeypatch):
    # Every decode program's attention reads the first rows and window columns of the whole cache
    # (4 slots x 256 columns) in place: none slices its rows' window out (and copies it back).
    # Only the calls of this engine's compiles count: the wrapper patched is the module's, which every
    # trace in the process calls (CI once counted reads of 128 columns, which no program here has).
    kernels = pytest.importorskip("hfjax.cpu._kernels")
    read, compiling = [], threading.local()
    attend = kernels.decode_attention

    def recording(query, key, value, bias, scale, key_length=None, used=None):
        if getattr(compiling, "ours", False):
            cache = key.size // (query.shape[1] * query.shape[3])
            read.append((query.shape[0], cache, bias.shape[-1], key_length, used is None))
        return attend(query, key, value, bias, scale, key_length, used)

    monkeypatch.setattr(kernels, "decode_attention", recording)
    engine = Engine(model, max_num_seqs=SLOTS, max_model_len=LENGTH, prefill_chunk=CHUNK, decode_steps=STEPS)
    slot_model = engine.compiler.programs.slot_model
    if not slot_model.attends_in_place:
        pytest.skip("this transformers repeats each key/value head for grouped queries: decode slices its window")
    if not slot_model.reads_cache_in_place():  # no compiler, or neither AVX-512 nor AVX2
        pytest.skip("the backend reads no cache in place on this machine: no hfjax.cpu kernels built")
    compile_one = engine.compiler._compile

    def ours(*args):
        compiling.ours = True
        try:
            return compile_one(*args)
        finally:
            compiling.ours = False

    monkeypatch.setattr(engine.compiler, "_compile", ours)
    engine.warm_up()
    # One window, the whole cache's columns: each step tells the kernel its rows' columns (their positions
    # + 1), where it stops, so the kernel neither reads nor looks for the mask's last column past them.
    assert engine.compiler.grid["decode"] == [(1, LENGTH), (SLOTS, LENGTH)]
    assert {(rows, columns) for rows, _, columns, _, _ in read} == set(engine.compiler.grid["decode"]), read
    assert {(cache, length, found) for _, cache, _, length, found in read} == {(SLOTS * LENGTH, LENGTH, False)}, read


def test_programs_stay_fixed_over_50_requests_of_mixed_lengths_and_settings(model, engine):
    before = dict(engine.program_counts)
    # warm_up prepared them all: a prefill chunk of one row and of 4 rows per window (128, 256 columns),
    # a decode chunk per row bucket (1, 4) and window (one where it reads in place), the swap of
    # two slots' cached prefixes, and the token choice after a prefill of one row and of 4.
    assert before == {"prefill": 4, "decode": _decode_programs(engine), "swap": 1, "choose": 2}
    ids = _ids(model, [PROMPTS[i % len(PROMPTS)] for i in range(50)])
    params = [
        SamplingParams(
            max_tokens=1 + (3 * i) % 23,
            temperature=(0.0, 0.7, 1.3)[i % 3],
            top_p=(1.0, 0.9, 0.5, 0.2)[i % 4],
            top_k=(None, 0, 5, 40)[i % 4],
            min_p=(None, 0.05)[i % 2],
            repetition_penalty=(None, 1.2, 0.9)[i % 3],
            presence_penalty=(0.0, 0.5, -0.3)[i % 3],
            frequency_penalty=(0.0, 0.4)[i % 2],
            logit_bias=(((5, 2.0), (17, -100.0)) if i % 6 == 0 else ()),
            seed=i,
            stop=("e",) if i % 5 == 0 else (),
            logprobs=(None, 0, 3, 20)[i % 4],
        )
        for i in range(50)
    ]
    events = engine.generate(ids, params)
    assert engine.program_counts == before
    assert engine.running == 0 and engine.waiting == 0
    for p, event in zip(params, events):
        assert 1 <= event.completion_tokens <= p.max_tokens
        if p.logprobs is not None:
            # (an EOS token that ended the answer has its log-probabilities too, as in vLLM)
            assert len(event.logprobs) == event.completion_tokens == len(event.token_ids) + event.eos
            assert all(len(lp.top) == p.logprobs for lp in event.logprobs)
            # The chosen token's log-probability is one of the model's: at most the most likely one's.
            assert all(lp.logprob <= lp.top[0][1] + 1e-6 for lp in event.logprobs if lp.top)
        if p.stop:
            assert "e" not in event.text
        if p.logit_bias:
            assert 17 not in event.token_ids  # a bias of -100: never chosen


class _OpenAIPenalties(transformers.LogitsProcessor):
    """OpenAI's presence and frequency penalties, as its API reference defines them: a token's logit
    goes down by frequency_penalty times the times the answer holds it, plus presence_penalty once
    it holds it. transformers has no processor for them; this is the reference."""

    def __init__(self, prompt_length: int, presence: float, frequency: float):
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids, scores):
        answer = input_ids[:, self.prompt_length :]
        counts = torch.zeros_like(scores).scatter_add_(1, answer, torch.ones_like(answer, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


@pytest.mark.parametrize(
    "fields, reference",
    [
        ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
        ({"repetition_penalty": 0.6}, {"repetition_penalty": 0.6}),
        (
            {"logit_bias": ((40, 6.0), (41, 4.5), (300, -100.0))},
            {"sequence_bias": {(40,): 6.0, (41,): 4.5, (300,): -100.0}},
        ),
        ({"presence_penalty": 1.5}, {"openai": (1.5, 0.0)}),
        ({"frequency_penalty": 0.9, "presence_penalty": -0.5}, {"openai": (-0.5, 0.9)}),
    ],
    ids=["repetition", "reward-repetition", "logit-bias", "presence", "frequency"],
)
def test_penalties_and_biases_choose_as_transformers_processors_do(model, engine, fields, reference):
    ids = _ids(model, PROMPTS[5:7])
    budget = 16
    got = engine.generate(ids, SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True, **fields))
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(model.path).eval()
    for prompt, event in zip(ids, got):
        options = dict(reference)
        if "openai" in options:
            presence, frequency = options.pop("openai")
            options["logits_processor"] = transformers.LogitsProcessorList(
                [_OpenAIPenalties(len(prompt), presence, frequency)]
            )
        with torch.no_grad():
            want = torch_model.generate(
                torch.tensor([prompt]), max_new_tokens=budget, do_sample=False, eos_token_id=None, **options
            )[0, len(prompt) :].tolist()
        plain = _generate_alone(model, [prompt], budget)[0]
        assert event.token_ids == want, fields
        assert want != plain[: len(want)], "the setting left the greedy answer as it was: the test proves nothing"


def test_the_checkpoints_processors_that_read_the_tokens_so_far_serve_as_in_transformers(model, tmp_path):
    # A generation_config.json with n-gram bans, a bad word of two tokens, a suppressed token, and a
    # min_length counted from each prompt's own length, with EOS so favoured that every answer ends
    # where min_length first lets it: the programs compile the rules in, the rows count from their own
    # prompts, and each answer is transformers' generate of the same checkpoint.
    ids = _ids(model, [PROMPTS[0], PROMPTS[2], PROMPTS[9]])
    plain = _generate_alone(model, ids, 40)
    path = tmp_path / "rules"
    shutil.copytree(model.path, path)
    config = json.loads((path / "generation_config.json").read_text())
    config.update(
        no_repeat_ngram_size=2, bad_words_ids=[plain[0][1:3]], suppress_tokens=[plain[1][0]], min_length=40,
        sequence_bias=[[[_tokenizer.EOS_ID], 60.0]],
    )  # fmt: skip
    (path / "generation_config.json").write_text(json.dumps(config))
    ruled = hfjax.load(str(path))
    engine = Engine(ruled, max_num_seqs=2, max_model_len=LENGTH, prefill_chunk=CHUNK, decode_steps=STEPS)
    assert engine.features.history is not None and engine.features.held_slots > 0  # EOS held back per row
    engine.start()
    try:
        got = engine.generate(ids, SamplingParams(max_tokens=48, temperature=0))  # three requests, two slots
    finally:
        engine.stop()
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert len({len(i) for i in ids}) == 3 and all(len(i) < 40 for i in ids)
    for prompt, event, alone in zip(ids, got, plain):
        with torch.no_grad():
            want = torch_model.generate(torch.tensor([prompt]), max_new_tokens=48)[0, len(prompt) :].tolist()
        assert want[-1] == _tokenizer.EOS_ID and len(want) == 40 - len(prompt) + 1
        assert event.token_ids == want[:-1] and event.finish_reason == "stop"
        assert want[:-1] != alone[: len(want) - 1], (
            "the rules left the greedy answer as it was: the test proves nothing"
        )


def test_min_tokens_holds_eos_back_as_transformers_min_new_tokens(model, engine):
    ids = _ids(model, PROMPTS[5:7])
    favoured = ((_tokenizer.EOS_ID, 60.0),)  # EOS is every step's most likely token
    got = engine.generate(
        ids, [SamplingParams(max_tokens=12, temperature=0, logit_bias=favoured, min_tokens=m) for m in (5, 0)]
    )
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(model.path).eval()
    for prompt, least, event in zip(ids, (5, 0), got):
        with torch.no_grad():
            want = torch_model.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=least,
                sequence_bias={(_tokenizer.EOS_ID,): 60.0},
            )[0, len(prompt) :].tolist()  # fmt: skip
        assert want[-1] == _tokenizer.EOS_ID and len(want) == least + 1
        assert event.token_ids == want[:-1] and event.finish_reason == "stop" and event.completion_tokens == least + 1
    with pytest.raises(hfjax.GenerationError, match=r"min_tokens=13 is more than max_tokens=12; pass min_tokens<=12"):
        engine.submit(ids[0], SamplingParams(max_tokens=12, min_tokens=13), lambda e: None)


def test_filters_that_keep_one_token_sample_the_greedy_answer(model, engine):
    ids = _ids(model, PROMPTS[3:5])
    greedy = engine.generate(ids, SamplingParams(max_tokens=10, temperature=0))
    for narrow in ({"top_p": 1e-6}, {"top_k": 1}, {"min_p": 1.0}):
        got = engine.generate(ids, SamplingParams(max_tokens=10, temperature=1.5, seed=3, **narrow))
        assert [e.token_ids for e in got] == [e.token_ids for e in greedy], narrow
    wide = engine.generate(ids, SamplingParams(max_tokens=10, temperature=1.5, top_p=1.0, seed=3))
    assert [e.token_ids for e in wide] != [e.token_ids for e in greedy]


def test_a_seed_gives_the_same_tokens_whatever_else_is_in_the_batch(model, engine):
    ids = _ids(model, PROMPTS[:6])
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    alone = engine.generate([ids[2]], sampled)[0]
    crowd = engine.generate(ids, [SamplingParams(max_tokens=12, temperature=0.9, seed=i) for i in range(6)])
    crowd[2] = engine.generate(
        ids[:3], [*[SamplingParams(max_tokens=9, temperature=1.0, seed=40 + i) for i in range(2)], sampled]
    )[2]
    assert crowd[2].token_ids == alone.token_ids
    other_seed = engine.generate([ids[2]], SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True))
    assert other_seed[0].token_ids != alone.token_ids


def test_a_request_cancelled_in_its_slot_gets_its_last_event_when_nothing_else_runs(model, engine):
    # Its listener cancels it at its first tokens, so it holds a slot; the engine thread finishes it at the
    # next chunk boundary and, with nothing left to run, hands it its last event before it sleeps.
    ids = _ids(model, PROMPTS[:1])[0]
    events, finished, held = [], threading.Event(), []

    def listener(event):
        events.append(event)
        if len(events) == 1:
            engine.cancel(held[0])
        if event.finish_reason is not None:
            finished.set()

    held.append(engine.submit(ids, SamplingParams(max_tokens=LENGTH - len(ids), ignore_eos=True), listener))
    assert finished.wait(60), events
    assert events[-1].finish_reason == "cancelled" and events[-1].completion_tokens < LENGTH - len(ids)


def test_a_cancelled_request_frees_its_slot_for_the_queue(model, engine):
    ids = _ids(model, PROMPTS[:1])[0]
    events, finished = [], threading.Event()

    def listener(event):
        events.append(event)
        if event.finish_reason is not None:
            finished.set()

    long = [engine.submit(ids, SamplingParams(max_tokens=LENGTH - len(ids), ignore_eos=True), listener)]
    long += [engine.submit(ids, SamplingParams(max_tokens=LENGTH - len(ids), ignore_eos=True), lambda e: None)]
    long += [engine.submit(ids, SamplingParams(max_tokens=LENGTH - len(ids), ignore_eos=True), lambda e: None)]
    long += [engine.submit(ids, SamplingParams(max_tokens=LENGTH - len(ids), ignore_eos=True), lambda e: None)]
    for request in long:
        engine.cancel(request)
    assert finished.wait(60)
    assert events[-1].finish_reason == "cancelled" and events[-1].completion_tokens < LENGTH - len(ids)
    # Every slot is free again: a new batch of SLOTS requests all run.
    again = engine.generate([ids] * SLOTS, SamplingParams(max_tokens=3, temperature=0.8, ignore_eos=True))
    assert all(e.finish_reason == "length" for e in again)
    assert engine.running == 0


def test_bad_requests_raise_errors_that_name_the_argument(model, engine):
    ids = _ids(model, PROMPTS[:1])[0]
    with pytest.raises(
        hfjax.GenerationError,
        match=rf"the prompt has \d+ tokens and max_tokens={LENGTH}, \d+ in all, more than max_model_len={LENGTH}",
    ):
        engine.submit(ids, SamplingParams(max_tokens=LENGTH), lambda e: None)
    room = LENGTH - len(ids)
    for params, match in (
        (SamplingParams(max_tokens=0), rf"max_tokens=0 must be a positive integer; pass one in \[1, {room}\]"),
        (SamplingParams(min_tokens=-1), r"min_tokens=-1 must be an integer >= 0"),
        (SamplingParams(min_tokens=LENGTH), rf"min_tokens={LENGTH} is more than the {room} tokens the prompt"),
    ):
        with pytest.raises(generation.LimitError, match=match):
            engine.submit(ids, params, lambda e: None)
    with pytest.raises(hfjax.GenerationError, match="top_p=0"):
        engine.submit(ids, SamplingParams(max_tokens=1, top_p=0.0), lambda e: None)
    with pytest.raises(hfjax.GenerationError, match=r"presence_penalty=3.0 is outside \[-2, 2\]"):
        engine.submit(ids, SamplingParams(max_tokens=1, presence_penalty=3.0), lambda e: None)
    with pytest.raises(hfjax.GenerationError, match=r"logit_bias names token 99999, outside the vocabulary"):
        engine.submit(ids, SamplingParams(max_tokens=1, logit_bias=((99999, 1.0),)), lambda e: None)
    with pytest.raises(hfjax.GenerationError, match=r"logit_bias holds 65 tokens; pass at most 64"):
        SamplingParams(max_tokens=1, logit_bias={token: 1.0 for token in range(65)})
    for outside in (-1, model.config.vocab_size, 2**40):  # (2**40: past int32, as the slot arrays hold ids)
        with pytest.raises(hfjax.GenerationError, match=f"the prompt holds token id {outside}, outside the vocabulary"):
            engine.submit([*ids, outside], SamplingParams(max_tokens=1), lambda e: None)
    with pytest.raises(hfjax.ServingError, match="max_model_len=100000"):
        Engine(model, max_model_len=100_000)


def test_slots_come_from_the_kv_cache_memory_budget(model):
    per_slot = Engine(model, max_num_seqs=1, max_model_len=LENGTH).sizing.bytes_per_slot
    engine = Engine(model, max_model_len=LENGTH, kv_cache_memory=3 * per_slot + 1)
    assert engine.max_num_seqs == 3 and engine.sizing.describe().startswith(f"3 sequence slots x {LENGTH} tokens")
    assert Engine(model, max_num_seqs=2, max_model_len=LENGTH, kv_cache_memory=3 * per_slot).max_num_seqs == 2
    assert Engine(model, max_model_len=LENGTH).max_num_seqs == 64  # the CPU's most, well within its budget
    with pytest.raises(hfjax.ServingError, match=rf"holds no slot of max_model_len={LENGTH} tokens"):
        Engine(model, max_model_len=LENGTH, kv_cache_memory=per_slot - 1)


def test_start_compiles_every_program_and_requests_after_it_compile_nothing(model):
    engine = Engine(model, max_num_seqs=SLOTS, max_model_len=LENGTH, prefill_chunk=CHUNK, decode_steps=STEPS)
    lines, at_ready = [], []

    def progress(line):
        lines.append(line)
        if " programs ready in " in line:  # every program compiled: running each once compiles nothing more
            at_ready.append(engine.metrics.compilations)

    engine.compiler.progress = progress
    engine.start()
    try:
        assert engine.metrics.compilations == at_ready[0]
        held = engine.compiler.held
        # prefill programs of one row and of prefill_rows (4) over 128 and 256 columns, the swap, and the
        # token choice after a prefill of each row count; a line each, one when all are ready, and one
        # when each has run once (on rows that hold no request)
        assert held == len(engine.compiler) == 4 + _decode_programs(engine) + 1 + 2 and len(lines) == held + 2
        assert lines[-1].startswith(f"ran the {held} programs once")
        assert engine.metrics.registry.get_sample_value("hfjax_programs_held") == held
        assert engine.metrics.registry.get_sample_value("hfjax_programs_memory_bytes") == engine.compiler.memory
        before = engine.metrics.compilations
        ids = _ids(model, PROMPTS[:3]) + [np.random.default_rng(0).integers(5, 400, 200).tolist()]
        params = [SamplingParams(max_tokens=8, temperature=0, logprobs=(None, 2)[i % 2]) for i in range(len(ids))]
        got = engine.generate(ids, params)
        assert engine.metrics.compilations == before
        assert [e.token_ids for e in got] == [_generate_alone(model, [prompt], 8)[0][:8] for prompt in ids]
    finally:
        engine.stop()


def test_a_hybrid_model_serves_transformers_tokens_from_its_states_and_keys(checkpoint):
    # Qwen3.5 alternates linear-attention layers (a state per slot) with full-attention ones (keys and
    # values): each prompt is prefilled whole, beside others; three requests for two slots, so a slot
    # reused by a new request must start its states from zeros.
    hybrid = hfjax.load(checkpoint("qwen3_5_text"))
    engine = Engine(hybrid, max_num_seqs=2, max_model_len=LENGTH, prefill_chunk=CHUNK, decode_steps=STEPS)
    engine.start()
    try:
        ids = _ids(hybrid, PROMPTS[4:7])
        got = engine.generate(ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    finally:
        engine.stop()
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(hybrid.path).eval()
    for prompt, event in zip(ids, got):
        with torch.no_grad():
            want = torch_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert event.token_ids == want[0, len(prompt) :].tolist()
    assert len({tuple(event.token_ids) for event in got}) == 3


def test_a_model_whose_layers_attend_and_scan_serves_transformers_tokens(checkpoint):
    # Zamba's layers each keep keys and values and a mamba state (transformers compiles it in no whole
    # program, so `Generator` recomputes it; the slots keep both).
    zamba = hfjax.load(checkpoint("zamba"))
    # (96 columns: one prefill window, so the engine compiles fewer programs at start)
    engine = Engine(zamba, max_num_seqs=2, max_model_len=96, prefill_chunk=CHUNK, decode_steps=STEPS)
    engine.start()
    try:
        ids = _ids(zamba, PROMPTS[4:7])  # three requests for two slots: a reused slot starts from zeros
        got = engine.generate(ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    finally:
        engine.stop()
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(zamba.path).eval()
    for prompt, event in zip(ids, got):
        with torch.no_grad():
            want = torch_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert event.token_ids == want[0, len(prompt) :].tolist()


def test_a_sliding_window_model_serves_answers_past_its_window_like_transformers(checkpoint):
    # Gemma 3 alternates layers that attend over the last 64 positions with full ones; answers of 80
    # tokens in a 256-column cache pass the window, where a key outside it would change the tokens.
    gemma = hfjax.load(checkpoint("gemma3_text"))
    assert gemma.module.config.sliding_window == 64
    engine = Engine(gemma, max_num_seqs=2, max_model_len=256, prefill_chunk=CHUNK, decode_steps=STEPS)
    engine.start()
    try:
        ids = _ids(gemma, PROMPTS[4:7])  # three requests for two slots: one waits for a free slot
        got = engine.generate(ids, SamplingParams(max_tokens=80, temperature=0, ignore_eos=True))
    finally:
        engine.stop()
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(gemma.path).eval()
    for prompt, event in zip(ids, got):
        with torch.no_grad():
            want = torch_model.generate(torch.tensor([prompt]), max_new_tokens=80, do_sample=False, eos_token_id=None)[
                0, len(prompt) :
            ].tolist()
        assert event.token_ids == want


def test_a_full_queue_raises_queue_full_while_a_listener_blocks_the_engine(model, engine):
    # A listener runs on the engine's thread: while the first request's listener blocks, nothing is
    # admitted, and the queue (of one, here) fills. Submitting never waits for a listener: listeners
    # are called after the engine releases the queue's lock.
    small = Engine(
        model, max_num_seqs=SLOTS, max_model_len=LENGTH, max_queue=1, prefill_chunk=CHUNK, decode_steps=STEPS
    )
    small.start()
    blocked, release, returned = threading.Event(), threading.Event(), threading.Event()

    def blocking(event):
        blocked.set()
        release.wait(30)
        returned.set()

    ids = _ids(model, PROMPTS[:1])[0]
    try:
        small.submit(ids, SamplingParams(max_tokens=2, temperature=0), blocking)
        assert blocked.wait(60)
        small.submit(ids, SamplingParams(max_tokens=2), lambda e: None)
        with pytest.raises(QueueFullError, match="max_queue=1"):
            small.submit(ids, SamplingParams(max_tokens=2), lambda e: None)
        assert not returned.is_set(), "submit waited for the listener the engine thread was calling"
    finally:
        release.set()
        small.stop()


def test_events_sent_under_the_queues_lock_reach_their_listeners_once_it_is_released():
    queue = _queue.RequestQueue(table=None, metrics=None, max_queue=1)
    got = []
    request = types.SimpleNamespace(listener=lambda event: got.append((event, queue.lock.locked())))
    with queue.held():
        queue.send(request, "first")
    with pytest.raises(RuntimeError, match="the engine thread failed"):
        with queue.held():
            queue.send(request, "last")
            raise RuntimeError("the engine thread failed")
    assert got == [("first", False), ("last", False)]  # outside the lock, and none lost to the error


class _Letters:
    """A tokenizer whose token i is the letter chr(i): a stop string can straddle tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_text_stream_holds_back_a_possible_stop_string_and_cuts_at_it():
    stream = _text.TextStream(_Letters(), stops=("STOP",))
    pieces = [stream.add([ord(c) for c in chunk]) for chunk in ("abc S", "T", "OP and more")]
    assert pieces == [("abc ", False), ("", False), ("", True)]
    stream = _text.TextStream(_Letters(), stops=("STOP",))
    assert stream.add([ord(c) for c in "ab ST"]) == ("ab ", False)
    assert stream.add([ord(c) for c in "ay"]) == ("STay", False)
    assert stream.rest() == ""


def test_text_stream_counts_a_stop_string_only_where_it_ends_after_min_tokens():
    """vLLM's rule: the first min_tokens tokens' text cannot end the answer, a stop string ending
    in a later token's text does (one that straddles the boundary too)."""
    letters = [ord(c) for c in "xabyab"]
    assert _text.TextStream(_Letters(), stops=("ab",), min_tokens=3).add(letters) == ("xaby", True)
    assert _text.TextStream(_Letters(), stops=("ab",), min_tokens=2).add(letters) == ("x", True)
    stream = _text.TextStream(_Letters(), stops=("ab",), min_tokens=3)
    assert stream.add(letters[:3]) == ("xab", False)  # still inside the first three tokens
    assert stream.add(letters[3:]) == ("y", True)


def test_stop_token_ids_end_the_answer_with_that_token(model, engine):
    ids = _ids(model, PROMPTS[4:5])
    [alone] = engine.generate(ids, [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)])
    fourth = alone.token_ids[3]
    [ended] = engine.generate(
        ids, [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[fourth])]
    )
    count = alone.token_ids.index(fourth) + 1
    assert ended.token_ids == alone.token_ids[:count] and ended.finish_reason == "stop" and count < 12
    assert ended.text == model.tokenizer.decode(alone.token_ids[:count], skip_special_tokens=True)
    # As vLLM's, min_tokens holds stop_token_ids back as it holds EOS: favoured at every step, the stop
    # token comes at once after the first 3 tokens; transformers' min_new_tokens with it as EOS agrees.
    bias = {"ignore_eos": True, "logit_bias": {fourth: 100.0}, "temperature": 0}
    [now, held] = engine.generate(
        ids * 2, [SamplingParams(max_tokens=12, stop_token_ids=[fourth], min_tokens=m, **bias) for m in (0, 3)]
    )
    assert now.token_ids == [fourth]
    want = np.asarray(
        model.generate(
            np.asarray(ids), max_new_tokens=12, do_sample=False, min_new_tokens=3, eos_token_id=[fourth],
            sequence_bias={(fourth,): 100.0},
        )
    )[0, len(ids[0]) :].tolist()  # fmt: skip
    assert held.token_ids == want[: want.index(fourth) + 1] and len(held.token_ids) == 4
    assert held.finish_reason == "stop"
    many = list(range(generation.MAX_HELD_STOP_TOKENS + 1))
    with pytest.raises(hfjax.GenerationError, match=r"stop_token_ids holds 17 tokens with min_tokens=2; .*pass fewer"):
        SamplingParams(max_tokens=12, stop_token_ids=many, min_tokens=2)
    SamplingParams(max_tokens=12, stop_token_ids=many)  # without min_tokens, none is held back
    with pytest.raises(hfjax.GenerationError, match=r"stop_token_ids names token 99999, outside the vocabulary"):
        engine.submit(ids[0], SamplingParams(max_tokens=4, stop_token_ids=[99999]), lambda event: None)


def test_each_row_holds_its_own_stop_token_ids_back_as_transformers(model, engine):
    # Two requests in one batch, each with its own stop token and min_tokens; both favour both tokens,
    # the row's own stop token most: each holds its own back (not the other's) for its min_tokens, then
    # ends with it, as transformers' min_new_tokens with that token as EOS.
    ids = _ids(model, PROMPTS[5:7])
    first, second = sorted({t for t in ids[0] + ids[1]} - {_tokenizer.EOS_ID})[:2]
    rows = ((first, second, 3), (second, first, 5))  # (its stop token, the other one, its min_tokens)
    got = engine.generate(
        ids,
        [
            SamplingParams(
                max_tokens=12, temperature=0, stop_token_ids=[stop], min_tokens=least,
                logit_bias={stop: 60.0, other: 50.0},
            )
            for stop, other, least in rows
        ],
    )  # fmt: skip
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(model.path).eval()
    for prompt, (stop, other, least), event in zip(ids, rows, got):
        with torch.no_grad():
            want = torch_model.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=least,
                eos_token_id=[stop], pad_token_id=0, sequence_bias={(stop,): 60.0, (other,): 50.0},
            )[0, len(prompt) :].tolist()  # fmt: skip
        assert want == [other] * least + [stop]  # held back, the other token comes; then the row's own
        assert event.token_ids == want and event.finish_reason == "stop"


def test_min_tokens_lets_a_stop_string_end_the_answer_only_after_them(model, engine):
    ids = _ids(model, PROMPTS[3:4])
    [alone] = engine.generate(ids, [SamplingParams(max_tokens=16, temperature=0)])
    first = model.tokenizer.decode(alone.token_ids[:1], skip_special_tokens=True).strip()
    assert first, "the answer's first token has no text: the test proves nothing"
    [early, late] = engine.generate(
        ids * 2, [SamplingParams(max_tokens=16, temperature=0, stop=(first,), min_tokens=m) for m in (0, 1)]
    )
    assert early.finish_reason == "stop" and first not in early.text
    # After the first token's text, the answer runs to the stop string's next end, or to its length.
    cut = alone.text.find(first, alone.text.index(first) + 1)
    assert late.text == (alone.text if cut < 0 else alone.text[:cut])
    assert late.finish_reason == ("length" if cut < 0 else "stop")


class _Counting:
    """A tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace: a token's leading "▁" is a space, dropped at the
    start of a decode) with byte fallback, like Llama's and Mistral's."""
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    def parts(model):
        words = tokenizers.Tokenizer(model)
        words.normalizer = normalizers.Replace(" ", "\u2581")
        words.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        words.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        return words

    trained = parts(models.BPE(unk_token="<unk>"))
    trained.train_from_iterator(
        [" ".join(WORDS)] * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    )
    learned = json.loads(trained.to_str())["model"]
    vocab = dict(learned["vocab"])
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})  # what no merge covers, as bytes
    merges = [tuple(m) for m in learned["merges"]]
    words = parts(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="</s>")


TEXTS = [
    " ".join(WORDS) + ". Ça coûte 5 € — naïve café, 東京 and 🙂 too!",
    "  spaces,  tabs\tand\nnew lines; punctuation ... and 'quotes' \"here\" (end).",
]


@pytest.mark.parametrize("kind", ["byte-level BPE", "metaspace"])
def test_text_streamed_in_pieces_is_the_decode_of_all_tokens_and_costs_linear_work(kind):
    tokenizer = _tokenizer.build("causal", "llama") if kind == "byte-level BPE" else _metaspace_tokenizer()
    rng = np.random.default_rng(0)
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] * 8
        counting = _Counting(tokenizer)
        stream = _text.TextStream(counting)
        pieces, at = [], 0
        while at < len(ids):
            size = int(rng.integers(1, 5))
            piece, stopped = stream.add(ids[at : at + size])
            assert not stopped and "\ufffd" not in piece
            pieces.append(piece)
            at += size
        pieces.append(stream.rest())
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
        # Each add decodes its new ids and a few before them, never the whole answer again.
        assert counting.decoded < 20 * len(ids), (counting.decoded, len(ids))


def test_a_prompt_starts_after_the_prefix_a_free_slot_holds_and_answers_the_same(model, engine):
    system = " ".join(WORDS[:20])
    first, second = _ids(model, [system + " What is", system + " Where did the children go"])
    engine.generate([first], SamplingParams(max_tokens=5, temperature=0))
    hits = engine.metrics.prefix_hit_tokens
    got = engine.generate([second], SamplingParams(max_tokens=12, temperature=0))[0]
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared > CHUNK and engine.metrics.prefix_hit_tokens - hits == shared
    assert got.token_ids == _generate_alone(model, [second], 12)[0][:12]
    assert engine.program_counts == {
        "prefill": 4,
        "decode": _decode_programs(engine),
        "swap": 1,
        "choose": len(engine.compiler.grid["choose"]),
    }


def test_a_finished_prompt_outlives_the_next_request_in_its_slot_and_is_read_once(model, engine):
    # One request at a time runs in slot 0 (the decode chunk's one row); the slots past it keep prefixes:
    # the first prompt's keys move there when the second request takes slot 0, and back when it comes again.
    first, second = _ids(model, [" ".join(WORDS[::3] * 2), " ".join(WORDS[1::3] * 2)])
    assert len(first) - 1 >= engine.table.move_tokens > 0
    params = SamplingParams(max_tokens=6, temperature=0)
    answer = engine.generate([first], params)[0]
    engine.generate([second], params)
    hits = engine.metrics.prefix_hit_tokens
    with bridge.Compiles() as compiles:
        again = engine.generate([first], params)[0]
    assert engine.metrics.prefix_hit_tokens - hits == len(first) - 1
    assert again.token_ids == answer.token_ids == _generate_alone(model, [first], 6)[0][:6]
    assert compiles.requested == 0


def _decode_windows(engine) -> set[int]:
    """An engine's decode windows at SLOTS x LENGTH: the one of 256 columns where the decode reads its
    rows of the cache in place (attention stops at each row's position), else 128 and 256."""
    return {LENGTH} if engine.compiler.programs.slot_model.reads_cache_in_place() else {128, LENGTH}


def _decode_programs(engine) -> int:
    """An engine's decode programs at SLOTS x LENGTH: 1 and 4 rows over each decode window."""
    return 2 * len(_decode_windows(engine))


def test_serve_without_the_extra_says_what_to_install(monkeypatch, capsys):
    import importlib.util

    from hfjax.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert main(["serve", "--model", "unused"]) == 1
    assert 'pip install "hfjax[serve]"' in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--decode-steps", "0"], "--decode-steps=0 must be at least 1"),
        (["--max-decode-steps", "2"], "--max-decode-steps=2 must be at least --decode-steps=4"),
    ],
)
def test_serve_refuses_bad_chunk_flags_before_loading(capsys, flags, message):
    from hfjax.cli import main

    assert main(["serve", "--model", "unused", *flags]) == 2  # (the model is never read)
    err = capsys.readouterr().err
    assert err.startswith("hfjax serve: ") and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("kind", ["byte-level BPE", "metaspace"])
def test_token_bytes_are_each_tokens_own_and_join_into_the_texts_utf8(kind):
    """OpenAI's logprobs `bytes`: a token that holds part of a character (a byte-level one, a SentencePiece
    byte fallback such as <0xE2>) gives its own bytes, so an answer's tokens' bytes join into its UTF-8;
    each token's text (vLLM's) is what it adds after the ones before it: "" until a character is whole."""
    tokenizer = _tokenizer.build("causal", "llama") if kind == "byte-level BPE" else _metaspace_tokenizer()
    token_text = _text.TokenText(tokenizer)
    split_seen = 0
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        pieces = [tokenizer.convert_ids_to_tokens(i) for i in ids]
        joined = b"".join(token_text.bytes_of(i) for i in ids).decode("utf-8")
        # (SentencePiece may start the first word with "▁", the space that decode drops)
        assert joined in (text, " " + text) if kind == "metaspace" else joined == text, pieces
        texts = [token_text.text_of(i, ids[:k]) for k, i in enumerate(ids)]
        assert "".join(texts) == joined and "\ufffd" not in "".join(texts)
        split = [k for k, i in enumerate(ids) if tokenizer.decode([i]).endswith("\ufffd")]
        assert all(texts[k] == "" or ord(texts[k][-1]) > 127 for k in split)
        split_seen += len(split)
    assert split_seen >= 4, "no token splits a character: the check proves nothing"


def test_sampling_left_out_takes_the_checkpoints_generation_config_else_openais_defaults(checkpoint, tmp_path):
    """vLLM's order: the request's value, else what the checkpoint's generation_config.json sets (not
    its do_sample), else OpenAI's defaults (temperature 1, top_p 1). Temperature 0 is greedy."""
    source = checkpoint("llama")

    def loaded(**generation):
        path = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        shutil.copytree(source, path)
        config = json.loads((path / "generation_config.json").read_text())
        (path / "generation_config.json").write_text(json.dumps({**config, **generation}))
        return hfjax.load(path)

    plain = SamplingParams(max_tokens=4)
    sampling = plain.settings(loaded(), prompt_length=4).sampling
    assert sampling.do_sample and (sampling.temperature, sampling.top_p, sampling.top_k) == (1.0, 1.0, 0)
    chosen = loaded(do_sample=False, temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1)
    sampling = plain.settings(chosen, prompt_length=4).sampling
    assert sampling.do_sample and (sampling.temperature, sampling.top_p, sampling.top_k) == (0.6, 0.95, 20)
    assert sampling.repetition_penalty == 1.1
    sampling = SamplingParams(max_tokens=4, temperature=1.2, top_k=5).settings(chosen, prompt_length=4).sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (1.2, 0.95, 5)
    greedy = loaded(do_sample=True, temperature=0.0)
    assert not plain.settings(greedy, prompt_length=4).sampling.do_sample
    assert SamplingParams(max_tokens=4, temperature=0.5).settings(greedy, prompt_length=4).sampling.do_sample


def test_a_stop_string_ends_the_answer_at_the_token_where_it_ends(model, engine):
    """A chunk decodes past a stop string; the answer, its log-probabilities and completion_tokens end
    at the token whose text completes it (vLLM checks stop strings token by token)."""
    ids = _ids(model, PROMPTS[5:6])
    [alone] = engine.generate(ids, [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)])
    texts = [model.tokenizer.decode(alone.token_ids[:k], skip_special_tokens=True) for k in range(25)]
    stop = texts[3][-2:]  # ends in the third token's text
    count = next(k for k, text in enumerate(texts) if stop in text)
    assert 1 <= count <= 3 and len(alone.token_ids) == 24
    [ended] = engine.generate(
        ids, [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(stop,), logprobs=1)]
    )
    assert ended.token_ids == alone.token_ids[:count] and ended.completion_tokens == count
    assert len(ended.logprobs) == len(ended.pieces) == count and ended.finish_reason == "stop"
    assert ended.text == alone.text[: alone.text.index(stop)]


def test_constrained_rows_sent_ahead_choose_generates_tokens(model, engine, monkeypatch):
    # Model.generate steps a constraint one token per call, each mask filled before the next call; the
    # engine sends a constrained chunk ahead once the matchers took in the last one's tokens.
    calls = _Calls(engine, monkeypatch)
    regex = r"[a-z]{2,8}( [a-z]{2,8}){3,6}\."
    ids = _ids(model, PROMPTS[:3])
    got = engine.generate(
        ids, SamplingParams(max_tokens=40, temperature=0, constraint=generation.Constraint.regex(regex))
    )
    for prompt, event in zip(ids, got):
        padded = np.array([prompt], np.int32)
        want = np.asarray(model.generate(padded, max_new_tokens=40, do_sample=False, regex=regex))[0, len(prompt) :]
        want = want.tolist()
        assert event.token_ids == (want[: want.index(_tokenizer.EOS_ID)] if _tokenizer.EOS_ID in want else want)
        assert re.fullmatch(regex, event.text) and event.finish_reason == "stop"
    order = [entry[0] for entry in calls.log if entry[0] in ("decode", "event")]
    assert any(a == b == "decode" for a, b in zip(order, order[1:])), calls.log  # sent before the last one's events


@pytest.mark.parametrize(
    "family, task, reason",
    [
        # its decoder's positions (and its relative position buckets) count from its cache's length
        ("prophetnet", "text2text-generation", "its decoder counts its positions"),
        # transformers' generate predicts a token it appends at every step
        ("xlnet", "text-generation", "appends a placeholder token"),
    ],
)
def test_a_model_the_slot_core_cannot_run_is_refused_at_start_with_the_reason(checkpoint, family, task, reason):
    other = hfjax.load(checkpoint(family, task=task))
    with pytest.raises(hfjax.GenerationError, match=rf"{type(other.module).__name__}: .*{reason}"):
        Engine(other, max_num_seqs=2, max_model_len=LENGTH, prefill_chunk=CHUNK, decode_steps=STEPS).start()


@pytest.mark.parametrize(
    "family, task",
    [
        ("mpt", "text-generation"),  # ALiBi of the key columns alone
        # a sinusoidal table that counts from its cache's length: each row's own positions looked up
        ("marian", "text-generation"),
        ("dbrx", "text-generation"),  # its experts: every one run, weighed by the routing (`bridge._data_free`)
        ("jetmoe", "text-generation"),  # the same, for its router's .tolist() of each expert's token count
        # its forward reads its encoder output's router_logits; its decoder's relative bias is T5's
        ("switch_transformers", "text2text-generation"),
        ("m2m_100", "text2text-generation"),  # (NLLB's) a decoder position table, as Marian's
        ("fsmt", "text2text-generation"),  # M2M100's position table, and a decoder that masks nothing over a cache
        # a decoder that makes no mask for one query; its encoder asks whether any token attends globally.
        # (At default init its greedy token is EOS, which min_new_tokens holds back and ignore_eos does not.)
        ("led", "text2text-generation"),
        # no cache a slot can hold: each slot keeps its tokens, and each step runs them whole
        ("recurrent_gemma", None),
        ("openai-gpt", None),
        ("roformer", "text-generation"),  # the same: its rotary positions count from its cache's length
        ("nemotron_h", None),  # a hybrid whose MLP and MoE layers keep no cache
        ("llama4_text", None),  # chunked attention (chunks of 4 here: the prompts and answers cross several)
        # sparse attention over the keys its indexer picks (3 of them here), the indexer's keys a third
        # array per layer beside the keys and values
        ("deepseek_v32", None),
    ],
)
def test_models_the_slot_core_took_on_are_served_with_transformers_tokens(checkpoint, family, task):
    # Two prompts of different lengths run side by side; each gives transformers' greedy tokens.
    if family == "fsmt" and Version(transformers.__version__) < Version("5.24"):
        pytest.skip("FSMT's decoder before transformers 5.24 takes all its tokens at every step: refused at start")
    overrides = {
        "led": {"init_std": 0.2},
        "llama4_text": {"attention_chunk_size": 4},
        "deepseek_v32": {"index_topk": 3},
    }
    overrides = overrides.get(family, {})
    path = checkpoint(family, task=task, **overrides)
    other = hfjax.load(path)
    seq2seq = task == "text2text-generation"
    auto = transformers.AutoModelForSeq2SeqLM if seq2seq else transformers.AutoModelForCausalLM
    reference = auto.from_pretrained(path).eval()
    prompts = [np.random.default_rng(seed).integers(5, 400, length).tolist() for seed, length in ((0, 3), (1, 11))]
    engine = Engine(other, max_num_seqs=2, max_model_len=LENGTH, prefill_chunk=CHUNK, decode_steps=STEPS).start()
    try:  # (min_tokens holds EOS back, as min_new_tokens does: Nemotron-H's and LED's greedy token is EOS)
        got = engine.generate(prompts, SamplingParams(max_tokens=8, min_tokens=8, temperature=0))
    finally:
        engine.stop()
    for prompt, event in zip(prompts, got):
        with torch.no_grad():
            want = reference.generate(
                torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False, num_beams=1
            )  # (greedy, as temperature 0: FSMT's generation config searches 5 beams)
        # (an encoder-decoder's answer follows its decoder's start token; a decoder-only one's, the prompt)
        answer = want[0, 1 if seq2seq else len(prompt) :].tolist()
        if event.eos:  # an EOS that ended the answer follows its token_ids (FSMT's, forced at the last step)
            assert answer[-1] in np.atleast_1d(reference.generation_config.eos_token_id)
        assert event.token_ids == answer[: len(answer) - event.eos]
