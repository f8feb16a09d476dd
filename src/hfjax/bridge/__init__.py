"""The torch -> JAX bridge: running Hugging Face torch modules through torchax as XLA programs.

Every other part of hfjax (the Model, generation, training, diffusion, serving) builds on these
pieces and imports them from here, never from the private modules:

    _env         hfjax's own torchax environment; torch tensors <-> jax.Arrays; the PRNG key
    _ops         the registry of op lowerings (`override_op`) and the generic ones
    _pytrees     Hugging Face output and cache types as JAX pytrees, by field name
    _compile     `JittedModule` (a module's methods as programs, weights as arguments), `bound`
                 (torch code run with given weights inside any trace; `extension`: arrays beside the
                 weights that a registered context applies, such as LoRA adapters), `jit_program`, `recording`
                 and `Compiles` (whether XLA compiled, or JAX's compilation cache answered)
    _specialize  programs specialised on the values that model code reads, with guards
    _hub         a path or a Hugging Face Hub id -> a local checkpoint directory (downloading it)
    _loading     checkpoint -> meta skeleton + jax.Array weights, transformers' conversion rules
    _reading     safetensors files -> host arrays: headers read by hand, tensors on a pool of threads
    _precision   float32 products as PyTorch computes them (torch's matmul precision setting)
    _hook        the interface a backend package implements (`Backend`); hfjax._backend picks one

The bridge depends on no other part of hfjax but the top-level helpers (`_errors`, `_dtypes`,
`_tasks`, `_compilation_cache`, `_quiet`).
"""

from ._compile import (
    Compiles,
    JittedModule,
    Recorded,
    bound,
    explain_errors,
    extension,
    jit_program,
    merge_outputs,
    module_state,
    recording,
    with_aliases,
)
from ._env import env, is_array, move_tensors, prng_key, set_prng_key, to_jax, to_torch, torch_to_jax, use_hook
from ._hook import Backend
from ._hub import resolve_checkpoint
from ._loading import (
    build_skeleton,
    checkpoint_dtype,
    context_length,
    load_weights,
    read_config,
    tensor_names,
    weight_files,
)
from ._ops import attention, check_no_dropout, grouped_scores, override_op, registered, torchax_lowering
from ._precision import PRECISIONS, Precision, check_precision, products, resolve_precision, under
from ._pytrees import assign_state, register_pytree, register_stateful, register_tree, registered_classes
from ._specialize import (
    MAX_SPECIALIZATIONS,
    Specializations,
    concrete,
    discover_values,
    first_difference,
    holds,
    replaying,
    run_specialized,
    values_key,
    warn_running_eagerly,
)

__all__ = [
    "MAX_SPECIALIZATIONS",
    "PRECISIONS",
    "Backend",
    "Compiles",
    "JittedModule",
    "Precision",
    "Recorded",
    "Specializations",
    "assign_state",
    "attention",
    "bound",
    "build_skeleton",
    "check_no_dropout",
    "check_precision",
    "checkpoint_dtype",
    "concrete",
    "context_length",
    "discover_values",
    "env",
    "explain_errors",
    "extension",
    "first_difference",
    "grouped_scores",
    "holds",
    "is_array",
    "jit_program",
    "load_weights",
    "merge_outputs",
    "module_state",
    "move_tensors",
    "override_op",
    "products",
    "prng_key",
    "read_config",
    "recording",
    "register_pytree",
    "register_stateful",
    "register_tree",
    "registered",
    "registered_classes",
    "replaying",
    "resolve_checkpoint",
    "resolve_precision",
    "run_specialized",
    "set_prng_key",
    "tensor_names",
    "to_jax",
    "to_torch",
    "torch_to_jax",
    "torchax_lowering",
    "under",
    "use_hook",
    "values_key",
    "warn_running_eagerly",
    "weight_files",
    "with_aliases",
]
