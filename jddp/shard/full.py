"""``dist.shard=full``: parameters, gradients and optimizer state split over each group's
devices (ZeRO-3, PyTorch's FSDP, the ``fsdp`` axis of MaxText and levanter).

At rest each device holds its slice of every array that splits
(:func:`jddp.shard.specs.split_axis`) and the whole of the rest. In the step, per device and
per micro-batch:

1. each split parameter is gathered inside the call of the module that holds it
   (:func:`jddp.models.units.bind_leaf_holders`: one ``all_gather`` per array within the group,
   in a ``jax.checkpoint`` per module that keeps only what matrix products and convolutions
   make), and gathered again where that module's backward pass runs, so the whole model is
   never gathered at once (FSDP's ``reshard_after_forward``); a rematerialised block
   (``model.remat=blocks``) gathers all of its parameters as it begins; a parameter read
   outside its module's call reads a copy gathered as the step begins. On XLA:CPU the step
   keeps its optimization barriers (:meth:`FullySharded.keeps_barriers`: XLA:CPU would
   otherwise merge each second gather into the first);
2. the gathered parameter's gradient goes back through the gather's transpose: the device
   receives the sum over its group of its slice's gradient, then the mean over every device
   (``Comm.mean_of_slice_sums``). Where the backend avoids reduce-scatters (gloo,
   ``Comm.reduce_scatter``) all split parameters are gathered at once as the step begins by one
   packed gather per dtype, whose backward all-reduces the gradients in one buffer per dtype
   and keeps the slices; whole arrays are all-reduced as in the replicated step. The transpose
   sends the parameters' dtype: ``dist.grad_allreduce_dtype=bfloat16`` is refused;
3. the optimizer updates the slices with the slices of its state, in a program XLA
   partitions (any optax transformation); nothing is gathered after the update.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from jddp.mesh import REPLICA_AXIS
from jddp.models.units import Plan, bind_leaf_holders, gathering_at_use
from jddp.shard import specs as specs_lib
from jddp.shard.base import Objective, PyTree, StateLayout, to_varying

GATHERED = "jddp/gathered"  # the checkpoint name of a gathered parameter: never saved

# Operations whose outputs the backward pass recomputes rather than keeps when the whole
# forward pass is one checkpoint (gloo's path): the gather itself (``all_gather``;
# ``jax.checkpoint`` asks about the collective's output, not the name given to it), and the
# cheap reshapes and casts that lead from a gathered parameter to the layer that reads it
# (``nnx.Linear`` casts its kernel to the compute dtype first: kept, that copy would hold the
# whole parameter from the forward pass to the backward pass). Activations go through those
# too: recomputing them from saved inputs costs next to nothing; a model's own psum (synced
# BatchNorm statistics) is recomputed, a few floats.
_RECOMPUTED = frozenset(
    {"all_gather", "psum", "convert_element_type", "reshape", "transpose", "broadcast_in_dim",
     "squeeze", "expand_dims", "copy", "copy_p", "pvary", "pcast"}
)  # fmt: skip


def _policy(prim: Any, *_: Any, **params: Any) -> bool:
    """``jax.checkpoint`` policy of the whole forward pass on gloo's path: save everything but
    a gathered parameter (named :data:`GATHERED`) and the outputs of :data:`_RECOMPUTED`."""
    if prim.name == "name":
        return params.get("name") != GATHERED
    return prim.name not in _RECOMPUTED


def varying_over_replicas(x: jax.Array, replicas: int) -> jax.Array:
    """This device's slice ``x`` typed as varying over the groups too, where there are several
    (with one group its spec names the replica axis already: :mod:`jddp.shard.specs`)."""
    return x if replicas == 1 else jax.lax.pcast(x, REPLICA_AXIS, to="varying")


class FullySharded(StateLayout):
    """Parameters and optimizer state (and the EMA) split along their
    :func:`~jddp.shard.specs.split_axis`; the model state and counters whole."""

    kind = "full"

    def state_specs(self, state: PyTree) -> PyTree:
        """Parameters, optimizer state and EMA split; the rest whole."""
        return specs_lib.whole_specs(state).replace(
            params=specs_lib.split_specs(state.params, self.mesh),
            opt_state=specs_lib.split_specs(state.opt_state, self.mesh),
            ema_params=specs_lib.split_specs(state.ema_params, self.mesh),
        )

    def grad_specs(self, params: PyTree) -> PyTree:
        """Each device's slices of the mean gradients, laid out like the parameters."""
        return specs_lib.split_specs(params, self.mesh)

    def _axes(self, shapes: PyTree) -> list[int | None]:
        return [specs_lib.split_axis(x.shape, self.group_size) for x in jax.tree.leaves(shapes)]

    def gradients(
        self, objective: Objective, params: PyTree, shapes: PyTree, comm: Any
    ) -> tuple[PyTree, Any]:
        """Split parameters gathered where used (and again in the backward pass): their
        gradients come back as the sums over the group of this device's slices; whole ones
        per device, as in the replicated step."""
        leaves, treedef = jax.tree.flatten(params)
        axes = self._axes(shapes)
        split = [i for i, k in enumerate(axes) if k is not None]
        # per-device gradients: of a whole array, and of a slice, which the groups hold alike
        # (its gradient would otherwise come back summed over the groups by autodiff)
        replicas = jax.lax.axis_size(REPLICA_AXIS)
        start = [
            to_varying(x) if k is None else varying_over_replicas(x, replicas)
            for x, k in zip(leaves, axes, strict=True)
        ]

        def on_slices(slices: list[jax.Array]):
            gathered = comm.gather_all([slices[i] for i in split], [axes[i] for i in split])
            whole = list(slices)
            for i, x in zip(split, gathered, strict=True):
                whole[i] = checkpoint_name(x, GATHERED)
            if not comm.reduce_scatter:  # all gathered at once: nothing to gather at use
                return objective(jax.tree.unflatten(treedef, whole))
            plan = Plan(
                {id(whole[i]): (whole[i], slices[i], axes[i]) for i in split},
                lambda x, k: checkpoint_name(comm.gather(x, k), GATHERED),
            )
            with gathering_at_use(plan):  # XLA drops each first gather that nothing reads
                return objective(jax.tree.unflatten(treedef, whole))

        if not comm.reduce_scatter:  # the backward pass gathers again, as a whole
            on_slices = jax.checkpoint(on_slices, policy=_policy)
        grads, aux = jax.grad(on_slices, has_aux=True)(start)
        return jax.tree.unflatten(treedef, grads), aux

    def mean(self, grads: PyTree, shapes: PyTree, comm: Any) -> PyTree:
        """The split gradients' group sums -> their mean (``comm.mean_of_slice_sums``); the
        whole ones all-reduced."""
        leaves, treedef = jax.tree.flatten(grads)
        axes = self._axes(shapes)
        split = [i for i, k in enumerate(axes) if k is not None]
        whole = [i for i, k in enumerate(axes) if k is None]
        out = list(leaves)
        for i, m in zip(split, comm.mean_of_slice_sums([leaves[i] for i in split]), strict=True):
            out[i] = m
        for i, m in zip(whole, comm.average_grads([leaves[i] for i in whole]), strict=True):
            out[i] = m
        return jax.tree.unflatten(treedef, out)

    def bind(self, model: Any) -> Any:
        """Each leaf holder gathers its parameters where it runs (with a gather plan active)."""
        return bind_leaf_holders(model)

    def keeps_barriers(self, comm: Any, rematerialises: bool) -> bool:
        """With per-array gathers, whatever the model does: the barriers hold each module's
        second gather apart from its first (XLA:CPU would otherwise merge them, every gathered
        parameter then held from the forward pass to the backward pass). On gloo's path never,
        even where the model rematerialises: the whole forward pass is one checkpoint there,
        and kept apart every gather of its backward pass would run as that pass begins."""
        return comm.reduce_scatter
