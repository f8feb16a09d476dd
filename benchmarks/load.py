"""Load benchmark: `hfjax.load` against transformers' `from_pretrained` and a plain safetensors read.

    python benchmarks/load.py                          # Llama-shaped float32 checkpoint of 612 MB (150m),
                                                       # warm and cold page cache, 3 rounds
    python benchmarks/load.py --size tiny --rounds 1   # a check that it runs (seconds)
    python benchmarks/load.py --size llama-1b --dtype bfloat16 --device gpu   # the 2.47 GB checkpoint on a GPU

Methods, each run in a new process of its own, in alternating order (A B C D D C B A ...):
  hfjax           hfjax.load(path), every array ready (`block_until_ready`), on JAX's default device
  hfjax_huge_pages  the same with HFJAX_HUGE_PAGES=1, so the CPU hook moves the weights onto 2 MB pages (CPU only)
  transformers    AutoModelForCausalLM.from_pretrained(path) (device_map="cuda" with --device gpu). On
                  the CPU its tensors map the file and nothing is read until first used
                  (its RSS hardly rises), so this times little more than building the module:
  transformers_read  the same, then every parameter read once (a sum each), as the first forward
                  would (CPU only)
  safetensors     safe_open(framework="np") and get_tensor of every tensor, all kept: the floor
Each process imports its libraries and the model's transformers module first, untimed (import_s),
then times the one call. Peak RSS is the process's VmHWM; peak_rss_rise is that over the RSS
just before the call. GB/s counts the checkpoint's tensor bytes.

Page cache: "warm" runs follow a discarded warm-up run of every method; "cold" runs first drop the
checkpoint's files from the page cache: posix_fadvise(POSIX_FADV_DONTNEED) on each file, then, if
pages stay resident (mincore) and /proc/sys/vm/drop_caches is writable, the whole cache. The JSON
says which was used and how much of the files stayed resident. A host under a virtual machine may
still serve "cold" reads from its own cache.

The last line on stdout is one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

from shapes import LLAMA_1B, LLAMA_20M, LLAMA_150M
from workers import import_model_code, run_json

SIZES = {"tiny": {}, "20m": LLAMA_20M, "150m": LLAMA_150M, "llama-1b": LLAMA_1B}
METHODS = ("hfjax", "hfjax_huge_pages", "transformers", "transformers_read", "safetensors")
CPU_ONLY = ("hfjax_huge_pages", "transformers_read")
TARGETS = dict(hfjax_over_safetensors=0.8, hfjax_over_transformers=1.0, gpu_warm_llama_1b_s=2.0)
_WORKER_TIMEOUT_S = 900


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- workers (one load per process)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    # VmHWM: the peak of this process image. ru_maxrss would not do: exec keeps the forking parent's.
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def worker(args) -> dict:
    started = time.perf_counter()
    gpu = args.device == "gpu"
    if args.method == "safetensors":
        import ml_dtypes  # noqa: F401  (numpy learns bfloat16 and float8 names)
        from safetensors import safe_open
    elif args.method in ("hfjax", "hfjax_huge_pages"):
        import jax

        import hfjax

        hfjax.load  # noqa: B018  (hfjax's loader module is imported lazily: here, as transformers' model code)
        import_model_code(args.checkpoint)
        jax.devices()  # the backend's start-up is not loading
    else:
        import torch
        import transformers

        import_model_code(args.checkpoint)
        if gpu:
            torch.cuda.init()
    imported = time.perf_counter()
    rss_before = _rss_bytes()

    start = time.perf_counter()
    if args.method == "safetensors":
        kept = []
        for file in sorted(pathlib.Path(args.checkpoint).glob("*.safetensors")):
            with safe_open(file, framework="np") as f:
                kept += [f.get_tensor(key) for key in f.keys()]
        where = "numpy"
    elif args.method in ("hfjax", "hfjax_huge_pages"):
        model = hfjax.load(args.checkpoint, dtype=args.load_dtype, progress=False)
        jax.block_until_ready(model.params)
        where = str(next(iter(model.params.values())).device)
    else:
        options = {"dtype": args.load_dtype or "auto"}
        if gpu:
            options["device_map"] = "cuda"
        model = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint, **options)
        if args.method == "transformers_read":
            with torch.no_grad():
                sum(float(p.float().sum()) for p in model.parameters())
        if gpu:
            torch.cuda.synchronize()
        where = str(next(model.parameters()).device)
    seconds = time.perf_counter() - start

    peak = _peak_rss_bytes()
    return {
        "seconds": seconds,
        "import_s": imported - started,
        "peak_rss_bytes": peak,
        "rss_before_bytes": rss_before,
        "peak_rss_rise_bytes": peak - rss_before,
        "device": where,
    }


def run_worker(method: str, checkpoint: pathlib.Path, args) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    if method == "hfjax_huge_pages":
        env["HFJAX_HUGE_PAGES"] = "1"
    if args.device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    command = [sys.executable, __file__, "--worker", method, "--checkpoint", str(checkpoint), "--device", args.device]
    if args.load_dtype:
        command += ["--load-dtype", args.load_dtype]
    return run_json(command, env, timeout=_WORKER_TIMEOUT_S, what=method)


# ---------------------------------------------------------------- the page cache


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def resident_fraction(files: list[pathlib.Path]) -> float:
    """The share of the files' pages in the page cache (mincore over a read-only mapping)."""
    import mmap

    libc, page = _libc(), os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for file in files:
        size = file.stat().st_size
        if size == 0:
            continue
        with open(file, "rb") as f:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {file} failed")
            try:
                pages = (size + page - 1) // page
                vector = (ctypes.c_ubyte * pages)()
                if libc.mincore(address, size, vector) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {file} failed")
                resident += sum(byte & 1 for byte in vector)
                total += pages
            finally:
                libc.munmap(address, size)
    return resident / total if total else 0.0


