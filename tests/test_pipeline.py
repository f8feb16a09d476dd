"""hfjax.pipeline against transformers.pipeline: the same outputs, with the model's compute on JAX."""

from __future__ import annotations

import inspect
import io
import wave

import numpy as np
import PIL.Image
import pytest
import torch
import transformers

import hfjax
from hfjax import cli, tolerances
from hfjax.tasks import _audio

_RNG = np.random.default_rng(0)
IMAGES = [
    PIL.Image.fromarray(_RNG.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in [(40, 48), (30, 30), (64, 20)]
]
AUDIO = (_RNG.standard_normal(8000) * 0.1).astype(np.float32)  # 0.5 s at 16 kHz
NLI = {"id2label": {0: "entailment", 1: "neutral", 2: "contradiction"}}
NLI["label2id"] = {v: k for k, v in NLI["id2label"].items()}

# (family, task, checkpoint overrides, inputs, call kwargs)
CASES = [
    ("bert", "text-classification", {}, ["I loved it", "The river ran quietly."], {"batch_size": 2, "top_k": None}),
    ("bert", "zero-shot-classification", NLI, "The baker opened her shop.", {"candidate_labels": ["bread", "sea"]}),
    ("bert", "feature-extraction", {}, "The river ran", {}),
    ("llama", "text-generation", {}, "The river", {"max_new_tokens": 6, "do_sample": False}),
    ("vit", "image-classification", {}, IMAGES, {"batch_size": 3, "top_k": 3}),
    ("vit", "image-feature-extraction", {}, IMAGES[0], {}),
    # "{}" puts the label's own tokens at the position tiny CLIP pools (the largest token id).
    (
        "clip",
        "zero-shot-image-classification",
        {},
        IMAGES[:2],
        {"candidate_labels": ["cat", "a dog"], "hypothesis_template": "{}"},
    ),
    ("siglip", "zero-shot-image-classification", {}, IMAGES[0], {"candidate_labels": ["cat", "dog", "bird"]}),
    ("wav2vec2", "automatic-speech-recognition", {}, AUDIO, {}),
]


def assert_same(got, expected, where="output"):
    """Texts and labels identical, numbers within PIPELINE_SCORES (arrays within DEFAULT)."""
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            assert_same(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)) and expected and isinstance(expected[0], float):
        np.testing.assert_allclose(got, expected, atol=tolerances.DEFAULT.atol, rtol=0, err_msg=where)
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(expected, float):
        assert abs(got - expected) <= tolerances.PIPELINE_SCORES.atol, f"{where}: {got} vs {expected}"
    else:
        assert got == expected, where


def _checkpoint_for(checkpoint, family, task, overrides):
    head = {"zero-shot-classification": "text-classification"}.get(task, task)
    return checkpoint(family, head, **overrides)


@pytest.mark.parametrize(
    ("family", "task", "overrides", "inputs", "kwargs"),
    CASES,
    ids=lambda v: v if isinstance(v, str) and len(v) < 40 else "",
)
def test_pipeline_matches_transformers(checkpoint, family, task, overrides, inputs, kwargs):
    path = _checkpoint_for(checkpoint, family, task, overrides)
    ours = hfjax.pipeline(task, model=str(path))
    reference = transformers.pipeline(task, model=str(path), device="cpu")
    got, expected = ours(inputs, **kwargs), reference(inputs, **kwargs)
    assert_same(got, expected)
    # The logits (or features) themselves, against the PyTorch model's, on the pipeline's own inputs.
    if task not in ("text-generation", "text2text-generation"):
        batch = reference.preprocess(inputs[0] if isinstance(inputs, list) else inputs, **_preprocess(kwargs))
        batch = next(batch) if inspect.isgenerator(batch) else batch  # chunk pipelines yield their batches
        texts = batch.pop("text_inputs", None)  # zero-shot image classification: the labels' texts
        batch.update((texts[0] if isinstance(texts, list) else texts) or {})
        batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        with torch.no_grad():
            want = reference.model(**batch)[0]
        np.testing.assert_allclose(ours.model(**batch)[0].numpy(), want.numpy(), atol=tolerances.DEFAULT.atol, rtol=0)


