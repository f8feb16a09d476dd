"""The errors hfjax raises for the person who called it: each names the argument, the value and the fix.

    HfjaxError
     ├── LoadError          a checkpoint, or an argument of loading it (task, dtype), cannot be used
     ├── UnsupportedOpError a torch op the model calls has no JAX lowering
     │    └── DataDependentError  model code reads its data's values into Python where no program can hold them
     ├── ShardingError      a model cannot be split over the mesh as asked, or `mesh=` is not a mesh
     ├── GenerationError    generation settings or prompts that cannot be carried out
     ├── PipelineError      a pipeline call (hfjax.pipeline, diffusers) that cannot run as given
     ├── TrainingError      a trainer setting, training data or a training checkpoint that cannot be used
     └── ServingError       a server or continuous-batching engine setting or request that cannot be served

Each also derives from the builtin error a caller would expect (ValueError, NotImplementedError),
so `except ValueError` keeps working.
"""

from __future__ import annotations


class HfjaxError(Exception):
    """Base class of hfjax's own errors."""


class LoadError(HfjaxError, ValueError):
    """A checkpoint could not be found, read or matched to a model class, or a loading argument is invalid."""


class UnsupportedOpError(HfjaxError, NotImplementedError):
    """A torch op the model calls has no JAX lowering in torchax or hfjax."""

    def __init__(self, op: str, model: str, caller: str | None):
        self.op, self.model, self.caller = op, model, caller
        where = f", called from {caller}" if caller else ""
        super().__init__(
            f"{model} calls the torch op {op}{where}, which has no JAX lowering in torchax or hfjax. "
            "Add one with @hfjax.override_op(op, why=...), or report it with this message."
        )


class DataDependentError(UnsupportedOpError):
    """Model code needs a value of its data in Python (`.item()`, `if mask.any():`, the size of
    `torch.nonzero`) inside a program that cannot be specialised on it.

    `hfjax.jit`, `hfjax.load` and `Model.generate` specialise their programs on such values (see
    `hfjax._specialize`); this is raised where that cannot be done, such as a plain `lower()`, or
    the serving engine's slot programs.
    """

    def __init__(self, what: str, site: str | None, *, detail: str = ""):
        self.what, self.site = what, site
        where = f" at {site}" if site else ""
        because = f" ({detail})" if detail else ""
        HfjaxError.__init__(
            self,
            f"The model needs {what}{where} as a Python value, which a compiled program cannot have{because}. "
            "hfjax.jit, hfjax.load and Model.generate specialise their programs on such values; this program "
            "cannot be. Run the model with hfjax.jit(model).eager() to go op by op, or report it with this message.",
        )


class ShardingError(HfjaxError, ValueError):
    """A model cannot be split over the mesh as asked (heads do not divide, bad mesh)."""


class GenerationError(HfjaxError, ValueError):
    """Generation settings or prompts that hfjax cannot carry out as given."""


class PipelineError(HfjaxError, ValueError):
    """A pipeline call hfjax cannot run as given: a task the checkpoint cannot do, bad audio, a bad size."""


class TrainingError(HfjaxError, ValueError):
    """A Trainer setting, a line of training data or a training checkpoint that cannot be used as given."""


class ServingError(HfjaxError, ValueError):
    """A continuous-batching engine or server setting, or a request to it, that cannot be served."""
