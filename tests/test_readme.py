"""Every example in README.md runs: the python blocks, the main job, and the check commands.

The README writes its tiny checkpoints under /tmp/hfjax-readme, as a user copying it would; the
tests run the same text with that directory moved into pytest's own temporary directory.
"""

from __future__ import annotations

import pathlib
import re
import shlex
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
README_DIR = "/tmp/hfjax-readme"


@pytest.fixture(scope="module")
def readme_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hfjax-readme"))


def _blocks(language: str, directory: str = README_DIR) -> list[str]:
    text = README.read_text().replace(README_DIR, directory)
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


@pytest.fixture(scope="module")
def python_examples_ran(readme_dir):
    """Runs the README's python blocks once; the command examples use the checkpoints they write."""
    blocks = _blocks("python", readme_dir)
    assert blocks, "README has no python example"
    namespace = {"__name__": "__readme__"}
    for code in blocks:
        exec(compile(code, str(README), "exec"), namespace)
    return namespace


def test_python_examples_run(python_examples_ran, readme_dir):
    # The tour ends with a model loaded and checkpoints on disk that the commands below use.
    assert python_examples_ran["model"].tokenizer is not None
    text = README.read_text().replace(README_DIR, readme_dir)
    for path in re.findall(rf"--model ({re.escape(readme_dir)}\S+)", text):
        assert any((pathlib.Path(path) / name).is_file() for name in ("config.json", "model_index.json")), path


def _commands(directory: str = README_DIR) -> list[str]:
    commands = []
    for block in _blocks("bash", directory):
        for line in block.splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("hfjax ") and "/path/to" not in line:
                commands.append(line)
    return commands


def test_readme_has_the_main_job():
    assert "hfjax demo" in _commands()


@pytest.mark.parametrize("index", range(len(_commands())), ids=[c.split(" --")[0] for c in _commands()])
def test_command_runs(index, python_examples_ran, readme_dir):
    argv = shlex.split(_commands(readme_dir)[index])
    result = subprocess.run([sys.executable, "-m", "hfjax.cli", *argv[1:]], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    if argv[1] == "demo":
        assert "parity: PASS" in result.stdout