def drop_from_page_cache(files: list[pathlib.Path]) -> dict:
    """Evicts the files from the page cache as far as this machine allows; says how."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    left = resident_fraction(files)
    method = "posix_fadvise"
    if left > 0.01:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            method = "posix_fadvise + drop_caches"
            left = resident_fraction(files)
        except OSError:
            pass
    return {"method": method, "resident_after": left}


# ---------------------------------------------------------------- the run


def checkpoint_bytes(files: list[pathlib.Path]) -> tuple[int, int]:
    """(every tensor's bytes, the largest tensor's), from the safetensors headers' byte ranges."""
    sizes = []
    for file in files:
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        sizes += [
            end - begin
            for key, info in header.items()
            if key != "__metadata__"
            for begin, end in [info["data_offsets"]]
        ]
    return sum(sizes), max(sizes)


def summarize(runs: list[dict], model_bytes: int) -> dict:
    good = [r for r in runs if "error" not in r]
    if not good:
        return {"error": runs[0]["error"] if runs else "no runs"}
    seconds = statistics.median(r["seconds"] for r in good)
    return {
        "seconds": seconds,
        "gb_per_s": model_bytes / seconds / 1e9,
        "runs_s": [r["seconds"] for r in good],
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in good),
        "peak_rss_rise_bytes": max(r["peak_rss_rise_bytes"] for r in good),
        "import_s": statistics.median(r["import_s"] for r in good),
        "device": good[0]["device"],
        "errors": [r["error"] for r in runs if "error" in r],
    }


def benchmark(args, checkpoint: pathlib.Path) -> dict:
    files = sorted(checkpoint.glob("*.safetensors"))
    model_bytes, largest = checkpoint_bytes(files)
    methods = [m for m in args.methods if not (m in CPU_ONLY and args.device == "gpu")]
    report = {
        "benchmark": "load",
        "checkpoint": {"size": args.size, "dtype": args.dtype, "bytes": model_bytes, "largest_tensor_bytes": largest},
        "load_dtype": args.load_dtype or "the checkpoint's",
        "device": args.device,
        "rounds": args.rounds,
        "methods": methods,
        "versions": versions(),
        "results": {},
    }
    log(f"checkpoint: {model_bytes / 1e6:.0f} MB in {len(files)} file(s), largest tensor {largest / 1e6:.0f} MB")
    if "warm" in args.caches:
        log("warm-up: one run of each method (discarded)")
        for method in methods:
            run_worker(method, checkpoint, args)
    for cache in args.caches:
        runs = {m: [] for m in methods}
        drops = []
        for round_index in range(args.rounds):
            order = methods if round_index % 2 == 0 else methods[::-1]
            for method in order:
                if cache == "cold":
                    drops.append(drop_from_page_cache(files))
                row = run_worker(method, checkpoint, args)
                runs[method].append(row)
                log(f"  {cache} round {round_index + 1} {method}: {_describe(row, model_bytes)}")
        result = {m: summarize(runs[m], model_bytes) for m in methods}
        if drops:
            result["page_cache_drop"] = {
                "method": sorted({d["method"] for d in drops}),
                "resident_after_max": max(d["resident_after"] for d in drops),
            }
        report["results"][cache] = result
    report["targets"] = targets(report, model_bytes, largest, args)
    return report


