"""The ("data", "model") device mesh: data parallel over the batch, tensor parallel over heads."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from .._errors import ShardingError


def make_mesh(data: int = 1, model: int | None = None, *, devices=None) -> jax.sharding.Mesh:
    """A device mesh with axes ("data", "model"): data parallel over batch, tensor parallel over heads.

    Args:
      data: devices along "data" (the batch is split over it).
      model: devices along "model" (weights are split over it); default: all the devices
        `data` leaves.
      devices: the devices to use; default `jax.devices()` (every process's, under
        `jax.distributed`).

    Returns:
      A `jax.sharding.Mesh` of shape (data, model).

    Example:
      >>> mesh = hfjax.make_mesh(model=8)
      >>> model = hfjax.load("./llama", mesh=mesh)
    """
    devices = list(jax.devices() if devices is None else devices)
    count = len(devices)
    if data < 1 or count % data:
        raise ShardingError(f"make_mesh: data={data} does not divide the {count} devices; pass a divisor of {count}")
    if model is None:
        model = count // data
    if data * model != count:
        raise ShardingError(
            f"make_mesh: data={data} x model={model} = {data * model} devices, but there are {count} "
            f"({devices[0].platform}); pass data and model whose product is {count}, e.g. make_mesh(data={data}, model={count // data})"
        )
    # Auto axes: XLA's partitioner propagates the weights' shardings through the model
    # (jax.make_mesh would make Explicit axes, under which a gather from a split
    # embedding table needs an out_sharding that torch code cannot pass).
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((data, model), ("data", "model"), axis_types=auto, devices=devices)


def axis_sizes(mesh) -> dict[str, int]:
    sizes = dict(mesh.shape)
    if "model" not in sizes:
        raise ShardingError(
            f"hfjax sharding: the mesh has axes {tuple(sizes)}; it needs a 'model' axis (and optionally 'data'); "
            "build one with hfjax.make_mesh(data=..., model=...)"
        )
    return sizes


def data_size(mesh) -> int:
    """Devices along the mesh's "data" axis (1 without a mesh or without that axis)."""
    return 1 if mesh is None else dict(mesh.shape).get("data", 1)


def batch_sharding(mesh, shape: tuple[int, ...]) -> jax.sharding.NamedSharding:
    """An array's leading (batch) axis split over "data" where it divides; else replicated."""
    data = data_size(mesh)
    split = data > 1 and len(shape) >= 1 and shape[0] % data == 0
    return jax.sharding.NamedSharding(mesh, P("data") if split else P())


def place_rows(mesh, array) -> jax.Array:
    """A host array [B, ...] (or a scalar) as one array over `mesh`: its rows split over "data" where
    they divide, else replicated. Every process holds the whole array and hands over its own
    devices' part, so it works on a mesh that spans several processes."""
    array = np.asarray(array)
    sharding = batch_sharding(mesh, array.shape)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def to_host(array: jax.Array | None) -> np.ndarray | None:
    """The whole of `array` on this host, also where other processes hold some of its rows."""
    if array is None:
        return None
    if array.is_fully_addressable or array.is_fully_replicated:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def check_mesh(mesh, *, caller: str) -> None:
    """A ShardingError naming `caller` unless `mesh` is None or a `jax.sharding.Mesh`."""
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise ShardingError(
            f"{caller}: mesh={mesh!r} is a {type(mesh).__name__}, not a jax.sharding.Mesh; "
            "build one with hfjax.make_mesh(data=..., model=...)"
        )


def split_over_data(array: jax.Array, mesh) -> jax.sharding.NamedSharding:
    """`array`'s sharding on `mesh` with, in addition, its largest dimension that is not split yet
    and that "data" divides split over "data" (fully sharded training: each data-parallel device
    holds a slice of every weight and of its optimizer state). Replicated where none divides; as
    it is where "data" splits it already (a weight a fully sharded trainer has trained)."""
    data = data_size(mesh)
    spec = list(array.sharding.spec) if isinstance(array.sharding, jax.sharding.NamedSharding) else []
    spec += [None] * (array.ndim - len(spec))
    if any(entry == "data" or (isinstance(entry, tuple) and "data" in entry) for entry in spec):
        return jax.sharding.NamedSharding(mesh, P(*spec))
    for dim in sorted(range(array.ndim), key=lambda d: -array.shape[d]):
        if spec[dim] is None and array.shape[dim] % data == 0:
            spec[dim] = "data"
            break
    return jax.sharding.NamedSharding(mesh, P(*spec))