def _preprocess(kwargs):
    keep = {"candidate_labels", "hypothesis_template"}
    return {k: v for k, v in kwargs.items() if k in keep}


def test_text2text_generation(checkpoint):
    """transformers 5 has no text2text-generation pipeline: the reference is its generate, decoded."""
    path = checkpoint("t5")
    texts = ["The river ran", "What is the capital of France?"]
    got = hfjax.pipeline("text2text-generation", model=str(path), max_new_tokens=6)(texts)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    expected = []
    for text in texts:  # one at a time: no padding
        ids = model.generate(**tokenizer(text, return_tensors="pt"), max_new_tokens=6, do_sample=False)
        expected.append([{"generated_text": tokenizer.decode(ids[0], skip_special_tokens=True)}])
    assert got == expected


def test_batches_pad_to_buckets(checkpoint):
    """3 and then 4 images in one batch share one compiled program (both padded to 4 rows)."""
    path = checkpoint("vit", "image-classification")
    ours = hfjax.pipeline("image-classification", model=str(path))
    three = ours(IMAGES, batch_size=3)
    four = ours([*IMAGES, IMAGES[0]], batch_size=4)
    assert ours.model._model.compiled.compile_count == 1
    assert_same(four[:3], three)


@pytest.mark.parametrize("task", ["text-classification", "feature-extraction"])
def test_texts_of_new_lengths_pad_to_buckets(checkpoint, task):
    """Texts of three lengths, one at a time, share one program (padded to 16 tokens the
    tokenizer's way) and give transformers' outputs, per-token features cut back to each text."""
    path = checkpoint("bert", task)
    ours = hfjax.pipeline(task, model=str(path))
    reference = transformers.pipeline(task, model=str(path), device="cpu")
    texts = ["a cat", "The river ran", "The river ran past"]
    lengths = {len(ours.tokenizer(text)["input_ids"]) for text in texts}
    assert len(lengths) == 3 and max(lengths) <= 16, lengths
    got, expected = ours(texts), reference(texts)
    if task == "feature-extraction":
        for g, e in zip(got, expected):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=tolerances.DEFAULT.atol, rtol=0)
    else:
        assert_same(got, expected)
    assert ours.model._model.compiled.compile_count == 1


def test_task_the_checkpoint_cannot_do(checkpoint):
    with pytest.raises(
        hfjax.PipelineError, match=r"task='image-classification' cannot run.*it can do: .*text-classification"
    ):
        hfjax.pipeline("image-classification", model=str(checkpoint("bert", "text-classification")))


def _pcm16(samples: np.ndarray) -> np.ndarray:
    return (np.clip(samples, -1, 1) * 32767).astype("<i2")


def _wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as file:
        file.setnchannels(1), file.setsampwidth(2), file.setframerate(rate)
        file.writeframes(_pcm16(samples).tobytes())
    return buffer.getvalue()


def _tones(rate: int, n: int, frequencies: np.ndarray, phases: np.ndarray) -> np.ndarray:
    """A sum of sines of amplitude 0.2, sampled at `rate`: float64 [n]."""
    t = np.arange(n) / rate
    return sum(0.2 * np.sin(2 * np.pi * f * t + p) for f, p in zip(frequencies, phases))


