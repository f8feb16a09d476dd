"""The training step and the evaluation loss as pure functions of arrays, each jitted once per shape.

    loss(trainable, frozen, key, batch)                    -> (loss [], key)
    step(trainable, frozen, opt_state, key, batch)         -> (trainable, opt_state, key, metrics)

`trainable` and `frozen` are {parameter name: jax.Array}; together (with the module's buffers,
which are frozen) they are the module's state, swapped in by `bridge.bound` for the trace. The
loss is the Hugging Face module's own (`labels=` in the batch). The step takes the gradient of it
with `jax.value_and_grad`, accumulates it over micro-batches in a `lax.scan`, clips it and applies
the optax update, in one program whose parameter and optimizer-state buffers are donated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from torchax.tensor import Tensor as JaxTensor

from .. import _dtypes, bridge
from ._optim import learning_rate


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """How the step computes (hashable: part of what a compiled step depends on).

    accumulation_steps: micro-batches per optimizer step; the batch's rows split evenly into them,
      and each micro-batch's mean loss weighs the same.
    max_grad_norm: clip the gradient's global norm to this (as `torch.nn.utils.clip_grad_norm_`); None: no clipping.
    compute_dtype: run the forward and backward in this dtype ("bfloat16"), the trained weights kept
      in float32; None: in the weights' own dtype.
    remat: recompute each decoder layer's activations in the backward pass instead of keeping them.
    dropout: run the module in training mode (dropout on, its keys from the trainer's PRNG key).
    """

    accumulation_steps: int = 1
    max_grad_norm: float | None = None
    compute_dtype: str | None = None
    remat: bool = False
    dropout: bool = True


def loss_function(module: torch.nn.Module, aliases: dict[str, str], settings: StepSettings) -> Callable:
    """(trainable, frozen, key, batch) -> (the module's float32 loss [], the key after dropout)."""
    accepts_use_cache = "use_cache" in inspect.signature(module.forward).parameters
    compute = _dtypes.jax_dtype(settings.compute_dtype) if settings.compute_dtype else None

    def loss(trainable, frozen, key, batch):
        params = {**frozen, **trainable}
        if compute is not None:
            params = {n: a.astype(compute) if jnp.issubdtype(a.dtype, jnp.floating) else a for n, a in params.items()}
        kwargs = bridge.to_torch(dict(batch))
        if accepts_use_cache:
            kwargs["use_cache"] = False  # no cache object is built in a training forward
        with _mode(module, training=settings.dropout), _remat_layers(module, settings.remat):
            with bridge.bound(module, params, aliases, key) as environment:
                out = module(**kwargs)
                new_key = environment.prng_key
        if getattr(out, "loss", None) is None:
            raise ValueError(
                f"hfjax.Trainer: {type(module).__name__} returned no loss for a batch with keys {sorted(batch)}; "
                "the batch needs `labels` (token ids with -100 where no loss is taken, or class ids)"
            )
        return bridge.to_jax(out.loss).astype(jnp.float32), new_key

    return loss


def step_function(
    module: torch.nn.Module, aliases: dict[str, str], settings: StepSettings, optimizer: optax.GradientTransformation
) -> Callable:
    """(trainable, frozen, opt_state, key, batch) -> (trainable, opt_state, key, metrics {loss, grad_norm,
    learning_rate}: float32 [])."""
    loss = loss_function(module, aliases, settings)
    gradient = jax.value_and_grad(loss, has_aux=True)

    def step(trainable, frozen, opt_state, key, batch):
        micro = _split(batch, settings.accumulation_steps)  # every leaf [steps, rows / steps, ...]

        def accumulate(carry, micro_batch):
            total, grads, key = carry
            (value, key), g = gradient(trainable, frozen, key, micro_batch)
            return (total + value, jax.tree_util.tree_map(jnp.add, grads, g), key), None

        zeros = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, jnp.float32), trainable)
        (total, grads, key), _ = jax.lax.scan(accumulate, (jnp.float32(0), zeros, key), micro)
        grads = jax.tree_util.tree_map(lambda g: g / settings.accumulation_steps, grads)
        norm = optax.tree.norm(grads)
        if settings.max_grad_norm is not None:
            scale = jnp.minimum(1.0, settings.max_grad_norm / (norm + 1e-6))  # clip_grad_norm_'s formula
            grads = jax.tree_util.tree_map(lambda g: g * scale, grads)
        grads = {n: g.astype(trainable[n].dtype) for n, g in grads.items()}
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        rate = learning_rate(opt_state)
        metrics = {
            "loss": total / settings.accumulation_steps,
            "grad_norm": norm,
            "learning_rate": jnp.float32(jnp.nan) if rate is None else jnp.asarray(rate, jnp.float32),
        }
        return trainable, opt_state, key, metrics

    return step


