"""Training against PyTorch: the same checkpoint fine-tuned by torch.optim (full) and by peft (LoRA)
over the same batches gives the same per-step losses, gradient norms, learning rates and final
logits; what the trainer saves loads back in transformers and peft."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
import transformers

import hfjax
from hfjax import tolerances

optax = pytest.importorskip("optax", reason="training needs the `train` extra (optax)")
training = pytest.importorskip("hfjax.training", reason="training needs the `train` extra (optax)")

AUTO = {
    "text-generation": transformers.AutoModelForCausalLM,
    "text-classification": transformers.AutoModelForSequenceClassification,
    "text2text-generation": transformers.AutoModelForSeq2SeqLM,
}


@dataclasses.dataclass(frozen=True)
class Run:
    family: str
    task: str = "text-generation"
    optimizer: str = "adamw"  # or "sgd"
    accumulation_steps: int = 1
    remat: bool = False
    steps: int = 3
    learning_rate: float = 1e-2
    weight_decay: float = 0.1
    warmup_steps: int = 1
    max_grad_norm: float = 1.0


# Each family once, each option in some run: SGD and AdamW, accumulation, remat, the three tasks.
RUNS = [
    Run("llama", optimizer="sgd", learning_rate=0.5),
    Run("qwen3", optimizer="sgd", learning_rate=0.5, remat=True),
    Run("gemma2", accumulation_steps=2),
    Run("gpt2"),
    Run("bert", task="text-classification"),
    Run("t5", task="text2text-generation"),
]


def batches(run: Run, config, count: int, rows: int = 4, length: int = 16) -> list[dict]:
    """Random batches with a padded row, for the run's task, as int64 numpy arrays."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        ids = rng.integers(3, config.vocab_size, (rows, length))
        mask = np.ones_like(ids)
        mask[1, length // 2 :] = 0
        batch = {"input_ids": ids, "attention_mask": mask}
        if run.task == "text-classification":
            batch["labels"] = rng.integers(0, config.num_labels, (rows,))
        elif run.task == "text2text-generation":
            batch["labels"] = rng.integers(3, config.vocab_size, (rows, length // 2))
        else:
            batch["labels"] = np.where(mask == 1, ids, -100)
        out.append(batch)
    return out


def torch_reference(path, run: Run, data: list[dict], model=None):
    """(per-step {loss, grad_norm, learning_rate}, the trained model) from torch.optim, as the HF
    Trainer sets it up: weight decay on transformers' choice of parameters, linear warmup/decay.
    `model`: the module to train (a peft model), default the checkpoint's."""
    if model is None:
        model = AUTO[run.task].from_pretrained(path)
    model.eval()  # no dropout: the trainer runs with dropout=False
    decay = set(transformers.trainer_pt_utils.get_parameter_names(model, [torch.nn.LayerNorm], _HF_NO_DECAY))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": run.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    if run.optimizer == "sgd":
        optimizer = torch.optim.SGD(groups, lr=run.learning_rate)
    else:
        optimizer = torch.optim.AdamW(groups, lr=run.learning_rate)
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, run.warmup_steps, run.steps)
    metrics = []
    for batch in data:
        rate = schedule.get_last_lr()[0]
        optimizer.zero_grad()
        total = 0.0
        for micro in _split(batch, run.accumulation_steps):
            loss = model(**{k: torch.as_tensor(v) for k, v in micro.items()}).loss / run.accumulation_steps
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in named], run.max_grad_norm)
        optimizer.step()
        schedule.step()
        metrics.append({"loss": total, "grad_norm": float(norm), "learning_rate": rate})
    return metrics, model


_HF_NO_DECAY = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]  # transformers.Trainer's


def _split(batch: dict, parts: int) -> list[dict]:
    rows = len(batch["input_ids"]) // parts
    return [{k: v[i * rows : (i + 1) * rows] for k, v in batch.items()} for i in range(parts)]


def hfjax_trainer(model, run: Run, **kwargs):
    schedule = training.linear_schedule(run.learning_rate, warmup_steps=run.warmup_steps, total_steps=run.steps)
    if run.optimizer == "sgd":
        # torch's SGD decays by adding weight_decay * p to the gradient, before the rate.
        optimizer = optax.chain(
            optax.masked(optax.add_decayed_weights(run.weight_decay), training.decay_mask(model.module)),
            training.sgd(schedule),
        )
    else:
        optimizer = training.adamw(schedule, weight_decay=run.weight_decay, mask=training.decay_mask(model.module))
    return hfjax.Trainer(
        model,
        optimizer,
        accumulation_steps=run.accumulation_steps,
        max_grad_norm=run.max_grad_norm,
        remat=run.remat,
        dropout=False,
        **kwargs,
    )


