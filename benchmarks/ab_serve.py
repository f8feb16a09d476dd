"""A/B of `hfjax serve`: two servers from two source trees (or flags), levels alternated in one run.

    python benchmarks/ab_serve.py --baseline 3fd5b67 --concurrency 1 --requests 16 --rounds 6
    python benchmarks/ab_serve.py --a-flags "--max-decode-steps 4" --concurrency 16 --requests 96

Both servers load the same checkpoint (serve.py's: a Llama shape of shapes.py, float32, a
word-level tokenizer) with serve.py's settings, and are started one after the other, so that each
warm-up (which times the decode programs) runs alone. Then the load generator of serve.py runs
one level (`--requests` streamed completions at `--concurrency`; with `--client openai`, streamed
chats from the official openai client, as serve.py's `openai` rows) against A, B, B, A, A, B, ... for
`--rounds` rounds, so neither side always goes first. Reported: per side the median over its
levels of tokens/s and TTFT and ITL percentiles, and B over A, the median of the per-round
ratios of tokens/s. `--baseline REV` runs A from a git worktree of REV (`PYTHONPATH`); otherwise
both run this tree, with `--a-flags` / `--b-flags` and `--a-env` / `--b-env` told apart.

The last line on stdout is one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import ab  # noqa: E402
import serve  # noqa: E402

KEYS = ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")


async def wait_compiled(url: str, timeout: float = 900) -> None:
    """Waits until a server of a revision that compiled in the background has compiled all it wants
    (its /metrics' hfjax_programs_pending is 0); one that compiles all before it listens has no such gauge."""
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            text = (await http.get(url + "/metrics", timeout=5)).text
            pending = [line for line in text.splitlines() if line.startswith("hfjax_programs_pending ")]
            if not pending or float(pending[0].split()[1]) == 0:
                return
            await asyncio.sleep(1)
    raise RuntimeError(f"{url} still compiled after {timeout} s")


async def run(args, checkpoint: pathlib.Path, work: pathlib.Path, sides: dict) -> dict:
    servers = {}
    try:
        for name, (flags, env) in sides.items():
            port = serve.free_port()
            url = f"http://127.0.0.1:{port}"
            saved = dict(os.environ)
            os.environ.update(env)
            try:
                tuned = ["--max-batch", str(args.max_batch), "--max-model-len", str(args.max_model_len),
                         "--prefill-chunk", str(args.prefill_chunk), "--prefill-rows", str(args.prefill_rows),
                         "--decode-steps", str(args.decode_steps)]  # fmt: skip
                process = serve.start_server("hfjax", checkpoint, port, work, [*tuned, *shlex.split(flags)])
            finally:
                os.environ.clear()
                os.environ.update(saved)
            servers[name] = (url, process)
            await serve.wait_up(url, process)
            await wait_compiled(url)
            await serve.run_level(url, "bench", args.prompt_tokens, args.new_tokens, 1, 2)  # first requests
            await serve.run_level(url, "bench", args.prompt_tokens, args.new_tokens, args.concurrency, args.concurrency)
        levels = {"A": [], "B": []}
        for round_ in range(args.rounds):
            for name in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
                url, _ = servers[name]
                level = await serve.run_level(
                    url, "bench", args.prompt_tokens, args.new_tokens, args.concurrency, args.requests,
                    client=args.client,
                )  # fmt: skip
                levels[name].append(level)
                serve.log(f"  round {round_ + 1} {name}: {json.dumps({k: round(level[k], 4) for k in KEYS})}")
        ratios = [b["output_tokens_per_s"] / a["output_tokens_per_s"] for a, b in zip(levels["A"], levels["B"])]
        report = {name: {k: statistics.median(level[k] for level in levels[name]) for k in KEYS} for name in levels}
        return {**report, "b_over_a_tokens_per_s": statistics.median(ratios), "per_round": ratios}
    finally:
        for _, process in servers.values():
            process.send_signal(signal.SIGTERM)
        for _, process in servers.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=None, help="git revision that A runs from (default: this tree)")
    parser.add_argument("--a-flags", default="", help="extra `hfjax serve` flags of A")
    parser.add_argument("--b-flags", default="", help="extra `hfjax serve` flags of B")
    parser.add_argument("--a-env", default="", help="NAME=VALUE ... for A's server")
    parser.add_argument("--b-env", default="", help="NAME=VALUE ... for B's server")
    parser.add_argument("--size", choices=serve.SIZES, default="20m")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=96, help="requests per level")
    parser.add_argument("--rounds", type=int, default=4, help="levels per side")
    parser.add_argument(
        "--client", choices=("async", "openai"), default="async",
        help="the load generator: serve.py's async completions, or the official openai client's streamed chats",
    )  # fmt: skip
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--prefill-chunk", type=int, default=32)
    parser.add_argument("--prefill-rows", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    parser.add_argument("--top-p", type=float, default=None, help="every request's top_p (default: not sent)")
    parser.add_argument("--top-k", type=int, default=None, help="every request's top_k, vLLM's (default: not sent)")
    args = parser.parse_args()
    for flag in ("concurrency", "requests", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}={getattr(args, flag)} must be at least 1")
    serve.SAMPLING.update(temperature=args.temperature)
    serve.SAMPLING.update({k: v for k, v in (("top_p", args.top_p), ("top_k", args.top_k)) if v is not None})
    work = pathlib.Path(tempfile.mkdtemp(prefix="hfjax-ab-serve-"))
    tree = None
    try:
        checkpoint = serve.write_checkpoint(args.size, work / args.size)
        env = {name: dict(item.split("=", 1) for item in shlex.split(text)) for name, text in
               (("A", args.a_env), ("B", args.b_env))}  # fmt: skip
        if args.baseline:
            tree = work / "baseline"
            env["A"]["PYTHONPATH"] = str(ab._checkout(args.baseline, tree))
        sides = {"A": (args.a_flags, env["A"]), "B": (args.b_flags, env["B"])}
        serve.log(
            f"A: {args.baseline or 'this tree'} {args.a_flags} {args.a_env}; B: this tree {args.b_flags} {args.b_env}"
        )
        report = asyncio.run(run(args, checkpoint, work, sides))
        print(json.dumps({
            "concurrency": args.concurrency, "requests": args.requests, "rounds": args.rounds, "client": args.client,
            "sampling": serve.SAMPLING, **report,
        }))  # fmt: skip
    finally:
        if tree is not None:
            command = ["git", "-C", str(ab.ROOT), "worktree", "remove", "--force", str(tree)]
            subprocess.run(command, check=False, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
