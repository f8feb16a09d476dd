"""hfjax: run Hugging Face PyTorch models on JAX and XLA, unchanged.

Public API:
    load                read a checkpoint (a path or hub id) into jax.Arrays: a `Model`
    Model               generate, classify, embed, a compiled forward; `Model.from_module(m)`
    chat_with_images    a vision-language model's reply to a conversation whose parts hold images
    jit                 compile a torch module's methods with XLA, weights as arguments
    JittedModule        what `jit` returns
    to_jax              run a diffusers pipeline on JAX, heavy parts compiled
    load_pipeline       DiffusionPipeline.from_pretrained + to_jax
    pipeline            transformers' task pipelines (text, vision, speech) with the model's compute on JAX
    make_mesh           a ("data", "model") device mesh for `load(path, mesh=...)`
    distributed         `hfjax.distributed.initialize()`: join a multi-process run
    set_cache_dir       keep compiled programs on disk between processes
    register_pytree     register Hugging Face output / cache classes as JAX pytrees (hfjax's calls do it)
    register_stateful   register a model's own cache class as a JAX pytree
    override_op         register a JAX lowering for a torch op that torchax lacks
    check               parity of a checkpoint against PyTorch
    Trainer             full and LoRA fine-tuning with optax (`hfjax.training`; needs the `train` extra)
    HfjaxError          base of LoadError, UnsupportedOpError (and its DataDependentError), ShardingError,
                        GenerationError, PipelineError, TrainingError, ServingError

Subpackages: `hfjax.bridge` (torch modules as XLA programs: the layer everything else builds on),
`hfjax.generation` (the engine), `hfjax.serving` (continuous batching, `hfjax serve`),
`hfjax.training` (imported when first used), `hfjax.lora` (LoRA adapters served beside the base,
`Model.load_adapter`), `hfjax.parallel` (meshes, sharding rules),
`hfjax.diffusion`, `hfjax.tasks` (pipelines, speech, parity checks), `hfjax.cpu` (the CPU's fast
paths, reached only through `hfjax._backend`), `hfjax.testing` (tiny checkpoints), `hfjax.cli`. Importing hfjax changes nothing in the process (README.md lists what its calls do).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._errors import (
    DataDependentError,
    GenerationError,
    HfjaxError,
    LoadError,
    PipelineError,
    ServingError,
    ShardingError,
    TrainingError,
    UnsupportedOpError,
)
from ._version import __version__

if TYPE_CHECKING:  # for type checkers and editors; at run time each name is imported when first used
    from ._compilation_cache import set_cache_dir
    from ._model import Model, jit, load
    from .bridge import JittedModule, override_op, register_pytree, register_stateful
    from .diffusion import load_pipeline, to_jax
    from .generation import chat_with_images
    from .parallel import distributed, make_mesh
    from .tasks import check, pipeline
    from .training import Trainer

# Public name -> (module, attribute). `import hfjax` imports none of them, so it costs little
# (the command line's `--help` and `launch` need neither torch nor JAX); the first use of a name
# imports its module. `Trainer` needs the `train` extra (optax).
_LAZY = {
    "chat_with_images": (".generation", "chat_with_images"),
    "check": (".tasks", "check"),
    "set_cache_dir": ("._compilation_cache", "set_cache_dir"),
    "JittedModule": (".bridge", "JittedModule"),
    "jit": ("._model", "jit"),
    "Model": ("._model", "Model"),
    "load": ("._model", "load"),
    "override_op": (".bridge", "override_op"),
    "pipeline": (".tasks", "pipeline"),
    "register_pytree": (".bridge", "register_pytree"),
    "register_stateful": (".bridge", "register_stateful"),
    "load_pipeline": (".diffusion", "load_pipeline"),
    "to_jax": (".diffusion", "to_jax"),
    "distributed": (".parallel", "distributed"),
    "make_mesh": (".parallel", "make_mesh"),
    "Trainer": (".training", "Trainer"),
}

__all__ = [
    "DataDependentError",
    "GenerationError",
    "HfjaxError",
    "JittedModule",
    "LoadError",
    "Model",
    "PipelineError",
    "ServingError",
    "ShardingError",
    "Trainer",
    "TrainingError",
    "UnsupportedOpError",
    "__version__",
    "chat_with_images",
    "check",
    "distributed",
    "jit",
    "load",
    "load_pipeline",
    "make_mesh",
    "override_op",
    "pipeline",
    "register_pytree",
    "register_stateful",
    "set_cache_dir",
    "to_jax",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'hfjax' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module, __name__), attribute)
    globals()[name] = value  # later uses are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
