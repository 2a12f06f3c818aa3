"""``dist.shard=full``: parameters, gradients and optimizer state split over the devices
(ZeRO-3, PyTorch's FSDP, the ``fsdp`` axis of MaxText and levanter).

At rest each device holds 1/N of every array that splits (:meth:`ShardLayout.axis`, as
``dist.shard=optimizer`` splits the optimizer state) and the whole of the rest. In the step,
per device and per micro-batch:

1. each split parameter is all-gathered where the model reads it (:func:`gather`: one
   ``all_gather`` per array, no annotation on the model), inside a ``jax.checkpoint`` whose
   policy (:func:`_policy`) keeps everything but the gathers and the casts and reshapes that
   follow them: the backward pass may gather each one again instead of keeping the whole
   model alive from the forward pass to the backward pass (FSDP's ``reshard_after_forward``).
   XLA:CPU removes ``jax.checkpoint``'s optimization barriers early and merges the second
   gathers with the first (measured on a 6-layer GPT: 116 gathers before its passes, 78
   after, for 78 split arrays), so on CPUs the gathered parameters stay whole through the
   step; GPUs keep the barriers (docs/performance.md);
2. the gathered parameter's gradient goes back through the gather's transpose, a
   reduce-scatter: the device receives the sum over devices of its slice's gradient, divided
   once as ``pmean`` divides (through gloo on CPUs the gather is a ``psum`` of the slice
   placed in zeros, whose transpose all-reduces then slices: gloo's reduce-scatter is
   unreliable, jax issue 40830); whole arrays are all-reduced as in the replicated step. The
   transpose sends the parameters' dtype: ``dist.grad_allreduce_dtype=bfloat16`` is refused;
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
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jddp.layout import GradsIO, to_varying
from jddp.mesh import DATA_AXIS
from jddp.sharded_update import ShardLayout
from jddp.state import TrainState

PyTree = Any
GATHERED = "jddp/gathered"  # the checkpoint name of a gathered parameter: never saved


def gather(x: jax.Array, axis: int, shards: int, reduce_scatter: bool) -> jax.Array:
    """Inside ``shard_map``: this device's slice ``x`` of an array split along ``axis`` over
    ``data`` -> the whole array. Its transpose (the gradient's way back) gives each device the
    *sum* over devices of its slice's gradient: a reduce-scatter (``all_gather``'s transpose),
    or, when ``reduce_scatter`` is False, an all-reduce then the slice (the gather written as
    a ``psum`` of the slice placed in zeros: gloo's reduce-scatter is unreliable, jax issue
    40830). Plain primitives, not a ``custom_vjp``: ``jax.checkpoint`` recomputes them in the
    backward pass (it keeps a ``custom_vjp``'s outputs from the forward pass)."""
    if reduce_scatter:
        return jax.lax.all_gather(x, DATA_AXIS, axis=axis, tiled=True)
    shape = (*x.shape[:axis], x.shape[axis] * shards, *x.shape[axis + 1 :])
    start = jax.lax.axis_index(DATA_AXIS) * x.shape[axis]
    placed = jax.lax.dynamic_update_slice_in_dim(jnp.zeros(shape, x.dtype), x, start, axis)
    return jax.lax.psum(placed, DATA_AXIS)


# Operations whose outputs the backward pass recomputes rather than keeps: the gather itself
# (``all_gather``, or gloo's ``psum``: ``jax.checkpoint`` asks about the collective's output,
# not the name given to it), and the cheap reshapes and casts that lead from a gathered
# parameter to the layer that reads it (``nnx.Linear`` casts its kernel to the compute dtype
# first: kept, that copy would hold the whole parameter from the forward pass to the backward
# pass). Activations go through those too: recomputing them from saved inputs costs next to
# nothing; a model's own psum (synced BatchNorm statistics) is recomputed, a few floats.
_RECOMPUTED = frozenset(
    {"all_gather", "psum", "convert_element_type", "reshape", "transpose", "broadcast_in_dim",
     "squeeze", "expand_dims", "copy", "copy_p", "pvary", "pcast"}
)  # fmt: skip


def _policy(prim: Any, *_: Any, **params: Any) -> bool:
    """``jax.checkpoint`` policy of the fully sharded step: save everything but a gathered
    parameter (named :data:`GATHERED`) and the outputs of :data:`_RECOMPUTED`."""
    if prim.name == "name":
        return params.get("name") != GATHERED
    return prim.name not in _RECOMPUTED


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

        def grads(objective: Callable, local: PyTree) -> tuple[PyTree, Any]:
            leaves, treedef = jax.tree.flatten(local)
            # whole arrays: per-device gradients, as in the replicated step
            start = [
                x if k is not None else to_varying(x) for x, k in zip(leaves, axes, strict=True)
            ]

            def on_slices(slices: list[jax.Array]):
                full = [
                    x if k is None else checkpoint_name(
                        gather(x, k, self.num_shards, self.reduce_scatter), GATHERED
                    )
                    for x, k in zip(slices, axes, strict=True)
                ]  # fmt: skip
                return objective(jax.tree.unflatten(treedef, full))

            g, aux = jax.grad(jax.checkpoint(on_slices, policy=_policy), has_aux=True)(start)
            return jax.tree.unflatten(treedef, g), aux

        def mean(grads: PyTree, comm: Any) -> PyTree:
            leaves, treedef = jax.tree.flatten(grads)
            whole = [i for i, k in enumerate(axes) if k is None]
            # the split ones: sums over devices since the gather's transpose; divided as pmean
            n = self.num_shards
            out = [g if k is None else g / n for g, k in zip(leaves, axes, strict=True)]
            for i, m in zip(whole, comm.average_grads([leaves[i] for i in whole]), strict=True):
                out[i] = m
            return jax.tree.unflatten(treedef, out)

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
