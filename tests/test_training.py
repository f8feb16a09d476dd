"""Training against PyTorch: the same checkpoint fine-tuned by torch.optim (full) and by peft (LoRA)
over the same batches gives the same per-step losses, gradient norms, learning rates and final
logits; what the trainer saves loads back in transformers and peft."""

from __future__ import annotations

import dataclasses

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
