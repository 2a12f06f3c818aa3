"""``dist.shard=optimizer``: the optimizer state split over each group's devices (ZeRO-1).

As in Xu et al. 2020, "Automatic Cross-Replica Sharding of Weight Update in Data-Parallel
Training" (MaxText's ``shard_optimizer_over_data``): instead of all-reducing the gradients and
having every device apply the same update to every parameter, the one jitted step

1. reduce-scatters the gradients: device *i* of a group receives the global mean of its slice
   of each parameter (``Comm.mean_scatter``: within the group, then averaged over the groups);
2. updates that slice with its slice of the optimizer state, which lives split the same way
   (``P(..., "shard", ...)``: about 1/G of the optimizer's bytes per device), in a program XLA
   partitions: any optax transformation, its statistics over whole arrays included;
3. all-gathers the new parameters within the group, which stay whole for the next forward
   pass (:meth:`OptimizerSharded.at_rest`).

Checkpoints hold every array at its full shape (orbax writes each device's slice), so a run
resumes on another device count, group or layout.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jddp.shard import specs as specs_lib
from jddp.shard.base import Objective, PyTree, StateLayout, replicated_gradients


class OptimizerSharded(StateLayout):
    """Parameters, model state and counters whole on every device; each optimizer-state array
    (and the parameters' EMA, read only by evals) split along its :func:`~jddp.shard.specs.
    split_axis`."""

    kind = "optimizer"

    def state_specs(self, state: PyTree) -> PyTree:
        """The optimizer state and the EMA split, the rest whole."""
        return specs_lib.whole_specs(state).replace(
            opt_state=specs_lib.split_specs(state.opt_state, self.mesh),
            ema_params=specs_lib.split_specs(state.ema_params, self.mesh),
        )

    def grad_specs(self, params: PyTree) -> PyTree:
        """Each device's slices of the mean gradients."""
        return specs_lib.split_specs(params, self.mesh)

    def gradients(
        self, objective: Objective, params: PyTree, shapes: PyTree, comm: Any
    ) -> tuple[PyTree, Any]:
        """At whole parameters, per device."""
        return replicated_gradients(objective, params)

    def mean(self, grads: PyTree, shapes: PyTree, comm: Any) -> PyTree:
        """The reduce-scatter (``comm.mean_scatter``)."""
        leaves, treedef = jax.tree.flatten(grads)
        axes = [specs_lib.split_axis(x.shape, self.group_size) for x in jax.tree.leaves(shapes)]
        return jax.tree.unflatten(treedef, comm.mean_scatter(leaves, axes))

    def at_rest(self, state: PyTree, comm: Any) -> PyTree:
        """The new state laid out as between steps: its parameters gathered whole within each
        group (``comm.gather_whole``: one all-gather per dtype of the packed slices where the
        backend fuses its collectives). Left to XLA, the partitioner gathered a group's
        arrays over every device of every group (half again the bytes between machines)."""
        rest = state.replace(params=None)
        rest = self.constrain(rest, self.state_specs(rest))
        leaves, treedef = jax.tree.flatten(state.params)
        specs = jax.tree.leaves(self.grad_specs(state.params), is_leaf=lambda x: isinstance(x, P))
        axes = [specs_lib.split_axis(x.shape, self.group_size) for x in leaves]
        # the same on every device of a group, and in every group: shard_map's types call an
        # all-gather's result per device, hence check_vma=False
        whole = jax.shard_map(
            lambda *slices: comm.gather_whole(list(slices), axes),
            mesh=self.mesh,
            in_specs=tuple(specs),
            out_specs=[P()] * len(leaves),
            check_vma=False,
        )(*leaves)
        return rest.replace(params=jax.tree.unflatten(treedef, whole))
