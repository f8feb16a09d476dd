"""`hfjax transcribe`: the text of audio files, from a speech-recognition checkpoint run on JAX."""

from __future__ import annotations

import argparse
import json
import sys

from ._options import model_options, model_path


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "transcribe",
        parents=[model_options(mesh=False)],
        help="transcribe audio files (a CTC model such as wav2vec2, or Whisper)",
        description="Runs transformers' automatic-speech-recognition pipeline with the model on JAX "
        "(hfjax.pipeline). Audio: WAV, FLAC, OGG or MP3 files at any sampling rate, resampled to the model's "
        "(the audio extra: pip install 'hfjax[audio]'). "
        "Prints one line of text per file.",
    )
    parser.add_argument(
        "audio",
        nargs="+",
        metavar="AUDIO",
        help="audio files to transcribe (WAV, FLAC, OGG, MP3), after MODEL (with --model: every positional argument)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per file: file, text")


def run(args: argparse.Namespace) -> int:
    args.model = model_path(args)
    import hfjax

    try:
        recognizer = hfjax.pipeline("automatic-speech-recognition", model=args.model, dtype=args.dtype)
        results = [recognizer(path) for path in args.audio]
    except ValueError as error:  # PipelineError, LoadError
        print(f"hfjax transcribe: {error}", file=sys.stderr)
        return 1
    for path, result in zip(args.audio, results):
        print(json.dumps({"file": path, "text": result["text"]}) if args.json else result["text"])
    return 0
