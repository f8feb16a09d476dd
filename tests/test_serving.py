"""The continuous-batching engine (hfjax.serving.Engine) in this process, against `Model.generate`."""

from __future__ import annotations

import json
import threading

import jax
import numpy as np
import pytest
import transformers

import hfjax
from hfjax import _compilation_cache
from hfjax.serving import Engine, QueueFullError, SamplingParams
from hfjax.serving._engine import Request
from hfjax.serving._text import TextStream
from hfjax.testing import _tokenizer

# Mixed lengths: some fit one prefill chunk (16 tokens here), some take two or three.
WORDS = (
    "The river ran quietly past the old mill and the children watched the water carry leaves toward the sea "
    "while the baker opened her shop before the sun was up"
).split()
PROMPTS = [" ".join(WORDS[: 1 + (7 * i) % len(WORDS)]) for i in range(16)]
SLOTS, LENGTH, CHUNK, STEPS = 4, 96, 16, 4


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
        engine = Engine(model, max_batch=SLOTS, max_model_len=LENGTH, prefill_chunk=CHUNK, decode_steps=STEPS)
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


def test_the_first_request_after_warm_up_compiles_nothing(engine):
    # warm_up's first call read the cache as allocated; jit told that apart from the placed cache
    # of every later call, and the first request lowered and compiled its prefill again (~0.2 s).
    assert FIRST_REQUEST_COMPILES == []


def _ids(model, prompts):
    return [model.tokenizer(p)["input_ids"] for p in prompts]


