"""hfjax: run Hugging Face PyTorch models on JAX and XLA, unchanged.

Public API:
    load                read a checkpoint (a path or hub id) into jax.Arrays: a `Model`
    Model               generate, classify, embed, a compiled forward; `Model.from_module(m)`
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
    HfjaxError          base of LoadError, UnsupportedOpError, ShardingError, GenerationError, PipelineError,
                        TrainingError, ServingError

Subpackages: `hfjax.generation` (the engine), `hfjax.serving` (continuous batching, `hfjax serve`), `hfjax.training` (imported when first used), `hfjax.parallel` (meshes, sharding rules),
`hfjax.diffusion`, `hfjax.cpu` (the CPU's fast paths), `hfjax.testing` (tiny checkpoints),
`hfjax.cli`. Importing hfjax changes nothing in the process (README.md lists what its calls do).
"""

from ._check import check
from ._compilation_cache import set_cache_dir
from ._compile import JittedModule, jit
from ._errors import (
    GenerationError,
    HfjaxError,
    LoadError,
    PipelineError,
    ServingError,
    ShardingError,
    TrainingError,
    UnsupportedOpError,
)
from ._model import Model, load
from ._ops import override as override_op
from ._pipeline import pipeline
from ._pytrees import register_pytree, register_stateful
from ._version import __version__
from .diffusion import load_pipeline, to_jax
from .parallel import distributed, make_mesh

__all__ = [
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
    # hfjax.Trainer imports optax (the `train` extra) only when first used.
    if name == "Trainer":
        from .training import Trainer

        return Trainer
    raise AttributeError(f"module 'hfjax' has no attribute {name!r}")
