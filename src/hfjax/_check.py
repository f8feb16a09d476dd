"""Parity of one checkpoint: hfjax (eager and jit) against the same model in PyTorch."""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import statistics
import tempfile
import time
import traceback

import numpy as np
import torch

from . import _tasks, tolerances
from ._errors import HfjaxError, UnsupportedOpError
from ._model import load


@dataclasses.dataclass(frozen=True)
class CheckRow:
    output: str  # the output field compared, e.g. "logits"
    path: str  # "eager" or "jit"
    max_abs_diff: float | None
    atol: float
    seconds: float | None  # median time of one forward (jit: after compiling)
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and self.max_abs_diff is not None and self.max_abs_diff <= self.atol


@dataclasses.dataclass(frozen=True)
class CheckReport:
    model: str
    model_type: str
    task: str
    rows: tuple[CheckRow, ...]
    torch_seconds: float | None
    compile_seconds: float | None
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.rows) and all(r.passed for r in self.rows)

    def table(self) -> str:
        lines = [f"{self.model} ({self.model_type}, {self.task})"]
        if self.error:
            lines.append(f"  FAIL  {self.error}")
            return "\n".join(lines)
        lines.append(f"  {'output':<18}{'path':<7}{'max|diff|':>12}{'atol':>10}{'ms':>10}  result")
        if self.torch_seconds is not None:
            lines.append(f"  {'(pytorch)':<18}{'eager':<7}{'':>12}{'':>10}{self.torch_seconds * 1e3:>10.2f}")
        for r in self.rows:
            diff = "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.2e}"
            ms = "-" if r.seconds is None else f"{r.seconds * 1e3:.2f}"
            result = "pass" if r.passed else f"FAIL {r.error or ''}".rstrip()
            lines.append(f"  {r.output:<18}{r.path:<7}{diff:>12}{r.atol:>10.0e}{ms:>10}  {result}")
        if self.compile_seconds is not None:
            lines.append(f"  compile: {self.compile_seconds:.2f} s")
        return "\n".join(lines)


def _inputs(config, task: str, *, batch: int, seq_len: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    vocab = int(getattr(config, "vocab_size", None) or config.get_text_config().vocab_size)
    low = min(4, vocab - 1)
    ids = rng.integers(low, vocab, size=(batch, seq_len), dtype=np.int64)
    eos = _eos_id(config)
    if task == "text-classification" and eos is not None and 0 <= eos < vocab:
        ids[:, -1] = eos  # BART / T5-style heads pool each row's last EOS, and refuse rows without one
    inputs = {"input_ids": ids, "attention_mask": np.ones((batch, seq_len), dtype=np.int64)}
    if task == "text2text-generation":
        inputs["decoder_input_ids"] = rng.integers(low, vocab, size=(batch, max(2, seq_len // 2)), dtype=np.int64)
    if task in ("text-generation", "text2text-generation"):
        inputs["use_cache"] = False
    return inputs


def _eos_id(config) -> int | None:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = getattr(config.get_text_config(), "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) else None


def _outputs_of(out, task: str) -> dict[str, np.ndarray]:
    name = "last_hidden_state" if task == "feature-extraction" else "logits"
    value = getattr(out, name, None)
    if value is None:
        value = out[0]
    return {name: np.asarray(value.detach() if isinstance(value, torch.Tensor) else value, dtype=np.float32)}


def _timed(fn, repeats: int) -> tuple[object, float]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        _block(out)
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def _block(out) -> None:
    import jax

    jax.block_until_ready([x for x in jax.tree_util.tree_leaves(out) if isinstance(x, jax.Array)])


def check(
    path: str | os.PathLike,
    *,
    task: str | None = None,
    batch: int = 2,
    seq_len: int = 8,
    seed: int = 0,
    repeats: int = 3,
    eager: bool = True,
) -> CheckReport:
    """Runs one checkpoint in PyTorch and in hfjax (eager and jit) and compares outputs.

    Returns:
      A `CheckReport`; `.passed` is True when every output is within
      `hfjax.tolerances.for_family(model_type)`.

    Example:
      >>> report = hfjax.check("./tiny-llama")
      >>> print(report.table())
    """
    path = pathlib.Path(path)
    try:
        model = load(path, task=task, dtype="float32")
    except HfjaxError as error:
        return CheckReport(str(path), "?", task or "?", (), None, None, error=str(error))
    task = model.task
    config = model.config
    atol = tolerances.for_family(config.model_type).atol
    inputs = _inputs(config, task, batch=batch, seq_len=seq_len, seed=seed)
    torch_inputs = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}

    reference_model = _tasks.auto_class(task, config).from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        reference, torch_seconds = _timed(lambda: reference_model(**torch_inputs), repeats)
    expected = _outputs_of(reference, task)

    rows, compile_seconds = [], None
    paths = (("eager", model.eager), ("jit", model)) if eager else (("jit", model),)
    for name, fn in paths:
        try:
            if name == "jit":
                start = time.perf_counter()
                _block(fn(**inputs))
                compile_seconds = time.perf_counter() - start
            out, seconds = _timed(functools.partial(fn, **inputs), repeats if name == "jit" else 1)
            got = _outputs_of(out, task)
            for field, want in expected.items():
                diff = float(np.max(np.abs(got[field] - want))) if got[field].shape == want.shape else float("inf")
                rows.append(CheckRow(field, name, diff, atol, seconds))
        except UnsupportedOpError as error:
            rows.append(CheckRow("-", name, None, atol, None, error=f"unsupported op {error.op} in {error.caller}"))
        except Exception as error:  # reported per path: the table must show every failure, not stop at the first
            last = traceback.extract_tb(error.__traceback__)[-1]
            rows.append(
                CheckRow(
                    "-",
                    name,
                    None,
                    atol,
                    None,
                    error=f"{type(error).__name__}: {str(error)[:200]} "
                    f"[{pathlib.Path(last.filename).name}:{last.lineno}]",
                )
            )
    return CheckReport(str(path), config.model_type, task, tuple(rows), torch_seconds, compile_seconds)


def check_arch(arch: str, *, task: str | None = None, **kwargs) -> CheckReport:
    """`check` on a tiny random checkpoint of a family (model_type) built by hfjax.testing."""
    from . import testing

    with tempfile.TemporaryDirectory(prefix=f"hfjax-{arch}-") as directory:
        path = testing.save_tiny_checkpoint(arch, pathlib.Path(directory) / arch, task=task)
        return check(path, task=task, **kwargs)
