"""The device mesh and the two shardings the trainer uses.

The mesh is 2-D: ``replica`` x ``shard``. The batch is split over both (every device of every
process holds its rows: :data:`DATA_AXES`); the train state, where a layout splits it
(``dist.shard``), is split over ``shard`` alone and replicated over ``replica``
(``dist.shard_group``: a group is one row of the mesh, ``shard`` devices; by default one row
holds every device). Collectives over the batch (the gradient mean, metrics, synchronised
BatchNorm) name :data:`DATA_AXES`; those of a split state (gathers, reduce-scatters) name
:data:`SHARD_AXIS`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

REPLICA_AXIS = "replica"  # across groups: each group holds a replica of a split state
SHARD_AXIS = "shard"  # within a group: a split state's slices
DATA_AXES = (REPLICA_AXIS, SHARD_AXIS)  # every device: the batch and its means
# The dtypes a config may name (train.precision, dist.grad_allreduce_dtype).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def make_mesh(devices: list[jax.Device] | None = None, group_size: int | None = None) -> Mesh:
    """The mesh ``replica`` x ``shard`` over ``devices`` (default: every device of every
    process), ``group_size`` devices a row (default: all of them, one row).

    Devices are ordered by (process index, device id), so process *p* owns a contiguous block
    of the mesh and therefore a contiguous slice of every global batch, and a group of the
    devices of one process (``dist.shard_group=process``) is a row. Raises ``ValueError`` when
    ``group_size`` does not divide the device count.
    """
    if devices is None:
        devices = jax.devices()
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    group = len(devices) if group_size is None else group_size
    if group < 1 or len(devices) % group:
        raise ValueError(f"a group of {group} devices does not divide {len(devices)} devices")
    grid = np.asarray(devices).reshape(len(devices) // group, group)
    return Mesh(grid, DATA_AXES)


def group_size(mesh: Mesh) -> int:
    """Devices of one group (a row of ``mesh``): what a split state is split over."""
    return mesh.shape[SHARD_AXIS]


def replicated(mesh: Mesh) -> NamedSharding:
    """Sharding of parameters and optimizer state: a full copy on every device."""
    return NamedSharding(mesh, P())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """Sharding of a global batch: split along its leading axis over ``data``."""
    return NamedSharding(mesh, P(DATA_AXES))


def select_devices(num_local_devices: int | None = None) -> list[jax.Device]:
    """The first ``num_local_devices`` devices of every process (default: all devices).

    Raises ``ValueError`` when a process has fewer devices than asked for.
    """
    by_process: dict[int, list[jax.Device]] = {}
    for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        by_process.setdefault(d.process_index, []).append(d)
    if num_local_devices is None:
        return [d for ds in by_process.values() for d in ds]
    fewest = min(len(ds) for ds in by_process.values())
    if num_local_devices > fewest:
        raise ValueError(
            f"dist.num_local_devices={num_local_devices} but a process has only {fewest} devices"
        )
    return [d for ds in by_process.values() for d in ds[:num_local_devices]]


def put_replicated(tree: Any, mesh: Mesh) -> Any:
    """Copy every array leaf of ``tree`` (same values on every process) to every mesh device.

    Works with one process and with many: each process supplies the copies for its own devices,
    so no host-local array is ever resharded across processes.
    """
    sharding = replicated(mesh)

    def put(x: Any) -> Any:
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            # Typed RNG keys have no numpy form: move their raw data, re-wrap on the devices.
            return jax.random.wrap_key_data(
                put(jax.random.key_data(x)), impl=jax.random.key_impl(x)
            )
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree)


def to_host(tree: Any) -> Any:
    """Numpy copies of arrays: a replicated one read from this process's first shard, one
    split over devices (under ``dist.shard`` optimizer or full) assembled
    whole, from every process's slices when they span processes (then every process must
    call this, as for a collective)."""

    def get(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        if x.is_fully_addressable:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(get, tree)
