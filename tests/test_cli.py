"""The `hfjax` command line, run as a user runs it: its dialect (vLLM's and Hugging Face's flag
names), its help, and its errors (one line on stderr for any bad input)."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys

import pytest

import hfjax
from hfjax import cli
from hfjax.cli import _options

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = _options.Parser(prog="hfjax")
    subparsers = parser.add_subparsers(dest="command")
    for command in cli._COMMANDS.values():
        command.add_parser(subparsers)
    return dict(subparsers.choices)


SUBCOMMANDS = _subcommands()


def _options_of(parser: argparse.ArgumentParser):
    """The options a user types (no -h), with whether each belongs to a required either-or group."""
    either_or = {id(a) for group in parser._mutually_exclusive_groups if group.required for a in group._group_actions}
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            yield action, id(action) in either_or


def test_check_passes_on_a_tiny_checkpoint(checkpoint, capsys):
    code = cli.main(["check", "--model", str(checkpoint("qwen3"))])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "logits" in out and "jit" in out and "eager" in out and "pass" in out


def test_check_exit_code_is_1_on_an_unloadable_model(tmp_path, capsys):
    code = cli.main(["check", "--model", str(tmp_path / "missing")])
    assert code == 1
    assert "no checkpoint directory" in capsys.readouterr().out


def test_console_script_help_and_version():
    result = subprocess.run([sys.executable, "-m", "hfjax.cli", "--help"], capture_output=True, text=True, check=True)
    assert "check" in result.stdout and "demo" in result.stdout
    result = subprocess.run(
        [sys.executable, "-m", "hfjax.cli", "--version"], capture_output=True, text=True, check=True
    )
    versions = {name: importlib.metadata.version(name) for name in ("jax", "torch", "transformers")}
    assert result.stdout.startswith(f"hfjax {hfjax.__version__} (")
    assert all(f"{name} {version}" in result.stdout for name, version in versions.items()), result.stdout


# Each subcommand that reads a checkpoint, given one that does not exist.
MISSING = {
    "check": ["--model", "{missing}"],
    "check MODEL": ["{missing}"],
    "generate": ["--model", "{missing}", "Hello"],
    "generate MODEL": ["{missing}", "--temperature", "0", "Hello"],
    "chat": ["--model", "{missing}"],
    "serve": ["{missing}", "--port", "0"],  # (any free port: serve binds its port before it loads)
    "serve --model": ["--model", "{missing}", "--port", "0"],
    "classify": ["--model", "{missing}", "I loved it"],
    "classify --image": ["--model", "{missing}", "--image", "{missing}.png"],
    "classify MODEL": ["{missing}", "I loved it"],
    "transcribe": ["--model", "{missing}", "{missing}.wav"],
    "transcribe MODEL": ["{missing}", "{missing}.wav"],
    "finetune": ["--model", "{missing}", "--data", "{missing}.jsonl", "--out", "{missing}-out", "--steps", "1"],
    "image": ["--model", "{missing}", "a red cat", "--out", "{missing}.png"],
    "shard-plan": ["--model", "{missing}", "--model-parallel", "2"],
}


@pytest.mark.parametrize("case", MISSING)
def test_a_missing_checkpoint_is_one_line_in_every_subcommand(case, tmp_path, capsys):
    missing = str(tmp_path / "no-such-checkpoint")
    command = case.split()[0]
    code = cli.main([command, *(arg.format(missing=missing) for arg in MISSING[case])])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.startswith(f"hfjax {command}: ") and missing in err and "no checkpoint directory" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_every_subcommand_that_reads_a_checkpoint_is_tried_with_a_missing_one():
    takes_model = {
        name
        for name, parser in SUBCOMMANDS.items()
        if any("--model" in a.option_strings for a, _ in _options_of(parser))
    }
    assert takes_model == {case.split()[0] for case in MISSING}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["generate", "--model", "M", "Hi", "--dtype", "float8"],
            "argument --dtype: invalid dtype 'float8'; choose from auto",
        ),
        (["serve", "M", "--dtype", "int4"], "argument --dtype: invalid dtype 'int4'"),
        (["image", "--model", "M", "cat", "--out", "x.png", "--dtype", "fp16"], "invalid dtype 'fp16'"),
        (["generate", "Hi"], "no model given; pass it as MODEL or with --model, e.g. `hfjax generate ./my-"),
        (["serve"], "no model given; pass it as MODEL or with --model"),
        (["serve", "a", "--model", "b"], "two models given: MODEL 'a' and --model 'b'"),
        (["generate", "a", "Hi", "--model", "b"], "two models given: MODEL 'a' and --model 'b'"),
        (["check", "M", "--arch", "llama"], "--arch 'llama' builds a model of its own; pass --arch or a MODEL"),
        (["serve", "M", "--max-num-seqs", "0"], "--max-batch=0 must be at least 1"),
        (["serve", "M", "--tensor-parallel-size", "0"], "--model-parallel=0 must be at least 1"),
        (["shard-plan", "--model", "M", "--data-parallel-size", "0"], "--data-parallel=0 must be at least 1"),
        (
            ["finetune", "--model", "M", "--data", "d.jsonl", "--out", "o", "--steps", "0"],
            "--steps 0; pass a positive number",
        ),
        (["classify", "--model", "M", "--labels", "a,,b", "text"], "--labels: empty label"),
        (["classify", "--model", "M", "text", "--image", "x.png"], "pass texts or --image, not both"),
        (["image", "--model", "M", "cat", "--out", "x.png", "--steps", "0"], "--steps=0 must be at least 1"),
        (["launch", "--nproc", "2"], "give the command after --"),
        (["build-kernels", "--timeout", "0"], "--timeout=0.0 must be > 0 seconds"),
    ],
)
def test_bad_flags_are_one_line_and_exit_code_2(argv, message, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as exit:  # argparse's own checks
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"hfjax {argv[0]}: ") and message in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_an_image_path_that_cannot_be_written_is_one_line_before_anything_runs(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "cat.png"
    code = cli.main(["image", "--model", str(tmp_path / "missing"), "a red cat", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"hfjax image: --out {str(out)!r}: cannot make its directory"), err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "name", [n for n, p in SUBCOMMANDS.items() if any("--dtype" in a.option_strings for a, _ in _options_of(p))]
)
def test_dtype_auto_is_the_checkpoints_in_every_subcommand(name):
    parser = SUBCOMMANDS[name]
    dtype = next(a for a, _ in _options_of(parser) if "--dtype" in a.option_strings)
    assert dtype.default == "auto" and parser._get_formatter()._expand_help(dtype).endswith("(default: auto)")
    for value, parsed in (("auto", None), ("bfloat16", "bfloat16")):
        assert dtype.type(value) == parsed


def test_vllms_flag_names_and_positional_model():
    args = SUBCOMMANDS["serve"].parse_args(
        ["ckpt", "--max-num-seqs", "3", "--tensor-parallel-size", "2", "--data-parallel-size", "4", "--dtype", "auto"]
    )
    assert (args.max_batch, args.model_parallel, args.data_parallel, args.dtype) == (3, 2, 4, None)
    assert _options.model_path(args) == "ckpt"
    assert _options.model_path(SUBCOMMANDS["serve"].parse_args(["--model", "ckpt"])) == "ckpt"
    assert _options.model_path(SUBCOMMANDS["serve"].parse_args(["ckpt", "--model", "ckpt"])) == "ckpt"
    # The engine-sizing flags keep their own names.
    args = SUBCOMMANDS["serve"].parse_args(["ckpt", "--max-batch", "5", "--max-model-len", "64", "--no-prefix-reuse"])
    assert (args.max_batch, args.max_model_len, args.enable_prefix_caching) == (5, 64, False)
    for name in ("generate", "chat", "finetune", "shard-plan"):
        args = SUBCOMMANDS[name].parse_args(
            ["--model", "m", "--tensor-parallel-size", "2", "--data-parallel-size", "3"]
            + {"generate": ["Hi"], "finetune": ["--data", "d", "--out", "o", "--steps", "1"]}.get(name, [])
        )
        assert (args.model_parallel, args.data_parallel) == (2, 3), name


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_help_shows_every_options_default(name):
    parser = SUBCOMMANDS[name]
    formatter = parser._get_formatter()
    for action, either_or in _options_of(parser):
        if action.nargs == 0 or action.required or either_or:  # a switch, or nothing to default to
            continue
        text = formatter._expand_help(action)
        assert "default" in text, f"hfjax {name} {action.option_strings[0]}: {text!r}"
        if action.default is not None:
            assert re.search(r"default:? ", text), text
    assert "default" in parser.format_help()


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_help_says_each_default_one_way(name):
    # argparse's "(default: X)", the form HelpFormatter appends and vLLM prints, never "(default X)".
    parser = SUBCOMMANDS[name]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help not in (None, argparse.SUPPRESS):
            text = formatter._expand_help(action)
            assert not re.search(r"\bdefault\b(?!: )", text), f"hfjax {name} {action.dest}: {text!r}"


# Each subcommand that loads a model, with the rest of what it needs.
REST = {
    "check": [],
    "generate": ["Hi"],
    "chat": [],
    "serve": [],
    "classify": ["I loved it", "Terrible."],
    "transcribe": ["a.wav", "b.wav"],
    "finetune": ["--data", "d.jsonl", "--out", "o", "--steps", "1"],
    "image": ["a red cat", "--out", "cat.png"],
    "shard-plan": [],
}


def test_every_subcommand_that_loads_a_model_is_tried_positionally():
    assert set(REST) == {case.split()[0] for case in MISSING}


@pytest.mark.parametrize("name", REST)
def test_the_model_is_the_first_argument_or_model(name):
    parser, rest = SUBCOMMANDS[name], REST[name]
    stats = ["--stats"] if name in ("generate", "image") else []
    positional = _options.parse_command(parser, ["ckpt", *stats, *rest])  # an option before the other positionals
    flag = _options.parse_command(parser, [*rest, "--model", "ckpt"])
    for args in (positional, flag):
        assert _options.model_path(args) == "ckpt", args
        others = [a.dest for a in parser._actions if not a.option_strings and a.dest != "positional_model"]
        assert [getattr(args, dest) for dest in others] == [getattr(positional, dest) for dest in others]
    if name not in ("classify", "transcribe"):  # (whose first TEXT or AUDIO file would be read as MODEL)
        with pytest.raises(_options.FlagError, match="no model given"):
            _options.model_path(_options.parse_command(parser, rest))


def test_the_readme_lists_every_flag_of_every_subcommand():
    readme = README.read_text()
    missing = [
        f"hfjax {name} {option}"
        for name, parser in SUBCOMMANDS.items()
        for action, _ in _options_of(parser)
        for option in action.option_strings
        if option.startswith("--") and f"`{option}`" not in readme
    ]
    assert missing == [], "flags the README does not name:\n" + "\n".join(missing)
    for name in SUBCOMMANDS:
        assert f"`{name}`" in readme, name


def test_generate_stats_say_compiled_only_when_xla_compiled(checkpoint, tmp_path):
    # Two new processes with one compilation cache: the first compiles, the second reads every
    # program from the cache (and hfjax's traced programs from beside it).
    path = checkpoint("llama")
    env = {**os.environ, "HFJAX_CACHE_DIR": str(tmp_path / "xla")}
    argv = [sys.executable, "-m", "hfjax.cli", "generate", "--model", str(path), "Hello", "--max-new-tokens", "4",
            "--temperature", "0", "--stats"]  # fmt: skip
    cold, warm = (subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600) for _ in range(2))
    assert cold.returncode == 0 and warm.returncode == 0, cold.stderr + warm.stderr
    assert cold.stdout == warm.stdout
    assert "tokens/s" in cold.stderr and ", compiled in this call" in cold.stderr, cold.stderr
    assert "tokens/s" in warm.stderr and "compiled" not in warm.stderr, warm.stderr
