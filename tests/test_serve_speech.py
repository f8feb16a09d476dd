"""Encoder-decoders in `hfjax serve`, through the official openai client: a tiny Whisper's
transcriptions (POST /v1/audio/transcriptions, a multipart upload) at temperature 0 give
`Model.generate`'s tokens and transformers' generate's, and a tiny BART's completions give
transformers'; bad uploads, languages and models are OpenAI-shaped 400s naming the field.

Three servers: "whisper" (hfjax.testing's tiny Whisper, whose window is 1 s of audio), "bart"
(hfjax.testing's tiny BART with wider weights, init_std=0.2, so that its answer depends on its prompt)
and "t5" (the tiny T5, initializer_factor=5, likewise, with a decoder relative position bias strong
enough to change its answers; two slots, so that a request joins a slot while another decodes, each
row with its own relative position bias).
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import pathlib
import re

import numpy as np
import pytest
import soundfile
import torch
import transformers

import background
import hfjax
from hfjax import generation, testing
from hfjax.serving import Engine, SamplingParams

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
pytest.importorskip("multipart", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install openai")
httpx = pytest.importorskip("httpx", reason="httpx is a test dependency: pip install httpx")

WHISPER, BART, T5 = "tiny-whisper", "tiny-bart", "tiny-t5"
RATE = 16000
_RNG = np.random.default_rng(0)
AUDIOS = [(_RNG.standard_normal(8000) * 0.1).astype(np.float32), (_RNG.standard_normal(12000) * 0.1).astype(np.float32)]
PROMPTS = ["hello world this is", "a b c d e"]
SERVERS = background.Servers("hfjax-serve-speech-test-")


def _wav(samples: np.ndarray, rate: int = RATE) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def urls():
    _start_readme()  # (in the background meanwhile)
    directory = SERVERS.directory
    whisper = testing.save_tiny_checkpoint("whisper", directory / "whisper", task="automatic-speech-recognition")
    bart = testing.save_tiny_checkpoint("bart", directory / "bart", init_std=0.2)
    SERVERS.launch("whisper", whisper, "--served-model-name", WHISPER, "--max-num-seqs", "4")
    SERVERS.launch("bart", bart, "--served-model-name", BART, "--max-num-seqs", "4", "--max-model-len", "64")
    t5 = _save_t5_with_a_strong_bias(directory / "t5")
    SERVERS.launch("t5", t5, "--served-model-name", T5, "--max-num-seqs", "2", "--max-model-len", "64")
    yield SERVERS.wait()
    SERVERS.stop()


def _save_t5_with_a_strong_bias(path: pathlib.Path) -> pathlib.Path:
    """The tiny T5 whose decoder's relative position bias is N(0, 30) (the tiny one's barely moves its
    answers): a bias counted from any other position than the row's own gives other tokens."""
    testing.save_tiny_checkpoint("t5", path, initializer_factor=5.0)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(path)
    table = model.decoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    with torch.no_grad():
        table.copy_(torch.randn(table.shape, generator=torch.Generator().manual_seed(0)) * 30)
    model.save_pretrained(path)
    return path


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _compilations(url: str) -> float:
    """The server's count of XLA compilations (its /metrics): the prefill and decode programs were all
    compiled before /health answered, so requests add none."""
    return float(re.search(r"^hfjax_compilations_total (\S+)$", httpx.get(url + "/metrics").text, re.M).group(1))


