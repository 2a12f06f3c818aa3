"""The 1-D device mesh (axis ``data``) and the two shardings the trainer uses."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"


def make_mesh(devices: list[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh with axis ``data`` over ``devices`` (default: every device of every process).

    Devices are ordered by (process index, device id), so process *p* owns a contiguous block
    of the mesh and therefore a contiguous slice of every global batch.
    """
    if devices is None:
        devices = jax.devices()
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    """Sharding of parameters and optimizer state: a full copy on every device."""
    return NamedSharding(mesh, P())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """Sharding of a global batch: split along its leading axis over ``data``."""
    return NamedSharding(mesh, P(DATA_AXIS))
