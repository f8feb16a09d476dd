"""Sweeps hfjax parity over every architecture of transformers' auto mappings; writes docs/coverage.md.

For each (model_type, task) in the auto mappings of the tasks in `_TASK_MAPPINGS` (causal LM,
seq2seq LM, sequence classification, image classification, zero-shot image classification,
image features, speech recognition), a worker subprocess builds a tiny random checkpoint
(`hfjax.testing.save_tiny_checkpoint`), checks that PyTorch runs it, then runs
`hfjax.check` (eager and jit), then, for causal and seq2seq LMs, compares greedy generation of
one padded batch with transformers' `generate`, and prints one JSON line. A crash or hang in
one architecture costs only its own worker. Not part of CI: it takes over an hour on 2 cores.

    python scripts/sweep_coverage.py                      # full sweep, writes docs/coverage.md
    python scripts/sweep_coverage.py --only llama,olmo2 --task text-generation --out /tmp/c.md
    python scripts/sweep_coverage.py --task image-classification --jsonl /tmp/image.jsonl
    python scripts/sweep_coverage.py --report-from old.jsonl new.jsonl  # the report only; later files win

Image-text-to-text is left to the curated `hfjax.testing.VISION_LANGUAGE_FAMILIES` (tests/): its
inputs need image tokens laid out per family.
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
# task -> transformers' auto mappings of its architectures (a model_type in several: the first).
_TASK_MAPPINGS: dict[str, str | tuple[str, ...]] = {
    "text-generation": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "text2text-generation": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "text-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "zero-shot-image-classification": "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "image-feature-extraction": "MODEL_FOR_IMAGE_MAPPING_NAMES",
    "image-text-to-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",  # a text forward (see hfjax.check)
    "automatic-speech-recognition": ("MODEL_FOR_CTC_MAPPING_NAMES", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
}
_STATUSES = ("pass", "fail", "pytorch-fails", "timeout")
_GENERATIVE = ("text-generation", "text2text-generation")  # tasks that also get greedy generation parity
_PROMPT_LENGTHS = (5, 8)  # tokens in each prompt of the generation batch
_NEW_TOKENS = 8  # greedy tokens generated and compared per prompt


# ----------------------------------------------------------------------------- worker


def _one_line(text: str, limit: int = 160) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _exception_reason(error: BaseException) -> str:
    return _one_line(f"{type(error).__name__}: {error}")


def _worker(model_type: str, task: str, *, generate: bool) -> None:
    # Prints the forward check's JSON line; where greedy generation follows, prints it with
    # generate="pending" first, so that a timeout or crash in generation keeps the forward result.
    import tempfile

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix=f"sweep-{model_type}-") as directory:
        path = pathlib.Path(directory) / model_type
        result, pytorch_ran = _forward_check(model_type, task, path)
        runs_generation = generate and task in _GENERATIVE and pytorch_ran
        result.update(generate="pending" if runs_generation else None, generate_reason="")
        print(json.dumps(result), flush=True)
        if runs_generation:
            start = time.perf_counter()
            result.update(_generate_check(path, task), generate_seconds=round(time.perf_counter() - start, 1))
            print(json.dumps(result), flush=True)


def _forward_check(model_type: str, task: str, path: pathlib.Path) -> tuple[dict, bool]:
    # (the result, whether PyTorch ran the checkpoint's forward)
    import torch
    import transformers

    from hfjax import HfjaxError, _tasks, testing
    from hfjax.tasks import _check

    result = {"model_type": model_type, "task": task, "status": "fail", "eager": None, "jit": None, "reason": ""}
    try:
        testing.save_tiny_checkpoint(model_type, path, task=task)
        auto_class = _tasks.auto_class(task, transformers.AutoConfig.from_pretrained(path))
        model, loading = auto_class.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
        model.eval()
    except Exception as error:  # any failure before hfjax runs is PyTorch's or the factory's
        result.update(status="pytorch-fails", reason=_exception_reason(error))
        return result, False
    try:
        arrays = _check._inputs(  # the inputs check() uses
            model.config, task, batch=2, seq_len=8, seed=0, main_input_name=model.main_input_name
        )
    except HfjaxError as error:  # hfjax.check cannot build this model's inputs
        result["reason"] = _exception_reason(error)
        return result, False
    try:
        inputs = {k: torch.from_numpy(v) if hasattr(v, "dtype") else v for k, v in arrays.items()}
        with torch.no_grad():
            model(**inputs)
    except Exception as error:  # PyTorch cannot run the inputs check() gives
        result.update(status="pytorch-fails", reason=_exception_reason(error))
        return result, False
    del model

    try:
        report = _check.check(path, task=task, batch=2, seq_len=8, repeats=1, eager=True)
    except Exception as error:  # check() raising is itself a finding
        result["reason"] = _exception_reason(error)
        return result, True
    for row in report.rows:
        if row.path in ("eager", "jit") and row.max_abs_diff is not None:
            previous = result[row.path]
            result[row.path] = row.max_abs_diff if previous is None else max(previous, row.max_abs_diff)
    missing = sorted(loading.get("missing_keys") or ())
    if report.passed:
        result["status"] = "pass"
    elif missing:
        # transformers' own from_pretrained of the checkpoint its save_pretrained wrote initialises
        # weights anew (a key renaming that does not round-trip): PyTorch does not run this checkpoint.
        reason = (
            f"transformers' from_pretrained of the checkpoint its save_pretrained wrote misses {len(missing)} weights"
        )
        result.update(status="pytorch-fails", reason=f"{reason} ({', '.join(missing[:2])}, ...)")
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
    return result, True


def _token_id(config, name: str) -> int | None:
    value = getattr(config, name, None)
    if value is None and hasattr(config, "get_text_config"):
        value = getattr(config.get_text_config(), name, None)
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return value


def _generation_prompts(config, task: str):
    """int64 [2, 8] token ids and mask, and the pad token: prompts of 5 and 8 tokens, left-padded for a decoder and
    right-padded for an encoder (as tokenizers pad them), with the config's pad token."""
    import numpy as np

    from hfjax.tasks import _check

    ids = _check._inputs(config, task, batch=2, seq_len=max(_PROMPT_LENGTHS), seed=1)["input_ids"]
    mask = np.zeros_like(ids)
    pad = next((t for t in (_token_id(config, "pad_token_id"), _token_id(config, "eos_token_id")) if t is not None), 0)
    for row, length in enumerate(_PROMPT_LENGTHS):
        span = slice(0, length) if getattr(config, "is_encoder_decoder", False) else slice(ids.shape[1] - length, None)
        mask[row, span] = 1
    ids[mask == 0] = pad
    return ids, mask, pad