def test_transcriptions_equal_model_generate_and_transformers(urls):
    path = SERVERS["whisper"]["checkpoint"]
    client = _client(urls["whisper"])
    reference = transformers.WhisperForConditionalGeneration.from_pretrained(path).eval()
    processor = transformers.WhisperProcessor.from_pretrained(path)
    ours = hfjax.pipeline("automatic-speech-recognition", model=str(path)).model  # (Whisper's generate)
    compiled = _compilations(urls["whisper"])
    for audio in AUDIOS:
        # The audio as the server reads it: the WAV's 16-bit samples.
        samples = soundfile.read(io.BytesIO(_wav(audio)), dtype="float32")[0]
        features = processor.feature_extractor(samples, sampling_rate=RATE, return_tensors="pt")["input_features"]
        budget = reference.config.max_target_positions - 4  # the server's: the decoder's positions past its prompt
        with torch.no_grad():
            want = reference.generate(
                features, language="en", task="transcribe", do_sample=False, max_new_tokens=budget
            )
        got = ours.generate(
            input_features=features, language="en", task="transcribe", do_sample=False, max_new_tokens=budget
        )
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        text = processor.tokenizer.decode(want[0], skip_special_tokens=True)
        answer = client.audio.transcriptions.create(
            model=WHISPER, file=("speech.wav", _wav(audio)), language="en", temperature=0
        )
        assert answer.text == text
        plain = client.audio.transcriptions.create(
            model=WHISPER, file=("speech.wav", _wav(audio)), response_format="text"
        )
        assert plain == text  # (language: English, vLLM's default)
        verbose = client.audio.transcriptions.create(
            model=WHISPER, file=("speech.wav", _wav(audio)), response_format="verbose_json", temperature=0
        )
        assert verbose.text == text and verbose.segments[0].tokens == want[0].tolist()
        assert verbose.duration == pytest.approx(len(audio) / RATE) and verbose.language == "english"
    assert _compilations(urls["whisper"]) == compiled


def test_a_transcription_prompt_is_whispers_prompt_ids(urls):
    path = SERVERS["whisper"]["checkpoint"]
    reference = transformers.WhisperForConditionalGeneration.from_pretrained(path).eval()
    processor = transformers.WhisperProcessor.from_pretrained(path)
    samples = soundfile.read(io.BytesIO(_wav(AUDIOS[0])), dtype="float32")[0]
    features = processor.feature_extractor(samples, sampling_rate=RATE, return_tensors="pt")["input_features"]
    prompt_ids = processor.get_prompt_ids("hello world", return_tensors="pt")
    budget = reference.config.max_target_positions - 4 - len(prompt_ids)
    with torch.no_grad():
        want = reference.generate(
            features, language="en", task="transcribe", prompt_ids=prompt_ids, max_new_tokens=budget, do_sample=False
        )
    text = processor.tokenizer.decode(want[0], skip_special_tokens=True)
    answer = _client(urls["whisper"]).audio.transcriptions.create(
        model=WHISPER, file=("speech.wav", _wav(AUDIOS[0])), language="en", prompt="hello world", temperature=0
    )
    assert answer.text == text


def test_completions_of_an_encoder_decoder_equal_transformers(urls):
    path = SERVERS["bart"]["checkpoint"]
    reference = transformers.AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ours = hfjax.load(str(path))
    client = _client(urls["bart"])
    compiled = _compilations(urls["bart"])
    answers = [client.completions.create(model=BART, prompt=prompt, max_tokens=8, temperature=0) for prompt in PROMPTS]
    for prompt, answer in zip(PROMPTS, answers):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            want = reference.generate(ids, max_new_tokens=8, do_sample=False)[0]
        got = np.asarray(ours.generate(ids.numpy().astype(np.int32), max_new_tokens=8, do_sample=False))[0]
        np.testing.assert_array_equal(got, want.numpy())
        assert answer.choices[0].text == tokenizer.decode(want[1:], skip_special_tokens=True)
        assert answer.usage.prompt_tokens == ids.shape[1]
    assert answers[0].choices[0].text != answers[1].choices[0].text  # the answer reads the encoder's input
    # A chat: the checkpoint's template rendered, read by the encoder.
    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat = client.chat.completions.create(model=BART, messages=messages, max_tokens=8, temperature=0)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=8, do_sample=False)[0]
    assert chat.choices[0].message.content == tokenizer.decode(want[1:], skip_special_tokens=True)
    assert _compilations(urls["bart"]) == compiled


T5_PROMPTS = ["hello world this is", "a b c d e", "the quick brown fox"]


