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


def test_python_examples_run():
    blocks = _blocks("python")
    assert blocks, "README has no python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})


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
def test_command_runs(command):
    argv = shlex.split(command)
    result = subprocess.run([sys.executable, "-m", "hfjax.cli", *argv[1:]], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    if argv[1] == "demo":
        assert "parity: PASS" in result.stdout
