"""Where one decode step's time goes on the device: hfjax's greedy decode under JAX's profiler, as a table.

    python benchmarks/profile_decode.py --size llama-1b --dtype bfloat16 --no-command-buffers --out /tmp/profile  # on a GPU
    python benchmarks/profile_decode.py --size tiny --new-tokens 4   # plumbing, on the CPU

It builds the shape's random-weight checkpoint (`shapes.py`), loads it with `hfjax.load`, runs one
`generate` to compile, one to time, then one more under `jax.profiler.trace` with a Perfetto trace.
From that trace it sums the device's kernels by name and prints, per decode step: the time the
device was busy, the step's wall time, the number of kernel launches, and the kernels that take the
most time. A device that is busy for a small part of the step waits on its host (launches, loop
control); a busy device whose weight-read kernels run below the memory bandwidth has slow kernels.

On the CPU, the trace holds host threads only, and the report says so instead of a table
(`accelerator.py --cpu-dry-run` runs it there for its plumbing). The last line on stdout is one
JSON object; --out also keeps the trace and XLA's optimized programs (the decode's among them).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import json
import os
import pathlib
import tempfile
import time

from decode import SIZES, generate_timed, log


def kernel_table(trace_dir: pathlib.Path, steps: int, top: int) -> dict:
    """The device's kernels in the Perfetto trace under `trace_dir`, summed by name, per decode step."""
    traces = list(trace_dir.rglob("perfetto_trace.json.gz"))
    if not traces:
        return {"error": f"no perfetto_trace.json.gz under {trace_dir}"}
    path = max(traces, key=lambda trace: trace.stat().st_mtime)  # this run's, where --out held an earlier one
    with gzip.open(path) as file:
        trace = json.load(file)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in processes.items() if "GPU" in name or "TPU" in name or "/device:" in name}
    if not device:  # XLA:CPU: the programs run on host threads, and the table would be of those
        return {"device_processes": [], "note": "no device in the trace (XLA:CPU's holds host threads only)"}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in device]
    if not kernels:
        return {"device_processes": sorted(processes[pid] for pid in device), "error": "no device kernels in the trace"}
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for event in kernels:
        entry = by_name[event["name"]]
        entry[0] += 1
        entry[1] += float(event.get("dur", 0.0))
    busy_us = sum(d for _, d in by_name.values())
    start = min(float(e["ts"]) for e in kernels)
    end = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in kernels)
    rows = sorted(by_name.items(), key=lambda item: -item[1][1])
    return {
        "device_processes": sorted(processes[pid] for pid in device),
        "kernels_per_step": len(kernels) / steps,
        "busy_us_per_step": busy_us / steps,
        "span_us_per_step": (end - start) / steps,
        "top": [
            {"name": name[:160], "calls_per_step": count / steps, "us_per_step": dur / steps, "share": dur / busy_us}
            for name, (count, dur) in rows[:top]
        ],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per generate")
    parser.add_argument("--top", type=int, default=25, help="kernels listed")
    parser.add_argument("--out", help="a folder that keeps the trace and XLA's optimized programs")
    parser.add_argument(
        "--no-command-buffers",
        action="store_true",
        help="HFJAX_GPU_COMMAND_BUFFERS=0: each kernel its own launch, so the trace names every kernel (a CUDA "
        "graph's kernels may show as one launch); the step then runs as without the lever",
    )
    args = parser.parse_args(argv)

    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="hfjax-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.no_command_buffers:
        os.environ["HFJAX_GPU_COMMAND_BUFFERS"] = "0"
    if args.out:  # before JAX starts: XLA reads its flags once
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={out / 'xla'}".strip()
    import jax
    import numpy as np

    import hfjax
    from hfjax import testing

    checkpoint = testing.save_tiny_checkpoint(
        "llama", out / "checkpoint", dtype=args.dtype, max_position_embeddings=4096, **SIZES[args.size]
    )
    started = time.perf_counter()
    model = hfjax.load(checkpoint, dtype=args.dtype)
    load_s = time.perf_counter() - started
    ids = jax.numpy.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (1, args.prompt)), "int32")

    first, _, _ = generate_timed(model, ids, args.new_tokens)
    timed, _, tokens = generate_timed(model, ids, args.new_tokens)
    tokens = np.asarray(tokens)[0, args.prompt :]
    log(f"compiled in {first.total - timed.total:.1f} s; {timed.decode_tokens_per_s:.1f} tok/s")
    with jax.profiler.trace(str(out / "trace"), create_perfetto_trace=True):
        profiled, _, _ = generate_timed(model, ids, args.new_tokens)
    steps = profiled.new_tokens  # the prefill's kernels count in, a small share at these lengths
    table = kernel_table(out / "trace", steps, args.top)
    report = {
        "benchmark": "profile_decode",
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "size": args.size,
        "dtype": args.dtype,
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "command_buffers": not args.no_command_buffers,
        "load_s": load_s,
        "tokens_sha1": hashlib.sha1(tokens.astype("int64").tobytes()).hexdigest(),  # to compare two settings' tokens
        "decode_tokens_per_s": timed.decode_tokens_per_s,
        "wall_us_per_step": 1e6 / timed.decode_tokens_per_s,
        "profiled_wall_us_per_step": 1e6 * profiled.total / steps,
        **table,
    }
    for row in table.get("top", []):
        log(f"{row['us_per_step']:9.1f} us {row['calls_per_step']:6.1f}x {row['share']:6.1%}  {row['name'][:110]}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
