"""What runs a loaded `Model` for a task from outside it: transformers' task pipelines with the compute
on JAX, speech (Whisper's generate, audio files), and parity checks against PyTorch.

    _pipeline.py  `pipeline`: transformers' pipelines (text, vision, speech, image-text-to-text)
    _whisper.py   Whisper's language detection and decoder prompt, for the speech pipeline
    _audio.py     audio files read (soundfile) and resampled (soxr), the speech pipeline class
    _check.py     `check` / `check_arch`: a checkpoint's (or family's) forward against PyTorch

A Model's own methods (`classify`, `embed`) live beside it (`hfjax/_classify.py`, `_embed.py`): the
Model does not import this package, which imports the Model.

Public names: `pipeline`, `check`, `check_arch`, `CheckReport`; for the server's transcriptions,
`read_audio`, `resample` and `whisper_decoder_prompt`.
"""

from ._audio import read_audio, resample
from ._check import CheckReport, check, check_arch
from ._pipeline import pipeline
from ._whisper import decoder_prompt as whisper_decoder_prompt

__all__ = ["CheckReport", "check", "check_arch", "pipeline", "read_audio", "resample", "whisper_decoder_prompt"]
