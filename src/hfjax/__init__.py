"""hfjax: run Hugging Face PyTorch models on JAX and XLA, unchanged.

Public API:
    load            read a checkpoint into jax.Arrays and return a runnable model
    jit             compile a torch module's methods with XLA, weights as arguments
    JittedModule    what `jit` returns
    Model           what `load` returns
    register_stateful  register a model's own cache class as a pytree
    to_jax          run a diffusers pipeline on JAX, heavy parts compiled
    load_pipeline   DiffusionPipeline.from_pretrained + to_jax
    set_cache_dir   where compiled XLA programs are kept between processes
    make_mesh       a ("data", "model") device mesh for hfjax.load(path, mesh=...)
    testing         tiny checkpoint factories (hfjax.testing)
"""

import os as _os
import sys as _sys

if "torch" not in _sys.modules:
    # With JAX's CPU runtime in the same process, torch's OpenMP threads spinning
    # while they wait slow torch down 30x on a 2-core machine; sleeping threads do not.
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from ._sharding import initialize_from_env as _initialize_from_env

_initialize_from_env()  # joins a multi-process run when $HFJAX_COORDINATOR is set (hfjax launch)

from ._compile import JittedModule, jit
from ._sharding import make_mesh
from ._model import Model, load
from ._diffusion import load_pipeline, to_jax
from ._env import set_cache_dir
from ._env import env as _setup_env
from ._errors import HfjaxError, LoadError, UnsupportedOpError
from ._pytrees import register_stateful

_setup_env()

__all__ = [
    "HfjaxError",
    "JittedModule",
    "LoadError",
    "UnsupportedOpError",
    "jit",
    "load",
    "Model",
    "register_stateful",
    "load_pipeline",
    "make_mesh",
    "set_cache_dir",
    "to_jax",
]
__version__ = "0.1.0"
