"""``dist.shard=optimizer``: the optimizer update split over the devices (ZeRO-1).

As in Xu et al. 2020, "Automatic Cross-Replica Sharding of Weight Update in Data-Parallel
Training" (MaxText's ``shard_optimizer_over_data``): instead of all-reducing the gradients and
having every device apply the same update to every parameter, the one jitted step

1. reduce-scatters the gradients: device *i* receives the global mean of its 1/N slice of each
   parameter (:meth:`ShardLayout.mean_scatter`: one ``psum_scatter`` per dtype over a buffer
   packing every slice; on CPUs through gloo an all-reduce, each device keeping its slice:
   see :class:`ShardLayout`);
2. updates that slice with its 1/N of the optimizer state, which lives split the same way
   (``P(..., "data", ...)``: about 1/N of the optimizer's bytes per device);
3. all-gathers the new parameters (one all-gather per dtype), which stay replicated for the
   next forward pass.

Each array is split along its first axis whose size N divides (:meth:`ShardLayout.axis`); an
array with none (scalars, a 10-class head's bias on 4 devices) stays whole: its gradient is
all-reduced and every device updates it, as without the key. The optimizers are elementwise
except for norms over a whole layer (LARS/LAMB trust ratios, :mod:`jddp.optimizer`) or over
everything (the logged gradient and parameter norms, the non-finite check): those add the
slices' partial results over ``data``, so each step takes the replicated step's update up to
the order of additions. Checkpoints hold every array at its full shape (orbax writes each
device's slice), so a run resumes on another device count or with the key switched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp.comm import Comm
from jddp.layout import (
    GradsIO,
    keep_checkpoint_barriers,
    replicated_grads,
    split_share_of,
    state_bytes_per_device,
)
from jddp.mesh import DATA_AXIS, DTYPES
from jddp.optimizer import layer_sq_norms, split_over_data
from jddp.state import TrainState

PyTree = Any


def cpu_gloo() -> bool:
    """Whether XLA:CPU runs this process's collectives through gloo (CPUs under
    ``jax.distributed``, even between the devices of one process)."""
    return (
        jax.default_backend() == "cpu"
        and jax.distributed.is_initialized()
        and jax.config.jax_cpu_collectives_implementation == "gloo"
    )


@dataclass(frozen=True)
class ShardLayout:
    """Where each array of the train state lives when the weight update is split over the
    ``data`` axis of ``mesh``: parameters, model state and counters whole on every device;
    each optimizer-state array split along :meth:`axis` (its shape alone decides, so a
    parameter, its gradient and its optimizer moments are split alike).

    ``reduce_scatter``: reduce-scatter the gradients (default), or all-reduce them as the
    replicated step does and keep the slice (the default through gloo: XLA:CPU's gloo
    reduce-scatter in jaxlib 0.10 returns wrong values on rank 0 now and then once a device's
    share reaches a few MiB, jax issue 40830; measured here: off by up to 8.1 in 1 of 20 calls
    of 2 x 6M floats, while ``psum`` never was). The gradients are then bitwise the
    replicated step's."""

    mesh: Mesh
    reduce_scatter: bool = field(default_factory=lambda: not cpu_gloo())
    kind = "optimizer"

    @property
    def num_shards(self) -> int:
        """Devices the update is split over."""
        return self.mesh.shape[DATA_AXIS]

    def compiler_options(self, rematerialises: bool) -> dict[str, str] | None:
        """XLA options of the jitted step: :func:`jddp.layout.keep_checkpoint_barriers` where
        the model rematerialises (``model.remat``), none otherwise."""
        return keep_checkpoint_barriers(self.mesh) if rematerialises else None

    def axis(self, shape: tuple[int, ...]) -> int | None:
        """The first axis of ``shape`` whose size the device count divides; None: kept whole."""
        n = self.num_shards
        return next((i for i, d in enumerate(shape) if d >= n and d % n == 0), None)

    def spec(self, x: Any) -> P:
        """``x``'s partition spec: split over ``data`` along :meth:`axis`, or ``P()``."""
        k = self.axis(np.shape(x))
        return P() if k is None else P(*([None] * k), DATA_AXIS)

    def specs(self, tree: PyTree) -> PyTree:
        """:meth:`spec` of every leaf (the parameters' and gradients' layout in the update)."""
        return jax.tree.map(self.spec, tree)

    def state_specs(self, state: TrainState) -> TrainState:
        """The train state's layout between steps: the optimizer state (and the parameters'
        EMA, read only by evals) split, the rest whole."""
        whole = jax.tree.map(lambda _: P(), state)
        return whole.replace(
            opt_state=self.specs(state.opt_state), ema_params=self.specs(state.ema_params)
        )

    def split_share(self, state: TrainState) -> float:
        """The share of the state's bytes split over the devices (the rest stays whole)."""
        return split_share_of(state, self.state_specs(state))

    def place(self, state: TrainState) -> TrainState:
        """``state`` (replicated, or laid out otherwise) moved to :meth:`state_specs`' layout:
        each device keeps its slice of the optimizer state."""
        shardings = jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec), self.state_specs(state)
        )
        return jax.jit(lambda s: s, out_shardings=shardings)(state)

    # -- inside the step's shard_map --------------------------------------------------------
    def _rows(self, x: jax.Array, k: int) -> jax.Array:
        """``x`` as ``[N, size/N]``: row *i* is device *i*'s slice along axis ``k``, flat."""
        n, s = self.num_shards, x.shape
        x = x.reshape(*s[:k], n, s[k] // n, *s[k + 1 :])
        return jnp.moveaxis(x, k, 0).reshape(n, -1)

    def _local_shape(self, shape: tuple[int, ...], k: int) -> tuple[int, ...]:
        return (*shape[:k], shape[k] // self.num_shards, *shape[k + 1 :])

    def _groups(self, leaves: list[Any]) -> dict[Any, list[int]]:
        """Indices of the leaves that are split, by dtype."""
        groups: dict[Any, list[int]] = {}
        for i, x in enumerate(leaves):
            if self.axis(x.shape) is not None and jnp.issubdtype(x.dtype, jnp.inexact):
                groups.setdefault(jnp.dtype(x.dtype), []).append(i)
        return groups

    def mean_scatter(self, grads: PyTree, comm: Comm) -> PyTree:
        """Per-device gradients -> their global mean, each device keeping its slice of the
        split arrays and the whole of the others. With ``reduce_scatter``: one
        ``psum_scatter`` per dtype over the slices packed as ``[N, size/N]`` rows, sent in
        ``comm.grad_dtype`` like the all-reduce; without: ``comm.average_grads`` (the
        replicated step's all-reduce, bitwise), then each device's slice."""
        if not self.reduce_scatter:
            return self.local_slices(comm.average_grads(grads))
        leaves, treedef = jax.tree.flatten(grads)
        groups = self._groups(leaves)
        split = {i for idx in groups.values() for i in idx}
        whole = [i for i in range(len(leaves)) if i not in split]
        out = list(leaves)
        for i, mean in zip(whole, comm.average_grads([leaves[i] for i in whole]), strict=True):
            out[i] = mean
        wire = DTYPES[comm.grad_dtype]
        for dtype, idx in groups.items():
            send = dtype if comm.grad_dtype == "float32" else wire
            axes = [self.axis(leaves[i].shape) for i in idx]
            rows = [self._rows(leaves[i].astype(send), k) for i, k in zip(idx, axes, strict=True)]
            mine = jax.lax.psum_scatter(
                jnp.concatenate(rows, axis=1), DATA_AXIS, scatter_dimension=0, tiled=False
            )
            mine = mine / self.num_shards  # as pmean divides its sum
            offsets = np.cumsum([r.shape[1] for r in rows])[:-1]
            for i, k, part in zip(idx, axes, jnp.split(mine, offsets), strict=True):
                out[i] = part.reshape(self._local_shape(leaves[i].shape, k)).astype(dtype)
        return jax.tree.unflatten(treedef, out)

    def local_slices(self, tree: PyTree) -> PyTree:
        """This device's slice of every split array of ``tree`` (whole arrays as they are)."""
        leaves, treedef = jax.tree.flatten(tree)
        split = {i for idx in self._groups(leaves).values() for i in idx}
        device = jax.lax.axis_index(DATA_AXIS)

        def mine(x: jax.Array) -> jax.Array:
            k = self.axis(x.shape)
            size = x.shape[k] // self.num_shards
            return jax.lax.dynamic_slice_in_dim(x, device * size, size, axis=k)

        out = [mine(x) if i in split else x for i, x in enumerate(leaves)]
        return jax.tree.unflatten(treedef, out)

    def pack(self, params: PyTree, like: PyTree) -> tuple[dict[str, jax.Array], list[jax.Array]]:
        """This device's slices of the split parameters, one flat buffer per dtype, and the
        whole parameters, in leaf order (what :meth:`unpack` reassembles); ``like``: the
        parameters at their full shapes (or their shape structs)."""
        leaves = jax.tree.leaves(params)
        groups = self._groups(jax.tree.leaves(like))
        split = {i for idx in groups.values() for i in idx}
        buffers = {
            str(dtype): jnp.concatenate([jnp.ravel(leaves[i]) for i in idx])
            for dtype, idx in groups.items()
        }
        return buffers, [x for i, x in enumerate(leaves) if i not in split]

    def all_finite(self, tree: PyTree) -> jax.Array:
        """Whether every element of ``tree`` is finite on every device (its slices included)."""
        ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))
        if split_over_data(ok):
            ok = jax.lax.pmin(ok.astype(jnp.int32), DATA_AXIS) > 0
        return ok

    @staticmethod
    def tree_norm(tree: PyTree) -> jax.Array:
        """The L2 norm of all of ``tree``, its slices' sums added over ``data``."""
        return jnp.sqrt(sum(layer_sq_norms(tree), jnp.zeros((), jnp.float32)))

    # -- outside it ---------------------------------------------------------------------------
    def unpack(self, buffers: dict[str, jax.Array], whole: list[jax.Array], like: PyTree) -> PyTree:
        """The full parameters from :meth:`pack`'s output: each buffer, ``[N * size]`` split
        over ``data``, all-gathered once (a replicated sharding constraint) and cut back into
        arrays of ``like``'s shapes."""
        leaves, treedef = jax.tree.flatten(like)
        groups = self._groups(leaves)
        out: list[Any] = [None] * len(leaves)
        split = {i for idx in groups.values() for i in idx}
        for i, x in zip([i for i in range(len(leaves)) if i not in split], whole, strict=True):
            out[i] = x
        replicated = NamedSharding(self.mesh, P())
        for dtype, idx in groups.items():
            gathered = jax.lax.with_sharding_constraint(buffers[str(dtype)], replicated)
            rows = gathered.reshape(self.num_shards, -1)
            sizes = [leaves[i].size // self.num_shards for i in idx]
            for i, part in zip(idx, jnp.split(rows, np.cumsum(sizes)[:-1], axis=1), strict=True):
                shape, k = leaves[i].shape, self.axis(leaves[i].shape)
                part = part.reshape(self.num_shards, *self._local_shape(shape, k))
                out[i] = jnp.moveaxis(part, 0, k).reshape(shape)
        return jax.tree.unflatten(treedef, out)

    # -- the step's two stages ----------------------------------------------------------------
    def grads_io(self, params: PyTree, comm: Comm) -> GradsIO:
        """Whole parameters (replicated); the gradients reduce-scattered (:meth:`mean_scatter`)."""
        return GradsIO(replicated_grads, self.mean_scatter)

    def grads_stage(self, per_device_batch: Callable, comm: Comm) -> Callable:
        """``per_device_batch(state, batch, io)`` (which ends in ``io.mean``) under
        ``shard_map``: the state in its layout, the batch split; out come the gradients as the
        global arrays of their slices, the model state and metrics whole."""

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
        """``make_update(tree_norm, all_finite)``: the optimizer stage ``(state, grads,
        model_state, metrics) -> (state, metrics)``, run by every device on its slices (the
        parameters' split like the gradients'), then the parameters all-gathered."""
        update_slices = make_update(self.tree_norm, self.all_finite)

        def stage(state: TrainState, grads, stats, terms) -> tuple[TrainState, PyTree]:
            full = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.params)

            def on_slices(state, grads, stats, terms):
                new, metrics = update_slices(state, grads, stats, terms)
                buffers, whole = self.pack(new.params, full)
                return new.replace(params=None), buffers, whole, metrics

            specs = self.state_specs(state)
            rest, buffers, whole, metrics = jax.shard_map(
                on_slices,
                mesh=self.mesh,
                in_specs=(
                    specs.replace(params=self.specs(state.params)),
                    self.specs(grads),
                    P(),
                    P(),
                ),
                out_specs=(specs.replace(params=None), P(DATA_AXIS), P(), P()),
            )(state, grads, stats, terms)
            return rest.replace(params=self.unpack(buffers, whole, state.params)), metrics

        return stage


def optimizer_state_bytes(state: TrainState) -> int:
    """Bytes of the optimizer state on one device (the first addressable one)."""
    return state_bytes_per_device(state.opt_state)