# The inputs of a forward check that the generation check's prompts stand for.
_TEXT_INPUTS = {"input_ids", "attention_mask", "decoder_input_ids", "token_type_ids", "use_cache"}


def _generate_check(path: pathlib.Path, task: str) -> dict:
    """Greedy generation of one padded batch in transformers (PyTorch) and in hfjax; the new tokens
    must be identical. Returns {"generate": status, "generate_reason": why}."""
    import numpy as np
    import torch
    import transformers

    import hfjax
    from hfjax import _tasks
    from hfjax.tasks import _check

    config = transformers.AutoConfig.from_pretrained(path)
    extra = set(_check._inputs(config, task, batch=2, seq_len=8, seed=0)) - _TEXT_INPUTS
    if extra:  # Voxtral-realtime's audio at every token: generate needs it, the prompts here are text
        return {"generate": None, "generate_reason": f"not checked: its forward needs {', '.join(sorted(extra))}"}
    try:
        auto_class = _tasks.auto_class(task, config)
        reference = auto_class.from_pretrained(path, dtype=torch.float32).eval()
        ids, mask, pad = _generation_prompts(reference.config, task)
        # min_new_tokens holds EOS back, so every row has _NEW_TOKENS tokens to compare.
        settings = dict(max_new_tokens=_NEW_TOKENS, min_new_tokens=_NEW_TOKENS, do_sample=False, pad_token_id=pad)
        with torch.no_grad():
            expected = reference.generate(
                torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), **settings
            ).numpy()
    except Exception as error:  # transformers' own generate failing does not count against hfjax
        return {"generate": "pytorch-fails", "generate_reason": _exception_reason(error)}
    # Decoders return prompt + new tokens; encoder-decoders the decoder start token + new tokens.
    start = 1 if getattr(reference.config, "is_encoder_decoder", False) else ids.shape[1]
    del reference

    try:
        model = hfjax.load(path, task=task, dtype="float32")
        actual = np.asarray(model.generate(ids, mask, **settings))
    except Exception as error:
        return {"generate": "error", "generate_reason": _exception_reason(error)}
    if actual.shape != expected.shape:
        return {"generate": "fail", "generate_reason": f"shape {actual.shape}, PyTorch's {expected.shape}"}
    differ = np.argwhere(actual[:, start:] != expected[:, start:])
    if differ.size:
        row, step = (int(i) for i in differ[0])
        return {
            "generate": "fail",
            "generate_reason": f"tokens differ: row {row} from new token {step} "
            f"(hfjax {actual[row, start + step]}, PyTorch {expected[row, start + step]})",
        }
    return {"generate": "pass", "generate_reason": ""}


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


