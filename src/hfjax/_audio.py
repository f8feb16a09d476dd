"""Audio for speech pipelines: WAV files read with the standard library, resampling with numpy's FFT.

transformers' speech pipeline reads files through an `ffmpeg` binary and resamples with torchaudio;
hfjax needs neither: WAV files (PCM, 8 to 32 bits, any channels) and arrays at any rate are turned
into float32 mono at the feature extractor's rate before transformers' preprocessing sees them.
"""

from __future__ import annotations

import io
import os
import pathlib
import wave

import numpy as np

from ._errors import PipelineError

_PCM_DTYPES = {1: np.uint8, 2: np.int16, 4: np.int32}


def read_wav(source: str | os.PathLike | bytes) -> tuple[np.ndarray, int]:
    """A WAV file (path or bytes) as (float32 mono samples in [-1, 1] [N], sampling rate)."""
    name = "<bytes>" if isinstance(source, bytes) else str(source)
    if not isinstance(source, bytes) and not pathlib.Path(source).is_file():
        raise PipelineError(f"audio file {name!r} does not exist; pass a WAV file's path")
    try:
        with wave.open(io.BytesIO(source) if isinstance(source, bytes) else str(source), "rb") as file:
            width, channels, rate = file.getsampwidth(), file.getnchannels(), file.getframerate()
            frames = file.readframes(file.getnframes())
    except (wave.Error, EOFError) as error:
        raise PipelineError(
            f"audio file {name!r} is not a PCM WAV file ({error}); convert it, e.g. "
            "`ffmpeg -i input -ar 16000 -ac 1 output.wav`"
        ) from None
    if width == 3:  # 24-bit: widen each sample to 32 bits
        raw = np.frombuffer(frames, np.uint8).reshape(-1, 3)
        samples = (np.pad(raw, ((0, 0), (1, 0))).view("<i4")[:, 0]).astype(np.float32) / 2.0**31
    elif width in _PCM_DTYPES:
        samples = np.frombuffer(frames, _PCM_DTYPES[width]).astype(np.float32)
        samples = (samples - 128.0) / 128.0 if width == 1 else samples / float(2 ** (8 * width - 1))
    else:
        raise PipelineError(f"audio file {name!r} has {8 * width}-bit samples; hfjax reads 8, 16, 24 or 32-bit PCM")
    return samples.reshape(-1, channels).mean(axis=1), rate


def resample(samples: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    """`samples` [N] at `source_rate` -> float32 [round(N * target / source)] at `target_rate`, by
    cutting or zero-padding the spectrum (band-limited; as scipy.signal.resample)."""
    samples = np.asarray(samples, dtype=np.float64)
    if source_rate == target_rate:
        return samples.astype(np.float32)
    n = samples.shape[-1]
    m = int(round(n * target_rate / source_rate))
    spectrum = np.fft.rfft(samples)
    out = np.zeros(m // 2 + 1, dtype=spectrum.dtype)
    shared = min(n, m)
    kept = shared // 2 + 1
    out[:kept] = spectrum[:kept]
    if shared % 2 == 0:
        # The Nyquist bin of the shorter length stands for two bins of the longer one.
        out[shared // 2] *= 2.0 if m < n else 0.5
    return (np.fft.irfft(out, m) * (m / n)).astype(np.float32)


def speech_pipeline_class():
    """transformers' speech-recognition pipeline, taking WAV files and any sampling rate without
    ffmpeg or torchaudio."""
    from transformers.pipelines.automatic_speech_recognition import AutomaticSpeechRecognitionPipeline

    class SpeechRecognitionPipeline(AutomaticSpeechRecognitionPipeline):
        def preprocess(self, inputs, **params):
            yield from super().preprocess(self._at_rate(inputs), **params)

        def _at_rate(self, inputs):
            rate = self.feature_extractor.sampling_rate
            if isinstance(inputs, (str, os.PathLike, bytes)):
                samples, source_rate = read_wav(inputs)
                return resample(samples, source_rate, rate)
            if isinstance(inputs, dict) and "sampling_rate" in inputs and inputs["sampling_rate"] != rate:
                if "stride" in inputs:
                    raise PipelineError(
                        f"audio with a stride at sampling_rate={inputs['sampling_rate']}: pass it at the feature "
                        f"extractor's rate, {rate}"
                    )
                key = "raw" if "raw" in inputs else "array"
                if key not in inputs:
                    raise PipelineError("audio dict: give the samples as 'raw' or 'array' beside 'sampling_rate'")
                samples = np.asarray(inputs[key], dtype=np.float32)
                if samples.ndim != 1:
                    raise PipelineError(f"audio dict: {key!r} has shape {samples.shape}; pass mono samples [N]")
                return {**inputs, key: resample(samples, inputs["sampling_rate"], rate), "sampling_rate": rate}
            return inputs

    return SpeechRecognitionPipeline
