"""Seconds per image: diffusers in PyTorch (eager and torch.compile) against hfjax (per-step and whole-loop).

Stable-Diffusion-shaped pipelines with random weights: "tiny" (the test pipeline, 32x32 pixels),
"medium" (a 3-level UNet, 64x64 pixels) and "sd2" (Stable Diffusion 2 base's UNet, VAE and text
encoder shapes, 512x512 pixels; the tokenizer stays the tiny one, so the text encoder's vocabulary
is 600: it runs once per image). Each side runs in its own process: torch's CPU threads run ~30x
slower beside JAX's CPU runtime unless they sleep while waiting, so neither side may slow the
other. Each side warms up (the first call, compilation included, is reported), then reports the
median of several calls.

  torch_eager    diffusers' pipeline as it comes
  torch_compile  the same with its UNet (channels-last on a GPU) and VAE decoder under torch.compile
                 (fullgraph=True, --compile-mode: "reduce-overhead" by default, diffusers' own
                 recommendation, which runs CUDA graphs on a GPU)
  hfjax_*        hfjax.load_pipeline: one program per denoising step, or the whole loop as one

    python benchmarks/diffusion.py [--steps 10] [--repeats 3] [--sizes tiny,medium]
    python benchmarks/diffusion.py --sizes sd2 --steps 20 --device gpu --dtype bfloat16   # on a GPU

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
    # stabilityai/stable-diffusion-2-base's unet/config.json
    "sd2": (
        dict(
            block_out_channels=(320, 640, 1280, 1280),
            layers_per_block=2,
            cross_attention_dim=1024,
            attention_head_dim=(5, 10, 20, 20),
            use_linear_projection=True,
            norm_num_groups=32,
            sample_size=64,
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        ),
        512,
    ),
}
# The rest of "sd2": its VAE and its text encoder (OpenCLIP ViT-H/14's text tower).
SD2_VAE = dict(
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=2,
    norm_num_groups=32,
    latent_channels=4,
    sample_size=512,
)
SD2_TEXT = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=23,
                projection_dim=512, hidden_act="gelu")  # fmt: skip


def build(size: str, path: pathlib.Path, *, dtype: str = "float32", device: str = "cpu") -> pathlib.Path:
    import diffusers
    import torch
    import transformers

    from hfjax.testing import save_tiny_pipeline

    overrides, _ = SIZES[size]
    save_tiny_pipeline("stable-diffusion", path, scheduler="euler")
    if overrides:
        pipe = diffusers.DiffusionPipeline.from_pretrained(path)
        torch.manual_seed(0)
        with torch.device("cuda" if device == "gpu" else "cpu"):  # random init of a large model is quicker there
            pipe.unet = diffusers.UNet2DConditionModel.from_config({**dict(pipe.unet.config), **overrides})
            if size == "sd2":
                pipe.vae = diffusers.AutoencoderKL.from_config({**dict(pipe.vae.config), **SD2_VAE})
                text = {**pipe.text_encoder.config.to_dict(), **SD2_TEXT}
                pipe.text_encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(**text))
        pipe.to(getattr(torch, dtype)).save_pretrained(path)
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
    gpu = args.device == "gpu"
    results = {}
    if args.side == "torch":
        import diffusers

        pipe = diffusers.DiffusionPipeline.from_pretrained(args.path, torch_dtype=getattr(torch, args.dtype))
        pipe = pipe.to("cuda" if gpu else "cpu")
        n_params = sum(p.numel() for p in pipe.unet.parameters())
        modes = {"torch_eager": None, "torch_compile": args.compile_mode}
    else:
        from hfjax import load_pipeline

        pipe = load_pipeline(args.path, dtype=args.dtype)
        n_params = sum(int(a.size) for a in pipe.unet.params.values())
        modes = {f"hfjax_{mode}": mode == "whole_loop" for mode in args.hfjax_modes.split(",")}
    pipe.set_progress_bar_config(disable=True)
    for mode, setting in modes.items():
        if args.side == "hfjax":
            pipe.hfjax_whole_loop = setting
        elif setting is not None:
            if gpu:  # diffusers' own advice for CUDA GPUs
                pipe.unet.to(memory_format=torch.channels_last)
            options = dict(mode=setting, fullgraph=True, backend=args.compile_backend)
            if args.compile_backend != "inductor":
                del options["mode"]  # modes are inductor's
            pipe.unet = torch.compile(pipe.unet, **options)
            pipe.vae.decode = torch.compile(pipe.vae.decode, **options)

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

        try:
            results[mode] = _time_calls(call, args.repeats)
        except Exception as error:  # reported in the JSON line (inductor failing on this machine, say)
            results[mode] = {"error": f"{type(error).__name__}: {str(error)[:800]}"}
            continue
        if args.side == "hfjax":
            results[mode]["path"] = pipe.hfjax_path
        elif setting is not None:
            results[mode]["compile"] = {**options, "compiled": ["unet", "vae.decode"]}
    return {"unet_params": n_params, **results}


def _child(size: str, path: pathlib.Path, which: str, args) -> dict:
    command = [
        sys.executable, __file__, "--child", which, "--size", size, "--path", str(path),
        "--steps", str(args.steps), "--repeats", str(args.repeats), "--device", args.device,
        "--dtype", args.dtype, "--compile-mode", args.compile_mode, "--compile-backend", args.compile_backend,
        "--hfjax-modes", args.hfjax_modes,
    ]  # fmt: skip
    environment = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    if args.device == "cpu":
        environment.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(command, capture_output=True, text=True, env=environment)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark child {which}/{size} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="denoising steps per image (default 10)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls after the first (default 3)")
    parser.add_argument("--sizes", default="tiny,medium", help="comma-separated subset of " + ",".join(SIZES))
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="where both sides run (default cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="weights and activations of both sides (default float32: the CPU's)")  # fmt: skip
    parser.add_argument(
        "--compile-mode", default="reduce-overhead", help="torch.compile mode of the torch_compile side"
    )
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of the torch_compile side (default inductor; eager for a quick plumbing check: "
        "aot_eager stops on the CPU at a group norm's memory-format check)",
    )
    parser.add_argument(
        "--hfjax-modes", default="per_step,whole_loop", help="hfjax's paths, comma-separated: per_step, whole_loop"
    )
    parser.add_argument("--child", choices=("torch", "hfjax"), help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = set(args.hfjax_modes.split(",")) - {"per_step", "whole_loop"}
    if unknown:
        raise SystemExit(f"--hfjax-modes: unknown {', '.join(sorted(unknown))}; choose from per_step, whole_loop")
    if args.child:
        args.side = args.child
        print(json.dumps(side(args)))
        return

    report = {
        "benchmark": "diffusion",
        "device": args.device,
        "dtype": args.dtype,
        "steps": args.steps,
        "repeats": args.repeats,
    }
    with tempfile.TemporaryDirectory(prefix="hfjax-bench-") as scratch:
        for size in args.sizes.split(","):
            path = build(size, pathlib.Path(scratch) / size, dtype=args.dtype, device=args.device)
            torch_side = _child(size, path, "torch", args)
            jax_side = _child(size, path, "hfjax", args)
            entry = {"pixels": SIZES[size][1], **torch_side, **jax_side}
            for mode in [m for m in entry if m.startswith("hfjax_")]:
                for baseline in ("torch_eager", "torch_compile"):
                    if "median_s" in entry[mode] and "median_s" in entry.get(baseline, {}):
                        ratio = entry[baseline]["median_s"] / entry[mode]["median_s"]
                        entry[mode][f"speedup_vs_{baseline}"] = round(ratio, 3)
            report[size] = entry
            print(f"{size}: {json.dumps(entry)}", file=sys.stderr)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
