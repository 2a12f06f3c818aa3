"""Which arrays a split layout splits, along which axis, and what that leaves each device: the
one place where the train state's bytes per device are counted.

An array is split over a group of G devices (the mesh's ``shard`` axis) along its first axis
whose size G divides; an array with none (scalars, a 10-class bias on 4 devices) stays whole
on every device. The shape alone decides, so a parameter, its gradient, its optimizer moments
and its EMA are split alike; an optimizer state array of another shape (Adafactor's factored
moments, a count) is split by the same rule, or kept whole.

With one group (``dist.shard_group=all``, the mesh's ``replica`` axis of size 1) a split
array's spec names both axes, ``P(..., ("replica", "shard"), ...)``: the same devices hold the
same slices, and the step's ``shard_map`` then knows that no device holds a replica of a slice.
Named by ``shard`` alone, a slice would be typed as the same on every replica, and autodiff
would sum its gradient over the one-device replica axis: an all-reduce XLA:CPU keeps, with the
gradients' buffers (the 100M GPT's fully sharded step took 10% more memory).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jddp.mesh import DATA_AXES, REPLICA_AXIS, SHARD_AXIS, group_size

PyTree = Any


def split_axis(shape: tuple[int, ...], group: int) -> int | None:
    """The first axis of ``shape`` whose size ``group`` divides; None: the array stays whole
    (also for a group of one device: nothing to split)."""
    if group <= 1:
        return None
    return next((i for i, d in enumerate(shape) if d >= group and d % group == 0), None)


def split_spec(x: Any, mesh: Mesh) -> P:
    """``x``'s partition spec on ``mesh``: split within each group along :func:`split_axis`
    (over ``shard``; with one group over both axes, see the module docstring), or ``P()``."""
    k = split_axis(np.shape(x), group_size(mesh))
    if k is None:
        return P()
    return P(*([None] * k), SHARD_AXIS if mesh.shape[REPLICA_AXIS] > 1 else DATA_AXES)


def split_specs(tree: PyTree, mesh: Mesh) -> PyTree:
    """:func:`split_spec` of every leaf of ``tree``."""
    return jax.tree.map(lambda x: split_spec(x, mesh), tree)


def whole_specs(tree: PyTree) -> PyTree:
    """``P()`` for every leaf of ``tree``: whole on every device."""
    return jax.tree.map(lambda _: P(), tree)


def is_split(spec: P) -> bool:
    """Whether ``spec`` splits its array over the ``shard`` axis."""
    return any(e == SHARD_AXIS or (isinstance(e, tuple) and SHARD_AXIS in e) for e in spec)


def nbytes(x: Any) -> int:
    """Bytes of ``x`` (an array or a shape struct) at its full shape."""
    return int(np.prod(np.shape(x))) * jnp.dtype(x.dtype).itemsize


def bytes_per_device(shapes: PyTree, specs: PyTree, group: int) -> int:
    """Bytes of ``shapes`` (arrays or shape structs) one device holds when laid out as
    ``specs`` over groups of ``group`` devices: each split array's share, every other whole."""
    total = 0
    for x, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(specs), strict=True):
        total += nbytes(x) // group if is_split(spec) else nbytes(x)
    return total


def split_share(shapes: PyTree, specs: PyTree) -> float:
    """The share of ``shapes``' bytes whose spec in ``specs`` splits them."""
    total = split = 0
    for x, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(specs), strict=True):
        total += nbytes(x)
        split += nbytes(x) if is_split(spec) else 0
    return split / total if total else 0.0


def bytes_held(tree: PyTree) -> int:
    """Bytes of ``tree`` held by one device (the first addressable one) now: each array's share
    there (measured on the live arrays, not computed from a layout)."""
    total = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            total += x.addressable_shards[0].data.nbytes
        else:
            total += np.asarray(x).nbytes
    return total
