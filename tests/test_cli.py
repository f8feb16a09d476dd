"""The `hfjax` command line, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys

from hfjax import cli


def test_check_passes_on_a_tiny_checkpoint(checkpoint, capsys):
    code = cli.main(["check", "--model", str(checkpoint("qwen3"))])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "logits" in out and "jit" in out and "eager" in out and "pass" in out


def test_check_exit_code_is_1_on_an_unloadable_model(tmp_path, capsys):
    code = cli.main(["check", "--model", str(tmp_path / "missing")])
    assert code == 1
    assert "no checkpoint directory" in capsys.readouterr().out


def test_console_script_help():
    result = subprocess.run([sys.executable, "-m", "hfjax.cli", "--help"], capture_output=True, text=True, check=True)
    assert "check" in result.stdout and "demo" in result.stdout
