"""A/B decode benchmark: hfjax's `generate` from two source trees (or settings), alternated in one run.

    python benchmarks/ab.py --baseline efddf78               # this tree against a commit (a git worktree)
    python benchmarks/ab.py --b-env HFJAX_CPU_KERNELS=0      # this tree, with and without the CPU hook
    python benchmarks/ab.py --a-env CXX=/bin/false --busy 0,1  # kernels off (A) and on (B), alone and beside a busy process
    python benchmarks/ab.py --baseline efddf78 --num-beams 4   # beam search, this tree against a commit
    python benchmarks/ab.py --baseline 2695d59 --family bart   # an encoder-decoder (also whisper, llava, jetmoe,
                                                               # recurrent_gemma, openai-gpt, fsmt, led)

Each round runs A, then B, then B, then A (so neither side always runs first), each in a fresh
process that loads the same checkpoint (the `150m` Llama shape of decode.py by default; with
`--family`, BART on random encoder ids, Whisper on a fixed waveform's features or LLaVA on a fixed
image and question, in their shapes of shapes.py, or JetMoE, RecurrentGemma, GPT-1, FSMT or LED in testing's tiny shape), warms up at the timed length, and times `--runs` greedy generates (or beam searches of `--num-beams`
beams) of exactly `--new-tokens` tokens at each batch size. Reported: per side and batch, the median decode tokens/s per sequence over all
runs, and B over A (the median of the per-round ratios). `--busy 0,1` runs every round once
alone and once with one single-threaded CPU-bound process beside each worker, and reports each
side's tokens/s beside it over its tokens/s alone (the median of the per-round ratios): how much
each gives up when another process wants the cores.

The last line on stdout is one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from shapes import BART_60M, LLAMA_20M, LLAMA_150M, LLAVA_20M, WHISPER_TINY

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIZES = {"20m": LLAMA_20M, "150m": LLAMA_150M}  # the Llama shapes of benchmarks/decode.py
# family: (shape name, config overrides, save_tiny_checkpoint's task); llama's shape is --size's
FAMILIES = {
    "llama": (None, None, None),
    "bart": ("BART_60M", BART_60M, None),
    "whisper": ("WHISPER_TINY", WHISPER_TINY, None),
    "llava": ("LLAVA_20M", LLAVA_20M, "image-text-to-text"),
    # a mixture of experts whose router reads its data (`.tolist()`), in testing's tiny shape
    "jetmoe": ("tiny", {}, None),
    # no cache a slot can hold: each step reruns a row's tokens (`_slots.recomputed`), in the tiny shape
    "recurrent_gemma": ("tiny", {}, None),
    "openai-gpt": ("tiny", {}, None),
    # a decoder that masks nothing over a cache: the slots give it their mask (`UNMASKED_DECODERS`)
    "fsmt": ("tiny", {}, "text2text-generation"),
    # an encoder that reads its data (whether any token attends globally: `KNOWN_READS`)
    "led": ("tiny", {}, "text2text-generation"),
}
_QUESTION = "Describe this image in a few words."
_BUSY = "import time\nwhile True:\n    sum(i * i for i in range(10000))\n"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def worker(args) -> dict:
    """Times hfjax's generate in this process (whose sys.path holds the side's source tree)."""
    import numpy as np

    import hfjax

    model = hfjax.load(args.checkpoint)
    rates = {}
    for batch in args.batches:
        if args.family == "whisper":
            inputs = _speech_inputs(args.checkpoint, batch)
        elif args.family == "llava":
            inputs = _image_inputs(args.checkpoint, batch)
        else:  # llama's prompt, or bart's encoder input
            shape = (batch, args.prompt)
            inputs = {
                "input_ids": np.random.default_rng(0).integers(8, model.config.vocab_size, shape).astype(np.int32)
            }
        generate(model, inputs, args.new_tokens, args.num_beams)  # compile, and warm up
        rates[str(batch)] = [generate(model, inputs, args.new_tokens, args.num_beams) for _ in range(args.runs)]
    return {"hfjax": str(pathlib.Path(hfjax.__file__).parent), "tokens_per_s": rates}


def _speech_inputs(checkpoint: str, batch: int) -> dict:
    """Whisper's input_features [batch, mels, frames] of 5 s of a 440 Hz tone in noise (seeded), every row alike."""
    import numpy as np
    import transformers

    seconds = np.arange(5 * 16000) / 16000
    wave = 0.5 * np.sin(2 * np.pi * 440 * seconds) + 0.05 * np.random.default_rng(0).standard_normal(seconds.size)
    extractor = transformers.AutoFeatureExtractor.from_pretrained(checkpoint)
    features = extractor([wave.astype(np.float32)] * batch, sampling_rate=16000, return_tensors="np")
    return {"input_features": features["input_features"]}


def _image_inputs(checkpoint: str, batch: int) -> dict:
    """The processor's input_ids, attention_mask and pixel_values for one fixed image and question, every row alike."""
    import numpy as np
    import PIL.Image
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(checkpoint)
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": _QUESTION}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    image = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 40, 3), dtype=np.uint8))
    return dict(processor(text=[text] * batch, images=[[image]] * batch, return_tensors="np"))


def generate(model, inputs: dict, new_tokens: int, num_beams: int = 1) -> float:
    """Decode tokens/s per sequence of one greedy generate (or beam search) of exactly `new_tokens` tokens."""
    import jax

    out = model.generate(
        **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=num_beams
    )
    jax.block_until_ready(out)
    return model.last_generation_stats.tokens_per_second


