"""``dist.shard=optimizer``: the optimizer state split over each group's devices (ZeRO-1).

As in Xu et al. 2020, "Automatic Cross-Replica Sharding of Weight Update in Data-Parallel
Training" (MaxText's ``shard_optimizer_over_data``): instead of all-reducing the gradients and
having every device apply the same update to every parameter, the one jitted step

1. reduce-scatters the gradients: device *i* of a group receives the global mean of its slice
   of each parameter (``Comm.mean_scatter``: within the group, then averaged over the groups);
2. updates that slice with its slice of the optimizer state, which lives split the same way
   (``P(..., "shard", ...)``: about 1/G of the optimizer's bytes per device), in a program XLA
   partitions: any optax transformation, its statistics over whole arrays included;
3. all-gathers the new parameters, which stay whole for the next forward pass (where the
   backend fuses its collectives, CPUs: one all-gather per dtype of every device's slices
   packed into one buffer, :meth:`OptimizerSharded.at_rest`; gloo pays a few ms per collective).

Checkpoints hold every array at its full shape (orbax writes each device's slice), so a run
resumes on another device count, group or layout.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
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
        """The new state laid out as between steps: its parameters gathered whole, in one
        all-gather per dtype of the slices packed into one buffer where ``comm`` fuses its
        collectives (XLA gathers each array apart otherwise)."""
        if not comm.fuse:
            return super().at_rest(state, comm)
        rest = self.constrain(
            state.replace(params=None), self.state_specs(state.replace(params=None))
        )
        return rest.replace(params=self._gathered(state.params))

    def _gathered(self, params: PyTree) -> PyTree:
        """``params`` (split as :meth:`grad_specs` says) whole on every device."""
        leaves, treedef = jax.tree.flatten(params)
        specs = jax.tree.leaves(self.grad_specs(params), is_leaf=lambda x: isinstance(x, P))
        group = self.group_size
        axes = [specs_lib.split_axis(x.shape, group) for x in leaves]
        by_dtype: dict[Any, list[int]] = {}
        for i, k in enumerate(axes):
            if k is not None:
                by_dtype.setdefault(jnp.dtype(leaves[i].dtype), []).append(i)
        out = list(self.constrain(leaves, [P()] * len(leaves)))  # the arrays kept whole
        for idx in by_dtype.values():
            size = sum(leaves[i].size // group for i in idx)  # one device's slices, flat
            buffer_spec = specs_lib.split_spec(np.empty(size * group), self.mesh)
            packed = jax.shard_map(
                lambda *xs: jnp.concatenate([jnp.ravel(x) for x in xs]),
                mesh=self.mesh,
                in_specs=tuple(specs[i] for i in idx),
                out_specs=buffer_spec,
            )(*[leaves[i] for i in idx])
            rows = self.constrain(packed, P()).reshape(group, size)  # one all-gather
            offset = 0
            for i in idx:
                x, k = leaves[i], axes[i]
                local = (*x.shape[:k], x.shape[k] // group, *x.shape[k + 1 :])
                part = rows[:, offset : offset + x.size // group].reshape(group, *local)
                out[i] = jnp.moveaxis(part, 0, k).reshape(x.shape)  # device blocks along k
                offset += x.size // group
        return jax.tree.unflatten(treedef, out)
