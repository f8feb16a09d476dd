"""Splitting a model over devices and processes.

- `make_mesh(data, model)`: a ("data", "model") `jax.sharding.Mesh`;
- `plan(model_or_config, mesh)`: the PartitionSpec of every parameter (a `Plan`; `plan.table()`
  prints bytes per device), from the registry of per-family `rules`, else a structural fallback;
- `rules(*families)`: the decorator that registers a family's table of parameter-name regexes
  to roles (`ROLES`);
- `distributed.initialize()`: joins a multi-process run (`hfjax launch` sets its variables);
- for the rest of hfjax: `check_mesh` (a `mesh=` argument), `data_size`, `batch_sharding`,
  `split_over_data` and `place_rows` (arrays over the "data" axis), `to_host` (an array whose rows
  other processes hold, on this host), `axis_sizes`.

`hfjax.load(path, mesh=...)` applies the plan as it reads the weights; XLA's SPMD partitioner
inserts the collectives.
"""

from __future__ import annotations

from . import distributed
from ._mesh import (
    axis_sizes,
    batch_sharding,
    check_mesh,
    data_size,
    make_mesh,
    place_rows,
    split_over_data,
    to_host,
)
from ._rules import ROLES, Plan, plan, rules

__all__ = [
    "ROLES",
    "Plan",
    "axis_sizes",
    "batch_sharding",
    "check_mesh",
    "data_size",
    "distributed",
    "make_mesh",
    "place_rows",
    "plan",
    "rules",
    "split_over_data",
    "to_host",
]
