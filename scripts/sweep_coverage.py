"""Sweeps hfjax parity over every text architecture transformers knows; writes docs/coverage.md.

For each (model_type, task) in transformers' causal-LM, seq2seq-LM and
sequence-classification auto mappings, a worker subprocess builds a tiny random checkpoint
(`hfjax.testing.save_tiny_checkpoint`), checks that PyTorch runs it, then runs
`hfjax.check` (eager and jit) and prints one JSON line. A crash or hang in one
architecture costs only its own worker. Not part of CI: it takes about an hour on 2 cores.

    python scripts/sweep_coverage.py                      # full sweep, writes docs/coverage.md
    python scripts/sweep_coverage.py --only llama,olmo2 --task text-generation --out /tmp/c.md
"""

from __future__ import annotations

import argparse
import collections
import collections.abc
import concurrent.futures
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import time

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_TASK_MAPPINGS = {
    "text-generation": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "text2text-generation": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "text-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
}
_STATUSES = ("pass", "fail", "pytorch-fails", "timeout")


# ----------------------------------------------------------------------------- worker


def _one_line(text: str, limit: int = 160) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _exception_reason(error: BaseException) -> str:
    return _one_line(f"{type(error).__name__}: {error}")


def _worker(model_type: str, task: str) -> dict:
    import tempfile

    import torch

    torch.set_num_threads(1)
    import transformers

    from hfjax import HfjaxError, _check, _tasks, testing

    result = {"model_type": model_type, "task": task, "status": "fail", "eager": None, "jit": None, "reason": ""}
    with tempfile.TemporaryDirectory(prefix=f"sweep-{model_type}-") as directory:
        try:
            path = testing.save_tiny_checkpoint(model_type, pathlib.Path(directory) / model_type, task=task)
            auto_class = _tasks.auto_class(task, transformers.AutoConfig.from_pretrained(path))
            model = auto_class.from_pretrained(path, dtype=torch.float32).eval()
        except Exception as error:  # any failure before hfjax runs is PyTorch's or the factory's
            result.update(status="pytorch-fails", reason=_exception_reason(error))
            return result
        try:
            arrays = _check._inputs(  # the inputs check() uses
                model.config, task, batch=2, seq_len=8, seed=0, main_input_name=model.main_input_name
            )
        except HfjaxError as error:  # hfjax.check cannot build this model's inputs
            result["reason"] = _exception_reason(error)
            return result
        try:
            inputs = {k: torch.from_numpy(v) if hasattr(v, "dtype") else v for k, v in arrays.items()}
            with torch.no_grad():
                model(**inputs)
        except Exception as error:  # PyTorch cannot run the inputs check() gives
            result.update(status="pytorch-fails", reason=_exception_reason(error))
            return result
        del model

        try:
            report = _check.check(path, task=task, batch=2, seq_len=8, repeats=1, eager=True)
        except Exception as error:  # check() raising is itself a finding
            result["reason"] = _exception_reason(error)
            return result
    for row in report.rows:
        if row.path in ("eager", "jit") and row.max_abs_diff is not None:
            previous = result[row.path]
            result[row.path] = row.max_abs_diff if previous is None else max(previous, row.max_abs_diff)
    if report.passed:
        result["status"] = "pass"
    elif report.error:
        result["reason"] = _one_line(report.error)
    else:
        failed = [row for row in report.rows if not row.passed]
        first = failed[0] if failed else None
        if first is None:
            result["reason"] = "no outputs compared"
        elif first.error:
            result["reason"] = _one_line(f"{first.path}: {first.error}")
        else:
            diff = f"max|diff| {first.max_abs_diff:.2e} > atol {first.atol:.0e}"
            result["reason"] = f"{first.path}: {first.output} {diff}"
    return result


# ----------------------------------------------------------------------------- parent


def _jobs_to_run(
    only: set[str] | None, tasks: list[str], mappings: dict[str, str | tuple[str, ...]] = _TASK_MAPPINGS
) -> list[tuple[str, str, str]]:
    # (model_type, task, class name) for each model_type in the task's auto mappings (the first holding it).
    from transformers.models.auto import modeling_auto

    jobs = []
    for task in tasks:
        names = (mappings[task],) if isinstance(mappings[task], str) else mappings[task]
        seen = set()
        for name in names:
            for model_type, arch in getattr(modeling_auto, name).items():
                if (only is None or model_type in only) and model_type not in seen:
                    seen.add(model_type)
                    jobs.append((model_type, task, arch if isinstance(arch, str) else arch[0]))
    return jobs