def test_resampling_gives_the_band_limited_signal_at_the_new_rate():
    pytest.importorskip("soxr", reason="the audio extra is not installed: pip install 'hfjax[audio]'")
    rng = np.random.default_rng(1)
    for n, source, target in [(8000, 8000, 16000), (44100, 44100, 16000), (16000, 16000, 8000),
                              (22050, 22050, 16000), (24000, 48000, 16000)]:  # fmt: skip
        frequencies, phases = rng.uniform(50, 0.4 * min(source, target), 5), rng.uniform(0, 2 * np.pi, 5)
        got = _audio.resample(_tones(source, n, frequencies, phases), source, target)
        want = _tones(target, round(n * target / source), frequencies, phases)
        assert got.dtype == np.float32 and got.shape == want.shape
        clear = target // 50  # 20 ms from each end, where the filter reaches past the signal
        np.testing.assert_allclose(
            got[clear:-clear], want[clear:-clear], atol=tolerances.RESAMPLING.atol, err_msg=f"{source} -> {target}"
        )


# (format, libsndfile subtype, the tolerance of the decoded samples against the PCM encoded)
FORMATS = [
    ("FLAC", "PCM_16", tolerances.EXACT),
    ("OGG", "VORBIS", tolerances.LOSSY_AUDIO),
    ("MP3", "MPEG_LAYER_III", tolerances.LOSSY_AUDIO),
]


@pytest.mark.parametrize("container, subtype, tolerance", FORMATS, ids=[f[0] for f in FORMATS])
def test_audio_files_of_each_format_are_read_as_mono(tmp_path, container, subtype, tolerance):
    """A stereo file, written by libsndfile's encoders from 16-bit PCM, is read as the mean of its
    channels at its own rate: exactly for FLAC, within the codec's loss for Vorbis and MP3."""
    soundfile = pytest.importorskip("soundfile", reason="the audio extra is not installed: pip install 'hfjax[audio]'")
    rng = np.random.default_rng(2)
    frequencies, phases = rng.uniform(100, 2400, 4), rng.uniform(0, 2 * np.pi, 4)
    left, right = _tones(8000, 8000, frequencies, phases), _tones(8000, 8000, frequencies[::-1], phases)
    pcm = _pcm16(np.stack([left, right], axis=1))  # int16 [N, 2]
    path = tmp_path / f"speech.{container.lower()}"
    soundfile.write(path, pcm, 8000, format=container, subtype=subtype)
    samples, rate = _audio.read_audio(path)
    assert rate == 8000 and samples.dtype == np.float32
    assert _audio.read_audio(path.read_bytes())[0].tolist() == samples.tolist()
    want = pcm.astype(np.float32).mean(axis=1) / 32768  # libsndfile's scale: int16 / 2 ** 15
    np.testing.assert_allclose(samples, want, atol=tolerance.atol, rtol=0, err_msg=tolerance.why)


def test_audio_files_at_any_rate_transcribe_as_transformers_does(checkpoint, tmp_path, capsys):
    pytest.importorskip("soundfile", reason="the audio extra is not installed: pip install 'hfjax[audio]'")
    # An 8 kHz WAV file (written by Python's wave module) transcribes as its samples resampled to
    # 16 kHz, in the pipeline and the CLI.
    at_8k = _audio.resample(AUDIO, 16000, 8000)
    wav = tmp_path / "speech.wav"
    wav.write_bytes(_wav_bytes(at_8k, 8000))
    samples, rate = _audio.read_audio(wav)
    assert rate == 8000
    np.testing.assert_array_equal(samples, _pcm16(at_8k) / np.float32(32768))
    path = checkpoint("wav2vec2")
    reference = transformers.pipeline("automatic-speech-recognition", model=str(path), device="cpu")
    expected = reference(_audio.resample(samples, 8000, 16000))["text"]
    ours = hfjax.pipeline("automatic-speech-recognition", model=str(path))
    assert ours(str(wav))["text"] == expected
    assert ours(wav.read_bytes())["text"] == expected
    assert ours({"raw": samples, "sampling_rate": 8000})["text"] == expected
    assert cli.main(["transcribe", "--model", str(path), str(wav)]) == 0
    assert capsys.readouterr().out == expected + "\n"
    bad = tmp_path / "noise.wav"
    bad.write_bytes(b"not an audio file")
    assert cli.main(["transcribe", "--model", str(path), str(bad)]) == 1
    assert "could not be decoded" in capsys.readouterr().err
    assert cli.main(["transcribe", "--model", str(checkpoint("vit", "image-classification")), str(wav)]) == 1
    assert "it can do: image-classification" in capsys.readouterr().err