def _t5_reference(path, prompt: str, budget: int) -> list[int]:
    """transformers' greedy new tokens (after the decoder start token) of the T5 at `path`, EOS ignored."""
    reference = transformers.AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    ids = transformers.AutoTokenizer.from_pretrained(path)(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=budget, do_sample=False, eos_token_id=None)[0]
    return want[1:].tolist()


def test_t5_rows_at_different_positions_each_get_their_own_relative_bias(urls):
    # Three requests for two slots, the first short: the third starts in its slot while the second is
    # several tokens in, so one decode step runs rows at different positions.
    path = SERVERS["t5"]["checkpoint"]
    model = hfjax.load(str(path))
    engine = Engine(model, max_num_seqs=2, max_model_len=64, prefill_chunk=16, decode_steps=4)
    engine.start()
    budgets = [3, 12, 12]
    try:
        ids = [model.tokenizer(prompt)["input_ids"] for prompt in T5_PROMPTS]
        got = engine.generate(ids, [SamplingParams(max_tokens=b, temperature=0, ignore_eos=True) for b in budgets])
    finally:
        engine.stop()
    for prompt, budget, event in zip(T5_PROMPTS, budgets, got):
        assert event.token_ids == _t5_reference(path, prompt, budget), prompt
    assert len({tuple(event.token_ids[:3]) for event in got}) == 3


