"""The protocol every state layout implements (``dist.shard``), and what they share.

A layout answers two kinds of question, and never calls the step back:

* **at rest** — where each array of the train state lives between steps
  (:meth:`StateLayout.state_specs`, :meth:`~StateLayout.place`), and what that leaves each
  device (:meth:`~StateLayout.bytes_per_device`, :meth:`~StateLayout.split_share`);
* **in the step** (:mod:`jddp.step`) — how one device's parameters reach the model and its
  gradients become the mean it keeps, inside the step's ``shard_map``
  (:meth:`~StateLayout.gradients`, :meth:`~StateLayout.bind`, :meth:`~StateLayout.mean`,
  :meth:`~StateLayout.grad_specs`), and under which specs the optimizer's update runs on the
  global arrays (:meth:`~StateLayout.update_specs`): XLA partitions the update, adding the
  reductions a statistic over a whole array needs (a global norm, a trust ratio, a factored
  moment), so any optax transformation updates split arrays as it would whole ones.

Splitting happens over the mesh's ``shard`` axis, a group of :attr:`~StateLayout.group_size`
devices (``dist.shard_group``); the groups, along ``replica``, hold replicas.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import jax
from jax.sharding import Mesh, NamedSharding

from jddp.mesh import DATA_AXES, REPLICA_AXIS, group_size
from jddp.shard import specs as specs_lib

PyTree = Any
Objective = Callable[[PyTree], tuple[jax.Array, Any]]


def to_varying(tree: PyTree) -> PyTree:
    """``tree`` typed as varying over the data axes (inside ``shard_map``): the gradient of a
    replicated input is then per device, not already summed over devices by autodiff."""
    return jax.lax.pcast(tree, DATA_AXES, to="varying")


def replicated_gradients(objective: Objective, params: PyTree) -> tuple[PyTree, Any]:
    """``jax.grad(objective, has_aux=True)`` at whole parameters, per device (see
    :func:`to_varying`)."""
    return jax.grad(objective, has_aux=True)(to_varying(params))


class StateLayout(ABC):
    """Where the train state lives over ``mesh`` and how a step's gradients reach it."""

    kind: ClassVar[str]  # the dist.shard value

    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    @property
    def group_size(self) -> int:
        """Devices a split array is split over (``dist.shard_group``)."""
        return group_size(self.mesh)

    @property
    def replicas(self) -> int:
        """Groups, each holding a replica of the split state."""
        return self.mesh.shape[REPLICA_AXIS]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group of {self.group_size}, {self.replicas} replicas)"

    # -- at rest ------------------------------------------------------------------------------
    @abstractmethod
    def state_specs(self, state: PyTree) -> PyTree:
        """The partition spec of every array of the train state between steps."""

    def shardings(self, specs: PyTree) -> PyTree:
        """``specs`` as ``NamedSharding`` s over the mesh."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs)

    def constrain(self, tree: PyTree, specs: PyTree) -> PyTree:
        """Inside a jitted program: ``tree`` laid out as ``specs`` (XLA moves what it must)."""
        return jax.lax.with_sharding_constraint(tree, self.shardings(specs))

    def at_rest(self, state: PyTree, comm: Any) -> PyTree:
        """Inside the step, after the update: the new state laid out as between steps."""
        return self.constrain(state, self.state_specs(state))

    def place(self, state: PyTree) -> PyTree:
        """``state`` moved to :meth:`state_specs`' layout (unchanged when it is there)."""
        shardings = self.shardings(self.state_specs(state))
        leaves = jax.tree.leaves(state)
        if all(
            isinstance(x, jax.Array) and x.sharding == s
            for x, s in zip(leaves, jax.tree.leaves(shardings), strict=True)
        ):
            return state
        return jax.jit(lambda s: s, out_shardings=shardings)(state)

    def bytes_per_device(self, shapes: PyTree) -> int:
        """Bytes of the train state ``shapes`` (arrays or shape structs) one device holds at
        rest in this layout."""
        return specs_lib.bytes_per_device(shapes, self.state_specs(shapes), self.group_size)

    def split_share(self, state: PyTree) -> float:
        """The share of the state's bytes that is split over the devices."""
        return specs_lib.split_share(state, self.state_specs(state))

    # -- in the step ----------------------------------------------------------------------------
    @abstractmethod
    def grad_specs(self, params: PyTree) -> PyTree:
        """The specs of the mean gradients the step's ``shard_map`` returns (each device's
        share of them)."""

    @abstractmethod
    def gradients(
        self, objective: Objective, params: PyTree, shapes: PyTree, comm: Any
    ) -> tuple[PyTree, Any]:
        """Inside ``shard_map``: ``jax.grad(objective, has_aux=True)`` at this device's
        parameters as the state holds them (whole, or its slices; ``shapes``: the parameters'
        full shapes), per device: gradients shaped like ``params``."""

    @abstractmethod
    def mean(self, grads: PyTree, shapes: PyTree, comm: Any) -> PyTree:
        """Inside ``shard_map``: the per-device gradients, summed over this device's
        micro-batches, -> the global mean of what this device keeps (:meth:`grad_specs`)."""

    def bind(self, model: Any) -> Any:
        """The model the objective merged, made ready to run (unchanged by default)."""
        return model

    def update_specs(self, state: PyTree) -> PyTree:
        """The specs the optimizer's update computes on: the state at rest, its parameters
        split like the gradients (a replicated array's slice is taken locally)."""
        return self.state_specs(state).replace(params=self.grad_specs(state.params))

    def keeps_barriers(self, comm: Any, rematerialises: bool) -> bool:
        """Whether the step must keep ``jax.checkpoint``'s recomputations apart from the
        forward pass (:func:`jddp.step.keep_checkpoint_barriers`): where the model
        rematerialises (``model.remat``)."""
        return rematerialises
