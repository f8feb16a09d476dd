"""`hfjax.Trainer`: full or LoRA fine-tuning of a `Model` with optax, one compiled program per step."""

from __future__ import annotations

import itertools
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import _dtypes, bridge, parallel
from .._errors import TrainingError
from .._model import Model
from . import _data, _lora, _optim, _plot, _save, _step


class Trainer:
    """Fine-tunes a `Model` on JAX: full fine-tuning, or LoRA through peft.

    The loss is the Hugging Face module's own (batches carry `labels`), its gradient taken by
    `jax.value_and_grad` through the module's torch code; each `step` is one XLA program
    (forward, backward, accumulation, clipping, optimizer update) compiled once per batch shape,
    with the weights and optimizer state updated in place (their buffers donated).

    Args:
      model: an `hfjax.Model` (`hfjax.load(path)`, `Model.from_module(module)`). Full fine-tuning
        trains it in place: after each step its `params` are the new weights.
      optimizer: an optax GradientTransformation; default `hfjax.training.adamw(5e-5)`. Built
        with `optax.inject_hyperparams` (as `hfjax.training.adamw` and `sgd` are), its
        learning rate is reported; otherwise `learning_rate` is NaN.
      lora: None (full fine-tuning), a `peft.LoraConfig`, or the directory of an adapter peft
        saved (training continues from its weights). Only LoRA's weights are trained; the
        model's own stay as they are, shared. A quantized model (`hfjax.load(path, quantize=...)`)
        trains LoRA only (QLoRA): its saved adapter is a plain peft adapter for the unquantized model.
      accumulation_steps: micro-batches per optimizer step (the batch's rows split evenly).
      max_grad_norm: clip the gradient's global norm (as `clip_grad_norm_`); None: no clipping.
      compute_dtype: e.g. "bfloat16": forward and backward in that dtype, the trained weights
        (and the optimizer's state) kept in float32. For GPUs and TPUs; None: the weights' dtype.
      remat: recompute each decoder layer in the backward pass (less memory, more compute).
      dropout: train with the model's dropout (training mode), as PyTorch's `model.train()`.
      seed: seeds dropout and LoRA's initialisation.
      fully_sharded: on a model loaded with a mesh whose "data" axis has several devices, split
        every weight and its optimizer state over "data" too (each keeps its "model" split), so a
        data-parallel device holds a slice of them; XLA gathers them where the step needs them.
        Without it the batch is split over "data" and the weights are copied on each of its devices.

    Example:
      >>> model = hfjax.load("./tiny-llama")
      >>> trainer = hfjax.Trainer(model, optimizer=hfjax.training.adamw(1e-3))
      >>> ids = model.tokenizer(["Hello world"], return_tensors="np")["input_ids"]
      >>> trainer.step({"input_ids": ids, "labels": ids})
      {'loss': 5.54, 'grad_norm': 1.9, 'learning_rate': 0.001}
    """

    def __init__(
        self,
        model: Model,
        optimizer: optax.GradientTransformation | None = None,
        *,
        lora=None,
        accumulation_steps: int = 1,
        max_grad_norm: float | None = None,
        compute_dtype=None,
        remat: bool = False,
        dropout: bool = True,
        seed: int = 0,
        fully_sharded: bool = False,
    ):
        if not isinstance(model, Model):
            raise TrainingError(
                f"hfjax.Trainer: model is a {type(model).__name__}; pass an hfjax.Model "
                "(hfjax.load(path) or hfjax.Model.from_module(torch_model))"
            )
        if optimizer is None:
            optimizer = _optim.adamw(5e-5)
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TrainingError(
                f"hfjax.Trainer(optimizer=...): got a {type(optimizer).__name__}; pass an optax "
                "GradientTransformation, e.g. hfjax.training.adamw(1e-4) or optax.sgd(0.1)"
            )
        if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise TrainingError(f"hfjax.Trainer(accumulation_steps={accumulation_steps!r}): pass an int >= 1")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise TrainingError(f"hfjax.Trainer(max_grad_norm={max_grad_norm!r}): pass a positive number, or None")
        compute_dtype = _dtypes.resolve(compute_dtype, caller="hfjax.Trainer(compute_dtype=...)")
        self.settings = _step.StepSettings(accumulation_steps, max_grad_norm, compute_dtype, remat, dropout)
        self.optimizer = optimizer
        self.seed = seed
        self.lora = None
        self._base = model
        if getattr(model, "adapter_slots", None) is not None:
            raise TrainingError(
                f"hfjax.Trainer: the model holds LoRA adapters beside its weights ({', '.join(model.adapters) or 'none'} "
                "loaded, in reserved slots), which training would leave out; train a model loaded without "
                "load_adapter, and pass an adapter to continue as lora=PATH"
            )
        if lora is None and model.quantization is not None:
            raise TrainingError(
                f"hfjax.Trainer: the model is quantized ({model.quantization.source}), so its weights cannot be "
                "trained; train LoRA adapters over it (lora=peft.LoraConfig(...)), or load it without quantize="
            )
        if lora is None:
            module, params, aliases = model.module, model.params, model.aliases
            trainable_names = [n for n, _ in module.named_parameters() if n in params]
            self._model = model
        else:
            self.lora = _lora.wrap(model.module, model.params, model.aliases, lora, seed=seed)
            module, params, aliases = self.lora.module, self.lora.params, self.lora.aliases
            trainable_names = self.lora.trainable
            self._model = Model(
                module, params, aliases, config=model.config, tokenizer=model.tokenizer, task=model.task,
                path=None, mesh=model.mesh, matmul_precision=model.matmul_precision,
            )  # fmt: skip
            self._model._generation_config = model.generation_config
        self._module, self._aliases = module, aliases
        master = jnp.float32 if compute_dtype is not None else None
        self.trainable = {n: params[n].astype(master) if master else params[n] for n in trainable_names}
        self.frozen = {n: a for n, a in params.items() if n not in self.trainable}
        mesh = model.mesh
        if fully_sharded:
            if parallel.data_size(mesh) < 2:
                raise TrainingError(
                    "hfjax.Trainer(fully_sharded=True): the model has no mesh with several devices on 'data'; load it "
                    "with hfjax.load(path, mesh=hfjax.make_mesh(data=N, model=M)) and N > 1"
                )
            self.trainable = {
                n: jax.device_put(a, parallel.split_over_data(a, mesh)) for n, a in self.trainable.items()
            }
            self.frozen = {n: jax.device_put(a, parallel.split_over_data(a, mesh)) for n, a in self.frozen.items()}
        self.opt_state = optimizer.init(self.trainable)
        if mesh is not None:  # scalars of the optimizer (its step count) live on the mesh too
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            self.opt_state = jax.tree_util.tree_map(
                lambda x: (
                    x
                    if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)
                    else jax.device_put(x, replicated)
                ),
                self.opt_state,
            )
        self.key = jax.random.PRNGKey(seed)
        self.step_count = 0
        self.history: list[dict] = []  # metrics of every step run so far (restored by `resume`)
        self._stale = False
        self._traces = 0
        step = _step.step_function(module, aliases, self.settings, optimizer)

        # precision: of float32 products (hfjax._precision), static: a new setting traces a new program
        def counted_step(*args, precision):
            self._traces += 1
            with bridge.products(precision):
                return step(*args)

        self._step = bridge.jit_program(
            counted_step, stage="train step", donate_argnums=(0, 2, 3), static_argnames="precision"
        )
        evaluation = _step.loss_function(
            module, aliases, _step.StepSettings(compute_dtype=compute_dtype, dropout=False)
        )

        def evaluation_loss(trainable, frozen, batch, *, precision):
            with bridge.products(precision):  # no dropout in evaluation: the key is never drawn from
                return evaluation(trainable, frozen, jax.random.PRNGKey(0), batch)[0]

        self._loss = bridge.jit_program(evaluation_loss, stage="evaluation loss", static_argnames="precision")

    # -- training ----------------------------------------------------------------

    @property
    def compile_count(self) -> int:
        """How many times the step program has been traced (once per batch shape)."""
        return self._traces

    def step(self, batch: dict) -> dict[str, float]:
        """One optimizer step on `batch`: {name: int array [B, ...]} with `labels`, as the module's
        forward takes it (`input_ids`, `attention_mask`, `labels`, `decoder_input_ids`, ...).

        Returns:
          {"loss": the module's loss on the batch before the update, "grad_norm": the gradient's
          global norm before clipping, "learning_rate": the rate this update used}, host floats.
        """
        batch = self._place(batch)
        with _env_errors(self._module):
            self.trainable, self.opt_state, self.key, metrics = self._step(
                self.trainable, self.frozen, self.opt_state, self.key, batch, precision=self._precision()
            )
        self.step_count += 1
        self._publish()
        metrics = {name: float(value) for name, value in jax.device_get(metrics).items()}
        self.history.append({"step": self.step_count, **metrics})
        return metrics

    def evaluate(self, batches) -> float:
        """The mean of the module's loss over `batches` (each weighs the same), without dropout."""
        precision = self._precision()
        losses = [self._loss(self.trainable, self.frozen, self._place(batch), precision=precision) for batch in batches]
        if not losses:
            raise TrainingError("Trainer.evaluate: got no batches; pass an iterable of batches with labels")
        return float(np.mean(jax.device_get(losses)))

    def fit(
        self,
        dataset,
        *,
        steps: int,
        batch_size: int = 8,
        max_length: int = 256,
        eval_dataset=None,
        eval_every: int | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        save_every: int | None = None,
        progress: bool = False,
        packing: bool = False,
    ) -> list[dict]:
        """Trains until `steps` optimizer steps have run in all (a resumed trainer goes on from its step).

        Args:
          dataset: a JSONL or CSV path, a `datasets.Dataset`, a list of records, or a
            `hfjax.training.Examples`. Records are {"text"}, {"messages"} (chat: the loss on the
            assistant's tokens only), {"text", "label"} (classification) or {"source", "target"}
            (seq2seq), tokenised with the model's tokenizer.
          steps: the step count to reach; batch_size: rows per step; max_length: tokens per row at most.
          eval_dataset, eval_every: the mean loss on eval_dataset every `eval_every` steps (and at the end).
          checkpoint_dir, save_every: a resumable checkpoint (`save_checkpoint`) every `save_every`
            steps and at the end, with a loss-curve PNG.
          progress: a progress bar with the loss, tokens/s and the time left.
          packing: causal LMs: several whole examples per row of `max_length` tokens, each attending
            only to itself (position ids from 0 per example, read by transformers' mask functions),
            so that every step has one shape and little padding. Evaluation is not packed.

        Returns:
          The metrics of the steps run here, plus "eval_loss" at evaluation steps.

        Raises:
          TrainingError: the loss became NaN or infinite (naming the step).
        """
        examples = self.examples(dataset, max_length=max_length)
        stream = _data.BatchStream(examples, batch_size, seed=self.seed, max_length=max_length, packing=packing)
        if packing and not self._packs_apart(examples):
            raise TrainingError(
                f"hfjax.Trainer.fit(packing=True): {type(self._module).__name__} does not keep packed examples apart "
                "(an example after another in a row, its position ids from 0, gets other logits than alone: the model "
                "ignores position_ids, builds its masks without them, or carries recurrent state), so they would "
                "train on each other; pass packing=False"
            )
        evaluation = None
        if eval_dataset is not None:
            evaluation = list(
                _data.BatchStream(
                    self.examples(eval_dataset, max_length=max_length), batch_size, seed=0, max_length=max_length
                ).epoch()
            )
        bar = _progress(progress, steps, self.step_count)
        ran = []
        started = _now()
        tokens = 0
        while self.step_count < steps:
            batch, batch_tokens = stream.batch_and_tokens(self.step_count)
            metrics = self.step(batch)
            if not math.isfinite(metrics["loss"]):
                raise TrainingError(
                    f"hfjax.Trainer.fit: the loss is {metrics['loss']} at step {self.step_count}; lower the learning "
                    "rate, set max_grad_norm, or check the data"
                )
            if len(ran) == 0:
                started = _now()  # tokens/s leaves out the first step, which compiles
            else:
                tokens += batch_tokens
            record = {"step": self.step_count, **metrics}
            last = self.step_count == steps
            if evaluation is not None and ((eval_every and self.step_count % eval_every == 0) or last):
                record["eval_loss"] = self.evaluate(evaluation)
                self.history[-1]["eval_loss"] = record["eval_loss"]
                if bar is not None:
                    bar.write(f"step {self.step_count}: eval loss {record['eval_loss']:.4f}")
            ran.append(record)
            if bar is not None:
                bar.set_postfix(
                    loss=f"{metrics['loss']:.4f}", tokens_per_s=f"{tokens / max(_now() - started, 1e-9):.0f}"
                )
                bar.update(1)
            if checkpoint_dir is not None and ((save_every and self.step_count % save_every == 0) or last):
                self.save_checkpoint(checkpoint_dir)
        if bar is not None:
            bar.close()
        return ran

    def examples(self, dataset, *, max_length: int = 256) -> _data.Examples:
        """`dataset` (as `fit` takes it) tokenised for this model's task."""
        if isinstance(dataset, _data.Examples):
            return dataset
        return _data.tokenize(
            dataset, self._model.tokenizer, task=self._model.task, config=self._model.config, max_length=max_length
        )

    # -- the model and what is written -------------------------------------------

    @property
    def model(self) -> Model:
        """An `hfjax.Model` with the current weights (generate, classify, embed); for LoRA, the
        model with its LoRA layers."""
        if self._stale:
            dtypes = {n: self._params_dtype(n) for n in self.trainable}
            self._model.params.update({n: a.astype(dtypes[n]) for n, a in self.trainable.items()})
            self._stale = False
        return self._model

    def save_pretrained(self, directory: str | os.PathLike, *, keep: tuple[str, ...] = ()) -> pathlib.Path:
        """Writes the trained model: a transformers checkpoint (full fine-tuning), which
        `AutoModelFor...from_pretrained` loads, or a peft adapter (adapter_config.json,
        adapter_model.safetensors) that `peft.PeftModel.from_pretrained(base, directory)` loads.
        Written whole or not at all; `keep` names entries of an existing `directory` to carry over
        (the CLI keeps its "checkpoint"). Returns the directory."""
        model = self.model
        with _save.atomic_directory(directory, keep=keep) as scratch:
            if self.lora is None:
                _save.write_weights(scratch, model.module, model.params, model.aliases)
                _save.write_model_files(
                    scratch, config=model.config, tokenizer=model.tokenizer, generation_config=self._generation_config()
                )
            else:
                self._write_adapter(scratch)
        return pathlib.Path(directory)

    def merge_and_save(self, directory: str | os.PathLike) -> pathlib.Path:
        """Writes a transformers checkpoint of the model with LoRA's updates merged into its weights
        (for full fine-tuning, the same as `save_pretrained`). Returns the directory."""
        if self.lora is None:
            return self.save_pretrained(directory)
        if self._base.quantization is not None:
            raise TrainingError(
                f"Trainer.merge_and_save: the base model is quantized ({self._base.quantization.source}); save the "
                "adapter (save_pretrained) and merge it into the unquantized model with peft's merge_and_unload"
            )
        model = self.model
        merged = _lora.merged_params(self.lora, model.params)
        base = self._base  # the model as given: its module has the unwrapped names
        with _save.atomic_directory(directory) as scratch:
            _save.write_weights(scratch, base.module, merged, base.aliases)
            _save.write_model_files(
                scratch, config=base.config, tokenizer=model.tokenizer, generation_config=self._generation_config()
            )
        return pathlib.Path(directory)

    def save_checkpoint(self, directory: str | os.PathLike) -> pathlib.Path:
        """A resumable checkpoint: the model as `save_pretrained` writes it, plus the exact training
        state (trained weights in their master dtype, optimizer state, step, PRNG key, the losses)
        and loss.png. `resume(directory)` continues exactly where this left off."""
        with _save.atomic_directory(directory) as scratch:
            self.save_pretrained(scratch / "model")
            record = {"step": self.step_count, "seed": self.seed, "history": self.history}
            _save.write_state(scratch, trainable=self.trainable, opt_state=self.opt_state, key=self.key, record=record)
            _plot.loss_curve(self.history, scratch / "loss.png")
        return pathlib.Path(directory)

    def resume(self, directory: str | os.PathLike) -> int:
        """Restores the training state `save_checkpoint` wrote; returns the step it had reached.
        The trainer must be built with the same model, optimizer and settings."""
        trainable, opt_state, key, record = _save.read_state(
            pathlib.Path(directory), trainable=self.trainable, opt_state=self.opt_state
        )
        self.trainable, self.opt_state, self.key = trainable, opt_state, key
        self.step_count = record["step"]
        self.history = record["history"]
        if record.get("seed", self.seed) != self.seed:
            raise TrainingError(
                f"Trainer.resume: the checkpoint was trained with seed={record['seed']}, this trainer has "
                f"seed={self.seed}; build the Trainer with seed={record['seed']} to continue the same run"
            )
        self._stale = True
        return self.step_count

    # -- helpers -----------------------------------------------------------------

    def _packs_apart(self, examples: _data.Examples) -> bool:
        ids = list(itertools.islice((t for row in examples.rows for t in row["input_ids"]), 4))
        return _step.keeps_packed_examples_apart(self.model, ids)

    def _params_dtype(self, name: str):
        return self._model.params[name].dtype

    def _publish(self):
        # Full fine-tuning in the model's own dtype: the model's dict takes the new arrays at once
        # (the old ones were donated); otherwise they are cast when `model` is read.
        if all(self._model.params[n].dtype == a.dtype for n, a in self.trainable.items()):
            self._model.params.update(self.trainable)
        else:
            self._stale = True

    def _generation_config(self):
        from .. import _tasks

        return self._model.generation_config if self._model.task in _tasks.GENERATIVE else None

    def _write_adapter(self, directory: pathlib.Path) -> None:
        from safetensors.torch import save_file

        saved = _lora.saved_names(self.lora.peft_model, list(self.trainable))
        tensors = {saved[n]: _save.to_torch_cpu(a.astype(self._params_dtype(n))) for n, a in self.trainable.items()}
        save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})
        config = self.lora.config
        was = config.inference_mode
        config.inference_mode = True  # as peft saves it
        try:
            config.save_pretrained(str(directory))
        finally:
            config.inference_mode = was
        if self._model.tokenizer is not None:
            self._model.tokenizer.save_pretrained(directory)

    def _precision(self) -> str:
        # The precision of the step's float32 products: the model's, else torch's setting now.
        return bridge.resolve_precision(self._base.matmul_precision)

    def _place(self, batch: dict) -> dict:
        if not isinstance(batch, dict) or not batch:
            raise TrainingError(
                f"hfjax.Trainer: a batch is a dict of arrays (input_ids, attention_mask, labels, ...); got {type(batch).__name__}"
            )
        arrays = {}
        for name, value in batch.items():
            array = np.asarray(value) if not isinstance(value, jax.Array) else value
            if array.dtype == np.int64:
                array = array.astype(np.int32)  # JAX runs with 32-bit integers
            arrays[name] = jnp.asarray(array) if not isinstance(array, jax.Array) else array
        mesh = self._model.mesh
        if mesh is not None and parallel.data_size(mesh) > 1:
            arrays = {n: jax.device_put(a, parallel.batch_sharding(mesh, a.shape)) for n, a in arrays.items()}
        return arrays


def _env_errors(module):
    from ..bridge import explain_errors

    return explain_errors(module)


def _now() -> float:
    import time

    return time.perf_counter()


def _progress(enabled: bool, total: int, initial: int):
    if not enabled or jax.process_index() != 0:  # one bar for a multi-process run
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
