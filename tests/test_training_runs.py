"""Whole training runs, in a process of their own beside the suite (`python tests/test_training_runs.py DIR`,
with 8 simulated CPU devices): `hfjax finetune` end to end, a run killed with SIGKILL and resumed,
and sharded training (data parallel; fully sharded by two processes joined by jax.distributed)
against one device."""

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
        try:  # (absent for a moment while a new checkpoint replaces the old: two renames)
            step = json.loads(state.read_text())["step"]
        except (FileNotFoundError, json.JSONDecodeError):
            step = 0
        if step >= 4:
            killed.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    record["killed"] = {"code": killed.wait(), "stderr": killed.stderr.read()[-3000:]}
    # (killed between the two renames: the checkpoint lies beside its place, which --resume restores)
    beside = sorted(state.parent.parent.glob(f".{state.parent.name}.old-*"))
    kept = state if state.is_file() else (beside[-1] / state.name if beside else None)
    record["killed_at"] = json.loads(kept.read_text())["step"] if kept is not None else None
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

    # Sharded training: the same steps on one device, data parallel over 8 devices, and fully sharded
    # over (2, 4) by two processes joined by jax.distributed (hfjax launch, 4 devices each), which
    # also save what they trained.
    texts = [{"text": " ".join(rng.choice(WORDS, 12))} for _ in range(32)]
    (directory / "texts.json").write_text(json.dumps(texts))
    runs = {}
    for name, mesh in [("one", None), ("data8", hfjax.make_mesh(data=8, model=1))]:
        trainer = hfjax.Trainer(hfjax.load(path, mesh=mesh), training.adamw(1e-2), max_grad_norm=1.0)
        runs[name] = {
            "losses": [m["loss"] for m in trainer.fit(texts, steps=3, batch_size=8)],
            "sizes": _sizes(trainer),
        }
        if mesh is None:
            trainer.save_pretrained(directory / "trained-one")
    launched = subprocess.run(
        [sys.executable, "-m", "hfjax.cli", "launch", "--nproc", "2", "--devices-per-proc", "4", "--",
         __file__, "--two-processes", str(path), str(directory)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    record["two_processes"] = {"code": launched.returncode, "output": (launched.stdout + launched.stderr)[-4000:]}
    if launched.returncode == 0:
        runs["fsdp2x4"] = json.loads((directory / "fsdp2x4.json").read_text())
        from safetensors.numpy import load_file

        one, two = (load_file(directory / name / "model.safetensors") for name in ("trained-one", "trained-fsdp2x4"))
        record["saved_weights"] = {"names": sorted(two) == sorted(one), "max_difference": _max_difference(one, two)}
    record["sharded"] = runs

    # A NaN loss stops the run, naming the step.
    trainer = hfjax.Trainer(hfjax.load(path), training.adamw(1e30))
    try:
        trainer.fit(texts, steps=5, batch_size=8)
        record["nan"] = None
    except hfjax.TrainingError as error:
        record["nan"] = str(error)
    (directory / "record.json").write_text(json.dumps(record))


def _two_processes_child(path: str, directory: pathlib.Path) -> None:
    """Each of the two processes: trains fully sharded over a (2, 4) mesh spanning both, saves (process
    0 writes the directory, the weights gathered from both), and resumes a checkpoint it wrote."""
    import jax

    import hfjax
    from hfjax import training

    hfjax.distributed.initialize()  # hfjax launch has joined the run already
    model = hfjax.load(path, mesh=hfjax.make_mesh(data=2, model=4))
    trainer = hfjax.Trainer(model, training.adamw(1e-2), max_grad_norm=1.0, fully_sharded=True)
    history = trainer.fit(json.loads((directory / "texts.json").read_text()), steps=3, batch_size=8)
    trainer.save_pretrained(directory / "trained-fsdp2x4")
    # A checkpoint resumed by a new trainer comes back split as it was, with the same values.
    trainer.save_checkpoint(directory / "checkpoint-fsdp2x4")
    again = hfjax.Trainer(model, training.adamw(1e-2), max_grad_norm=1.0, fully_sharded=True)
    again.resume(directory / "checkpoint-fsdp2x4")
    pairs = [(again.trainable[n], a) for n, a in trainer.trainable.items()]
    pairs += list(zip(jax.tree_util.tree_leaves(again.opt_state), jax.tree_util.tree_leaves(trainer.opt_state)))
    resumed = {
        "same_sharding": all(a.sharding == b.sharding for a, b in pairs),
        "same_values": all(bool(jax.numpy.array_equal(a, b)) for a, b in pairs),
    }
    if jax.process_index() == 0:
        run = {"losses": [h["loss"] for h in history], "sizes": _sizes(trainer), "resumed": resumed}
        (directory / "fsdp2x4.json").write_text(json.dumps(run))


def _sizes(trainer) -> list[list[int]]:
    """(shard size, full size) of every trained weight and 2-D optimizer moment."""
    import jax

    moments = [x for x in jax.tree_util.tree_leaves(trainer.opt_state) if x.ndim == 2]
    return [
        [int(np.prod(x.sharding.shard_shape(x.shape))), int(x.size)] for x in [*trainer.trainable.values(), *moments]
    ]


def _max_difference(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[name] - b[name]))) for name in a)


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

    assert record["two_processes"]["code"] == 0, record["two_processes"]["output"]
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
    # What the two processes saved (weights gathered from both) is what one device trained.
    assert record["saved_weights"]["names"]
    assert record["saved_weights"]["max_difference"] <= tolerances.TRAINING_ADAMW.atol, record["saved_weights"]
    assert runs["fsdp2x4"]["resumed"] == {"same_sharding": True, "same_values": True}


def test_a_nan_loss_stops_the_run_naming_the_step(record):
    assert record["nan"] is not None and "at step 2" in record["nan"], record["nan"]


if __name__ == "__main__":
    if sys.argv[1] == "--two-processes":  # run by hfjax launch, in each process
        _two_processes_child(sys.argv[2], pathlib.Path(sys.argv[3]))
    else:
        _run_child(pathlib.Path(sys.argv[1]))