def test_classify_image_cli(checkpoint, tmp_path, capsys):
    image = tmp_path / "cat.png"
    IMAGES[0].save(image)
    vit = checkpoint("vit", "image-classification")
    expected = transformers.pipeline("image-classification", model=str(vit), device="cpu")(IMAGES[0], top_k=None)
    assert cli.main(["classify", "--model", str(vit), "--image", str(image)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[::2] == [item["label"] for item in expected]
    np.testing.assert_allclose(
        [float(s) for s in printed[1::2]], [i["score"] for i in expected], atol=tolerances.PRINTED_4_DECIMALS.atol
    )
    clip = checkpoint("clip")
    assert cli.main(["classify", "--model", str(clip), "--image", str(image), "--labels", "cat,dog", "--json"]) == 0
    assert '"label"' in capsys.readouterr().out
    text = tmp_path / "notes.png"
    text.write_text("hello")
    assert cli.main(["classify", "--model", str(vit), "--image", str(text)]) == 1
    assert "is not an image file" in capsys.readouterr().err
    bert = checkpoint("bert", "text-classification")
    assert cli.main(["classify", "--model", str(bert), "--image", str(image)]) == 1
    assert "is a text-classification model" in capsys.readouterr().err


def test_whisper_matches_transformers(checkpoint, tmp_path, capsys, monkeypatch):
    """Whisper's short-form generate: the tokens of transformers' WhisperForConditionalGeneration.generate
    (language and task given, greedy: on the slot core, hfjax serve's programs), and transformers.pipeline's
    texts (its default: 5 beams), with the language given and detected; `hfjax transcribe` prints the
    pipeline's text."""
    pytest.importorskip("soundfile", reason="the audio extra is not installed: pip install 'hfjax[audio]'")
    from hfjax import generation

    decodes = []
    decode = generation.SlotPrograms.decode
    monkeypatch.setattr(
        generation.SlotPrograms, "decode", lambda self, *a, **k: decodes.append(1) or decode(self, *a, **k)
    )
    path = checkpoint("whisper")
    audios = [AUDIO, AUDIO[:6000] * 2]
    reference = transformers.pipeline("automatic-speech-recognition", model=str(path), device="cpu")
    ours = hfjax.pipeline("automatic-speech-recognition", model=str(path))
    features = reference.feature_extractor(audios, sampling_rate=16000, return_tensors="pt")["input_features"]
    for language, task in [("en", "transcribe"), ("fr", "translate")]:
        with torch.no_grad():
            want = reference.model.generate(features, language=language, task=task, do_sample=False)
        got = ours.model.generate(input_features=features, language=language, task=task, do_sample=False)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert decodes, "the greedy calls did not run on the slot core"
    for kwargs in ({"generate_kwargs": {"language": "en", "task": "transcribe"}}, {}):
        assert ours(audios[0], **kwargs) == reference(audios[0], **kwargs)
    wav = tmp_path / "speech.wav"
    wav.write_bytes(_wav_bytes(AUDIO, 16000))
    assert cli.main(["transcribe", "--model", str(path), str(wav)]) == 0
    samples, _ = _audio.read_audio(wav)
    assert capsys.readouterr().out == reference(samples)["text"] + "\n"


def test_whisper_refuses_what_it_cannot_do(checkpoint):
    ours = hfjax.pipeline("automatic-speech-recognition", model=str(checkpoint("whisper")))
    with pytest.raises(hfjax.PipelineError, match=r"return_timestamps=True asks for timestamp tokens"):
        ours(AUDIO, return_timestamps=True)
    with pytest.raises(hfjax.PipelineError, match=r"200 feature frames, more than Whisper's window of 100"):
        ours(np.concatenate([AUDIO] * 4))
