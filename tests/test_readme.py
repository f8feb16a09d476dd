"""Every example in README.md runs: the python blocks, the main job, and the check commands."""

from __future__ import annotations

import pathlib
import re
import shlex
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def python_examples_ran():
    """Runs the README's python blocks once; the command examples use the checkpoints they write."""
    blocks = _blocks("python")
    assert blocks, "README has no python example"
    namespace = {"__name__": "__readme__"}
    for code in blocks:
        exec(compile(code, str(README), "exec"), namespace)
    return namespace


def test_python_examples_run(python_examples_ran):
    # The tour ends with a model loaded and checkpoints on disk that the commands below use.
    assert python_examples_ran["model"].tokenizer is not None
    for path in re.findall(r"--model (/tmp/\S+)", README.read_text()):
        assert any((pathlib.Path(path) / name).is_file() for name in ("config.json", "model_index.json")), path


def _commands() -> list[str]:
    commands = []
    for block in _blocks("bash"):
        for line in block.splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("hfjax ") and "/path/to" not in line:
                commands.append(line)
    return commands


def test_readme_has_the_main_job():
    assert "hfjax demo" in _commands()


@pytest.mark.parametrize("command", _commands())
def test_command_runs(command, python_examples_ran):
    argv = shlex.split(command)
    result = subprocess.run([sys.executable, "-m", "hfjax.cli", *argv[1:]], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    if argv[1] == "demo":
        assert "parity: PASS" in result.stdout
