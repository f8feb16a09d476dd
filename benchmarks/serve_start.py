"""How long `hfjax serve MODEL`, with its default flags, takes to listen and to answer, cold and warm.

    python benchmarks/serve_start.py              # a tiny Llama checkpoint, 3 rounds
    python benchmarks/serve_start.py --rounds 1   # a check that it runs

Each round starts the server twice on the same checkpoint, each time in a new process:
  cold  with an empty compilation cache on disk ($HFJAX_CACHE_DIR pointed at a new folder), so
        every program it compiles before listening is compiled;
  warm  again on the cache the cold start filled, as a second `hfjax serve` of the day starts.
For each start: listen_s, from the process's start to /health answering 200; first_answer_s, from
there to the end of a 16-token chat answer (the openai client's request); and the progress
lines the server printed before it listened. The server stops with SIGTERM between starts.

The issue's targets (a newcomer's first hour) on this CPU: listening within 20 s cold, 5 s warm.
The last line on stdout is one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

TARGETS = {"cold_listen_s": 20.0, "warm_listen_s": 5.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(checkpoint: pathlib.Path, cache: pathlib.Path, log: pathlib.Path) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HFJAX_CACHE_DIR": str(cache), "OMP_WAIT_POLICY": "PASSIVE"}
    argv = [sys.executable, "-m", "hfjax.cli", "serve", str(checkpoint), "--port", str(port)]
    with open(log, "w") as out:
        began = time.perf_counter()
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            while True:
                if process.poll() is not None:
                    raise SystemExit(f"the server exited with {process.returncode}: {log.read_text()[-2000:]}")
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
            listening = time.perf_counter()
            printed = log.read_text().splitlines()
            body = {"model": str(checkpoint), "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
            answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
            answer.raise_for_status()
            answered = time.perf_counter()
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
    return {
        "listen_s": round(listening - began, 2),
        "first_answer_s": round(answered - listening, 3),
        "lines_before_listening": len(printed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--family", default="llama", help="the tiny checkpoint's family (hfjax.testing)")
    args = parser.parse_args()

    from hfjax import testing

    with tempfile.TemporaryDirectory(prefix="hfjax-serve-start-") as scratch:
        root = pathlib.Path(scratch)
        checkpoint = testing.save_tiny_checkpoint(args.family, root / "model")
        runs: dict[str, list[dict]] = {"cold": [], "warm": []}
        for round_ in range(args.rounds):
            cache = root / f"cache-{round_}"
            for kind in ("cold", "warm"):
                run = _start(checkpoint, cache, root / f"{kind}-{round_}.log")
                runs[kind].append(run)
                print(f"round {round_ + 1}/{args.rounds} {kind}: {run}", file=sys.stderr)
        example = (root / "cold-0.log").read_text().splitlines()[:12]

    medians = {
        f"{kind}_{field}": statistics.median(r[field] for r in rows)
        for kind, rows in runs.items()
        for field in ("listen_s", "first_answer_s")
    }
    result = {
        "benchmark": "serve_start",
        "flags": "defaults (`hfjax serve MODEL --port P`)",
        "family": args.family,
        "rounds": args.rounds,
        "runs": runs,
        "median": medians,
        "targets": {
            name: {"target_s": t, "median_s": medians[name], "met": medians[name] <= t} for name, t in TARGETS.items()
        },  # fmt: skip
        "cold_start_output": example,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
