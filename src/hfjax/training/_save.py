"""What the trainer writes: transformers checkpoints, peft adapters and resumable training state,
each directory written whole or not at all (built beside its place, then renamed into it)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import tempfile

import jax
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .._errors import TrainingError

STATE_FILE = "trainer_state.safetensors"
STATE_JSON = "trainer_state.json"


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, keep: tuple[str, ...] = ()):
    """Yields an empty scratch directory beside `path`; when the block ends without an error, it
    becomes `path` (replacing what was there). A crash leaves `path` as it was, old or absent.
    `keep`: entries of the old `path` moved (renamed) into the new one."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.writing-", dir=path.parent))
    try:
        yield scratch
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    for name in keep:
        if (path / name).exists():
            os.replace(path / name, scratch / name)
    if path.exists():
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        os.replace(path, old)  # both renames are atomic; between them `path` is briefly absent
        os.replace(scratch, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(scratch, path)


def to_torch_cpu(array: jax.Array) -> torch.Tensor:
    """A jax.Array's values as a CPU torch tensor with memory of its own (bfloat16 kept)."""
    if array.dtype == jax.numpy.bfloat16:
        return torch.from_numpy(np.array(array.astype(jax.numpy.float32))).to(torch.bfloat16)
    return torch.from_numpy(np.array(array))


def write_weights(directory: pathlib.Path, module: torch.nn.Module, params: dict, aliases: dict) -> None:
    """model.safetensors with the module's state-dict names, each tied weight once (as transformers saves)."""
    tensors = {}
    for name in module.state_dict():
        if name in params:
            tensors[name] = to_torch_cpu(params[name])
        elif name not in aliases:
            raise TrainingError(f"hfjax: no value for {name!r} of {type(module).__name__} to save")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def write_model_files(directory: pathlib.Path, *, config, tokenizer, generation_config) -> None:
    """config.json, generation_config.json (generative models) and the tokenizer's files."""
    config.save_pretrained(directory)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def write_state(directory: pathlib.Path, *, trainable: dict, opt_state, key: jax.Array, record: dict) -> None:
    """The exact training state: trained weights (master copies), optimizer state, PRNG key, and a
    JSON record (step, data position, losses)."""
    tensors = {f"params/{n}": to_torch_cpu(a) for n, a in trainable.items()}
    for i, leaf in enumerate(jax.tree_util.tree_leaves(opt_state)):
        tensors[f"optimizer/{i}"] = to_torch_cpu(jax.numpy.asarray(leaf))
    tensors["prng_key"] = to_torch_cpu(key)
    save_file(tensors, directory / STATE_FILE)
    (directory / STATE_JSON).write_text(json.dumps(record, indent=1) + "\n")


def read_state(directory: pathlib.Path, *, trainable: dict, opt_state) -> tuple[dict, object, jax.Array, dict]:
    """(trainable, opt_state, key, record) as `write_state` left them; `trainable` and `opt_state`
    give the structure, shapes and dtypes expected."""
    file = directory / STATE_FILE
    if not file.is_file():
        raise TrainingError(
            f"hfjax: no {STATE_FILE} in {str(directory)!r}; pass a checkpoint directory the trainer wrote"
        )
    tensors = load_file(file)
    leaves, treedef = jax.tree_util.tree_flatten(opt_state)

    def read(name: str, like) -> jax.Array:
        if name not in tensors:
            raise TrainingError(
                f"hfjax: the checkpoint {str(directory)!r} lacks {name!r}; it was written for another model or optimizer"
            )
        value = tensors[name]
        array = (
            jax.numpy.asarray(value.float().numpy()).astype(like.dtype)
            if value.dtype == torch.bfloat16
            else jax.numpy.asarray(value.numpy())
        )
        if array.shape != like.shape:
            raise TrainingError(
                f"hfjax: {name!r} in the checkpoint {str(directory)!r} has shape {array.shape}, this trainer's "
                f"{like.shape}; resume with the model and settings the checkpoint was written with"
            )
        return array.astype(like.dtype)

    new_trainable = {n: read(f"params/{n}", a) for n, a in trainable.items()}
    new_leaves = [read(f"optimizer/{i}", jax.numpy.asarray(leaf)) for i, leaf in enumerate(leaves)]
    key = jax.numpy.asarray(tensors["prng_key"].numpy())
    record = json.loads((directory / STATE_JSON).read_text())
    return new_trainable, jax.tree_util.tree_unflatten(treedef, new_leaves), key, record