def _run_worker(model_type: str, task: str, timeout: float, script: str = __file__) -> dict:
    # `script --worker MODEL_TYPE --task TASK` in a subprocess; its last JSON line is the result.
    env = {
        **os.environ,
        "OMP_WAIT_POLICY": "PASSIVE",
        "OMP_NUM_THREADS": "1",
        "JAX_PLATFORMS": "cpu",
        "TOKENIZERS_PARALLELISM": "false",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    command = [sys.executable, script, "--worker", model_type, "--task", task]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=_ROOT)
    except subprocess.TimeoutExpired:
        return {
            "model_type": model_type,
            "task": task,
            "status": "timeout",
            "eager": None,
            "jit": None,
            "reason": f"timeout after {timeout:.0f} s",
            "seconds": timeout,
        }
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        result = json.loads(lines[-1])
    else:  # the worker died without a result line: a segfault, OOM kill or import error
        tail = [line for line in done.stderr.splitlines() if line.strip()]
        reason = tail[-1] if tail else f"worker exited with code {done.returncode}"
        result = {
            "model_type": model_type,
            "task": task,
            "status": "fail",
            "eager": None,
            "jit": None,
            "reason": _one_line(f"worker crashed (exit {done.returncode}): {reason}"),
        }
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def sweep(
    jobs: list[tuple[str, str, str]],
    *,
    workers: int,
    timeout: float,
    jsonl: pathlib.Path | None,
    script: str = __file__,
) -> collections.abc.Iterator[dict]:
    """Runs one worker subprocess of `script` per (model_type, task, class name); yields each result as it
    finishes, after printing a progress line and appending it to `jsonl`."""
    print(f"sweeping {len(jobs)} checks with {workers} workers", file=sys.stderr, flush=True)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {pool.submit(_run_worker, model_type, task, timeout, script): arch for model_type, task, arch in jobs}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            result = {**future.result(), "arch": futures[future]}
            print(
                f"[{done}/{len(jobs)}] {result['model_type']} {result['task']}: {result['status']} "
                f"({result['seconds']} s) {result['reason']}",
                file=sys.stderr,
                flush=True,
            )
            if jsonl:
                with jsonl.open("a") as f:
                    f.write(json.dumps(result) + "\n")
            yield result


def _cause(reason: str) -> str:
    # Groups failure reasons: strips the per-arch parts (numbers, shapes, module paths).
    reason = re.sub(r"^(eager|jit): ", "", reason)
    op = re.match(r"unsupported op (\S+)", reason)
    if op:
        return f"unsupported op {op.group(1)}"
    if "max|diff|" in reason:
        return "numerical mismatch (max|diff| > atol)"
    reason = re.sub(r"\[[^\]]*\.py:\d+\]", "", reason)
    reason = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", reason)
    reason = re.sub(r"\d+x\d+", "NxN", reason)
    reason = re.sub(r"(?<![A-Za-z_])\d+(\.\d+)?(e-?\d+)?", "N", reason)
    return _one_line(reason, 90)


def _versions() -> str:
    import importlib.metadata as metadata

    return ", ".join(f"{name} {metadata.version(name)}" for name in ("transformers", "torch", "torchax", "jax"))


