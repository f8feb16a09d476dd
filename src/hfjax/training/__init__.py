"""Fine-tuning on JAX: full and LoRA (through peft), the Hugging Face module's own loss, optax.

Public names:
    Trainer            step / evaluate / fit, save_pretrained (transformers checkpoint or peft
                       adapter), merge_and_save, save_checkpoint / resume; also `hfjax.Trainer`
    adamw, sgd         optax optimizers as torch.optim's, their learning rate reported by the Trainer
    linear_schedule    transformers' linear schedule with warmup, as an optax schedule
    cosine_schedule    transformers' cosine schedule with warmup
    decay_mask         the HF Trainer's choice of weight-decayed parameters (not biases, not norms)
    Examples           tokenised training examples; `tokenize` makes them from records
    tokenize           JSONL / CSV / datasets.Dataset / list records -> Examples for a task
    BatchStream        padded, bucketed batches in a seeded shuffled order
    StepSettings       accumulation, clipping, compute dtype, remat, dropout of a step
    plot_losses        the loss curve of `Trainer.history` as a PNG, drawn by matplotlib
    restored           a checkpoint path, after renaming back the copy a killed save left beside it

Parts: `_trainer.py` (Trainer), `_step.py` (the loss and the step as functions of arrays),
`_optim.py`, `_lora.py` (peft), `_data.py`, `_save.py` (atomic directories, checkpoints),
`_plot.py` (the loss curve). Needs the `train` extra: `pip install 'hfjax[train]'` (optax, peft, matplotlib).
"""

from ._data import BatchStream, Examples, tokenize
from ._optim import adamw, cosine_schedule, decay_mask, linear_schedule, sgd
from ._plot import loss_curve as plot_losses
from ._save import restored
from ._step import StepSettings
from ._trainer import Trainer

__all__ = [
    "BatchStream",
    "Examples",
    "StepSettings",
    "Trainer",
    "adamw",
    "cosine_schedule",
    "decay_mask",
    "linear_schedule",
    "plot_losses",
    "restored",
    "sgd",
    "tokenize",
]