def test_an_encoder_decoder_engine_drafting_by_prompt_lookup_gives_transformers_tokens(urls):
    # The engine's decode in speculative rounds, each verifying forward over the rows' cross keys.
    path = SERVERS["t5"]["checkpoint"]
    model = hfjax.load(str(path))
    speculation = generation.Speculation(method="ngram", num_speculative_tokens=3)
    engine = Engine(model, max_num_seqs=2, max_model_len=64, prefill_chunk=16, decode_steps=4, speculation=speculation)
    engine.start()
    try:
        ids = [model.tokenizer(prompt)["input_ids"] for prompt in T5_PROMPTS]
        got = engine.generate(ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    finally:
        engine.stop()
    for prompt, event in zip(T5_PROMPTS, got):
        assert event.token_ids == _t5_reference(path, prompt, 12), prompt
    assert engine.metrics.draft_tokens > 0, "no row drafted"


def test_t5_beams_over_its_cross_slots_equal_transformers(urls, monkeypatch):
    # Model.generate's beam search on the slot core: each beam's slot holds its prompt's cross keys.
    from hfjax.generation import _slot_beams

    path = SERVERS["t5"]["checkpoint"]
    searches = []
    search = _slot_beams.SlotBeams.search
    monkeypatch.setattr(
        _slot_beams.SlotBeams, "search", lambda self, *a, **k: searches.append(1) or search(self, *a, **k)
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    batch = tokenizer(T5_PROMPTS, padding=True, return_tensors="np")
    settings = dict(max_new_tokens=8, num_beams=2, num_return_sequences=2, do_sample=False)
    with torch.no_grad():
        want = (
            transformers.AutoModelForSeq2SeqLM.from_pretrained(path)
            .eval()
            .generate(
                torch.as_tensor(batch["input_ids"]), attention_mask=torch.as_tensor(batch["attention_mask"]), **settings
            )
        )
    got = hfjax.load(str(path)).generate(batch["input_ids"], batch["attention_mask"], **settings)
    np.testing.assert_array_equal(np.asarray(got), want.numpy())
    assert searches


def test_t5_completions_equal_model_generate_and_transformers(urls):
    path = SERVERS["t5"]["checkpoint"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ours = hfjax.load(str(path))
    client = _client(urls["t5"])
    compiled = _compilations(urls["t5"])
    budgets = [4, 10, 10]
    with concurrent.futures.ThreadPoolExecutor(len(T5_PROMPTS)) as pool:  # more requests than slots
        answers = list(
            pool.map(
                lambda prompt, budget: client.completions.create(
                    model=T5, prompt=prompt, max_tokens=budget, temperature=0, extra_body={"ignore_eos": True}
                ),
                T5_PROMPTS, budgets,
            )
        )  # fmt: skip
    for prompt, budget, answer in zip(T5_PROMPTS, budgets, answers):
        want = _t5_reference(path, prompt, budget)
        ids = tokenizer(prompt, return_tensors="np")["input_ids"].astype(np.int32)
        got = np.asarray(ours.generate(ids, max_new_tokens=budget, do_sample=False, eos_token_id=None))[0]
        assert got[1:].tolist() == want
        assert answer.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
        assert answer.usage.completion_tokens == budget and answer.usage.prompt_tokens == ids.shape[1]
    assert len({answer.choices[0].text for answer in answers}) == 3
    assert _compilations(urls["t5"]) == compiled


def _refused(url: str, files: dict, data: dict) -> dict:
    response = httpx.post(url + "/v1/audio/transcriptions", files=files, data=data, timeout=60)
    assert response.status_code == 400, response.text
    return response.json()["error"]


@pytest.mark.parametrize(
    "name, files, data, param, message",
    [
        ("unreadable", {"file": ("speech.wav", b"not audio")}, {"model": WHISPER}, "file", "could not be decoded"),
        ("missing", {}, {"model": WHISPER, "language": "en"}, "file", "has no 'file'"),
        ("too long", {"file": ("long.wav", _wav(np.zeros(2 * RATE, np.float32)))}, {"model": WHISPER}, "file", "1 s"),
        ("language", {"file": ("speech.wav", _wav(AUDIOS[0]))}, {"model": WHISPER, "language": "klingon"}, "language",
         "klingon"),
        ("format", {"file": ("speech.wav", _wav(AUDIOS[0]))}, {"model": WHISPER, "response_format": "srt"},
         "response_format", "srt"),
        ("temperature", {"file": ("speech.wav", _wav(AUDIOS[0]))}, {"model": WHISPER, "temperature": "hot"},
         "temperature", "not a number"),
        ("prompt", {"file": ("speech.wav", _wav(AUDIOS[0]))}, {"model": WHISPER, "prompt": "a b c d " * 40}, "prompt",
         "leaving none"),
        ("unknown field", {"file": ("speech.wav", _wav(AUDIOS[0]))}, {"model": WHISPER, "speed": "2"}, "speed",
         "not a field"),
    ],
)  # fmt: skip
def test_bad_transcriptions_are_400s_naming_the_field(urls, name, files, data, param, message):
    error = _refused(urls["whisper"], files, data)
    assert error["param"] == param and message in error["message"], error


def test_a_transcription_to_a_text_model_and_text_to_whisper_are_400s(urls):
    error = _refused(urls["bart"], {"file": ("speech.wav", _wav(AUDIOS[0]))}, {"model": BART})
    assert error["param"] == "model" and "not a speech-to-text" in error["message"]
    with pytest.raises(openai.BadRequestError, match="/v1/audio/transcriptions"):
        _client(urls["whisper"]).completions.create(model=WHISPER, prompt="hello", max_tokens=4)


README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _start_readme() -> None:
    background.start(
        "speech-readme", background.python(background.README_SERVE_JOB), seconds=60,
        env={"HFJAX_README": str(README), "HFJAX_README_BLOCK": "serve-whisper"},
    )  # fmt: skip


def test_the_readmes_transcription_example_runs(urls):
    # The README's example: a tiny Whisper (the same weights as this module's) transcribes a 1 s tone.
    job = background.finished("speech-readme", _start_readme)
    assert job.returncode == 0, job.output[-3000:]
    ran = [json.loads(line) for line in job.output.splitlines() if line.startswith('{"command"')]
    assert all(step["returncode"] == 0 for step in ran if step["command"] != "server"), ran  # (the server: stopped)
    tone = 0.1 * np.sin(np.arange(RATE) * 2 * np.pi * 440 / RATE)
    answer = _client(urls["whisper"]).audio.transcriptions.create(
        model=WHISPER, file=("speech.wav", _wav(tone)), language="en", temperature=0
    )
    transcribed = [step for step in ran if step["command"] == "python"][-1]["stdout"]  # (the last step)
    assert transcribed == answer.text + "\n"
