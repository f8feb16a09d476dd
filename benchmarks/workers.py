"""Running one side of a benchmark in a process of its own, which prints its result as JSON last."""

from __future__ import annotations

import json
import subprocess


def run_json(command: list[str], env: dict, *, timeout: float, what: str) -> dict:
    """Runs `command` and returns the JSON object of its last stdout line, or {"error": ...} saying
    that `what` timed out or exited without one (with the end of its stderr)."""
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"{what} timed out after {timeout} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"{what} exited with {done.returncode}: {done.stderr.strip()[-800:]}"}
    return json.loads(lines[-1])


def import_model_code(path, auto_name: str = "AutoModelForCausalLM") -> None:
    """Imports the transformers module of the checkpoint at `path`'s model (transformers imports it
    lazily on first use), so that a worker can time a load apart from that import."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    getattr(transformers, auto_name)._model_mapping[type(config)]
