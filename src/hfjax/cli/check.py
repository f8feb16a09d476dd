"""`hfjax check`: compare one model in hfjax (eager and jit) against PyTorch."""

from __future__ import annotations

import argparse
import sys

from ._options import FlagError, model_options, model_path


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "check",
        parents=[model_options(dtype=False, mesh=False)],
        help="compare a model's outputs in hfjax against PyTorch",
        description="Run a checkpoint in PyTorch and in hfjax (eager and jit), print max |diff| per output "
        "and times; exit 1 on a mismatch.",
    )
    parser.add_argument(
        "--arch",
        default=None,
        help="instead of MODEL: the model_type of a tiny random model to build (see hfjax.testing.FAMILIES) "
        "(default: none)",
    )
    parser.add_argument("--task", default=None, help="transformers pipeline task (default: from config.architectures)")
    parser.add_argument("--batch", type=int, default=2, help="batch size of the random inputs (default: 2)")
    parser.add_argument("--seq-len", type=int, default=8, help="sequence length of the random inputs (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--no-eager", action="store_true", help="skip the op-by-op eager path")


def run(args: argparse.Namespace) -> int:
    from ..tasks import check, check_arch

    if args.arch is not None and (args.model is not None or args.positional_model is not None):
        raise FlagError(f"--arch {args.arch!r} builds a model of its own; pass --arch or a MODEL, not both")
    options = dict(task=args.task, batch=args.batch, seq_len=args.seq_len, seed=args.seed, eager=not args.no_eager)
    report = check_arch(args.arch, **options) if args.arch else check(model_path(args), **options)
    print(report.table())
    if report.error:
        print(f"hfjax check: {report.error}", file=sys.stderr)
    return 0 if report.passed else 1
