"""`hfjax build-kernels`: build and load hfjax's CPU decoding kernels now, and say whether they run here."""

from __future__ import annotations

import argparse
import sys
import time


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "build-kernels",
        help="build hfjax's CPU kernels for decoding (otherwise built when a model is first loaded)",
        description="Compiles hfjax's kernels (AVX-512; on AVX2 the attention, and the products with HFJAX_CPU_KERNELS=avx2) for decoding on the CPU with the host's C++ compiler into "
        "~/.cache/hfjax/kernels (once per machine), checks and loads them, and prints whether they are used. "
        "Exit code 0 when they are loaded or do not apply to this machine, 1 when a build failed.",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds the compiler may take (default: 300)")


def run(args: argparse.Namespace) -> int:
    from hfjax import _backend

    if args.timeout <= 0:
        print(f"hfjax build-kernels: --timeout={args.timeout} must be > 0 seconds", file=sys.stderr)
        return 2
    try:
        command, why_not = _backend.kernel_compiler()
    except ImportError as error:
        print(
            f"hfjax build-kernels: hfjax.cpu is not installed ({error}); the generic engine runs on the CPU",
            file=sys.stderr,
        )
        return 1
    if command is None:
        print(f"hfjax build-kernels: not used on this machine: {why_not}")
        return 0
    print(f"hfjax build-kernels: building with {command} (up to {args.timeout:.0f} s)...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    digest = _backend.build_kernels(args.timeout)
    print(f"hfjax build-kernels: {_backend.kernels_status()} ({time.perf_counter() - start:.1f} s)")
    return 0 if digest is not None else 1
