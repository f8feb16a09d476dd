"""Every example in README.md runs: the python blocks, the main job, and the check commands.

The README writes its tiny checkpoints under /tmp/hfjax-readme, as a user copying it would; the
tests run the same text with that directory moved into a temporary one. Like a user, they run it
in a new process (`python tests/test_readme.py DIR`), which conftest.py starts beside the rest of
the suite: it runs the python blocks, then each command, and writes what happened to DIR.
"""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

import background

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
README_DIR = "/tmp/hfjax-readme"


def _text(directory: str = README_DIR) -> str:
    """README.md with its directory moved, less the Serve section, whose examples need a live
    server: tests/test_serve.py runs them against one."""
    text = README.read_text().replace(README_DIR, directory)
    return re.sub(r"\n## Serve\n.*?(?=\n## )", "\n", text, flags=re.S)


def _blocks(language: str, directory: str = README_DIR) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", _text(directory), flags=re.S)


def _commands(directory: str = README_DIR) -> list[str]:
    commands = []
    for block in _blocks("bash", directory):
        for line in block.splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("hfjax ") and "/path/to" not in line:
                commands.append(line)
    return commands


def _run_readme(directory: pathlib.Path) -> None:
    """The child: the python blocks in this process, then each command in one of its own."""
    record = {"python": None, "commands": []}
    namespace = {"__name__": "__readme__"}
    try:
        for code in _blocks("python", str(directory)):
            exec(compile(code, str(README), "exec"), namespace)
        record["python"] = {"ok": True, "tokenizer": namespace["model"].tokenizer is not None}
    except Exception as error:  # reported by test_python_examples_run
        record["python"] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    (directory / "record.json").write_text(json.dumps(record))
    for command in _commands(str(directory)):
        argv = shlex.split(command)
        result = subprocess.run(
            [sys.executable, "-m", "hfjax.cli", *argv[1:]], capture_output=True, text=True, timeout=900
        )
        record["commands"].append(
            {"command": command, "code": result.returncode, "stdout": result.stdout, "stderr": result.stderr}
        )
        (directory / "record.json").write_text(json.dumps(record))


def start_in_background() -> None:
    background.start("readme", [sys.executable, __file__], seconds=100)


@pytest.fixture(scope="module")
def readme():
    """(the directory the README ran in, what happened: its python blocks and each command)."""
    child = background.finished("readme", start_in_background, timeout=1800)
    assert child.returncode == 0, child.output[-4000:]
    return child.directory, json.loads((child.directory / "record.json").read_text())


def test_python_examples_run(readme):
    directory, record = readme
    assert record["python"]["ok"], record["python"].get("error")
    # The tour ends with a model loaded and checkpoints on disk that the commands use.
    assert record["python"]["tokenizer"]
    for path in re.findall(rf"--model ({re.escape(str(directory))}\S+)", _text(str(directory))):
        assert any((pathlib.Path(path) / name).is_file() for name in ("config.json", "model_index.json")), path


def test_readme_has_the_main_job():
    assert "hfjax demo" in _commands()


@pytest.mark.parametrize("index", range(len(_commands())), ids=[c.split(" --")[0] for c in _commands()])
def test_command_runs(index, readme):
    directory, record = readme
    assert len(record["commands"]) == len(_commands()), "the README's commands did not all run"
    ran = record["commands"][index]
    assert ran["command"] == _commands(str(directory))[index]
    assert ran["code"] == 0, ran["stdout"] + ran["stderr"]
    # Each command is a user's first run in a new process: transformers' and diffusers' once-only
    # notes about packages hfjax does not need must not reach them.
    for note in ("accelerate", "torchvision"):
        assert note not in ran["stderr"], ran["stderr"]
    if ran["command"].startswith("hfjax demo"):
        assert "parity: PASS" in ran["stdout"]


if __name__ == "__main__":
    _run_readme(pathlib.Path(sys.argv[1]))