def _tolerance(run: Run):
    return tolerances.TRAINING_SGD if run.optimizer == "sgd" else tolerances.TRAINING_ADAMW


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r.family}-{r.optimizer}")
def test_full_finetuning_matches_torch_optim(checkpoint, tmp_path, run):
    path = checkpoint(run.family, task=run.task)
    model = hfjax.load(path)
    data = batches(run, model.config, run.steps)
    want, reference = torch_reference(path, run, data)
    trainer = hfjax_trainer(model, run)
    got = [trainer.step(batch) for batch in data]
    tolerance = _tolerance(run)
    for name in ("loss", "grad_norm", "learning_rate"):
        np.testing.assert_allclose(
            [m[name] for m in got], [m[name] for m in want], atol=tolerance.atol, rtol=tolerance.rtol, err_msg=name
        )
    assert trainer.compile_count == 1  # one program for every step of one shape

    # The trained weights: in the model the trainer holds, and in the checkpoint it saves.
    probe = {k: v for k, v in data[0].items() if k != "labels"}
    if run.task == "text2text-generation":
        probe["decoder_input_ids"] = data[0]["labels"]
    with torch.no_grad():
        want_logits = reference(**{k: torch.as_tensor(v) for k, v in probe.items()}).logits.numpy()
    got_logits = np.asarray(trainer.model(**{k: v.astype(np.int32) for k, v in probe.items()}).logits)
    np.testing.assert_allclose(got_logits, want_logits, atol=tolerance.atol, rtol=tolerance.rtol)
    saved = AUTO[run.task].from_pretrained(trainer.save_pretrained(tmp_path / "out")).eval()
    with torch.no_grad():
        loaded = saved(**{k: torch.as_tensor(v) for k, v in probe.items()}).logits.numpy()
    np.testing.assert_allclose(loaded, got_logits, atol=tolerances.DEFAULT.atol, rtol=0)


LORA_TARGETS = {
    "llama": {"target_modules": ["q_proj", "v_proj"]},
    "gpt2": {"target_modules": ["c_attn"], "fan_in_fan_out": True},
}


