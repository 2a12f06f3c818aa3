"""Where the train state lives over the devices (``dist.shard``, ``dist.shard_group``): three
layouts behind one protocol (:class:`jddp.shard.base.StateLayout`).

=========  ======================  ======================  =====================================
``shard``  parameters at rest      optimizer state         the step
=========  ======================  ======================  =====================================
none       whole on every device   whole on every device   all-reduce the gradients, every
                                                           device applies the whole update
optimizer  whole on every device   1/G per device          reduce-scatter, update the slices,
                                                           all-gather the parameters (ZeRO-1,
                                                           :mod:`jddp.shard.optimizer`)
full       1/G per device          1/G per device          gather each parameter where its
                                                           module runs (again in the backward
                                                           pass), reduce-scatter its gradient,
                                                           update the slices (ZeRO-3/FSDP,
                                                           :mod:`jddp.shard.full`)
=========  ======================  ======================  =====================================

G is the group (``dist.shard_group``: every device by default, or the devices of a process,
or any count that divides them): a split state is split within each group, the groups hold
replicas (hybrid sharding, as FSDP2's 2-D mesh, torchtitan's ``dp_replicate`` x ``dp_shard``
and MaxText's ``dcn`` x ``ici_fsdp``): gathers never leave a group, and the gradients cross
groups once, as an all-reduce of each device's slices. What splits and the bytes that leaves
each device: :mod:`jddp.shard.specs`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # the config reads the names without importing JAX
    from jax.sharding import Mesh

    from jddp.shard.base import StateLayout

# The values of dist.shard, each with the class that implements it: the one list of them.
# ShardKind spells them as the config schema's type (mypy checks LAYOUTS' keys against it).
ShardKind = Literal["none", "optimizer", "full"]
LAYOUTS: dict[ShardKind, str] = {
    "none": "jddp.shard.replicated:Replicated",
    "optimizer": "jddp.shard.optimizer:OptimizerSharded",
    "full": "jddp.shard.full:FullySharded",
}
SHARD_CHOICES = tuple(LAYOUTS)


def layout_class(kind: str) -> type[StateLayout]:
    """The class of ``dist.shard=kind``; raises ``ValueError`` naming the choices."""
    if kind not in LAYOUTS:
        raise ValueError(f"dist.shard: {kind!r} is not one of {', '.join(SHARD_CHOICES)}")
    module, _, name = LAYOUTS[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def make_layout(kind: str, mesh: Mesh) -> StateLayout:
    """The layout ``dist.shard=kind`` over ``mesh`` (split within its rows: the groups)."""
    return layout_class(kind)(mesh)
