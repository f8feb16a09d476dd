"""What the subcommands share: the parser class, the help format, and the model options.

The model options (MODEL or `--model`, `--dtype`, `--model-parallel`, `--data-parallel`) are defined
once, in `model_options`, with the names vLLM and transformers use as aliases (`--tensor-parallel-size`,
`--data-parallel-size`, `--dtype auto`); each subcommand takes them as a parent parser. As `vllm serve
MODEL` and `transformers chat MODEL` do, every subcommand that loads a model takes it as its first
positional argument, or as `--model`.
"""

from __future__ import annotations

import argparse

from .. import _dtypes

DTYPES = ("auto", *_dtypes.NAMES)
QUANTIZE_MODES = ("int8", "fp8", "int4")  # hfjax.quantization.MODES, without importing it (no torch at parse time)
# vLLM's --quantization names of the checkpoint formats hfjax reads: {name: the config's quant_method}.
QUANTIZATION_METHODS = {
    "awq": "awq", "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq", "fp8": "fp8",
    "compressed-tensors": "compressed-tensors",
}  # fmt: skip


class FlagError(ValueError):
    """Flags that parse but do not go together, or a value out of range: exit code 2."""


class HelpFormatter(argparse.HelpFormatter):
    """argparse's format, with each option's default after its help, unless the help already
    says it (a default in words, such as "the checkpoint's") or the option is a switch or required."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = "default" in text or action.required or action.nargs == 0
        if shown or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line: the command, what is wrong, where to read more."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}; see `{self.prog} --help`\n")


def _dtype(value: str) -> str | None:
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(f"invalid dtype {value!r}; choose from {', '.join(DTYPES)}")
    return None if value == "auto" else value


def model_options(*, dtype: bool = True, mesh: bool = True, quantize: bool = False) -> Parser:
    """A parent parser with the model options a subcommand takes.

    The model is the first positional argument, MODEL, or `--model` (read it with `model_path`;
    parse with `parse_command`, which lets options come between MODEL and the other positionals).

    Args:
      dtype: add `--dtype` (default auto: the checkpoint's; parsed to None or a dtype name).
      mesh: add `--model-parallel` / `--tensor-parallel-size` and `--data-parallel` /
        `--data-parallel-size` (default 1 each).
      quantize: add `--quantize`, `--quantization` and `--quantize-lm-head` (`hfjax.load`'s
        quantize= and quantize_lm_head=; read them with `quantize_options`).
    """
    parent = Parser(add_help=False)
    parent.add_argument(
        "positional_model", nargs="?", default=None, metavar="MODEL", help="checkpoint directory or hub id"
    )
    parent.add_argument("--model", default=None, help="MODEL, given as a flag instead (default: none)")
    if dtype:
        parent.add_argument(
            "--dtype",
            type=_dtype,
            default="auto",
            metavar="{" + ",".join(DTYPES) + "}",
            help="weights dtype; auto: the checkpoint's",
        )
    if mesh:
        parent.add_argument(
            "--model-parallel",
            "--tensor-parallel-size",
            dest="model_parallel",
            type=int,
            default=1,
            metavar="N",
            help="devices each weight is split over (tensor parallel)",
        )
        parent.add_argument(
            "--data-parallel",
            "--data-parallel-size",
            dest="data_parallel",
            type=int,
            default=1,
            metavar="N",
            help="devices the batch is split over; --data-parallel x --model-parallel devices are used",
        )
    if quantize:
        parent.add_argument(
            "--quantize",
            choices=QUANTIZE_MODES,
            default=None,
            help="quantize the linear layers while loading: int8 (a scale per output channel), fp8 (e4m3, a "
            "scale per output channel) or int4 (groups of 128 inputs); a checkpoint published quantized "
            "(fp8, compressed-tensors, GPTQ, AWQ) is read as it is without it (default: none)",
        )
        parent.add_argument(
            "--quantization",
            default=None,
            metavar="METHOD",
            help="vLLM's flag: the checkpoint's quantization method ("
            + ", ".join(QUANTIZATION_METHODS)
            + "; the config's quant_method), which hfjax reads without it; a method that is not the "
            "checkpoint's is an error. On an unquantized checkpoint, fp8 quantizes as --quantize fp8 does (weights "
            "only, where vLLM's dynamic fp8 also quantizes activations), and int8 and int4 as --quantize does "
            "(default: none)",
        )
        parent.add_argument("--quantize-lm-head", action="store_true", help="with --quantize: quantize the LM head too")
    return parent


def quantize_options(args: argparse.Namespace, model: str | None = None) -> dict:
    """`hfjax.load`'s quantize= and quantize_lm_head= from `--quantize`, `--quantization` and
    `--quantize-lm-head`, for the checkpoint `model` (default: MODEL or `--model`).

    Raises:
      FlagError: `--quantization` naming a method hfjax does not read, or not the checkpoint's, or
        given with `--quantize`.
    """
    quantize = getattr(args, "quantize", None)
    method = getattr(args, "quantization", None)
    if method is not None:
        quantize = _quantize_for(method, quantize, model if model is not None else model_path(args))
    return {"quantize": quantize, "quantize_lm_head": getattr(args, "quantize_lm_head", False)}


def _quantize_for(method: str, quantize: str | None, model: str) -> str | None:
    # --quantization METHOD checked against the checkpoint's quant_method; what to quantize on load, if anything.
    from .. import bridge, quantization

    allowed = ", ".join([*QUANTIZATION_METHODS, "int8", "int4"])
    if method not in QUANTIZATION_METHODS and method not in QUANTIZE_MODES:
        raise FlagError(f"--quantization {method}: hfjax does not read {method} checkpoints; pass one of {allowed}")
    if quantize is not None:
        raise FlagError(f"--quantization {method} and --quantize {quantize}: pass one of them")
    found = quantization.checkpoint_method(bridge.read_config(bridge.resolve_checkpoint(model)))
    if found is None:
        if method not in QUANTIZE_MODES:
            raise FlagError(
                f"--quantization {method}: the checkpoint is not quantized (its config.json has no "
                "quantization_config); leave --quantization out, or pass --quantization fp8 to quantize it on load"
            )
        return method
    if found not in QUANTIZATION_METHODS.values():
        return None  # a format hfjax cannot read: hfjax.load says so, naming it
    if QUANTIZATION_METHODS.get(method) != found:
        raise FlagError(
            f"--quantization {method} does not match the checkpoint's quantization, {found} (config.json's "
            f"quantization_config.quant_method); pass --quantization {found} or leave it out"
        )
    return None


def parse_command(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """A subcommand's arguments. One that takes a model (`model_options`) allows options between its
    positional arguments (as `parse_intermixed_args` reads them): `hfjax generate MODEL --stats PROMPT`
    reads as `hfjax generate MODEL PROMPT --stats`. With `--model`, one whose MODEL is followed by a
    list of positionals (classify's TEXTs, transcribe's AUDIO files) takes them all into that list.
    """
    positionals = [action for action in parser._actions if not action.option_strings]
    if not positionals or positionals[0].dest != "positional_model":
        return parser.parse_args(argv)
    args = parser.parse_intermixed_args(argv)
    listed = positionals[1] if len(positionals) > 1 and positionals[1].nargs in ("*", "+") else None
    if listed is not None and args.model is not None and args.positional_model is not None:
        setattr(args, listed.dest, [args.positional_model, *getattr(args, listed.dest)])
        args.positional_model = None
    return args


def model_path(args: argparse.Namespace) -> str:
    """The model a subcommand with `model_options` was given: MODEL or --model.

    Raises:
      FlagError: for neither, or two different ones.
    """
    given = [m for m in (args.positional_model, args.model) if m is not None]
    if not given:
        command = getattr(args, "command", None) or "COMMAND"
        raise FlagError(f"no model given; pass it as MODEL or with --model, e.g. `hfjax {command} ./my-checkpoint ...`")
    if len(set(given)) > 1:
        raise FlagError(
            f"two models given: MODEL {args.positional_model!r} and --model {args.model!r}; pass one of them"
        )
    return given[0]


def at_least_one(args: argparse.Namespace, *names: str) -> None:
    """Checks that each named integer flag is at least 1.

    Raises:
      FlagError: naming the first flag that is not, e.g. "--max-batch=0 must be at least 1".
    """
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise FlagError(f"--{name.replace('_', '-')}={value} must be at least 1")


def mesh(args: argparse.Namespace):
    """The device mesh of `--data-parallel` x `--model-parallel`, or None for one device.

    Raises:
      FlagError: for a size below 1.
      ShardingError: for more devices than there are.
    """
    at_least_one(args, "model_parallel", "data_parallel")
    if args.model_parallel * args.data_parallel == 1:
        return None
    import hfjax

    return hfjax.make_mesh(data=args.data_parallel, model=args.model_parallel)
