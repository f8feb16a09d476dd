"""The `hfjax` command line: one module per subcommand, each with `add_parser` and `run`.

    hfjax demo | check | generate | chat | serve | classify | transcribe | finetune | image | shard-plan | launch | build-kernels

Unlike the library, the command line owns its process: it keeps compiled programs on disk
($HFJAX_CACHE_DIR, default ~/.cache/hfjax/xla; "off" turns it off). Bad input, whether a flag or
a checkpoint, is one line on stderr: exit code 2 for flags, 1 for what cannot be loaded or run.

Public names: `main`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys

from .. import _compilation_cache
from .._compilation_cache import set_cache_dir
from .._errors import HfjaxError
from .._version import __version__
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
from ._options import FlagError, HelpFormatter, Parser, parse_command

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


class _Version(argparse.Action):
    """`hfjax --version`: hfjax's version and its stack's, from the packages' metadata (nothing is imported)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        stack = []
        for name in ("jax", "torch", "transformers", "torchax"):
            try:
                stack.append(f"{name} {importlib.metadata.version(name)}")
            except importlib.metadata.PackageNotFoundError:
                stack.append(f"{name} not installed")
        print(f"hfjax {__version__} ({', '.join(stack)})")
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="hfjax",
        description="Run Hugging Face PyTorch models on JAX and XLA, unchanged.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action=_Version, help="print hfjax's version and its stack's, then exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in _COMMANDS.values():
        command.add_parser(subparsers)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in subparsers.choices:
        args = parse_command(subparsers.choices[argv[0]], argv[1:])
        args.command = argv[0]
    else:
        args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    command = _COMMANDS[args.command]
    try:
        # A command's checks that need no JAX come first (serve binds its port), in the first second.
        preflight = getattr(command, "preflight", None)
        code = preflight(args) if preflight is not None else None
        if code is not None:
            return code
        # The command line owns its process: compiled programs are kept between runs unless turned off.
        # (`launch` only starts processes, each of which does this for itself; it never starts JAX.)
        if args.command != "launch":
            set_cache_dir(os.environ.get(_compilation_cache.VARIABLE, str(_compilation_cache.DEFAULT)))
        return command.run(args)
    except FlagError as error:
        print(f"hfjax {args.command}: {error}", file=sys.stderr)
        return 2
    except HfjaxError as error:  # a checkpoint that cannot be loaded, a model that cannot do the job, ...
        print(f"hfjax {args.command}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