def _split(batch: dict, steps: int) -> dict:
    def split(x):
        if x.shape[0] % steps:
            raise ValueError(
                f"hfjax.Trainer(accumulation_steps={steps}): a batch of {x.shape[0]} rows does not split into "
                f"{steps} micro-batches; pass a batch size that is a multiple of {steps}"
            )
        return x.reshape(steps, x.shape[0] // steps, *x.shape[1:])

    return jax.tree_util.tree_map(split, batch)


@contextlib.contextmanager
def _mode(module: torch.nn.Module, *, training: bool):
    was = module.training
    module.train(training)
    try:
        yield
    finally:
        module.train(was)


def keeps_packed_examples_apart(model, ids: list[int]) -> bool:
    """Whether `model` (an hfjax.Model) runs an example packed after another as it runs it alone:
    position ids that restart at 0 and no attention mask must keep its attention (and any
    recurrent state) from reaching the one before. Checked on a row of `ids` twice over (two small
    forwards); a module without a `position_ids` argument cannot tell packed examples apart."""
    from .. import tolerances

    if "position_ids" not in inspect.signature(model.module.forward).parameters:
        return False
    row = np.asarray([ids + ids], np.int32)
    positions = np.asarray([list(range(len(ids))) * 2], np.int32)
    packed = model(row, position_ids=positions, use_cache=False).logits[0, len(ids) :]
    alone = model(np.asarray([ids], np.int32), use_cache=False).logits[0]
    return bool(np.allclose(np.asarray(packed), np.asarray(alone), atol=tolerances.PACKING.atol, rtol=0))


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The module's repeated blocks: submodules whose class transformers lists in `_no_split_modules`."""
    names = set(getattr(module, "_no_split_modules", None) or ())
    return [m for m in module.modules() if type(m).__name__ in names]


@contextlib.contextmanager
def _remat_layers(module: torch.nn.Module, on: bool):
    layers = decoder_layers(module) if on else []
    if on and not layers:
        raise ValueError(
            f"hfjax.Trainer(remat=True): {type(module).__name__} names no repeated layer class in "
            "`_no_split_modules`, so there is no layer to recompute; pass remat=False"
        )
    for layer in layers:
        layer.forward = _rematerialised(layer.forward)  # an instance attribute, removed below
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def _rematerialised(forward: Callable) -> Callable:
    # The layer runs under jax.checkpoint: its torchax tensor arguments and the PRNG key go in as
    # arrays, everything else stays as given; its weights are the enclosing trace's, closed over.
    environment = bridge.env()

    def is_tensor(x):
        return isinstance(x, torch.Tensor)

    def call(*args, **kwargs):
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_tensor)
        at = [i for i, x in enumerate(leaves) if isinstance(x, JaxTensor)]
        shape = {}

        def pure(arrays, key):
            inner = list(leaves)
            for i, a in zip(at, arrays):
                inner[i] = JaxTensor(a, environment)
            inner_args, inner_kwargs = jax.tree_util.tree_unflatten(treedef, inner)
            with environment.override_property(prng=key):
                out = forward(*inner_args, **inner_kwargs)
                key = environment.prng_key
            out_leaves, shape["tree"] = jax.tree_util.tree_flatten(out, is_leaf=is_tensor)
            shape["statics"] = {i: x for i, x in enumerate(out_leaves) if not isinstance(x, JaxTensor)}
            return [x.jax() for x in out_leaves if isinstance(x, JaxTensor)], key

        arrays, key = jax.checkpoint(pure)([leaves[i].jax() for i in at], environment.prng_key)
        environment.prng_key = key
        it = iter(arrays)
        out = [
            shape["statics"][i] if i in shape["statics"] else JaxTensor(next(it), environment)
            for i in range(shape["tree"].num_leaves)
        ]
        return jax.tree_util.tree_unflatten(shape["tree"], out)

    return call
