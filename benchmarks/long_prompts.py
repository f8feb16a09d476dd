"""Long prompts in the serving engine: this tree against a commit, alternated in one run.

    python benchmarks/long_prompts.py --baseline 8376d1f            # ~10 minutes on 2 CPU cores
    python benchmarks/long_prompts.py --baseline 8376d1f --rounds 1

A 20m Llama (benchmarks/shapes.py) whose config has an 8192-token context, float32, served by
`hfjax.serving.Engine` in this process's own way (16 slots of 8192 columns, `--prefill-chunk` 64 as
`hfjax serve`'s default, every program compiled at start), greedy, EOS ignored. Each case is timed
once per side and round, from submitting its prompts to the last token:

- `ttft_4000`: one prompt of 4000 tokens, one new token (the prefill alone);
- `short_16x32`: 16 prompts of 32 tokens, 64 new tokens each (short rows only);
- `short_15x32_long_3000`: 15 of them beside one prompt of 3000 tokens, 64 new tokens each (a long
  row in the decode batch);
- `four_long`: prompts of 1000, 2000, 3000 and 4000 tokens, 32 new tokens each.

Rounds run A (the baseline), B (this tree), B, A, each side in a fresh process (`--worker`).
Reported per case and side: the median seconds, and B over A as A's seconds over B's (above 1: B
is faster), the median of the per-round ratios. The last line on stdout is one JSON object; progress
goes to stderr.
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

from workers import run_json

ROOT = pathlib.Path(__file__).resolve().parent.parent
SLOTS, CONTEXT, PREFILL_CHUNK = 16, 8192, 64
CASES = {  # name: (prompt lengths, new tokens)
    "ttft_4000": ([4000], 1),
    "short_16x32": ([32] * 16, 64),
    "short_15x32_long_3000": ([32] * 15 + [3000], 64),
    "four_long": ([1000, 2000, 3000, 4000], 32),
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def worker(checkpoint: str) -> dict:
    """Seconds per case in this process (whose sys.path holds the side's source tree)."""
    import numpy as np

    import hfjax
    from hfjax.serving import Engine, SamplingParams

    model = hfjax.load(checkpoint)
    engine = Engine(model, max_num_seqs=SLOTS, prefill_chunk=PREFILL_CHUNK, progress=lambda line: None)
    engine.start()
    rng = np.random.default_rng(0)
    try:
        engine.generate([rng.integers(3, 30000, 32).tolist()], SamplingParams(max_tokens=4, temperature=0))
        seconds = {}
        for name, (lengths, new_tokens) in CASES.items():
            prompts = [rng.integers(3, 30000, n).tolist() for n in lengths]
            start = time.perf_counter()
            events = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
            seconds[name] = time.perf_counter() - start
            assert all(len(e.token_ids) == new_tokens for e in events)
    finally:
        engine.stop()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=False, help="the commit to compare this tree against (side A)")
    parser.add_argument("--rounds", type=int, default=2, help="A-B-B-A rounds (default: 2)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.checkpoint)))
        return
    if not args.baseline:
        parser.error("--baseline REV is required: the commit to compare this tree against")
    from serve import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="hfjax-long-prompts-") as work:
        work = pathlib.Path(work)
        checkpoint = write_checkpoint("20m", work / "20m", CONTEXT)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(work / "baseline"), args.baseline],
                       check=True, capture_output=True, text=True)  # fmt: skip
        sources = {"A": work / "baseline" / "src", "B": ROOT / "src"}
        runs: dict[str, list[dict]] = {"A": [], "B": []}
        try:
            for round_ in range(args.rounds):
                for side in ("A", "B", "B", "A"):
                    env = {**os.environ, "PYTHONPATH": str(sources[side]), "OMP_WAIT_POLICY": "PASSIVE"}
                    env.pop("HFJAX_CACHE_DIR", None)
                    command = [sys.executable, __file__, "--worker", "--checkpoint", str(checkpoint)]
                    result = run_json(command, env, timeout=1800, what=f"side {side}")
                    if "error" in result:
                        raise SystemExit(result["error"])
                    runs[side].append(result)
                    log(f"round {round_ + 1} {side}: " + ", ".join(f"{k} {v:.2f} s" for k, v in result.items()))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "baseline")],
                           capture_output=True)  # fmt: skip
    report = {"baseline": args.baseline, "rounds": args.rounds, "slots": SLOTS, "context": CONTEXT, "cases": {}}
    for name in CASES:
        a, b = [r[name] for r in runs["A"]], [r[name] for r in runs["B"]]
        ratios = [x / y for x, y in zip(a, b)]  # A's seconds over B's, paired in run order
        report["cases"][name] = {
            "A_seconds": round(statistics.median(a), 3),
            "B_seconds": round(statistics.median(b), 3),
            "B_over_A": round(statistics.median(ratios), 3),
            "per_run": [round(r, 2) for r in ratios],
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
