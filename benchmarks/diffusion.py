"""Seconds per image: diffusers in PyTorch eager against hfjax (per-step and whole-loop), CPU, float32.

Two Stable-Diffusion-shaped pipelines with random weights: "tiny" (the test pipeline,
32x32 pixels) and "medium" (a 3-level UNet, 64x64 pixels). Each side runs in its own
process: torch's CPU threads run ~30x slower beside JAX's CPU runtime unless they sleep
while waiting, so neither side may slow the other. Each side warms up (the first call,
compilation included, is reported), then reports the median of several calls.

    python benchmarks/diffusion.py [--steps 10] [--repeats 3] [--sizes tiny,medium]

Prints one JSON line last.
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

# name -> (UNet overrides, pixels)
SIZES = {
    "tiny": ({}, 32),
    "medium": (
        dict(
            block_out_channels=(64, 128, 256),
            layers_per_block=2,
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=32,
            sample_size=32,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        ),
        64,
    ),
}


def build(size: str, path: pathlib.Path) -> pathlib.Path:
    import diffusers
    import torch

    from hfjax.testing import save_tiny_pipeline

    overrides, _ = SIZES[size]
    save_tiny_pipeline("stable-diffusion", path, scheduler="euler")
    if overrides:
        pipe = diffusers.DiffusionPipeline.from_pretrained(path)
        torch.manual_seed(0)
        config = {**dict(pipe.unet.config), **overrides}
        pipe.unet = diffusers.UNet2DConditionModel.from_config(config)
        pipe.save_pretrained(path)
    return path


def _time_calls(call, repeats: int) -> dict:
    start = time.perf_counter()
    call()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return {"first_s": round(first, 4), "median_s": round(statistics.median(times), 4)}


def side(args) -> dict:
    """Runs in a child process: one side of the comparison on one pipeline."""
    import torch

    _, pixels = SIZES[args.size]
    results = {}
    if args.side == "torch":
        import diffusers

        pipe = diffusers.DiffusionPipeline.from_pretrained(args.path)
        n_params = sum(p.numel() for p in pipe.unet.parameters())
        modes = {"torch_eager": None}
    else:
        from hfjax import load_pipeline

        pipe = load_pipeline(args.path)
        n_params = sum(int(a.size) for a in pipe.unet.params.values())
        modes = {"hfjax_per_step": False, "hfjax_whole_loop": True}
    pipe.set_progress_bar_config(disable=True)
    for mode, whole_loop in modes.items():
        if whole_loop is not None:
            pipe.hfjax_whole_loop = whole_loop

        def call():
            images = pipe(
                "a red cat",
                num_inference_steps=args.steps,
                height=pixels,
                width=pixels,
                output_type="np",
                generator=torch.Generator().manual_seed(0),
            ).images
            assert images.shape == (1, pixels, pixels, 3)  # np output: the work is done

        results[mode] = _time_calls(call, args.repeats)
        if whole_loop is not None:
            results[mode]["path"] = pipe.hfjax_path
    return {"unet_params": n_params, **results}


def _child(size: str, path: pathlib.Path, which: str, args) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        which,
        "--size",
        size,
        "--path",
        str(path),
        "--steps",
        str(args.steps),
        "--repeats",
        str(args.repeats),
    ]
    environment = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run(command, capture_output=True, text=True, env=environment)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark child {which}/{size} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="denoising steps per image (default 10)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls after the first (default 3)")
    parser.add_argument("--sizes", default="tiny,medium", help="comma-separated subset of " + ",".join(SIZES))
    parser.add_argument("--child", choices=("torch", "hfjax"), help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.side = args.child
        print(json.dumps(side(args)))
        return

    report = {
        "benchmark": "diffusion",
        "device": "cpu",
        "dtype": "float32",
        "steps": args.steps,
        "repeats": args.repeats,
    }
    with tempfile.TemporaryDirectory(prefix="hfjax-bench-") as scratch:
        for size in args.sizes.split(","):
            path = build(size, pathlib.Path(scratch) / size)
            torch_side = _child(size, path, "torch", args)
            jax_side = _child(size, path, "hfjax", args)
            entry = {"pixels": SIZES[size][1], **torch_side, **jax_side}
            baseline = torch_side["torch_eager"]["median_s"]
            for mode in ("hfjax_per_step", "hfjax_whole_loop"):
                entry[mode]["speedup_vs_torch"] = round(baseline / jax_side[mode]["median_s"], 3)
            report[size] = entry
            print(f"{size}: {json.dumps(entry)}", file=sys.stderr)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