def _side_env(source: pathlib.Path, extra: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(source), "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("HFJAX_CACHE_DIR", None)
    for item in extra:
        name, _, value = item.partition("=")
        env[name] = value
    return env


def _run_side(args, env: dict, busy: int) -> dict:
    command = [sys.executable, __file__, "--worker", "--checkpoint", str(args.checkpoint), "--family", args.family,
               "--prompt", str(args.prompt),
               "--new-tokens", str(args.new_tokens), "--runs", str(args.runs), "--num-beams", str(args.num_beams),
               "--batches", ",".join(map(str, args.batches))]  # fmt: skip
    others = [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(busy)]
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    finally:
        for process in others:
            process.kill()
    if result.returncode != 0:
        raise SystemExit(f"worker failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def _checkout(revision: str, into: pathlib.Path) -> pathlib.Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(into), revision],
                   check=True, capture_output=True, text=True)  # fmt: skip
    return into / "src"


def _median_ratio(top: list[dict], bottom: list[dict], batch: str, rounds: int) -> tuple[float, list[float]]:
    """Per round, the median of `top`'s two workers' runs over `bottom`'s; then their median."""
    ratios = []
    for index in range(rounds):
        up = statistics.median(r for run in top[2 * index : 2 * index + 2] for r in run[batch])
        down = statistics.median(r for run in bottom[2 * index : 2 * index + 2] for r in run[batch])
        ratios.append(up / down)
    return statistics.median(ratios), ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=None, help="git revision of side A (default: this tree, like B)")
    parser.add_argument("--a-env", action="append", default=[], help="NAME=VALUE for side A's processes")
    parser.add_argument("--b-env", action="append", default=[], help="NAME=VALUE for side B's processes")
    parser.add_argument(
        "--family", choices=tuple(FAMILIES), default="llama",
        help="the model (default llama): bart, whisper, llava and jetmoe have one shape each, --size is llama's",
    )  # fmt: skip
    parser.add_argument("--size", choices=tuple(SIZES), default="150m", help="the Llama shape (default 150m)")
    parser.add_argument("--batches", default="1,8", help="batch sizes (default 1,8)")
    parser.add_argument(
        "--prompt", type=int, default=16,
        help="prompt tokens (default 16): llama's prompt, bart's encoder input; whisper's audio and llava's image "
        "and question are fixed",
    )  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens per generate (default 128)")
    parser.add_argument("--num-beams", type=int, default=1, help="beams per prompt (default 1: greedy)")
    parser.add_argument("--runs", type=int, default=3, help="timed generates per batch size and worker (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="A-B-B-A rounds (default 3)")
    parser.add_argument(
        "--busy", default="0", help="CPU-bound processes beside each worker, one level or several: 0,1 (default 0)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batches = [int(b) for b in str(args.batches).split(",")]
    if args.worker:
        print(json.dumps(worker(args)))
        return
    levels = [int(level) for level in args.busy.split(",")]
    if args.rounds < 1 or args.runs < 1 or args.num_beams < 1 or min(levels) < 0:
        raise SystemExit(
            f"--rounds={args.rounds}, --runs={args.runs} and --num-beams={args.num_beams} must be at least 1, "
            f"--busy={args.busy} at least 0"
        )

    with tempfile.TemporaryDirectory(prefix="hfjax-ab-") as tmp:
        work = pathlib.Path(tmp)
        sys.path.insert(0, str(ROOT / "src"))
        from hfjax import testing

        shape_name, shape, task = FAMILIES[args.family]
        if args.family == "llama":
            shape_name, shape = args.size, SIZES[args.size]
        args.checkpoint = testing.save_tiny_checkpoint(args.family, work / args.family, task=task, **shape)
        source_b = ROOT / "src"
        source_a = _checkout(args.baseline, work / "baseline") if args.baseline else source_b
        sides = {"A": _side_env(source_a, args.a_env), "B": _side_env(source_b, args.b_env)}
        runs = {(side, level): [] for side in sides for level in levels}
        start = time.perf_counter()
        try:
            for round_index in range(args.rounds):
                for level in levels:
                    for side in ("A", "B", "B", "A"):
                        result = _run_side(args, sides[side], level)
                        runs[side, level].append(result["tokens_per_s"])
                        log(
                            f"round {round_index + 1}/{args.rounds} busy {level} {side}: {json.dumps(result['tokens_per_s'])}"
                        )
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "baseline")],
                               capture_output=True)  # fmt: skip

    report = {"baseline": args.baseline or "this tree", "a_env": args.a_env, "b_env": args.b_env,
              "family": args.family, "size": shape_name, "shape": shape,
              "prompt": args.prompt, "new_tokens": args.new_tokens, "num_beams": args.num_beams, "busy_levels": levels,
              "seconds": round(time.perf_counter() - start, 1), "batches": {}}  # fmt: skip
    for batch in map(str, args.batches):
        entry = {}
        for level in levels:
            medians = {side: statistics.median(r for run in runs[side, level] for r in run[batch]) for side in sides}
            b_over_a, per_round = _median_ratio(runs["B", level], runs["A", level], batch, args.rounds)
            entry[f"busy_{level}"] = {"a_tokens_per_s": medians["A"], "b_tokens_per_s": medians["B"],
                                      "b_over_a": b_over_a, "b_over_a_per_round": per_round}  # fmt: skip
            if level != levels[0]:
                for side in sides:
                    kept, _ = _median_ratio(runs[side, level], runs[side, levels[0]], batch, args.rounds)
                    entry[f"busy_{level}"][f"{side.lower()}_kept_of_busy_{levels[0]}"] = kept
        report["batches"][batch] = entry
    print(json.dumps(report))


if __name__ == "__main__":
    main()
