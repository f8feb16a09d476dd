"""Sharding benchmark: bytes per device and decode tokens/s per mesh shape; peak host memory while loading.

    python benchmarks/sharding.py            # 8 simulated CPU devices, a ~60M-parameter Llama shape;
                                             # loading measured on a Llama-3.2-1B shape in bfloat16
    python benchmarks/sharding.py --quick    # a ~10M shape for both, 1 run

Each measurement runs in its own subprocess (peak resident memory is per process):
  mesh      hfjax.load(path, mesh=make_mesh(data, model)) on 8 simulated CPU devices; parameter
            bytes on device 0 and decode tokens/s of a greedy generate of one sequence per "data"
            shard (median of --runs after a warm-up). Simulated devices share the same cores, so only relative figures mean anything.
  load      peak host RSS (sampled every 2 ms), and its rise over the RSS after imports, of a
            process that only loads the checkpoint (--load-size): hfjax sharded over (1, 8),
            hfjax on one device, and transformers' from_pretrained (PyTorch, CPU).
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
import threading
import time

from shapes import LLAMA_1B

MESHES = [(1, 1), (1, 8), (2, 4), (8, 1)]
SIZES = {
    "default": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=32000,
    ),
    "quick": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=32,
        vocab_size=8192,
    ),
    # Llama-3.2-1B, written in bfloat16 (2.5 GB): for peak host memory while loading only.
    "1b": dict(LLAMA_1B, dtype="bfloat16"),
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def mesh_worker(path: str, data: int, model: int, new_tokens: int, runs: int) -> dict:
    import jax
    import numpy as np

    import hfjax

    mesh = hfjax.make_mesh(data=data, model=model) if data * model > 1 else None  # (1, 1): one device, no mesh
    loaded = hfjax.load(path, mesh=mesh)
    device = jax.devices()[0]
    on_device = sum(s.data.nbytes for a in loaded.params.values() for s in a.addressable_shards if s.device == device)
    # One sequence per "data" shard: the batch that mesh is for.
    ids = np.random.default_rng(0).integers(8, 500, size=(data, 16)).astype(np.int32)
    loaded.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False).block_until_ready()
    rates = []
    for _ in range(runs):
        loaded.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False).block_until_ready()
        rates.append(loaded.last_generation_stats.tokens_per_second)
    rate = statistics.median(rates)
    return {
        "mesh": [data, model],
        "batch": data,
        "param_bytes_device0": on_device,
        "decode_tokens_per_s": rate,
        "decode_tokens_per_s_total": rate * data,
    }


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load_worker(path: str, how: str) -> dict:
    # Resident memory is sampled every 2 ms while loading; the import peak (ru_maxrss) would
    # hide the load, so the figure is the highest sample minus the RSS right after imports.
    if how == "transformers":
        import transformers
    else:
        import hfjax
    baseline = _rss_bytes()
    peak = [baseline]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    if how == "transformers":
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto")  # the checkpoint's dtype
        # transformers may leave weights memory-mapped and unread until a forward touches them:
        # read one element per 4 KiB page of every tensor, as the first forward would.
        for tensor in model.state_dict().values():
            flat = tensor.detach().reshape(-1)
            flat[:: max(1, 4096 // flat.element_size())].float().sum()
    else:
        mesh = hfjax.make_mesh(data=1, model=8) if how == "hfjax_sharded" else None
        model = hfjax.load(path, mesh=mesh)
        for array in model.params.values():
            array.block_until_ready()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    peak[0] = max(peak[0], _rss_bytes())
    return {"how": how, "peak_rss_bytes": peak[0], "rise_over_imports_bytes": peak[0] - baseline, "seconds": seconds}


def _run(kind: str, *args) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, __file__, "--worker", kind, *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        raise RuntimeError(f"{kind} worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller model and 1 run")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per mesh (median)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--load-size",
        choices=SIZES,
        default=None,
        help="the checkpoint whose loading is measured (default 1b; --quick: quick)",
    )
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, rest = args.worker[0], args.worker[1:]
        result = mesh_worker(rest[0], *map(int, rest[1:])) if kind == "mesh" else load_worker(*rest)
        print(json.dumps(result))
        return

    from hfjax import parallel, testing

    size = "quick" if args.quick else "default"
    if args.load_size is None and not args.quick:
        args.load_size = "1b"
    runs = 1 if args.quick else args.runs
    work = pathlib.Path(tempfile.mkdtemp(prefix="hfjax-sharding-bench-"))
    path = testing.save_tiny_checkpoint("llama", work / "llama", **SIZES[size])
    checkpoint_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    log(f"checkpoint: {size} Llama shape, {checkpoint_bytes / 2**20:.0f} MiB float32")
    import jax

    plans = {}
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    for data, model in MESHES:
        plan = parallel.plan(config, jax.sharding.AbstractMesh((data, model), ("data", "model")))
        plans[f"{data}x{model}"] = plan.total_bytes_per_device()
    meshes = []
    for data, model in MESHES:
        log(f"mesh {data}x{model} ...")
        meshes.append(_run("mesh", path, data, model, args.new_tokens, runs))
    load_size = args.load_size or size
    load_path = path
    if load_size != size:
        load_path = testing.save_tiny_checkpoint("llama", work / f"llama-{load_size}", **SIZES[load_size])
    load_bytes = sum(f.stat().st_size for f in load_path.glob("*.safetensors"))
    loads = []
    for how in ("hfjax_sharded", "hfjax_one_device", "transformers"):
        log(f"load {how} ({load_size}, {load_bytes / 2**20:.0f} MiB) ...")
        loads.append(_run("load", load_path, how))
    report = {
        "benchmark": "sharding",
        "size": size,
        "checkpoint_bytes": checkpoint_bytes,
        "load_size": load_size,
        "load_checkpoint_bytes": load_bytes,
        "plan_bytes_per_device": plans,
        "meshes": meshes,
        "load": loads,
        "note": "8 simulated CPU devices share the same cores: tokens/s are relative figures only",
    }
    for row in meshes:
        log(
            f"  mesh {row['mesh']}: {row['param_bytes_device0'] / 2**20:.1f} MiB on device 0, batch {row['batch']}: "
            f"{row['decode_tokens_per_s']:.1f} tok/s per sequence, {row['decode_tokens_per_s_total']:.1f} total"
        )
    for row in loads:
        log(
            f"  load {row['how']}: peak RSS {row['peak_rss_bytes'] / 2**20:.0f} MiB, "
            f"{row['rise_over_imports_bytes'] / 2**20:.0f} MiB over the imports, in {row['seconds']:.1f} s"
        )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