def _run_worker(model_type: str, task: str, timeout: float, script: str = __file__, generate: bool = True) -> dict:
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
    command += [] if generate else ["--no-generate"]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=_ROOT)
        stdout, stderr, returncode = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:  # keeps a forward result printed before the timeout
        stdout, stderr, returncode = _text(expired.stdout), _text(expired.stderr), None
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    tail = [line for line in stderr.splitlines() if line.strip()]
    if lines:
        result = json.loads(lines[-1])
        if result.get("generate") == "pending":  # generation did not finish
            if returncode is None:
                why = f"timeout after {timeout:.0f} s"
            else:
                why = f"worker crashed (exit {returncode}): {tail[-1] if tail else ''}"
            result.update(generate="timeout" if returncode is None else "error", generate_reason=_one_line(why))
    elif returncode is None:
        result = {
            "model_type": model_type,
            "task": task,
            "status": "timeout",
            "eager": None,
            "jit": None,
            "reason": f"timeout after {timeout:.0f} s",
        }
    else:  # the worker died without a result line: a segfault, OOM kill or import error
        reason = tail[-1] if tail else f"worker exited with code {returncode}"
        result = {
            "model_type": model_type,
            "task": task,
            "status": "fail",
            "eager": None,
            "jit": None,
            "reason": _one_line(f"worker crashed (exit {returncode}): {reason}"),
        }
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["run"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    return result


def _text(output: str | bytes | None) -> str:
    # TimeoutExpired holds the output read so far as bytes, even for text=True.
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def sweep(
    jobs: list[tuple[str, str, str]],
    *,
    workers: int,
    timeout: float,
    jsonl: pathlib.Path | None,
    script: str = __file__,
    generate: bool = True,
) -> collections.abc.Iterator[dict]:
    """Runs one worker subprocess of `script` per (model_type, task, class name); yields each result as it
    finishes, after printing a progress line and appending it to `jsonl`."""
    print(f"sweeping {len(jobs)} checks with {workers} workers", file=sys.stderr, flush=True)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {
            pool.submit(_run_worker, model_type, task, timeout, script, generate): arch
            for model_type, task, arch in jobs
        }
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            result = {**future.result(), "arch": futures[future]}
            print(
                f"[{done}/{len(jobs)}] {result['model_type']} {result['task']}: {result['status']}"
                + (f", generate {result['generate']}" if result.get("generate") else "")
                + f" ({result['seconds']} s) {result['reason']}"
                + (f" generate: {result['generate_reason']}" if result.get("generate_reason") else ""),
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
    if reason.startswith("tokens differ"):
        return "greedy tokens differ from PyTorch's"
    reason = re.sub(r"\[[^\]]*\.py:\d+\]", "", reason)
    reason = re.sub(r" \(from [^)]*\)", "", reason)  # hfjax's "(from <checkpoint>/generation_config.json)"
    reason = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", reason)
    reason = re.sub(r"\d+x\d+", "NxN", reason)
    reason = re.sub(r"(?<![A-Za-z_\d])\d+(\.\d+)?(e-?\d+)?", "N", reason)
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
        "`hfjax.check` against PyTorch, eager and jit, on random inputs built from the config: batch 2 of 8 "
        "tokens; images at the config's image size (64x64 where it has none); raw audio or log-mel features "
        "for speech; vision-language models (image-text-to-text) and audio language models (speech "
        "recognition on input_ids) get a text forward, token ids without media placeholder tokens, and those "
        "that cannot run on text alone (BLIP, IDEFICS, Pix2Struct, ...) their image and the processor's "
        "placeholders (see `hfjax.check`). The `run` column is the date of the row's run. "
        "`pytorch-fails` means PyTorch itself could not run the checkpoint: transformers raised (each reason "
        "below was checked against transformers' source: a bug, a config its own checks refuse, an optional "
        "library that is not installed), or transformers' from_pretrained of the checkpoint its own "
        "save_pretrained wrote left weights uninitialised. Those do not count against hfjax. A row the "
        "generic config shrinker sized wrongly is not one of them: it gets an entry in "
        "`hfjax.testing._families._GENERIC_FIXES` (or a rule of the shrinker).",
        "",
    ]
    if any(r.get("generate") for r in results):
        lines += [
            f"Every causal and sequence-to-sequence LM that PyTorch runs also gets greedy generation parity "
            f"(`generate` column): one batch of two prompts of {' and '.join(map(str, _PROMPT_LENGTHS))} random "
            "tokens, padded with an attention mask (left for decoders, right for encoders, with the config's pad "
            f"token), {_NEW_TOKENS} new tokens (`min_new_tokens` holds EOS back), generated by transformers' "
            "`generate` in PyTorch and by `hfjax.load(...).generate`; the new tokens must be identical. "
            "`error` means hfjax raised; `pytorch-fails` there means transformers' own `generate` raised. "
            "Models whose forward needs more than the prompt (Voxtral-realtime's audio at every token) are "
            "not checked.",
            "",
        ]
    if partial:
        lines += [f"**Partial: {len(results)} of {total} checks have results; the others have not run yet.**", ""]
    lines += [
        "## Totals",
        "",
        "| task | pass | fail | pytorch-fails | timeout | pass rate among archs PyTorch runs |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for task in _TASK_MAPPINGS:
        task_results = [r for r in results if r["task"] == task]
        lines += _totals_row(task, collections.Counter(r["status"] for r in task_results))
        if task in _GENERATIVE:
            # A generation that raised in hfjax counts as a fail.
            generated = [
                "fail" if r["generate"] == "error" else r["generate"] for r in task_results if r.get("generate")
            ]
            lines += _totals_row(f"{task} (greedy generate)", collections.Counter(generated))

    sections = (
        ("Failure causes (hfjax)", "status", "reason", ("fail", "timeout")),
        ("PyTorch-side failures", "status", "reason", ("pytorch-fails",)),
        ("Generation failure causes (hfjax)", "generate", "generate_reason", ("fail", "error", "timeout")),
        ("Generation: PyTorch-side failures", "generate", "generate_reason", ("pytorch-fails",)),
    )
    for title, field, why, statuses in sections:
        groups: dict[str, list[str]] = collections.defaultdict(list)
        for r in results:
            if r.get(field) in statuses:
                groups[_cause(r[why])].append(f"{r['model_type']} ({r['task']})")
        if not groups and field == "generate":
            continue
        if not groups:
            lines += ["", f"## {title}", "", "None."]
            continue
        lines += ["", f"## {title}", "", "| count | cause | archs |", "|---:|---|---|"]
        for cause, archs in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
            lines.append(f"| {len(archs)} | {_escape(cause)} | {', '.join(sorted(archs))} |")

    lines += [
        "",
        "## Per architecture",
        "",
        "| model_type | task | class | status | eager max\\|diff\\| | jit max\\|diff\\| | generate | s | run | reason |",
        "|---|---|---|---|---:|---:|---|---:|---|---|",
    ]
    for r in sorted(results, key=lambda r: (list(_TASK_MAPPINGS).index(r["task"]), r["model_type"])):
        reasons = [r["reason"]] + ([f"generate: {r['generate_reason']}"] if r.get("generate_reason") else [])
        lines.append(
            f"| {r['model_type']} | {r['task']} | {r.get('arch', '')} | {r['status']} | {_fmt(r['eager'])} | "
            f"{_fmt(r['jit'])} | {r.get('generate') or '-'} | {r.get('seconds', '')} | {r.get('run', '')} | "
            f"{_escape('; '.join(filter(None, reasons)))} |"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    # The quantized-weights table (scripts/quantization_accuracy.py) is kept as it was.
    old = out.read_text() if out.is_file() else ""
    kept = re.search(r"\n<!-- quantization table: .*?<!-- end of quantization table -->", old, flags=re.S)
    out.write_text("\n".join(lines) + "\n" + (kept.group(0) + "\n" if kept else ""))


def _totals_row(label: str, counts: collections.Counter) -> list[str]:
    if not counts:
        return []
    runnable = counts["pass"] + counts["fail"] + counts["timeout"]
    rate = f"{100 * counts['pass'] / runnable:.0f}% ({counts['pass']}/{runnable})" if runnable else "-"
    return [f"| {label} | " + " | ".join(str(counts[s]) for s in _STATUSES) + f" | {rate} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model_types to run, e.g. llama,olmo2 (default: all)")
    parser.add_argument("--task", choices=list(_TASK_MAPPINGS), help="run one task only (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes at a time (default: 2)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=180.0,
        help="seconds per check (forward and generation together) before it counts as timeout",
    )
    parser.add_argument(
        "--generate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also check greedy generation of causal and seq2seq LMs against PyTorch (default: on)",
    )
    parser.add_argument("--out", type=pathlib.Path, default=_ROOT / "docs" / "coverage.md", help="report to write")
    parser.add_argument("--jsonl", type=pathlib.Path, help="also append each result as a JSON line to this file")
    parser.add_argument(
        "--report-from",
        type=pathlib.Path,
        nargs="+",
        metavar="JSONL",
        help="run nothing: rewrite --out from the results --jsonl files hold (a later file's result for the "
        "same model_type and task replaces an earlier one's)",
    )
    parser.add_argument("--worker", metavar="MODEL_TYPE", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        _worker(args.worker, args.task, generate=args.generate)
        return

    only = set(args.only.split(",")) if args.only else None
    tasks = [args.task] if args.task else list(_TASK_MAPPINGS)
    jobs = _jobs_to_run(only, tasks)
    if not jobs:
        parser.error(f"no (model_type, task) matches --only={args.only!r} --task={args.task!r}")
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")
    if args.report_from:
        latest: dict[tuple[str, str], dict] = {}
        for path in args.report_from:
            for line in path.read_text().splitlines():
                if line.strip():
                    result = json.loads(line)
                    latest[result["model_type"], result["task"]] = result
        wanted = {(model_type, task) for model_type, task, _ in jobs}
        results = [r for key, r in latest.items() if key in wanted]
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
    for result in sweep(jobs, workers=args.jobs, timeout=args.timeout, jsonl=args.jsonl, generate=args.generate):
        results.append(result)
        _write_report(args.out, results, len(jobs), started, command.strip())
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
