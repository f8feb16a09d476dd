"""Every example in README.md runs as written, in order, in a fresh directory: the python blocks,
the main job, and every command.

The README writes its files under /tmp/hfjax-readme, as a user copying it would; the tests run the
same text with that directory moved into a new, empty one. Like a user, they run it in a new
process (`python tests/test_readme.py DIR`), which conftest.py starts beside the rest of the
suite: it runs each python block on its own (a block that leans on another's names fails), then
each command in a shell of its own (pipes included), and writes what happened to DIR. Nothing they
print may be a warning: hfjax calls other libraries as they ask to be called, and silences around
its own calls the notes it cannot avoid.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

import background

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
README_DIR = "/tmp/hfjax-readme"
# A warning on stderr: Python's (FutureWarning, UserWarning, ...), a library logger's note
# ("[transformers] ..."), a deprecation, or absl's W/E lines from XLA.
WARNING = re.compile(r"warning\b|\bdeprecated\b|^\[(transformers|diffusers|peft)\]|^[WE]\d{4} ", re.I | re.M)


def _text(directory: str = README_DIR) -> str:
    """README.md with its directory moved, less the Serve section, whose examples need a live
    server: tests/test_serve.py runs them against one."""
    text = README.read_text().replace(README_DIR, directory)
    return re.sub(r"\n## Serve\n.*?(?=\n## )", "\n", text, flags=re.S)


def _blocks(language: str, directory: str = README_DIR) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", _text(directory), flags=re.S)


def _commands(directory: str = README_DIR) -> list[str]:
    """The hfjax command lines of the bash blocks (comments cut), a pipe into hfjax included."""
    commands = []
    for block in _blocks("bash", directory):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line.startswith("hfjax ") or " | hfjax " in line:
                commands.append(line)
    return commands


class _Notes(logging.Handler):
    """Collects what libraries' loggers say at WARNING or above."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.notes: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.notes.append(f"[{record.name}] {record.getMessage()}")


def _run_readme(directory: pathlib.Path) -> None:
    """The child: each python block in a namespace of its own, then each command in a shell."""
    record = {"python": [], "commands": []}
    notes = _Notes()
    for name in ("transformers", "diffusers", "peft", "jax", "torchax"):
        logging.getLogger(name).addHandler(notes)
    for index, code in enumerate(_blocks("python", str(directory))):
        namespace = {"__name__": "__readme__"}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                exec(compile(code, f"{README} python block {index}", "exec"), namespace)
                result = {"ok": True}
            except Exception as error:  # reported by test_python_examples_run
                result = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        result["warnings"] = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]
        result["warnings"] += notes.notes
        notes.notes = []
        if index == 0:
            result["tokenizer"] = getattr(namespace.get("model"), "tokenizer", None) is not None
        record["python"].append(result)
        (directory / "record.json").write_text(json.dumps(record))
    # `hfjax` on the PATH is this interpreter's, as a console script installed beside it would be.
    bin_dir = directory / "bin"
    bin_dir.mkdir()
    (bin_dir / "hfjax").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m hfjax.cli "$@"\n')
    (bin_dir / "hfjax").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    for command in _commands(str(directory)):
        absent = [path for path in re.findall(rf"{re.escape(str(directory))}\S*", command) if not os.path.exists(path)]
        result = subprocess.run(
            ["bash", "-c", command], capture_output=True, text=True, timeout=900, env=env, cwd=directory
        )
        record["commands"].append(
            {
                "command": command,
                "code": result.returncode,
                "stdout": result.stdout,
                "stderr": result.stderr,
                "absent": absent,
            }  # fmt: skip
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


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_example_runs_on_its_own_without_warnings(index, readme):
    directory, record = readme
    assert len(record["python"]) == len(_blocks("python")), "the README's python blocks did not all run"
    ran = record["python"][index]
    assert ran["ok"], ran.get("error")
    assert ran["warnings"] == [], "\n".join(ran["warnings"])
    if index == 0:  # the tour ends with a model loaded, its tokenizer with it
        assert ran["tokenizer"]


def test_every_path_a_command_reads_was_made_by_an_earlier_step(readme):
    directory, record = readme
    assert len(record["commands"]) == len(_commands()), "the README's commands did not all run"
    for ran in record["commands"]:
        # What did not exist when the command started is what it writes.
        written = re.findall(rf"--out ({re.escape(str(directory))}\S+)", ran["command"])
        assert set(ran["absent"]) <= set(written), f"{ran['command']!r} reads {ran['absent']}, which no step made"
        for path in re.findall(rf"--model ({re.escape(str(directory))}\S+)", ran["command"]):
            assert any((pathlib.Path(path) / name).is_file() for name in ("config.json", "model_index.json")), path
    assert "/path/to" not in README.read_text(), "a placeholder path that no step creates"


def test_readme_has_the_main_job():
    assert "hfjax demo" in _commands()


@pytest.mark.parametrize("index", range(len(_commands())), ids=[c.split(" --")[0] for c in _commands()])
def test_command_runs_without_warnings(index, readme):
    directory, record = readme
    assert len(record["commands"]) == len(_commands()), "the README's commands did not all run"
    ran = record["commands"][index]
    assert ran["command"] == _commands(str(directory))[index]
    assert ran["code"] == 0, ran["stdout"] + ran["stderr"]
    # Each command is a user's first run in a new process: no library's note may reach it.
    assert not WARNING.search(ran["stderr"]), ran["stderr"]
    for note in ("accelerate", "torchvision"):
        assert note not in ran["stderr"], ran["stderr"]
    if ran["command"].startswith("hfjax demo"):
        assert "parity: PASS" in ran["stdout"]


if __name__ == "__main__":
    _run_readme(pathlib.Path(sys.argv[1]))
