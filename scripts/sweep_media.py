"""Sweeps hfjax parity over every vision and speech architecture in transformers' auto mappings.

For each (model_type, task) in the image-classification, zero-shot-image-classification,
image (image-feature-extraction), CTC and speech seq2seq (automatic-speech-recognition) auto
mappings, a worker subprocess builds a tiny random checkpoint (`hfjax.testing.save_tiny_checkpoint`:
curated `MEDIA_FAMILIES`, else the generic config shrinker), checks that PyTorch runs it on
`hfjax.check`'s inputs, then runs `hfjax.check` (eager and jit) and prints one JSON line; results
have the keys of `sweep_coverage.py`'s. Image-text-to-text is left to the curated
`hfjax.testing.VISION_LANGUAGE_FAMILIES`: its inputs need image tokens laid out per family.
Not part of CI.

    python scripts/sweep_media.py --task image-classification --jsonl /tmp/media_image-classification.jsonl
    python scripts/sweep_media.py --only vit,wav2vec2 --jobs 1
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import pathlib
import sys

_HERE = pathlib.Path(__file__).resolve().parent
_TASK_MAPPINGS: dict[str, tuple[str, ...]] = {
    "image-classification": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",),
    "zero-shot-image-classification": ("MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",),
    "image-feature-extraction": ("MODEL_FOR_IMAGE_MAPPING_NAMES",),
    "automatic-speech-recognition": ("MODEL_FOR_CTC_MAPPING_NAMES", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
}


def _sweep_coverage():
    # The text sweep's worker, subprocess runner and failure grouping, imported from beside this file.
    spec = importlib.util.spec_from_file_location("sweep_coverage", _HERE / "sweep_coverage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summary(results: list[dict], coverage) -> str:
    lines = [f"{'task':<32}" + "".join(f"{s:>15}" for s in coverage._STATUSES)]
    for task in _TASK_MAPPINGS:
        counts = collections.Counter(r["status"] for r in results if r["task"] == task)
        if counts:
            lines.append(f"{task:<32}" + "".join(f"{counts[s]:>15}" for s in coverage._STATUSES))
    causes = collections.Counter(coverage._cause(r["reason"]) for r in results if r["status"] != "pass")
    lines += ["", "causes (fail, timeout, pytorch-fails):"]
    lines += [f"{count:>4}  {cause}" for cause, count in causes.most_common()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model_types to run, e.g. vit,beit (default: all)")
    parser.add_argument("--task", choices=list(_TASK_MAPPINGS), help="run one task only (default: all four)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes at a time (default: 1)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per check before it counts as timeout")
    parser.add_argument("--jsonl", type=pathlib.Path, help="append each result as a JSON line to this file")
    parser.add_argument("--worker", metavar="MODEL_TYPE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    coverage = _sweep_coverage()

    if args.worker:
        coverage._worker(args.worker, args.task, generate=False)  # prints its JSON line
        return

    only = set(args.only.split(",")) if args.only else None
    tasks = [args.task] if args.task else list(_TASK_MAPPINGS)
    jobs = coverage._jobs_to_run(only, tasks, _TASK_MAPPINGS)
    if not jobs:
        parser.error(f"no (model_type, task) matches --only={args.only!r} --task={args.task!r}")
    results = list(coverage.sweep(jobs, workers=args.jobs, timeout=args.timeout, jsonl=args.jsonl, script=__file__))
    print(_summary(results, coverage), file=sys.stderr)


if __name__ == "__main__":
    main()