def _generate_alone(model, ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Model.generate's greedy tokens of each prompt, cut before its first EOS (one left-padded batch:
    each row gets what its prompt alone would)."""
    width = max(len(i) for i in ids)
    padded = np.array([[0] * (width - len(i)) + i for i in ids], np.int32)
    mask = np.array([[0] * (width - len(i)) + [1] * len(i) for i in ids], np.int32)
    out = np.asarray(model.generate(padded, mask, max_new_tokens=max_new_tokens, do_sample=False))[:, width:]
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
    # Decode chunks over 48 of the 96 columns, and over all of them, for requests that outgrow 48.
    assert engine.windows == (LENGTH // 2, LENGTH)
    ends = [len(i) + b for i, b in zip(ids, budgets)]
    assert min(ends) + STEPS <= LENGTH // 2 < max(ends)
    for prompt, budget, event, reference in zip(PROMPTS, budgets, got, want):
        assert event.token_ids == reference[:budget], prompt
        assert event.finish_reason == ("length" if len(reference) >= budget else "stop"), prompt
        assert event.text == model.tokenizer.decode(reference[:budget], skip_special_tokens=True)
        assert event.prompt_tokens == len(model.tokenizer(prompt)["input_ids"])
    assert engine.running == 0 and engine.waiting == 0


def test_a_steady_stream_sends_its_next_chunk_before_the_last_comes_back_and_runs_no_step_past_max_tokens(
    model, engine, monkeypatch
):
    # warm_up timed each decode program; here a chunk of 1 row takes 2/5 of the time of one of all 4
    # slots, so a lone request's chunks run 4 * 5 / 2 = 10 steps (the request before freed a slot, but
    # this one came in since).
    assert set(engine._chunk_seconds) == {(r, w) for r in engine.row_buckets for w in engine.windows}
    assert all(seconds > 0 for seconds in engine._chunk_seconds.values())
    timed = {(rows, window): 0.001 * (1 + rows) for rows, window in engine._chunk_seconds}
    monkeypatch.setattr(engine, "_chunk_seconds", timed)
    monkeypatch.setattr(engine, "_free_slot", lambda prompt: 0)  # one row (not the one holding its prefix)
    with engine._lock:
        engine._unclaimed = 1  # as one request left last (the tests before may have ended several at once)
    order = []
    dispatch, collect = engine._dispatch, engine._collect

    def dispatched(**kwargs):
        chunk = dispatch(**kwargs)
        order.append(("dispatch", chunk.steps))
        return chunk

    def collected(chunk):
        order.append(("collect", chunk.steps))
        collect(chunk)

    monkeypatch.setattr(engine, "_dispatch", dispatched)
    monkeypatch.setattr(engine, "_collect", collected)
    ids = _ids(model, PROMPTS[3:4])
    budget = 1 + 10 + 10 + 3  # the prefill's token, two chunks of 10 and one of 3
    got = engine.generate(ids, SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True))[0]
    padded = np.array(ids, np.int32)
    want = np.asarray(model.generate(padded, max_new_tokens=budget, do_sample=False, eos_token_id=[]))[
        0, padded.shape[1] :
    ]
    assert got.token_ids == want.tolist() and got.finish_reason == "length"
    # The first chunk after a slot freed waits (another request may be on its way); later ones go
    # ahead until the chunk that ends the request by length.
    assert order == [
        ("dispatch", 10), ("collect", 10), ("dispatch", 10), ("dispatch", 3), ("collect", 10), ("collect", 3)
    ]  # fmt: skip


def test_chunks_of_fewer_rows_run_more_steps_only_while_no_request_waits_reads_its_prompt_or_just_left(model):
    engine = Engine(model, max_batch=SLOTS, max_model_len=LENGTH, prefill_chunk=CHUNK, decode_steps=STEPS)
    assert engine.max_decode_steps == 4 * STEPS and engine.row_buckets == (1, 2, 4)
    window = engine.windows[0]
    engine._chunk_seconds = {(1, window): 0.002, (2, window): 0.003, (4, window): 0.005}
    # As many steps as take about the time of STEPS steps of every slot.
    assert [engine._chunk_steps(rows, window) for rows in (1, 2, 4)] == [10, 6, 4]
    assert engine._chunk_steps(1, engine.windows[1]) == STEPS  # a window warm_up did not time
    engine._chunk_seconds[1, window] = 0.0001
    assert engine._chunk_steps(1, window) == 4 * STEPS  # max_decode_steps at most
    engine._chunk_seconds[1, window] = 0.002
    engine._unclaimed = 1  # a request left in the chunk before, and none came in since
    assert engine._chunk_steps(1, window) == STEPS
    engine._unclaimed = 0
    reading = Request([5] * (2 * CHUNK), SamplingParams(max_tokens=4), lambda event: None, None)
    engine._slots[1] = reading
    assert engine._chunk_steps(1, window) == STEPS
    reading.prefilled = len(reading.prompt)
    assert engine._chunk_steps(1, window) == 10
    engine._waiting.append(Request([5], SamplingParams(max_tokens=4), lambda event: None, None))
    assert engine._chunk_steps(1, window) == STEPS


def test_max_decode_steps_below_decode_steps_is_refused_by_name(model):
    with pytest.raises(hfjax.ServingError, match=r"max_decode_steps=2; pass a whole number >= decode_steps=4"):
        Engine(model, max_batch=SLOTS, max_model_len=LENGTH, decode_steps=4, max_decode_steps=2)


def test_chunks_that_outgrow_the_smaller_window_attend_over_the_larger(model, engine):
    # Prompts of 44-47 tokens: their first decode chunk writes columns 44-50, across the 48-column
    # window, so it must run over all 96; the 60-token prompt's last prefill chunk (columns 48-59)
    # too. Greedy answers equal Model.generate's.
    ids = [np.random.default_rng(n).integers(5, 400, n).tolist() for n in (44, 45, 46, 47, 60)]
    got = engine.generate(ids, [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)] * len(ids))
    for prompt, event in zip(ids, got):
        alone = model.generate(np.array([prompt], np.int32), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert event.token_ids == np.asarray(alone)[0, len(prompt) :].tolist()


def test_programs_stay_fixed_over_50_requests_of_mixed_lengths_and_settings(model, engine):
    before = dict(engine.program_counts)
    # warm_up prepared them all: a prefill chunk and a decode chunk per row bucket (1, 2 and 4 rows)
    # and window (48 and 96 columns).
    assert engine.prefill_buckets == engine.row_buckets == (1, 2, 4) and before == {"prefill": 6, "decode": 6}
    ids = _ids(model, [PROMPTS[i % len(PROMPTS)] for i in range(50)])
    params = [
        SamplingParams(
            max_tokens=1 + (3 * i) % 23,
            temperature=(0.0, 0.7, 1.3)[i % 3],
            top_p=(1.0, 0.9, 0.5, 0.2)[i % 4],
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
            assert len(event.logprobs) == len(event.token_ids)
            assert all(len(lp.top) == p.logprobs for lp in event.logprobs)
            # The chosen token's log-probability is one of the model's: at most the most likely one's.
            assert all(lp.logprob <= lp.top[0][1] + 1e-6 for lp in event.logprobs if lp.top)
        if p.stop:
            assert "e" not in event.text


def test_a_seed_gives_the_same_tokens_whatever_else_is_in_the_batch(model, engine):
    ids = _ids(model, PROMPTS[:6])
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    alone = engine.generate([ids[2]], sampled)[0]
    crowd = engine.generate(ids, [SamplingParams(max_tokens=12, temperature=0.9, seed=i) for i in range(6)])
    crowd[2] = engine.generate(ids[:3], [*[SamplingParams(max_tokens=9, seed=40 + i) for i in range(2)], sampled])[2]
    assert crowd[2].token_ids == alone.token_ids
    other_seed = engine.generate([ids[2]], SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True))
    assert other_seed[0].token_ids != alone.token_ids


def test_top_p_that_keeps_one_token_samples_the_greedy_answer(model, engine):
    ids = _ids(model, PROMPTS[3:5])
    greedy = engine.generate(ids, SamplingParams(max_tokens=10, temperature=0))
    narrow = engine.generate(ids, SamplingParams(max_tokens=10, temperature=1.5, top_p=1e-6, seed=3))
    wide = engine.generate(ids, SamplingParams(max_tokens=10, temperature=1.5, top_p=1.0, seed=3))
    assert [e.token_ids for e in narrow] == [e.token_ids for e in greedy]
    assert [e.token_ids for e in wide] != [e.token_ids for e in greedy]


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
    again = engine.generate([ids] * SLOTS, SamplingParams(max_tokens=3, ignore_eos=True))  # sampled: EOS may come
    assert all(e.finish_reason == "length" for e in again)
    assert engine.running == 0


def test_bad_requests_raise_errors_that_name_the_argument(model, engine):
    ids = _ids(model, PROMPTS[:1])[0]
    with pytest.raises(hfjax.GenerationError, match=r"max_tokens=\d+ with a prompt of \d+ tokens"):
        engine.submit(ids, SamplingParams(max_tokens=LENGTH), lambda e: None)
    with pytest.raises(hfjax.GenerationError, match="temperature=3"):
        SamplingParams(max_tokens=1, temperature=3)
    with pytest.raises(hfjax.GenerationError, match="top_p=0"):
        SamplingParams(max_tokens=1, top_p=0)
    with pytest.raises(hfjax.ServingError, match="max_model_len=100000"):
        Engine(model, max_model_len=100_000)


def test_a_hybrid_model_is_refused_by_name(checkpoint):
    # Qwen3.5's linear-attention layers keep states the slot cache has no place for
    hybrid = hfjax.load(checkpoint("qwen3_5_text"))
    with pytest.raises(hfjax.GenerationError, match="qwen3_5_text also has linear-attention or mamba layers"):
        Engine(hybrid, max_batch=SLOTS, max_model_len=LENGTH, prefill_chunk=CHUNK, decode_steps=STEPS)


def test_a_full_queue_raises_queue_full(model):
    engine = Engine(model, max_batch=SLOTS, max_model_len=LENGTH, max_queue=1, prefill_chunk=CHUNK, decode_steps=STEPS)
    engine._thread = threading.Thread()  # accepted, never run: the queue only fills
    ids = _ids(model, PROMPTS[:1])[0]
    engine.submit(ids, SamplingParams(max_tokens=2), lambda e: None)
    with pytest.raises(QueueFullError, match="max_queue=1"):
        engine.submit(ids, SamplingParams(max_tokens=2), lambda e: None)


class _Letters:
    """A tokenizer whose token i is the letter chr(i): a stop string can straddle tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_text_stream_holds_back_a_possible_stop_string_and_cuts_at_it():
    stream = TextStream(_Letters(), stops=("STOP",))
    pieces = [stream.add([ord(c) for c in chunk]) for chunk in ("abc S", "T", "OP and more")]
    assert pieces == [("abc ", False), ("", False), ("", True)]
    stream = TextStream(_Letters(), stops=("STOP",))
    assert stream.add([ord(c) for c in "ab ST"]) == ("ab ", False)
    assert stream.add([ord(c) for c in "ay"]) == ("STay", False)
    assert stream.rest() == ""


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
        stream = TextStream(counting)
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
    assert engine.program_counts == {"prefill": 6, "decode": 6}


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
