"""The `hfjax` command line: one module per subcommand, each with `add_parser` and `run`.

    hfjax demo | check | generate | chat | serve | classify | transcribe | finetune | image | shard-plan | launch | build-kernels

Unlike the library, the command line owns its process: it keeps compiled programs on disk
($HFJAX_CACHE_DIR, default ~/.cache/hfjax/xla; "off" turns it off).

Public names: `main`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from .. import _compilation_cache
from .._compilation_cache import set_cache_dir
from . import (
    build_kernels,
    chat,
    check,
    classify,
    demo,
    finetune,
    generate,
    image,
    launch,
    serve,
    shard_plan,
    transcribe,
)

__all__ = ["main"]

_COMMANDS = {
    "demo": demo,
    "check": check,
    "generate": generate,
    "chat": chat,
    "serve": serve,
    "classify": classify,
    "transcribe": transcribe,
    "finetune": finetune,
    "image": image,
    "shard-plan": shard_plan,
    "launch": launch,
    "build-kernels": build_kernels,
}


def _no_torchvision_fallback_note(record: logging.LogRecord) -> bool:
    # diffusers' pipelines import transformers' CLIP image processors; without torchvision
    # transformers substitutes their PIL versions, which is what a pipeline run needs, and
    # says so on every run.
    return "requires torchvision (not installed); falling back" not in record.getMessage()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hfjax", description="Run Hugging Face PyTorch models on JAX and XLA, unchanged."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in _COMMANDS.values():
        command.add_parser(subparsers)
    args = parser.parse_args(argv)
    # torchax runs JAX with 32-bit integers and floats by design; JAX's note on each 64-bit
    # cast in the model code (with advice to enable x64) is noise on a terminal.
    warnings.filterwarnings("ignore", message=r"Explicitly requested dtype (int|uint|float|complex)(64|128)")
    logging.getLogger("transformers.utils.import_utils").addFilter(
        _no_torchvision_fallback_note
    )  # addFilter skips repeats
    if args.command is None:
        parser.print_help()
        return 2
    # The command line owns its process: compiled programs are kept between runs unless turned off.
    # (`launch` only starts processes, each of which does this for itself; it never starts JAX.)
    if args.command != "launch":
        set_cache_dir(os.environ.get(_compilation_cache.VARIABLE, str(_compilation_cache.DEFAULT)))
    try:
        return _COMMANDS[args.command].run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
