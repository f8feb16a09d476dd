"""Joining a multi-process JAX run: `hfjax.distributed.initialize()`, called explicitly.

hfjax uses JAX's own multi-controller runtime (`jax.distributed`). `initialize()` must run in
every process before anything starts JAX's backends (before the first `jax.devices()`,
`hfjax.load` or array). Its arguments default to the environment variables that
`hfjax launch` sets (`ENV_VARS`); without them, JAX detects the cluster itself (TPU pods,
SLURM, Open MPI). On the CPU it selects gloo collectives, which a run over several CPU
processes needs.

    import hfjax
    hfjax.distributed.initialize()
    mesh = hfjax.make_mesh(model=len(jax.devices()))
"""

from __future__ import annotations

import os

import jax

from .._errors import ShardingError

__all__ = ["ENV_VARS", "initialize", "is_initialized"]

ENV_VARS = {
    "HFJAX_COORDINATOR": "host:port of process 0's coordinator, e.g. 127.0.0.1:12355",
    "HFJAX_NUM_PROCESSES": "how many processes take part",
    "HFJAX_PROCESS_ID": "this process's index, 0 .. HFJAX_NUM_PROCESSES - 1",
}


def is_initialized() -> bool:
    """Whether this process has joined a multi-process run."""
    return jax.distributed.is_initialized()


def initialize(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
    """Joins this process to a multi-process JAX run (`jax.distributed.initialize`).

    Args:
      coordinator_address: "host:port" of process 0's coordinator; default $HFJAX_COORDINATOR.
      num_processes: how many processes take part; default $HFJAX_NUM_PROCESSES.
      process_id: this process's index; default $HFJAX_PROCESS_ID.
      With none given and none of the variables set, JAX detects the cluster itself.

    Raises:
      ShardingError: a variable is set but not an integer, or JAX's backends are already running.

    Example:
      >>> hfjax.distributed.initialize()  # in each process of `hfjax launch --nproc 2 -- script.py`
    """
    if is_initialized():
        return
    coordinator_address = coordinator_address or os.environ.get("HFJAX_COORDINATOR")
    if coordinator_address:
        num_processes = _integer("num_processes", num_processes, "HFJAX_NUM_PROCESSES")
        process_id = _integer("process_id", process_id, "HFJAX_PROCESS_ID")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
        )
    except RuntimeError as error:
        raise ShardingError(
            f"hfjax.distributed.initialize: {error}; call it first in each process, before any JAX array, "
            "jax.devices() or hfjax.load"
        ) from None


def _integer(argument: str, value: int | None, variable: str) -> int:
    if value is not None:
        return value
    text = os.environ.get(variable)
    try:
        return int(text)
    except (TypeError, ValueError):
        raise ShardingError(
            f"hfjax.distributed.initialize: a coordinator is given, so {argument} is needed too; pass {argument}= "
            f"or set ${variable} (got {text!r})"
        ) from None
