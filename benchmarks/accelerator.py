"""One command that measures every path on one GPU against its strongest peer, and its CPU dry run.

    python benchmarks/accelerator.py --only decode,profile,demo,load --out gpu.json  # one H100/H200 lease's part
    python benchmarks/accelerator.py --cpu-dry-run           # every step with tiny shapes on the CPU (CI runs it)
    python benchmarks/accelerator.py --only decode,load      # some steps
    python benchmarks/accelerator.py --limit decode=200      # another time limit for a step

Steps, in this order, each a process (group) of its own with its own time limit; a step that fails
or runs out of time is recorded with the tail of its output, and the others still run. The
benchmark steps run the scripts beside this one, which measure each peer in a process of its own:

  decode     decode.py --gpu-llama-1b: Llama-3.2-1B shape, bfloat16, prompt 128, 128 tokens, batch 1
             (decode.py --batches 1,8 adds batch 8, beyond this step's time): hfjax against
             transformers eager (static cache) and transformers' torch.compile path (mode
             reduce-overhead, one StaticCache kept across calls), whose CUDA graph replays are
             counted: its row says `cuda_graphs.verified`; then hfjax at batch 1 under each lever
             of the GPU hook (`hfjax.gpu`: command buffers for the decode loop, cuDNN attention),
             alternated with the default
  profile    profile_decode.py --size llama-1b: where hfjax's decode step goes on the device (kernels
             per step, busy and idle time, the costliest kernels), command buffers off so that the
             trace names each kernel (the second H200 run's setting)
  load       load.py: the Llama-3.2-1B-shaped bfloat16 checkpoint (2.47 GB): hfjax.load against
             from_pretrained(device_map="cuda") and a plain safetensors read, warm and cold page cache
  diffusion  diffusion.py --sizes sd2: Stable Diffusion 2 base's shapes, 512 px, 20 steps, bfloat16:
             hfjax's whole loop against diffusers eager and diffusers + torch.compile (reduce-overhead)
  train      train.py: the 150M Llama shape, batch 8 x 512, bfloat16 (hfjax's compute_dtype against
             torch.autocast), full fine-tuning and LoRA, against eager and torch.compile
  serve      serve.py: `hfjax serve` against `transformers serve --continuous-batching --device cuda`,
             16 concurrent streamed requests
  demo       hfjax demo
  tests      pytest under xdist over the parity, generate, training, diffusion and serving-engine tests

Every step takes minutes on a GPU (the first H200 run, 2026-12-04, found each over the limits first
written, before any run): no 15-minute device lease holds them all, so a GPU run takes one group of
steps with --only, each within one 10-minute call: decode,profile,demo,load; then train,serve; then
diffusion; then tests alone, which needs more than one call (about a third of it ran in 240 s on
the second H200 run; benchmarks/README.md). The whole run keeps to --budget-s (540 s on a GPU): a step
starts with the smaller of its own limit and the time left, and is skipped (recorded) below 10 s.
Steps share one TORCHINDUCTOR_CACHE_DIR, and JAX does not preallocate GPU memory
(XLA_PYTHON_CLIENT_PREALLOCATE=false), so torch and JAX processes and the test workers can share
the GPU.

The last line on stdout is one JSON object: the device, the library versions, each step's record
(seconds, exit code, whether it timed out, the script's own JSON, headline figures); --out writes
it to a file as well, and also after each step with "finished": false, so that a call stopped from
outside (a device lease's limit) keeps the steps it finished. The exit code is 1 if any step
failed: its script failed, ran out of time, or reported an error for any of its peers (an "error"
field anywhere in its JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
TEST_FILES = ("tests/test_parity.py", "tests/test_generate.py", "tests/test_training.py",
              "tests/test_diffusion.py", "tests/test_serving.py")  # fmt: skip
# The dry run's tests: one quick test of each file (CI runs every file in full before it).
DRY_TESTS = (
    "tests/test_parity.py::test_family_matches_pytorch[llama]",
    "tests/test_generate.py::test_greedy_tokens_match_transformers[llama]",
    "tests/test_training.py::test_bfloat16_compute_keeps_float32_weights_and_compiles_once_per_shape",
    "tests/test_diffusion.py::test_to_jax_rejects_what_is_not_a_pipeline",
    "tests/test_serving.py::test_max_decode_steps_below_decode_steps_is_refused_by_name",
)
_SKIP_BELOW_S = 10.0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Step:
    """One step: its command on a GPU and in the CPU dry run (a script beside this one, or `-m
    module`, then its flags), its time limit in each, and whether its last stdout line is JSON."""

    name: str
    what: str
    gpu: str
    dry: str
    limit_s: float
    dry_limit_s: float
    reports_json: bool = True
    # Inner errors at these paths of the JSON are a peer's known failure: kept as `peer_errors`, not a
    # failed step (the step's own figures stand).
    known_peer_failures: tuple[str, ...] = ()

    def argv(self, dry_run: bool) -> list[str]:
        words = (self.dry if dry_run else self.gpu).split()
        return [str(HERE / words[0]), *words[1:]] if words[0].endswith(".py") else words


STEPS = (
    Step(
        "decode",
        "Llama-3.2-1B shape, bf16, batch 1: hfjax vs transformers eager and torch.compile (CUDA graphs)",
        gpu="decode.py --gpu-llama-1b --prompts 128 --batches 1 --runs 2 --pairs 2 --gpu-levers",
        dry="decode.py --sizes tiny --prompts 8 --batches 1 --new-tokens 4 --runs 1 --pairs 1 "
        "--skip hand_recipe,torch_dynamic --gpu-levers",
        limit_s=330,
        dry_limit_s=300,
    ),
    Step(
        "profile",
        "Llama-3.2-1B shape, bf16, batch 1: one decode step's kernels on the device, summed by name",
        gpu="profile_decode.py --size llama-1b --dtype bfloat16 --new-tokens 64 --no-command-buffers",
        dry="profile_decode.py --size tiny --prompt 8 --new-tokens 4",
        limit_s=120,
        dry_limit_s=120,
    ),
    Step(
        "load",
        "hfjax.load vs from_pretrained vs a plain safetensors read, warm and cold page cache",
        gpu="load.py --size llama-1b --dtype bfloat16 --device gpu --rounds 1",
        dry="load.py --size tiny --rounds 1 --caches cold --methods hfjax,transformers,safetensors",
        limit_s=120,
        dry_limit_s=180,
    ),
    Step(
        "diffusion",
        "SD-2-shaped pipeline, 512 px, 20 steps, bf16: hfjax whole loop vs diffusers eager and torch.compile",
        gpu="diffusion.py --sizes sd2 --steps 20 --repeats 2 --device gpu --dtype bfloat16 --hfjax-modes whole_loop",
        dry="diffusion.py --sizes tiny --steps 2 --repeats 1 --hfjax-modes whole_loop --compile-backend eager",
        limit_s=300,
        dry_limit_s=240,
    ),
    Step(
        "train",
        "150M Llama, batch 8 x 512, bf16, full and LoRA: hfjax vs torch autocast eager and torch.compile",
        gpu="train.py --sizes 150m --batch 8 --length 512 --steps 3 --warmup 2 --compute-dtype bfloat16",
        dry="train.py --sizes tiny --batch 2 --length 16 --steps 1 --warmup 1 --compute-dtype bfloat16 "
        "--compile-backend aot_eager --methods hfjax,torch_compile",
        limit_s=300,
        dry_limit_s=300,
    ),
    Step(
        "serve",
        "hfjax serve vs transformers serve, 16 concurrent streamed requests",
        gpu="serve.py --size 150m --concurrency 16 --clients async --prefix-tokens 0 --pairs 2 "
        "--servers hfjax transformers --transformers-device cuda",
        dry="serve.py --size tiny --concurrency 16 --clients async --prefix-tokens 0 --pairs 1 "
        "--servers hfjax transformers --prompt-tokens 8 --new-tokens 8 --requests-per-client 1 --min-requests 16",
        limit_s=240,
        dry_limit_s=300,
        # transformers serve --continuous-batching 5.17 (the GPU machines') closes a chat stream after its
        # role delta (reproduced with curl alone); serve.py records that as the peer's error
        known_peer_failures=("/servers/transformers",),
    ),
    Step(
        "demo",
        "hfjax demo",
        gpu="-m hfjax.cli demo",
        dry="-m hfjax.cli demo --seq-len 16",
        limit_s=60,
        dry_limit_s=180,
        reports_json=False,
    ),  # fmt: skip
    Step(
        "tests",
        "parity, generate, training, diffusion and serving-engine tests under pytest-xdist",
        # -v: pytest-xdist names each test as it ends, so a step stopped at its limit still says which failed
        gpu=f"-m pytest {' '.join(TEST_FILES)} -n 8 -v -p no:cacheprovider",
        dry=f"-m pytest {' '.join(DRY_TESTS)} -n 2 -v -p no:cacheprovider",
        limit_s=540,
        dry_limit_s=300,
        reports_json=False,
    ),
)


# ---------------------------------------------------------------- running a step


def run_step(step: Step, argv: list[str], limit_s: float, env: dict, logs: pathlib.Path) -> dict:
    """Runs one step in a process group of its own (its workers and servers are ended with it)."""
    out_path, err_path = logs / f"{step.name}.out", logs / f"{step.name}.err"
    record = {"what": step.what, "command": " ".join(["python", *argv]), "limit_s": limit_s}
    start = time.perf_counter()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        process = subprocess.Popen(
            [sys.executable, *argv], stdout=out, stderr=err, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            process.wait(timeout=limit_s)
            record["timed_out"] = False
        except subprocess.TimeoutExpired:
            _end_group(process)
            record["timed_out"] = True
    record["seconds"] = time.perf_counter() - start
    record["returncode"] = process.returncode
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    record["ok"] = process.returncode == 0 and not record["timed_out"]
    if step.reports_json and record["ok"]:
        try:
            record["result"] = json.loads(stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            record["ok"] = False
            record["error"] = "the last line on stdout is not JSON"
        else:
            # A peer that failed inside the script (inductor on this machine, say) fails the step.
            found = inner_errors(record["result"])
            record["peer_errors"] = {k: v for k, v in found.items() if k in step.known_peer_failures}
            record["inner_errors"] = {k: v for k, v in found.items() if k not in step.known_peer_failures}
            record["ok"] = not record["inner_errors"]
    if not record["ok"] or not step.reports_json:
        record["output_tail"] = (stdout + "\n" + stderr)[-3000:]
    if not step.reports_json:  # pytest's line for each failed test, as it came (-v; the demo prints none)
        record["failed_tests"] = [
            line.strip() for line in stdout.splitlines() if " FAILED " in line or " ERROR " in line
        ]
    return record


def inner_errors(value, where: str = "") -> dict[str, str]:
    """{path in a script's JSON: message} of every "error" field in it."""
    found = {}
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("error", "errors") and item:
                found[where or "."] = str(item)[:500]
            else:
                found.update(inner_errors(item, f"{where}/{key}"))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found.update(inner_errors(item, f"{where}/{index}"))
    return found


def _end_group(process: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


# ---------------------------------------------------------------- headline figures


def headlines(name: str, result: dict | None) -> dict:
    """A few figures of a step's JSON for the README's table (what is missing is left out)."""
    if not result:
        return {}
    try:
        return _HEADLINES[name](result)
    except (KeyError, TypeError, IndexError, ValueError):
        return {}


def _decode(result: dict) -> dict:
    out = {}
    for row in result.get("results", []):
        if "error" in row:
            out[f"{row['method']}/b{row['batch']}"] = {"error": row["error"][:200]}
            continue
        figures = {"tok_s": row["decode_tokens_per_s"], "tok_s_total": row["decode_tokens_per_s_total"]}
        if "fraction_of_ceiling" in row:
            figures["fraction_of_ceiling"] = row["fraction_of_ceiling"]
        if "cuda_graphs" in row:
            figures["cuda_graphs"] = row["cuda_graphs"]
            figures["compile_mode"] = row.get("compile_mode")
        out[f"{row['method']}/p{row['prompt']}/b{row['batch']}"] = figures
    out["ratios"] = result.get("ratios")
    out["gpu_levers"] = {
        config: {"hook": levers["hook"], "over_default": levers["over_default"], "tok_s": levers["decode_tokens_per_s"]}
        for config, levers in (result.get("gpu_levers") or {}).items()
    }
    out["time_to_first_token_new_process"] = {
        label: (result.get("time_to_first_token_new_process") or {}).get(label, {}).get("time_to_first_token_s")
        for label in ("cold", "warm")
    }
    return out


def _load(result: dict) -> dict:
    return {
        cache: {m: {k: r.get(k) for k in ("seconds", "gb_per_s", "peak_rss_bytes")} for m, r in methods.items()
                if isinstance(r, dict) and "seconds" in r}
        for cache, methods in result["results"].items()
    } | {"targets": result.get("targets")}  # fmt: skip


def _diffusion(result: dict) -> dict:
    sizes = [key for key, value in result.items() if isinstance(value, dict) and "pixels" in value]
    return {
        size: {mode: figures.get("median_s") for mode, figures in result[size].items() if isinstance(figures, dict)}
        | {f"{m}/{k}": v for m, f in result[size].items() if isinstance(f, dict) for k, v in f.items()
           if k.startswith("speedup")}
        for size in sizes
    }  # fmt: skip


def _train(result: dict) -> dict:
    return {
        f"{row['method']}/{row['size']}/{row['mode']}": row.get("error")
        or {k: row.get(k) for k in ("step_s", "tokens_per_s", "speedup_vs_torch_eager", "speedup_vs_torch_compile")}
        for row in result["rows"]
    }


def _serve(result: dict) -> dict:
    return {"over_transformers": result.get("over_transformers")}


def _profile(result: dict) -> dict:
    keys = ("decode_tokens_per_s", "kernels_per_step", "busy_us_per_step", "wall_us_per_step")
    return {key: result[key] for key in keys if key in result}


_HEADLINES = {
    "decode": _decode,
    "profile": _profile,
    "load": _load,
    "diffusion": _diffusion,
    "train": _train,
    "serve": _serve,
}


# ---------------------------------------------------------------- the run


def device_and_versions(env: dict) -> dict:
    """The devices JAX and torch see, and the versions, from a process of its own."""
    code = (
        "import json, jax, torch\n"
        "print(json.dumps({'jax_backend': jax.default_backend(), 'jax_devices': [d.device_kind for d in jax.devices()],"
        " 'torch_cuda': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))"
    )
    found: dict = {}
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        found = (
            json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {"error": done.stderr[-500:]}
        )
    except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as error:
        found = {"error": repr(error)}
    from importlib import metadata

    versions = {}
    for name in ("hfjax", "jax", "jaxlib", "torch", "torchax", "transformers", "diffusers", "accelerate", "optax",
                 "peft", "safetensors", "pytest-xdist", "fastapi", "uvicorn"):  # fmt: skip
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    versions["python"] = sys.version.split()[0]
    return {"device": {**found, "cpu_count": os.cpu_count()}, "versions": versions}


def step_env(dry_run: bool, work: pathlib.Path) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false",
           "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    if dry_run:
        env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    else:
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return env


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-dry-run", action="store_true", help="every step with tiny shapes on the CPU")
    parser.add_argument("--only", help=f"steps to run, comma-separated, of {', '.join(s.name for s in STEPS)}")
    parser.add_argument(
        "--limit", action="append", default=[], metavar="STEP=SECONDS", help="a step's time limit (repeatable)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        help="the whole run's seconds (default 540 on a GPU: a 10-minute call less the install and the time to end a step; 1500 dry)",
    )
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument(
        "--logs", help="keep each step's stdout and stderr in this directory (default: a temporary one)"
    )
    args = parser.parse_args(argv)
    names = [s.name for s in STEPS]
    args.only = [n.strip() for n in args.only.split(",")] if args.only else names
    unknown = [n for n in args.only if n not in names]
    if unknown:
        raise SystemExit(f"--only: unknown step(s) {', '.join(map(repr, unknown))}; choose from {', '.join(names)}")
    limits = {}
    for item in args.limit:
        name, _, seconds = item.partition("=")
        if name not in names or not seconds.replace(".", "", 1).isdigit():
            raise SystemExit(f"--limit {item!r}: write STEP=SECONDS with STEP one of {', '.join(names)}")
        limits[name] = float(seconds)
    args.limits = limits
    if args.budget_s is None:
        args.budget_s = 1500.0 if args.cpu_dry_run else 540.0
    return args


def _write(path: str, report: dict) -> str:
    """Writes `report` as JSON to `path` (whole or not at all: a reader never sees half of it); the text."""
    text = json.dumps(report)
    partial = pathlib.Path(f"{path}.tmp")
    partial.write_text(text + "\n")
    os.replace(partial, path)
    return text


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hfjax-accelerator-") as tmp:
        work = pathlib.Path(tmp)
        logs = pathlib.Path(args.logs) if args.logs else work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = step_env(args.cpu_dry_run, work)
        report = {
            "benchmark": "accelerator",
            "mode": "cpu-dry-run" if args.cpu_dry_run else "gpu",
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            **device_and_versions(env),
            "budget_s": args.budget_s,
            "steps": {},
        }
        log(f"device: {json.dumps(report['device'])}")
        for step in (s for s in STEPS if s.name in args.only):
            left = args.budget_s - (time.perf_counter() - started)
            own = args.limits.get(step.name, step.dry_limit_s if args.cpu_dry_run else step.limit_s)
            if left < _SKIP_BELOW_S:
                report["steps"][step.name] = {
                    "what": step.what,
                    "ok": False,
                    "skipped": f"{left:.0f} s of the budget left",
                }
                log(f"{step.name}: skipped, {left:.0f} s of the budget left")
                continue
            limit = min(own, left)
            shapes = "dry run, tiny shapes on the CPU: " if args.cpu_dry_run else ""
            log(f"{step.name}: {shapes}{step.what} (limit {limit:.0f} s) ...")
            record = run_step(step, step.argv(args.cpu_dry_run), limit, env, logs)
            record["headlines"] = headlines(step.name, record.get("result"))
            report["steps"][step.name] = record
            state = (
                "ok" if record["ok"] else ("timed out" if record["timed_out"] else f"failed ({record['returncode']})")
            )
            log(f"  {state} in {record['seconds']:.0f} s")
            if args.out:  # the steps so far, should the call be stopped from outside (a device lease's limit)
                _write(args.out, {**report, "finished": False})
        report["total_s"] = time.perf_counter() - started
        report["failed"] = [name for name, record in report["steps"].items() if not record["ok"]]
        report["finished"] = True
    text = _write(args.out, report) if args.out else json.dumps(report)
    print(text)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
