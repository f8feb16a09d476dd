"""Audio for speech pipelines: files decoded by soundfile (libsndfile: WAV, FLAC, OGG Vorbis and
Opus, MP3, ...) and resampled by soxr; both are the `audio` extra.

transformers' speech pipeline reads files through an `ffmpeg` binary and resamples with torchaudio;
hfjax needs neither: audio files (path or bytes) and arrays at any rate are turned into float32 mono
at the feature extractor's rate before transformers' preprocessing sees them.
"""

from __future__ import annotations

import importlib
import io
import os
import pathlib

import numpy as np

from .._errors import PipelineError


def _library(name: str):
    try:
        return importlib.import_module(name)
    except (ImportError, OSError) as error:  # soundfile raises OSError where libsndfile is missing
        raise ImportError(
            f"speech recognition reads audio with soundfile and resamples it with soxr ({name}: {error}); "
            "install the audio extra: pip install 'hfjax[audio]'"
        ) from error


def read_audio(source: str | os.PathLike | bytes) -> tuple[np.ndarray, int]:
    """An audio file (path or bytes; any format libsndfile reads) as (float32 mono samples [N],
    channels averaged, in [-1, 1]; its sampling rate)."""
    soundfile = _library("soundfile")
    name = "<bytes>" if isinstance(source, bytes) else str(source)
    if not isinstance(source, bytes) and not pathlib.Path(source).is_file():
        raise PipelineError(f"audio file {name!r} does not exist; pass an audio file's path")
    try:
        samples, rate = soundfile.read(
            io.BytesIO(source) if isinstance(source, bytes) else name, dtype="float32", always_2d=True
        )  # [N, channels]
    except soundfile.SoundFileError as error:
        raise PipelineError(
            f"audio file {name!r} could not be decoded ({error}); hfjax reads WAV, FLAC, OGG and MP3 files "
            "(libsndfile's formats): convert it, e.g. `ffmpeg -i input -ar 16000 -ac 1 output.flac`"
        ) from None
    return samples.mean(axis=1), rate


def resample(samples: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    """`samples` [N] at `source_rate` -> float32 [round(N * target / source)] at `target_rate`,
    through soxr's high-quality ("HQ") filter, the default of librosa and of `datasets`' Audio."""
    samples = np.asarray(samples, dtype=np.float32)
    if source_rate == target_rate:
        return samples
    return _library("soxr").resample(samples, source_rate, target_rate, quality="HQ")


def speech_pipeline_class():
    """transformers' speech-recognition pipeline, taking audio files and any sampling rate without
    ffmpeg or torchaudio."""
    from transformers.pipelines.automatic_speech_recognition import AutomaticSpeechRecognitionPipeline

    class SpeechRecognitionPipeline(AutomaticSpeechRecognitionPipeline):
        def preprocess(self, inputs, **params):
            yield from super().preprocess(self._at_rate(inputs), **params)

        def _at_rate(self, inputs):
            rate = self.feature_extractor.sampling_rate
            if isinstance(inputs, (str, os.PathLike, bytes)):
                samples, source_rate = read_audio(inputs)
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
