"""`hfjax shard-plan`: how a checkpoint would be split over a mesh, from its config and headers alone."""

from __future__ import annotations

import argparse

from ._options import at_least_one, model_options, model_path, quantize_options


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "shard-plan",
        parents=[model_options(quantize=True)],
        help="print each parameter's PartitionSpec and bytes per device over a mesh",
        description="Builds the model's structure from config.json (no weights are read; the dtype comes from the "
        "safetensors headers) and prints the PartitionSpec, shape and bytes per device of every parameter, "
        "then the total per device. Needs no devices: the mesh is only a shape. A quantized model (--quantize, "
        "or a checkpoint published quantized) shows its quantized weights and their scales.",
    )
    parser.add_argument("--task", default=None, help="transformers pipeline task (default: from config.architectures)")


def run(args: argparse.Namespace) -> int:
    import jax

    from .. import _tasks, bridge, quantization
    from ..parallel import plan

    args.model = model_path(args)
    at_least_one(args, "model_parallel", "data_parallel")
    path = bridge.resolve_checkpoint(args.model)
    config = bridge.read_config(path)
    files = bridge.weight_files(path)
    dtype = args.dtype or bridge.checkpoint_dtype(files)
    module = bridge.build_skeleton(config, args.task or _tasks.infer(config), dtype)
    options = quantize_options(args)
    settings = quantization.settings(options["quantize"], options["quantize_lm_head"], caller="hfjax shard-plan")
    quantization.prepare_load(module, config, files, settings, dtype)  # quantized layers as they would load
    mesh = jax.sharding.AbstractMesh((args.data_parallel, args.model_parallel), ("data", "model"))
    print(plan(module, mesh).table())
    return 0
