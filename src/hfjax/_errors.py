"""Errors hfjax raises for the person who called it: each names the value and the fix."""

from __future__ import annotations


class HfjaxError(Exception):
    """Base class of hfjax's own errors."""


class UnsupportedOpError(HfjaxError, NotImplementedError):
    """A torch op the model calls has no JAX lowering in torchax or hfjax."""

    def __init__(self, op: str, model: str, caller: str | None):
        self.op, self.model, self.caller = op, model, caller
        where = f", called from {caller}" if caller else ""
        super().__init__(
            f"{model} calls the torch op {op}{where}, which has no JAX lowering in torchax or hfjax. "
            "Add one with @hfjax._ops.override, or report it with this message."
        )


class LoadError(HfjaxError, ValueError):
    """A checkpoint could not be found, read or matched to a model class."""
