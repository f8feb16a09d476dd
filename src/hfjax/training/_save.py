"""What the trainer writes: transformers checkpoints, peft adapters and resumable training state,
each directory written whole or not at all (built beside its place, then renamed into it).

In a multi-process run (jax.distributed), every process runs the same writing code, so that the
gathers of weights split over processes happen in the same order everywhere; process 0's
directory is the one put in place, the others' are scratch, and no process goes on before it is
in place."""

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
    if jax.process_index() != 0:  # another process publishes it; this one writes scratch only
        scratch = pathlib.Path(tempfile.mkdtemp(prefix=f"hfjax-{path.name}-process-{jax.process_index()}-"))
        try:
            yield scratch
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        _barrier(f"hfjax wrote {path.name}")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.writing-", dir=path.parent))
    scratch.chmod(0o777 & ~_umask())  # mkdtemp's 0700 is for scratch; the result is a plain directory
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
    _barrier(f"hfjax wrote {path.name}")


def restored(path: str | os.PathLike) -> pathlib.Path:
    """`path`, put back where a process died between `atomic_directory`'s two renames: then `path` is
    absent and its last whole version lies beside it as `.NAME.old-PID`, which is renamed back (the
    newest where there are several). Returns `path`."""
    path = pathlib.Path(path)
    if not path.exists():
        old = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
        if old:
            os.replace(old[-1], path)
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def host_array(array) -> np.ndarray:
    """The whole value of `array` in this process, gathered where other processes hold parts of it
    (then every process must ask for the same arrays in the same order)."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)


def to_torch_cpu(array: jax.Array) -> torch.Tensor:
    """A jax.Array's values as a CPU torch tensor with memory of its own (bfloat16 kept)."""
    if array.dtype == jax.numpy.bfloat16:
        return torch.from_numpy(np.array(host_array(array.astype(jax.numpy.float32)))).to(torch.bfloat16)
    return torch.from_numpy(np.array(host_array(array)))


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
        tensors[f"optimizer/{i}"] = to_torch_cpu(leaf if isinstance(leaf, jax.Array) else jax.numpy.asarray(leaf))
    tensors["prng_key"] = to_torch_cpu(key)
    save_file(tensors, directory / STATE_FILE)
    (directory / STATE_JSON).write_text(json.dumps(record, indent=1) + "\n")


def read_state(directory: pathlib.Path, *, trainable: dict, opt_state) -> tuple[dict, object, jax.Array, dict]:
    """(trainable, opt_state, key, record) as `write_state` left them; `trainable` and `opt_state`
    give the structure, shapes, dtypes and shardings expected."""
    file = restored(directory) / STATE_FILE
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
        host = value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy()
        if host.shape != like.shape:
            raise TrainingError(
                f"hfjax: {name!r} in the checkpoint {str(directory)!r} has shape {host.shape}, this trainer's "
                f"{like.shape}; resume with the model and settings the checkpoint was written with"
            )
        sharding = getattr(like, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):  # on a mesh: split as the trainer keeps it
            host = host.astype(like.dtype)
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
        return jax.numpy.asarray(host).astype(like.dtype)

    new_trainable = {n: read(f"params/{n}", a) for n, a in trainable.items()}
    new_leaves = [
        read(f"optimizer/{i}", leaf if isinstance(leaf, jax.Array) else jax.numpy.asarray(leaf))
        for i, leaf in enumerate(leaves)
    ]
    key = jax.numpy.asarray(tensors["prng_key"].numpy())
    record = json.loads((directory / STATE_JSON).read_text())
    return new_trainable, jax.tree_util.tree_unflatten(treedef, new_leaves), key, record
