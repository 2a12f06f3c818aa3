"""``dist.shard=full``: parameters, gradients and optimizer state split over the devices
(ZeRO-3, PyTorch's FSDP, the ``fsdp`` axis of MaxText and levanter).

At rest each device holds 1/N of every array that splits (:meth:`ShardLayout.axis`, as
``dist.shard=optimizer`` splits the optimizer state) and the whole of the rest. In the step,
per device and per micro-batch:

1. each split parameter is all-gathered where the model reads it (:func:`gather`: one
   ``all_gather`` per array, no annotation on the model), inside a ``jax.checkpoint`` whose
   policy saves everything except the gathered parameters: the backward pass gathers each
   one again instead of keeping the whole model alive from the forward pass to the backward
   pass (FSDP's ``reshard_after_forward``);
2. the gathered parameter's gradient goes back through the gather's transpose, a
   reduce-scatter: the device receives the global mean of its slice only (``psum_scatter``;
   through gloo on CPUs a ``pmean`` then the slice, as :class:`ShardLayout` does, jax issue
   40830), sent in ``dist.grad_allreduce_dtype``; whole arrays are all-reduced as usual;
3. each device updates its slices with its slices of the optimizer state; nothing is gathered
   after the update.

Why per-array gathers inside ``shard_map`` rather than XLA's SPMD partitioner over sharding
annotations (MaxText, levanter): the step stays the replicated step's code with one line
changed, so it keeps that step's exact weighted means, model-state sync, NaN guard and
collective choices (gloo's reduce-scatter avoided), and it needs no per-model annotation; the
partitioner would choose its own collectives per op, which we could not keep equal to the
replicated run's losses on every topology. docs/performance.md has the measurements.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jddp.layout import GradsIO, to_varying
from jddp.mesh import DATA_AXIS, DTYPES
from jddp.sharded_update import ShardLayout
from jddp.state import TrainState

PyTree = Any
GATHERED = "jddp/gathered"  # the checkpoint name of a gathered parameter: never saved


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def gather(x: jax.Array, axis: int, shards: int, reduce_scatter: bool, wire: Any) -> jax.Array:
    """Inside ``shard_map``: this device's slice ``x`` of an array split along ``axis`` over
    ``data`` -> the whole array. Its gradient: the global mean of the slice's gradient
    (reduce-scattered, or all-reduced and sliced when ``reduce_scatter`` is False), sent in
    ``wire`` dtype."""
    return jax.lax.all_gather(x, DATA_AXIS, axis=axis, tiled=True)


def _gather_fwd(x, axis, shards, reduce_scatter, wire):
    return gather(x, axis, shards, reduce_scatter, wire), None


def _gather_bwd(axis, shards, reduce_scatter, wire, _, g):
    sent = g.astype(wire)
    if reduce_scatter:
        mine = jax.lax.psum_scatter(sent, DATA_AXIS, scatter_dimension=axis, tiled=True)
        mine = mine / shards  # as pmean divides its sum
    else:
        size = g.shape[axis] // shards
        start = jax.lax.axis_index(DATA_AXIS) * size
        mine = jax.lax.dynamic_slice_in_dim(jax.lax.pmean(sent, DATA_AXIS), start, size, axis)
    return (mine.astype(g.dtype),)


gather.defvjp(_gather_fwd, _gather_bwd)


@dataclass(frozen=True)
class FullShardLayout(ShardLayout):
    """Where each array lives under ``dist.shard=full``: parameters and optimizer state split
    along :meth:`axis`, the model state and counters whole."""

    kind = "full"

    def state_specs(self, state: TrainState) -> TrainState:
        """Parameters and optimizer state split, the rest whole."""
        whole = jax.tree.map(lambda _: P(), state)
        return whole.replace(params=self.specs(state.params), opt_state=self.specs(state.opt_state))

    def grads_io(self, params: PyTree, comm: Any) -> GradsIO:
        """Split parameters gathered where used (and again in the backward pass); their
        gradients come back as this device's slice of the mean; whole ones all-reduced."""
        axes = [self.axis(x.shape) for x in jax.tree.leaves(params)]
        wire = DTYPES[comm.grad_dtype]

        def grads(objective: Callable, local: PyTree) -> tuple[PyTree, Any]:
            leaves, treedef = jax.tree.flatten(local)
            # whole arrays: per-device gradients, as in the replicated step
            start = [
                x if k is not None else to_varying(x) for x, k in zip(leaves, axes, strict=True)
            ]

            def on_slices(slices: list[jax.Array]):
                full = [
                    x if k is None else checkpoint_name(
                        gather(x, k, self.num_shards, self.reduce_scatter, wire), GATHERED
                    )
                    for x, k in zip(slices, axes, strict=True)
                ]  # fmt: skip
                return objective(jax.tree.unflatten(treedef, full))

            policy = jax.checkpoint_policies.save_anything_except_these_names(GATHERED)
            g, aux = jax.grad(jax.checkpoint(on_slices, policy=policy), has_aux=True)(start)
            return jax.tree.unflatten(treedef, g), aux

        def mean(grads: PyTree, comm: Any) -> PyTree:
            leaves, treedef = jax.tree.flatten(grads)
            whole = [i for i, k in enumerate(axes) if k is None]
            out = list(leaves)
            for i, m in zip(whole, comm.average_grads([leaves[i] for i in whole]), strict=True):
                out[i] = m
            return jax.tree.unflatten(treedef, out)  # the split ones: means since the gather

        return GradsIO(grads, mean)

    def grads_stage(self, per_device_batch: Callable, comm: Any) -> Callable:
        """``per_device_batch(state, batch, io)`` under ``shard_map``: the state in its
        layout, the batch split; out come the gradients as the global arrays of their slices,
        the model state and metrics whole."""

        def stage(state: TrainState, batch: PyTree) -> tuple[PyTree, PyTree, PyTree]:
            io = self.grads_io(state.params, comm)
            return jax.shard_map(
                lambda s, b: per_device_batch(s, b, io),
                mesh=self.mesh,
                in_specs=(self.state_specs(state), P(DATA_AXIS)),
                out_specs=(self.specs(state.params), P(), P()),
            )(state, batch)

        return stage

    def update_stage(self, make_update: Callable) -> Callable:
        """The optimizer stage run by every device on its slices; the parameters stay split."""
        update_slices = make_update(self.tree_norm, self.all_finite)

        def stage(state: TrainState, grads, stats, terms) -> tuple[TrainState, PyTree]:
            specs = self.state_specs(state)
            return jax.shard_map(
                update_slices,
                mesh=self.mesh,
                in_specs=(specs, self.specs(grads), P(), P()),
                out_specs=(specs, P()),
            )(state, grads, stats, terms)

        return stage
