"""Encoder-decoders in `hfjax serve`, through the official openai client: a tiny Whisper's
transcriptions (POST /v1/audio/transcriptions, a multipart upload) at temperature 0 give
`Model.generate`'s tokens and transformers' generate's, and a tiny BART's completions give
transformers'; bad uploads, languages and models are OpenAI-shaped 400s naming the field.

Two servers: "whisper" (hfjax.testing's tiny Whisper, whose window is 1 s of audio) and "bart"
(hfjax.testing's tiny BART with wider weights, init_std=0.2, so that its answer depends on its prompt).
"""

from __future__ import annotations

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
from hfjax import testing

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
pytest.importorskip("multipart", reason="the serve extra is not installed: pip install 'hfjax[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install openai")
httpx = pytest.importorskip("httpx", reason="httpx is a test dependency: pip install httpx")

WHISPER, BART = "tiny-whisper", "tiny-bart"
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
    yield SERVERS.wait()
    SERVERS.stop()


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
