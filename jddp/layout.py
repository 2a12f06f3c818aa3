"""How the train state is laid out over the devices (``dist.shard``), behind one interface.

Three layouts, each a small object built once per run (:func:`jddp.build.build_layout`) and
kept on it; the step (:mod:`jddp.step`) asks it four things and never which one it is:

=========  ======================  ======================  =====================================
``shard``  parameters at rest      optimizer state         the step
=========  ======================  ======================  =====================================
none       whole on every device   whole on every device   all-reduce the gradients, every
                                                           device applies the whole update
optimizer  whole on every device   1/N per device          reduce-scatter, update a 1/N slice,
                                                           all-gather the parameters (ZeRO-1,
                                                           :mod:`jddp.sharded_update`)
full       1/N per device          1/N per device          all-gather each parameter where the
                                                           forward pass uses it (again in the
                                                           backward pass), reduce-scatter its
                                                           gradient, update the slice (ZeRO-3 /
                                                           FSDP, :mod:`jddp.fully_sharded`)
=========  ======================  ======================  =====================================

An array is split along its first axis whose size the device count divides; one with none
(scalars, a 10-class bias on 4 devices) stays whole in every layout. What the layout answers:

* :meth:`state_specs` / :meth:`place`: where each array of the state lives between steps;
* :meth:`grads_stage`: the per-device forward/backward under ``shard_map``, given a
  :class:`GradsIO` that says how a device's parameters reach the model and how its gradients
  become the mean it keeps (the step's one line where gradients become updates);
* :meth:`update_stage`: the optimizer stage, on whole arrays or on each device's slices;
* :meth:`tree_norm` / :meth:`all_finite`: norms and the non-finite check over slices too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp.mesh import DATA_AXIS

PyTree = Any
SHARD_CHOICES = ("none", "optimizer", "full")


def to_varying(tree: PyTree) -> PyTree:
    """``tree`` typed as varying over ``data`` (inside ``shard_map``): the gradient of a
    replicated input is then per device, not already summed over devices by autodiff."""
    return jax.lax.pcast(tree, DATA_AXIS, to="varying")


def keep_checkpoint_barriers(mesh: Mesh) -> dict[str, str] | None:
    """XLA options for a step whose ``jax.checkpoint`` recomputations must stay apart from the
    forward pass: where ``mesh``'s devices are CPUs, ``cse_barrier_expander`` disabled
    (XLA:CPU expands the checkpoints' optimization barriers early, then merges each
    recomputation back into the value it recomputes, which keeps the forward pass's values
    alive after all: measured in experiments/RESULTS.md section 9). None elsewhere: XLA:GPU
    keeps the barriers. The passes ``XLA_FLAGS`` disables stay disabled (an option replaces
    the flag's list)."""
    if mesh.devices.flat[0].platform != "cpu":
        return None
    given = re.findall(r"--xla_disable_hlo_passes=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return {"xla_disable_hlo_passes": ",".join([*given, "cse_barrier_expander"])}


def all_finite(tree: PyTree) -> jax.Array:
    """Whether every element of ``tree`` is finite (whole arrays)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


@dataclass(frozen=True)
class GradsIO:
    """One device's view of the parameters in the forward/backward pass.

    ``grads(objective, params)``: ``jax.grad(objective, has_aux=True)`` at this device's
    ``params`` as the state holds them (whole, or its slices), returning gradients shaped
    like ``params``. ``mean(grads, comm)``: the per-device gradients summed over this device's
    micro-batches -> the global mean of what this device keeps (whole arrays, or its slices).
    ``bind(model)``: the model the objective merged, made ready to run (``full``: its modules
    gather their parameters where they run, :mod:`jddp.gather_at_use`); unchanged by default."""

    grads: Callable[[Callable, PyTree], tuple[PyTree, Any]]
    mean: Callable[[PyTree, Any], PyTree]
    bind: Callable[[Any], Any] = lambda model: model


def replicated_grads(objective: Callable, params: PyTree) -> tuple[PyTree, Any]:
    """The gradient at whole parameters, per device (see :func:`to_varying`)."""
    return jax.grad(objective, has_aux=True)(to_varying(params))


@dataclass(frozen=True)
class ReplicatedLayout:
    """``dist.shard=none``: every array of the train state whole on every device."""

    mesh: Mesh
    kind = "none"

    @property
    def num_shards(self) -> int:
        """Devices of the ``data`` axis."""
        return self.mesh.shape[DATA_AXIS]

    def state_specs(self, state: PyTree) -> PyTree:
        """Every array ``P()``."""
        return jax.tree.map(lambda _: P(), state)

    def place(self, state: PyTree) -> PyTree:
        """``state`` moved to :meth:`state_specs`' layout (a no-op when it is there)."""
        specs = self.state_specs(state)
        if all(
            isinstance(x, jax.Array) and x.sharding == NamedSharding(self.mesh, s)
            for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(specs), strict=True)
        ):
            return state
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs)
        return jax.jit(lambda s: s, out_shardings=shardings)(state)

    def compiler_options(self, rematerialises: bool) -> dict[str, str] | None:
        """XLA options of the jitted step: :func:`keep_checkpoint_barriers` where the model
        rematerialises (``model.remat``), none otherwise."""
        return keep_checkpoint_barriers(self.mesh) if rematerialises else None

    def grads_io(self, params: PyTree, comm: Any) -> GradsIO:
        """Whole parameters; the gradients all-reduced (``comm.average_grads``)."""
        return GradsIO(replicated_grads, lambda grads, comm: comm.average_grads(grads))

    def grads_stage(self, per_device_batch: Callable, comm: Any) -> Callable:
        """``per_device_batch(state, batch, io)`` under ``shard_map``: everything whole, the
        batch split."""

        def stage(state, batch):
            io = self.grads_io(state.params, comm)
            return jax.shard_map(
                lambda s, b: per_device_batch(s, b, io),
                mesh=self.mesh,
                in_specs=(P(), P(DATA_AXIS)),
                out_specs=P(),
            )(state, batch)

        return stage

    def update_stage(self, make_update: Callable) -> Callable:
        """``make_update(tree_norm, all_finite)``'s stage, run on whole arrays."""
        return make_update(optax.tree.norm, all_finite)

    def split_share(self, state: PyTree) -> float:
        """The share of the state's bytes that is split over the devices (0 here)."""
        return split_share_of(state, self.state_specs(state))


def split_share_of(state: PyTree, specs: PyTree) -> float:
    """The share of ``state``'s bytes whose spec in ``specs`` splits them over ``data``."""
    total = split = 0
    for x, spec in zip(jax.tree.leaves(state), jax.tree.leaves(specs), strict=True):
        nbytes = int(np.prod(np.shape(x))) * jnp.dtype(x.dtype).itemsize
        total += nbytes
        split += nbytes if DATA_AXIS in tuple(spec) else 0
    return split / total if total else 0.0


def state_bytes_per_device(state: PyTree) -> int:
    """Bytes of the train state held by one device (the first addressable one) at rest:
    parameters, optimizer state, model state and counters, each its share there."""
    total = 0
    for x in jax.tree.leaves(state):
        if isinstance(x, jax.Array):
            total += x.addressable_shards[0].data.nbytes
        else:
            total += np.asarray(x).nbytes
    return total
