"""`hfjax shard-plan`: how a checkpoint would be split over a mesh, from its config and headers alone."""

from __future__ import annotations

import argparse
import sys

from .. import _dtypes


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "shard-plan",
        help="print each parameter's PartitionSpec and bytes per device over a mesh",
        description="Builds the model's structure from config.json (no weights are read; the dtype comes from the "
        "safetensors headers) and prints the PartitionSpec, shape and bytes per device of every parameter, "
        "then the total per device. Needs no devices: the mesh is only a shape.",
    )
    parser.add_argument("--model", required=True, help="checkpoint directory or hub id")
    parser.add_argument(
        "--model-parallel", type=int, required=True, help="devices along the 'model' axis (tensor parallel)"
    )
    parser.add_argument("--data-parallel", type=int, default=1, help="devices along the 'data' axis (default 1)")
    parser.add_argument("--task", default=None, help="transformers pipeline task (default: from config.architectures)")
    parser.add_argument(
        "--dtype", choices=_dtypes.NAMES, default=None, help="weights dtype (default: the checkpoint's)"
    )


def run(args: argparse.Namespace) -> int:
    import jax

    from .. import _loading
    from .._errors import ShardingError
    from ..parallel import plan

    if args.model_parallel < 1 or args.data_parallel < 1:
        print(
            f"hfjax shard-plan: --model-parallel and --data-parallel must be >= 1, got {args.model_parallel} and {args.data_parallel}",
            file=sys.stderr,
        )
        return 2
    path = _loading.resolve(args.model)
    config = _loading.read_config(path)
    dtype = args.dtype or _loading.checkpoint_dtype(_loading.weight_files(path))
    mesh = jax.sharding.AbstractMesh((args.data_parallel, args.model_parallel), ("data", "model"))
    try:
        shard_plan = plan(config, mesh, task=args.task, dtype=dtype)
    except ShardingError as error:
        print(f"hfjax shard-plan: {error}", file=sys.stderr)
        return 1
    print(shard_plan.table())
    return 0