@pytest.mark.parametrize("family", LORA_TARGETS)
def test_lora_matches_peft(checkpoint, tmp_path, family):
    peft = pytest.importorskip("peft", reason="LoRA needs the `train` extra (peft)")
    run = Run(family)
    path = checkpoint(family)
    # An adapter as peft saves it; random B (init_lora_weights=False), so that it changes the logits.
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **LORA_TARGETS[family])
    peft.get_peft_model(AUTO[run.task].from_pretrained(path), config).save_pretrained(tmp_path / "start")

    model = hfjax.load(path)
    data = batches(run, model.config, run.steps)
    start = peft.PeftModel.from_pretrained(AUTO[run.task].from_pretrained(path), tmp_path / "start", is_trainable=True)
    want, reference = torch_reference(path, run, data, model=start)
    trainer = hfjax_trainer(model, run, lora=tmp_path / "start")
    got = [trainer.step(batch) for batch in data]
    tolerance = tolerances.TRAINING_ADAMW
    for name in ("loss", "grad_norm", "learning_rate"):
        np.testing.assert_allclose(
            [m[name] for m in got], [m[name] for m in want], atol=tolerance.atol, rtol=tolerance.rtol, err_msg=name
        )
    assert sorted(trainer.trainable) == sorted(
        n.removeprefix("base_model.model.") for n, p in reference.named_parameters() if p.requires_grad
    )

    ids = data[0]["input_ids"]
    with torch.no_grad():
        want_logits = reference(input_ids=torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(
        np.asarray(trainer.model(ids.astype(np.int32)).logits), want_logits, atol=tolerance.atol, rtol=tolerance.rtol
    )
    # The adapter hfjax writes, loaded by peft, and the merged checkpoint, loaded by transformers.
    saved = trainer.save_pretrained(tmp_path / "adapter")
    assert sorted(p.name for p in saved.iterdir() if p.name.startswith("adapter")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    loaded = peft.PeftModel.from_pretrained(AUTO[run.task].from_pretrained(path), saved).eval()
    merged = AUTO[run.task].from_pretrained(trainer.merge_and_save(tmp_path / "merged")).eval()
    for name, module in [("adapter", loaded), ("merged", merged)]:
        with torch.no_grad():
            logits = module(input_ids=torch.as_tensor(ids)).logits.numpy()
        np.testing.assert_allclose(logits, want_logits, atol=tolerance.atol, rtol=tolerance.rtol, err_msg=name)
    # The base model's weights were not trained.
    assert all(np.array_equal(np.asarray(model.params[n]), np.asarray(a)) for n, a in hfjax.load(path).params.items())


# ---- schedules, decay, data: against transformers, no compiling ----------------------------


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_schedules_match_transformers(kind):
    made = {
        "linear": transformers.get_linear_schedule_with_warmup,
        "cosine": transformers.get_cosine_schedule_with_warmup,
    }
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    reference = made[kind](optimizer, num_warmup_steps=3, num_training_steps=10)
    want = []
    for _ in range(12):
        want.append(reference.get_last_lr()[0])
        optimizer.step()
        reference.step()
    schedule = {"linear": training.linear_schedule, "cosine": training.cosine_schedule}[kind]
    got = [float(schedule(3e-4, warmup_steps=3, total_steps=10)(step)) for step in range(12)]
    np.testing.assert_allclose(got, want, atol=tolerances.JSON_FLOATS.atol * 3e-4, rtol=1e-6)


@pytest.mark.parametrize(
    "family,task", [("llama", None), ("gpt2", None), ("gemma2", None), ("bert", "text-classification"), ("t5", None)]
)
def test_decay_mask_is_the_hf_trainers(checkpoint, family, task):
    model = hfjax.load(checkpoint(family, task=task))
    torch_model = AUTO[model.task].from_config(model.config)
    names = {n for n, _ in torch_model.named_parameters()}  # a tied weight once, as the trainer holds it
    want = (
        set(transformers.trainer_pt_utils.get_parameter_names(torch_model, [torch.nn.LayerNorm], _HF_NO_DECAY)) & names
    )
    mask = training.decay_mask(model.module)({n: None for n, _ in model.module.named_parameters()})
    assert {n for n, decayed in mask.items() if decayed} == want
    assert any(not decayed for decayed in mask.values())


def test_chat_labels_are_the_assistant_tokens_transformers_marks(checkpoint):
    tokenizer = hfjax.load(checkpoint("llama")).tokenizer
    # The same template with transformers' {% generation %} markers around each assistant turn:
    # apply_chat_template(return_assistant_tokens_mask=True) marks those tokens (TRL's assistant_only_loss).
    marked = tokenizer.chat_template.replace(
        "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n",
        "<|{{ message['role'] }}|>\n{% if message['role'] == 'assistant' %}{% generation %}"
        "{{ message['content'] }}{{ eos_token }}\n{% endgeneration %}{% else %}{{ message['content'] }}{{ eos_token }}\n{% endif %}",
    )
    assert marked != tokenizer.chat_template
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the river?"},
        {"role": "assistant", "content": "Water that runs to the sea."},
        {"role": "user", "content": "And the mill?"},
        {"role": "assistant", "content": "An old building by it."},
    ]
    reference = tokenizer.apply_chat_template(
        messages, chat_template=marked, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    row = training.tokenize(
        [{"messages": messages}], tokenizer, task="text-generation", config=None, max_length=256
    ).rows[0]
    assert row["input_ids"] == list(reference["input_ids"])
    want = [t if m else -100 for t, m in zip(reference["input_ids"], reference["assistant_masks"])]
    assert row["labels"] == want and sum(reference["assistant_masks"]) > 0


def test_data_files_become_bucketed_batches(checkpoint, tmp_path):
    model = hfjax.load(checkpoint("bert", task="text-classification"))
    (tmp_path / "train.csv").write_text("text,label\nthe river ran,0\nbread in the morning at the shop,1\nnews,1\n")
    examples = training.tokenize(
        tmp_path / "train.csv", model.tokenizer, task=model.task, config=model.config, max_length=64
    )
    batch = training.BatchStream(examples, 2, seed=0, max_length=64).batch(0)
    assert batch["input_ids"].shape == (2, 16) and batch["labels"].shape == (2,)
    assert batch["input_ids"].dtype == np.int32
    lengths = {len(r["input_ids"]) for r in examples.rows}
    assert set(batch["attention_mask"].sum(axis=1)) <= lengths

    t5 = hfjax.load(checkpoint("t5"))
    records = [{"source": "translate: the river " * 5, "target": "der Fluss"}]
    batch = training.BatchStream(
        training.tokenize(records, t5.tokenizer, task=t5.task, config=t5.config, max_length=64),
        1,
        seed=0,
        max_length=64,
    ).batch(0)
    target = t5.tokenizer(text_target="der Fluss")["input_ids"]
    assert batch["input_ids"].shape[1] in (16, 32, 64) and batch["labels"].shape == (1, 16)
    assert list(batch["labels"][0, : len(target)]) == target and set(batch["labels"][0, len(target) :]) == {-100}


def test_a_malformed_line_is_one_error_naming_file_and_line(checkpoint, tmp_path, capsys):
    from hfjax import cli

    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "fine"}\n\n{"text": "also fine"}\n{"text": broken}\n')
    code = cli.main(
        [
            "finetune",
            "--model",
            str(checkpoint("llama")),
            "--data",
            str(data),
            "--steps",
            "1",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith(f"hfjax finetune: {data}:4: not valid JSON"), err
    (tmp_path / "wrong.jsonl").write_text('{"prompt": "no text field"}\n')
    with pytest.raises(hfjax.TrainingError, match=r"wrong\.jsonl:1: no field 'text'"):
        training.tokenize(
            tmp_path / "wrong.jsonl",
            hfjax.load(checkpoint("llama")).tokenizer,
            task="text-generation",
            config=None,
            max_length=8,
        )
    assert not (tmp_path / "out").exists()


def test_bad_settings_name_the_argument(checkpoint):
    model = hfjax.load(checkpoint("llama"))
    with pytest.raises(hfjax.TrainingError, match=r"optimizer=.*got a SGD"):
        hfjax.Trainer(model, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    with pytest.raises(hfjax.TrainingError, match=r"lora=.*got a dict"):
        hfjax.Trainer(model, training.sgd(0.1), lora={"r": 4})
    with pytest.raises(hfjax.TrainingError, match=r"accumulation_steps=0"):
        hfjax.Trainer(model, training.sgd(0.1), accumulation_steps=0)
    with pytest.raises(hfjax.TrainingError, match=r"fully_sharded=True"):
        hfjax.Trainer(model, training.sgd(0.1), fully_sharded=True)


def test_bfloat16_compute_keeps_float32_weights_and_compiles_once_per_shape(checkpoint):
    run = Run("llama", optimizer="sgd", learning_rate=0.5)
    path = checkpoint("llama")
    model = hfjax.load(path)
    data = batches(run, model.config, 2, length=8) + batches(run, model.config, 1, length=16)
    want, _ = torch_reference(path, Run("llama", optimizer="sgd", learning_rate=0.5), data)
    trainer = hfjax_trainer(model, run, compute_dtype="bfloat16")
    got = [trainer.step(batch) for batch in data]
    np.testing.assert_allclose(
        [m["loss"] for m in got],
        [m["loss"] for m in want],
        atol=tolerances.TRAINING_BF16.atol,
        rtol=tolerances.TRAINING_BF16.rtol,
    )
    assert {str(a.dtype) for a in trainer.trainable.values()} == {"float32"}
    assert trainer.compile_count == 2  # two batch shapes
    assert trainer.model.params["model.norm.weight"].dtype == np.float32  # the model's own dtype, updated
    np.testing.assert_array_equal(
        np.asarray(trainer.model.params["model.norm.weight"]), np.asarray(trainer.trainable["model.norm.weight"])
    )


def test_a_directory_is_written_whole_or_not_at_all(tmp_path):
    from hfjax.training import _save

    target = tmp_path / "out"
    with _save.atomic_directory(target) as scratch:
        (scratch / "weights").write_text("first")
    assert (target / "weights").read_text() == "first"
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o777 & ~mask  # as mkdir makes it, not mkdtemp's 0700

    with pytest.raises(KeyboardInterrupt):  # a crash halfway: the old directory stays, whole
        with _save.atomic_directory(target) as scratch:
            (scratch / "weights").write_text("second, half")
            raise KeyboardInterrupt
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (target / "weights").read_text() == "first"

    # A process killed between the two renames that put a new version in place: the old one, whole,
    # lies beside the absent directory, and what reads a checkpoint puts it back first.
    target.rename(tmp_path / ".out.old-12345")
    assert _save.restored(target) == target
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (target / "weights").read_text() == "first"


# matplotlib's default colours: the first line ("C0") and the second ("C1"), as RGB.
TRAIN_LINE, EVAL_LINE = (31, 119, 180), (255, 127, 14)


def test_plot_losses_draws_the_train_and_eval_curves(tmp_path):
    import PIL.Image  # pillow: a dependency of matplotlib

    history = [{"step": step, "loss": 3.0 - 0.1 * step} for step in range(1, 21)]
    for step in (5, 10, 15, 20):
        history[step - 1]["eval_loss"] = 3.2 - 0.1 * step
    for measured, name in (
        (history, "both.png"),
        ([{k: h[k] for k in ("step", "loss")} for h in history], "train.png"),
    ):
        path = training.plot_losses(measured, tmp_path / name)
        pixels = np.asarray(PIL.Image.open(path).convert("RGB"))  # [360, 640, 3]
        assert pixels.shape == (360, 640, 3)
        rows, columns = np.nonzero((pixels == TRAIN_LINE).all(-1))
        # The loss falls: the line's pixels sit higher (smaller rows) on the left than further right
        # (the legend's sample of the line sits in the top right, past column 480).
        assert rows[columns < 160].mean() < rows[(columns > 320) & (columns < 480)].mean()
        assert (pixels == EVAL_LINE).all(-1).any() == (measured is history)


_WORDS = "the cat sat on the mat while the dog ran to the park".split()
TEXTS = [{"text": " ".join(_WORDS[i % 4 : i % 4 + 2 + i % 6])} for i in range(12)]


def test_packed_rows_train_each_example_as_pytorch_runs_it_alone(checkpoint):
    path = checkpoint("llama")
    trainer = hfjax.Trainer(hfjax.load(path), training.sgd(1e-2), dropout=False)
    examples = trainer.examples(TEXTS, max_length=32)
    stream = training.BatchStream(examples, 2, seed=0, max_length=32, packing=True)
    batch, tokens = stream.batch_and_tokens(0)
    assert set(batch) == {"input_ids", "labels", "position_ids"} and batch["input_ids"].shape == (2, 32)

    # Each row: whole examples one after another (positions from 0 in each, its first label -100),
    # then padding (its own run of positions, no labels).
    known = {tuple(r["input_ids"]) for r in examples.rows}
    segments, most = [], 0
    for ids, labels, positions in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
        starts = [*np.flatnonzero(positions == 0), len(positions)]
        runs = [(a, b) for a, b in zip(starts, starts[1:])]
        *whole, tail = runs
        if tuple(ids[tail[0] : tail[1]]) in known:  # a row filled exactly: no padding
            whole.append(tail)
        else:
            assert set(labels[tail[0] : tail[1]]) == {-100}
        most = max(most, len(whole))
        for a, b in whole:
            assert tuple(ids[a:b]) in known
            assert labels[a] == -100 and list(labels[a + 1 : b]) == list(ids[a + 1 : b])
            segments.append(ids[a:b])
    assert tokens == sum(len(s) for s in segments)
    assert most >= 2  # short examples share a row

    # The packed batch's loss is the token-weighted mean of each example's loss run alone in PyTorch.
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in segments:
            ids = torch.tensor(ids[None].astype(np.int64))
            total += reference(input_ids=ids, labels=ids).loss.item() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    np.testing.assert_allclose(trainer.evaluate([batch]), total / count, atol=tolerances.DEFAULT.atol)

    # Training on packed rows: one shape, one compiled step.
    history = trainer.fit(TEXTS, steps=3, batch_size=2, max_length=32, packing=True)
    assert trainer.compile_count == 1 and history[-1]["loss"] < history[0]["loss"]


def test_packing_is_refused_where_examples_would_see_each_other(checkpoint):
    bloom = hfjax.Trainer(hfjax.load(checkpoint("bloom")), training.sgd(1e-2))  # no position_ids
    with pytest.raises(hfjax.TrainingError, match=r"packing=True\): BloomForCausalLM does not keep packed examples"):
        bloom.fit(TEXTS, steps=1, batch_size=2, packing=True)
    bert = hfjax.Trainer(hfjax.load(checkpoint("bert", task="text-classification")), training.sgd(1e-2))
    with pytest.raises(hfjax.TrainingError, match="packs causal-LM examples; these are classification examples"):
        bert.fit([{"text": "a", "label": 0}], steps=1, batch_size=1, packing=True)


_THREAD_MADE_ENVIRONMENT = """
import sys, threading, numpy as np, optax, hfjax
from hfjax import bridge
# The environment made in another thread first, as hfjax.load's reading threads may make it: this
# thread's torchax settings (its PRNG key) are then made on its first torch code, a traced step.
maker = threading.Thread(target=bridge.env)
maker.start()
maker.join()
model = hfjax.load(sys.argv[1])
trainer = hfjax.Trainer(model, optax.sgd(1e-3), dropout=False)
ids = np.arange(3, 19, dtype=np.int32).reshape(2, 8)
trainer.step({"input_ids": ids, "labels": ids})
print("LOGITS", np.asarray(trainer.model(input_ids=ids).logits).shape)
"""


def test_a_train_step_that_is_a_threads_first_torch_code_leaks_no_tracer(checkpoint):
    import subprocess
    import sys

    path = checkpoint("llama")
    result = subprocess.run(
        [sys.executable, "-c", _THREAD_MADE_ENVIRONMENT, str(path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LOGITS (2, 8, " in result.stdout