def _describe(row: dict, model_bytes: int) -> str:
    if "error" in row:
        return f"error: {row['error']}"
    return (
        f"{row['seconds']:.3f} s, {model_bytes / row['seconds'] / 1e9:.2f} GB/s, "
        f"peak RSS {row['peak_rss_bytes'] / 1e6:.0f} MB (+{row['peak_rss_rise_bytes'] / 1e6:.0f} MB over the start)"
    )


def targets(report: dict, model_bytes: int, largest: int, args) -> dict:
    """The issue's targets next to the figures: speed against the floor and transformers, and hfjax's
    peak RSS rise against the model's bytes plus its largest tensor."""
    out = {}
    for cache, result in report["results"].items():
        hfjax, floor = result.get("hfjax", {}), result.get("safetensors", {})
        if "seconds" not in hfjax:
            continue
        row = {}
        if "seconds" in floor:
            value = floor["seconds"] / hfjax["seconds"]
            row["hfjax_over_safetensors"] = {"value": value, "min": TARGETS["hfjax_over_safetensors"]}
            row["hfjax_over_safetensors"]["met"] = value >= TARGETS["hfjax_over_safetensors"]
        for peer in ("transformers", "transformers_read"):
            if "seconds" in result.get(peer, {}):
                value = result[peer]["seconds"] / hfjax["seconds"]
                row[f"hfjax_over_{peer}"] = {"value": value, "min": TARGETS["hfjax_over_transformers"]}
                row[f"hfjax_over_{peer}"]["met"] = value > TARGETS["hfjax_over_transformers"]
        bound = model_bytes + largest
        row["peak_rss_rise_bytes"] = {"value": hfjax["peak_rss_rise_bytes"], "max": bound}
        row["peak_rss_rise_bytes"]["met"] = hfjax["peak_rss_rise_bytes"] <= bound
        if args.device == "gpu" and args.size == "llama-1b" and cache == "warm":
            row["gpu_warm_s"] = {"value": hfjax["seconds"], "max": TARGETS["gpu_warm_llama_1b_s"]}
            row["gpu_warm_s"]["met"] = hfjax["seconds"] < TARGETS["gpu_warm_llama_1b_s"]
        out[cache] = row
    return out


def versions() -> dict:
    from importlib import metadata

    found = {}
    for name in ("hfjax", "jax", "jaxlib", "torch", "transformers", "safetensors", "numpy"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return {**found, "python": sys.version.split()[0], "cpu_count": os.cpu_count()}


def write_checkpoint(args, directory: pathlib.Path) -> pathlib.Path:
    # Imported here: the parent process needs hfjax only to write the checkpoint.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from hfjax import testing

    log(f"writing a {args.size} Llama-shaped checkpoint in {args.dtype} ...")
    return testing.save_tiny_checkpoint("llama", directory, dtype=args.dtype, **SIZES[args.size])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size",
        choices=SIZES,
        default="150m",
        help="Llama shape of benchmarks/shapes.py (default 150m: 612 MB in float32)",
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="the checkpoint's dtype"
    )
    parser.add_argument(
        "--load-dtype",
        choices=("float32", "bfloat16", "float16"),
        help="load in this dtype (default: the checkpoint's)",
    )
    parser.add_argument("--checkpoint", help="an existing checkpoint directory in place of --size")
    parser.add_argument(
        "--device", choices=("cpu", "gpu"), default="cpu", help="where hfjax and transformers put the weights"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of each method per page-cache state (median reported)"
    )
    parser.add_argument("--caches", default="warm,cold", help="page-cache states, comma-separated: warm, cold")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.method = args.worker
        return args
    args.caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for flag, values, allowed in (("--caches", args.caches, ("warm", "cold")), ("--methods", args.methods, METHODS)):
        unknown = [v for v in values if v not in allowed]
        if unknown or not values:
            raise SystemExit(
                f"{flag}: got {', '.join(map(repr, unknown)) or 'nothing'}; choose from {', '.join(allowed)}"
            )
    if args.rounds < 1:
        raise SystemExit(f"--rounds={args.rounds} must be at least 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    with tempfile.TemporaryDirectory(prefix="hfjax-load-") as tmp:
        checkpoint = pathlib.Path(args.checkpoint) if args.checkpoint else write_checkpoint(args, pathlib.Path(tmp))
        report = benchmark(args, checkpoint)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
