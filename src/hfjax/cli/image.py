"""`hfjax image`: one image from a diffusers pipeline running on JAX, written as a PNG."""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from ._options import FlagError, at_least_one, model_options, model_path


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "image",
        parents=[model_options(mesh=False)],
        help="generate an image with a diffusers pipeline compiled by XLA",
        description="Load a diffusers pipeline (directory or hub id) with hfjax.load_pipeline, run it on a "
        "prompt and write the first image as a PNG.",
    )
    parser.add_argument("prompt", help="text prompt")
    parser.add_argument("--out", required=True, help="PNG file to write (its directory is made if missing)")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps (default: 20)")
    parser.add_argument("--guidance", type=float, default=7.5, help="classifier-free guidance scale (default: 7.5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the starting noise (default: 0)")
    parser.add_argument("--height", type=int, default=None, help="image height in pixels (default: the pipeline's)")
    parser.add_argument("--width", type=int, default=None, help="image width in pixels (default: the pipeline's)")
    parser.add_argument("--negative-prompt", default=None, help="what the image should not show (default: none)")
    parser.add_argument("--whole-loop", action="store_true", help="compile all denoising steps as one program")
    parser.add_argument(
        "--stats", action="store_true", help="run twice and print the time per image with and without compilation"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from .._errors import HfjaxError
    from ..diffusion import load_pipeline

    args.model = model_path(args)
    at_least_one(args, "steps", "height", "width")
    try:  # before the pipeline runs: a run should not end in a path that cannot be written
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise FlagError(f"--out {args.out!r}: cannot make its directory ({error.strerror})") from None
    try:
        pipe = load_pipeline(args.model, dtype=args.dtype, whole_loop="auto" if args.whole_loop else False)
    except HfjaxError as error:
        print(f"hfjax image: {error}", file=sys.stderr)
        return 1

    def generate():
        options = dict(num_inference_steps=args.steps, guidance_scale=args.guidance, output_type="pil")
        options.update({k: v for k, v in (("height", args.height), ("width", args.width)) if v is not None})
        if args.negative_prompt is not None:
            options["negative_prompt"] = args.negative_prompt
        start = time.perf_counter()
        image = pipe(args.prompt, generator=torch.Generator().manual_seed(args.seed), **options).images[0]
        return image, time.perf_counter() - start

    try:
        image, first = generate()
        if args.stats:
            image, again = generate()
    except HfjaxError as error:
        print(f"hfjax image: {error}", file=sys.stderr)
        return 1
    image.save(args.out, format="PNG")
    print(f"wrote {args.out} ({image.width}x{image.height}, {args.steps} steps, {pipe.hfjax_path})")
    if args.stats:
        print(f"time per image: {again:.3f} s compiled ({first:.3f} s first call, with compilation)")
    return 0
