"""Whole training runs, in a process of their own beside the suite (`python tests/test_training_runs.py DIR`,
with 8 simulated CPU devices): `hfjax finetune` end to end, a run killed with SIGKILL and resumed,
and sharded training (data parallel, fully sharded) against one device."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import background

pytest.importorskip("optax", reason="training needs the `train` extra (optax)")

STEPS = 12
WORDS = "the cat sat on a mat and the dog ran to the park while birds sang in the old trees".split()


def _finetune(directory: pathlib.Path, out: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "hfjax.cli", "finetune", "--model", str(directory / "llama"),
        "--data", str(directory / "train.jsonl"), "--eval-data", str(directory / "eval.jsonl"),
        "--steps", str(STEPS), "--batch-size", "4", "--learning-rate", "1e-2", "--warmup-steps", "2",
        "--save-every", "2", "--eval-every", "4", "--out", str(directory / out), "--no-progress", *extra,
    ]  # fmt: skip


def _history(out: pathlib.Path) -> list[dict]:
    return json.loads((out / "checkpoint" / "trainer_state.json").read_text())["history"]


def _run_child(directory: pathlib.Path) -> None:
    """The child: the runs, then record.json with what each did."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    import transformers

    import hfjax
    from hfjax import testing, training

    rng = np.random.default_rng(0)
    for name, count in [("train", 32), ("eval", 8)]:
        lines = [json.dumps({"text": " ".join(rng.choice(WORDS, rng.integers(6, 20)))}) for _ in range(count)]
        (directory / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    path = testing.save_tiny_checkpoint("llama", directory / "llama")
    record = {}

    # A run killed with SIGKILL once its checkpoint is at step 4 or later, then resumed; and the same
    # run uninterrupted, as the command sets it up, in this process.
    killed = subprocess.Popen(
        _finetune(directory, "killed"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    state = directory / "killed" / "checkpoint" / "trainer_state.json"
    while killed.poll() is None:
        if state.is_file() and json.loads(state.read_text())["step"] >= 4:
            killed.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    record["killed"] = {"code": killed.wait(), "stderr": killed.stderr.read()[-3000:]}
    record["killed_at"] = json.loads(state.read_text())["step"] if state.is_file() else None
    resumed = subprocess.run(_finetune(directory, "killed", "--resume"), capture_output=True, text=True, timeout=600)
    record["resumed"] = {"code": resumed.returncode, "stderr": resumed.stderr[-3000:]}
    model = hfjax.load(path)
    schedule = training.linear_schedule(1e-2, warmup_steps=2, total_steps=STEPS)
    optimizer = training.adamw(schedule, mask=training.decay_mask(model.module))
    whole = hfjax.Trainer(model, optimizer, max_grad_norm=1.0)
    whole.fit(directory / "train.jsonl", steps=STEPS, batch_size=4, eval_dataset=directory / "eval.jsonl", eval_every=4)
    record["whole_history"] = whole.history
    if resumed.returncode == 0:
        record["resumed_history"] = _history(directory / "killed")
        record["png"] = (directory / "killed" / "loss.png").read_bytes()[:8].hex()
        # transformers loads the output; its loss on the training data is below the start's.
        ids = transformers.AutoTokenizer.from_pretrained(path)(
            [json.loads(line)["text"] for line in (directory / "train.jsonl").read_text().splitlines()[:8]],
            return_tensors="pt", padding=True,
        )  # fmt: skip
        labels = ids["input_ids"].masked_fill(ids["attention_mask"] == 0, -100)
        with torch.no_grad():
            record["transformers_loss"] = {
                name: transformers.AutoModelForCausalLM.from_pretrained(where)(**ids, labels=labels).loss.item()
                for name, where in [("start", path), ("trained", directory / "killed")]
            }
    (directory / "record.json").write_text(json.dumps(record))

    # Sharded training: the same steps on one device, data parallel over 8, fully sharded over (2, 4).
    texts = [{"text": " ".join(rng.choice(WORDS, 12))} for _ in range(32)]
    runs = {}
    for name, mesh, fully in [
        ("one", None, False),
        ("data8", hfjax.make_mesh(data=8, model=1), False),
        ("fsdp2x4", hfjax.make_mesh(data=2, model=4), True),
    ]:
        trainer = hfjax.Trainer(
            hfjax.load(path, mesh=mesh), training.adamw(1e-2), max_grad_norm=1.0, fully_sharded=fully
        )
        losses = [m["loss"] for m in trainer.fit(texts, steps=3, batch_size=8)]
        moments = [x for x in jax_leaves(trainer.opt_state) if x.ndim == 2]
        runs[name] = {
            "losses": losses,
            # (shard size, full size) of every trained weight and 2-D optimizer moment after the steps
            "sizes": [
                [int(np.prod(x.sharding.shard_shape(x.shape))), int(x.size)]
                for x in [*trainer.trainable.values(), *moments]
            ],
        }
    record["sharded"] = runs

    # A NaN loss stops the run, naming the step.
    trainer = hfjax.Trainer(hfjax.load(path), training.adamw(1e30))
    try:
        trainer.fit(texts, steps=5, batch_size=8)
        record["nan"] = None
    except hfjax.TrainingError as error:
        record["nan"] = str(error)
    (directory / "record.json").write_text(json.dumps(record))


def jax_leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def start_in_background() -> None:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    background.start(
        "training-runs", [sys.executable, __file__], env={"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}, seconds=90
    )


@pytest.fixture(scope="module")
def record():
    child = background.finished("training-runs", start_in_background)
    assert child.returncode == 0, child.output[-4000:]
    return json.loads((child.directory / "record.json").read_text())


def test_finetune_writes_a_model_transformers_loads_with_lower_loss(record):
    assert record["resumed"]["code"] == 0, record["resumed"]["stderr"]
    assert record["png"] == "89504e470d0a1a0a"  # the PNG signature
    loss = record["transformers_loss"]
    assert loss["trained"] < loss["start"], loss
    history = record["resumed_history"]
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert [h["step"] for h in history if "eval_loss" in h] == [4, 8, 12]


def test_a_killed_run_resumes_with_the_same_losses(record):
    assert record["killed"]["code"] == -signal.SIGKILL, f"the run ended before it was killed: {record['killed']}"
    assert 4 <= record["killed_at"] < STEPS
    assert record["resumed"]["code"] == 0, record["resumed"]["stderr"]
    # Exactly the uninterrupted run's steps: the same program from the same state and data position.
    assert record["resumed_history"] == record["whole_history"]


def test_sharded_training_matches_one_device(record):
    from hfjax import tolerances

    runs = record["sharded"]
    for name in ("data8", "fsdp2x4"):
        np.testing.assert_allclose(
            runs[name]["losses"], runs["one"]["losses"], atol=tolerances.DEFAULT.atol, err_msg=name
        )
    # Fully sharded: every weight and optimizer moment split over "data" (2), and over "model" (4)
    # too where the sharding rules split it (projections and embeddings; not norm scales).
    ways = [full // shard for shard, full in runs["fsdp2x4"]["sizes"]]
    assert set(ways) == {2, 8}, runs["fsdp2x4"]["sizes"]
    assert all(shard == full for shard, full in runs["data8"]["sizes"])  # data parallel: copies


def test_a_nan_loss_stops_the_run_naming_the_step(record):
    assert record["nan"] is not None and "at step 2" in record["nan"], record["nan"]


if __name__ == "__main__":
    _run_child(pathlib.Path(sys.argv[1]))