def _fmt(diff: float | None) -> str:
    return "-" if diff is None else f"{diff:.1e}"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _write_report(out: pathlib.Path, results: list[dict], total: int, started: str, command: str) -> None:
    partial = len(results) < total
    lines = [
        "# hfjax architecture coverage",
        "",
        f"Generated {started} (UTC); regenerate with `{command}`. Versions: {_versions()}.",
        "",
        "Each row is one tiny random checkpoint (`hfjax.testing.save_tiny_checkpoint`: hidden 64, 2 layers, "
        "4 heads; model types outside `hfjax.testing.FAMILIES` use the generic config shrinker) run by "
        "`hfjax.check` (batch 2, 8 tokens) against PyTorch, eager and jit. "
        "`pytorch-fails` means the tiny checkpoint could not be built or PyTorch itself could not run its "
        "forward; those do not count against hfjax. Many of them are limits of the generic shrinker (a "
        "default config field sized for the full model, such as a per-layer list or a rotary dimension, that "
        "no longer fits 2 layers of width 64) or of the random inputs (no eos token for BART-style "
        "classifiers), not bugs in transformers; a hand-tuned entry in `hfjax.testing._families.REGISTRY` fixes them.",
        "",
    ]
    if partial:
        lines += [f"**Partial: {len(results)} of {total} checks finished; the sweep was still running.**", ""]
    lines += [
        "## Totals",
        "",
        "| task | pass | fail | pytorch-fails | timeout | pass rate among archs PyTorch runs |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for task in _TASK_MAPPINGS:
        counts = collections.Counter(r["status"] for r in results if r["task"] == task)
        if not counts:
            continue
        runnable = counts["pass"] + counts["fail"] + counts["timeout"]
        rate = f"{100 * counts['pass'] / runnable:.0f}% ({counts['pass']}/{runnable})" if runnable else "-"
        lines.append(f"| {task} | " + " | ".join(str(counts[s]) for s in _STATUSES) + f" | {rate} |")

    sections = (("Failure causes (hfjax)", ("fail", "timeout")), ("PyTorch-side failures", ("pytorch-fails",)))
    for title, statuses in sections:
        groups: dict[str, list[str]] = collections.defaultdict(list)
        for r in results:
            if r["status"] in statuses:
                groups[_cause(r["reason"])].append(f"{r['model_type']} ({r['task']})")
        lines += ["", f"## {title}", "", "| count | cause | archs |", "|---:|---|---|"]
        for cause, archs in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
            lines.append(f"| {len(archs)} | {_escape(cause)} | {', '.join(sorted(archs))} |")

    lines += [
        "",
        "## Per architecture",
        "",
        "| model_type | task | class | status | eager max\\|diff\\| | jit max\\|diff\\| | s | reason |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    for r in sorted(results, key=lambda r: (list(_TASK_MAPPINGS).index(r["task"]), r["model_type"])):
        lines.append(
            f"| {r['model_type']} | {r['task']} | {r.get('arch', '')} | {r['status']} | {_fmt(r['eager'])} | "
            f"{_fmt(r['jit'])} | {r.get('seconds', '')} | {_escape(r['reason'])} |"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model_types to run, e.g. llama,olmo2 (default: all)")
    parser.add_argument("--task", choices=list(_TASK_MAPPINGS), help="run one task only (default: all three)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes at a time (default: 2)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per check before it counts as timeout")
    parser.add_argument("--out", type=pathlib.Path, default=_ROOT / "docs" / "coverage.md", help="report to write")
    parser.add_argument("--jsonl", type=pathlib.Path, help="also append each result as a JSON line to this file")
    parser.add_argument(
        "--report-from",
        type=pathlib.Path,
        metavar="JSONL",
        help="run nothing: rewrite --out from the results a --jsonl file holds",
    )
    parser.add_argument("--worker", metavar="MODEL_TYPE", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        print(json.dumps(_worker(args.worker, args.task)), flush=True)
        return

    only = set(args.only.split(",")) if args.only else None
    tasks = [args.task] if args.task else list(_TASK_MAPPINGS)
    jobs = _jobs_to_run(only, tasks)
    if not jobs:
        parser.error(f"no (model_type, task) matches --only={args.only!r} --task={args.task!r}")
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")
    if args.report_from:
        results = [json.loads(line) for line in args.report_from.read_text().splitlines() if line.strip()]
        command = (
            "python scripts/sweep_coverage.py"
            + (f" --only {args.only}" if args.only else "")
            + (f" --task {args.task}" if args.task else "")
        )
        _write_report(args.out, results, len(jobs), started, command)
        print(f"wrote {args.out} from {len(results)} results", file=sys.stderr)
        return
    command = "python scripts/sweep_coverage.py " + " ".join(sys.argv[1:])
    results: list[dict] = []
    for result in sweep(jobs, workers=args.jobs, timeout=args.timeout, jsonl=args.jsonl):
        results.append(result)
        _write_report(args.out, results, len(jobs), started, command.strip())
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
