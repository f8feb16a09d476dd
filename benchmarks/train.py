"""Training tokens/s and peak memory: hfjax's Trainer against PyTorch eager and torch.compile.

    python benchmarks/train.py                       # 20m and 150m Llama shapes, full and LoRA
    python benchmarks/train.py --sizes 20m --quick   # one model, fewer steps: a few minutes
    python benchmarks/train.py --sizes 150m --batch 8 --length 512 --compute-dtype bfloat16   # on a GPU

Each (method, size, mode) runs in a process of its own, so that peak memory is that run's and
no runtime shares the process (PyTorch's workers never import JAX). Every method trains the same
checkpoint (float32, random weights, `hfjax.testing`) on the same random batches with AdamW
(lr 1e-4, clipping at 1.0); LoRA is rank 8 on every linear layer of the decoder, through peft.
With --compute-dtype bfloat16, hfjax's Trainer runs forward and backward in bfloat16
(compute_dtype) and PyTorch under torch.autocast(bfloat16): both keep float32 weights.
Reported per run: median step time after the warm-up steps, training tokens/s (batch x length /
step time), peak memory (CPU: the process's peak resident set; GPU: the device's peak bytes in
use), the first-step loss (the methods must agree: same weights, same batch), the compile time
(first step minus a warm one). The last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from shapes import LLAMA_20M, LLAMA_150M, LLAMA_TINY  # noqa: E402
from workers import run_json  # noqa: E402

SIZES = {"tiny": LLAMA_TINY, "20m": LLAMA_20M, "150m": LLAMA_150M}
METHODS = ("hfjax", "torch_eager", "torch_compile")
LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}
_WORKER_TIMEOUT_S = 3600


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def batches(count: int, batch: int, length: int, vocab: int):
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, (batch, length)) for _ in range(count)]


def peak_memory_bytes(device: str) -> int:
    if device == "gpu_jax":
        import jax

        return int(jax.devices()[0].memory_stats().get("peak_bytes_in_use", 0))
    if device == "gpu_torch":
        import torch

        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def hfjax_worker(args) -> dict:
    import jax
    import peft

    import hfjax
    from hfjax import training

    model = hfjax.load(args.checkpoint)
    lora = peft.LoraConfig(**LORA) if args.mode == "lora" else None
    trainer = hfjax.Trainer(
        model, training.adamw(1e-4), lora=lora, max_grad_norm=1.0, dropout=False, compute_dtype=args.compute_dtype
    )
    times, losses = [], []
    for ids in batches(args.warmup + args.steps, args.batch, args.length, model.config.vocab_size):
        start = time.perf_counter()
        metrics = trainer.step({"input_ids": ids, "labels": ids})  # host floats: waits for the step
        jax.block_until_ready(trainer.trainable)
        times.append(time.perf_counter() - start)
        losses.append(metrics["loss"])
    gpu = jax.default_backend() == "gpu"
    return result(args, times, losses, peak_memory_bytes("gpu_jax" if gpu else "cpu"), compiled=True)


def torch_worker(args) -> dict:
    import torch
    import transformers

    torch.set_num_threads(args.torch_threads)
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint).to(device).eval()
    if args.mode == "lora":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    autocast = dict(device_type=device, dtype=getattr(torch, args.compute_dtype or "float32"))
    autocast["enabled"] = args.compute_dtype is not None

    def step(ids):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(**autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return loss

    if args.method == "torch_compile":
        step = torch.compile(step, backend=args.compile_backend)
    times, losses = [], []
    for ids in batches(args.warmup + args.steps, args.batch, args.length, model.config.vocab_size):
        ids = torch.as_tensor(ids).to(device)
        start = time.perf_counter()
        loss = step(ids).item()  # .item() waits for the step
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss)
    return result(
        args, times, losses, peak_memory_bytes("gpu_torch" if gpu else "cpu"), compiled=args.method == "torch_compile"
    )


def result(args, times: list[float], losses: list[float], peak: int, *, compiled: bool) -> dict:
    timed = times[args.warmup :]
    step_s = statistics.median(timed)
    return {
        "method": args.method,
        "size": args.size,
        "mode": args.mode,
        "step_s": step_s,
        "tokens_per_s": args.batch * args.length / step_s,
        "peak_memory_mb": peak / 2**20,
        "first_loss": losses[0],
        "compile_s": times[0] - step_s if compiled else None,
    }


def run_worker(args, method: str, size: str, mode: str, checkpoint: pathlib.Path, env: dict) -> dict:
    command = [
        sys.executable, __file__, "--worker", method, "--size", size, "--mode", mode, "--checkpoint", str(checkpoint),
        "--batch", str(args.batch), "--length", str(args.length), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--torch-threads", str(args.torch_threads),
        "--compile-backend", args.compile_backend,
    ]  # fmt: skip
    if args.compute_dtype:
        command += ["--compute-dtype", args.compute_dtype]
    row = run_json(command, env, timeout=_WORKER_TIMEOUT_S, what=f"worker {method} {size} {mode}")
    return {"method": method, "size": size, "mode": mode, **row} if "error" in row else row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="20m,150m", help=f"comma-separated: {', '.join(SIZES)}")
    parser.add_argument("--modes", default="full,lora", help="comma-separated: full, lora")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated: {', '.join(METHODS)}")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (the median is reported)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing (compiles happen here)")
    parser.add_argument("--quick", action="store_true", help="2 timed steps after 1 warm-up")
    parser.add_argument("--torch-threads", type=int, default=os.cpu_count())
    parser.add_argument(
        "--compute-dtype",
        choices=("bfloat16", "float16"),
        help="train in this dtype: hfjax's compute_dtype against torch.autocast (default: float32 throughout)",
    )
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of torch_compile (default inductor; aot_eager for a quick plumbing check)",
    )
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup = 2, 1
    if args.worker:
        args.method = args.worker
        print(json.dumps(hfjax_worker(args) if args.worker == "hfjax" else torch_worker(args)))
        return

    from hfjax import testing

    work = pathlib.Path(tempfile.mkdtemp(prefix="hfjax-bench-train-"))
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HFJAX_CACHE_DIR": str(work / "xla")}
    rows = []
    for size in args.sizes.split(","):
        checkpoint = testing.save_tiny_checkpoint("llama", work / size, **SIZES[size])
        for mode in args.modes.split(","):
            for method in args.methods.split(","):
                log(f"{method} {size} {mode} ...")
                row = run_worker(args, method, size, mode, checkpoint, env)
                log(f"  {json.dumps(row)}")
                rows.append(row)
    for row in rows:  # against PyTorch eager and torch.compile on the same model and mode
        for baseline in ("torch_eager", "torch_compile"):
            other = next(
                (r for r in rows if r["method"] == baseline and r["size"] == row["size"] and r["mode"] == row["mode"]),
                None,
            )
            if other and other is not row and "error" not in row and "error" not in other:
                row[f"speedup_vs_{baseline}"] = row["tokens_per_s"] / other["tokens_per_s"]
    import jax
    import torch

    settings = {
        "batch": args.batch,
        "length": args.length,
        "steps": args.steps,
        "warmup": args.warmup,
        "torch_threads": args.torch_threads,
        "compute_dtype": args.compute_dtype or "float32",
        "compile_backend": args.compile_backend,
    }
    print(
        json.dumps(
            {
                "benchmark": "train",
                "settings": settings,
                "backend": jax.default_backend(),
                "torch": torch.__version__,
                "jax": jax.__version__,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
