"""``mpi``: processes share no JAX runtime; MPI carries the gradients between them.

The mesh holds this process's devices; the step's ``shard_map`` averages over them (an
all-reduce, or under a split layout a reduce-scatter: each device keeps the process's mean of
its slice), then each distinct slice is averaged across processes with ``mpi4jax.allreduce``
in a jit over the one device holding it (mpi4jax cannot run inside ``shard_map`` or on
multi-device arrays), and every process applies the identical update over its devices, as the
layout lays the state out (``dist.shard_group=process``: a group is a process's devices, the
processes hold replicas).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jddp import weighted
from jddp.comm.base import Comm, GradsStage, PyTree, UpdateStage, fused
from jddp.config import DistConfig
from jddp.distributed import Job, current_job, mpi_world
from jddp.mesh import DATA_AXES, DTYPES, put_replicated, replicated, to_host


def one_device(tree: PyTree) -> PyTree:
    """Each array of ``tree`` as its first addressable copy (one device)."""
    return jax.tree.map(lambda x: x.addressable_data(0), tree)


def _index_key(index: tuple) -> tuple:
    """A shard's index (a tuple of slices) as a hashable key."""
    return tuple((s.start, s.stop, s.step) for s in index)


class MpiComm(Comm):
    """Hierarchical averaging: ``pmean`` over local devices, ``mpi4jax.allreduce`` across."""

    name = "mpi"

    def __init__(
        self, grad_dtype: str = "float32", job: Job | None = None, fuse: bool | None = None
    ):
        super().__init__(grad_dtype, job, fuse)
        from mpi4py import MPI

        self._MPI = MPI
        self.world = mpi_world()

    @staticmethod
    def current_job() -> Job:
        """MPI's rank and world size."""
        return current_job(DistConfig(backend="mpi"))

    @property
    def writes_checkpoints(self) -> bool:
        """Rank 0 alone: without a shared JAX runtime every rank would act as orbax's primary
        host; the others only restore (the directory must be shared)."""
        return self.is_writer

    def device_index(self) -> jax.Array:
        """Rank-major index over every rank's local devices (inside the local step)."""
        local = jax.lax.axis_index(DATA_AXES)
        return self.process_index * jax.lax.psum(1, DATA_AXES) + local

    def average_grads(self, grads: PyTree) -> PyTree:
        """Local mean in full precision; compression applies to the MPI stage only."""
        return self.average(grads)

    def _allreduce_mean(self, tree: PyTree, wire: Any = None) -> PyTree:
        import mpi4jax

        def reduce(x: jax.Array) -> jax.Array:
            if not jnp.issubdtype(x.dtype, jnp.inexact):
                # Counters advance identically on every rank; MAX keeps them exact.
                return mpi4jax.allreduce(x, op=self._MPI.MAX, comm=self.world)
            if wire is not None and jnp.issubdtype(x.dtype, jnp.floating):
                return (self.bf16_allreduce_sum(x) / self.process_count).astype(x.dtype)
            total = mpi4jax.allreduce(x, op=self._MPI.SUM, comm=self.world)
            return (total / self.process_count).astype(x.dtype)

        if self._fuse is False:
            return jax.tree.map(reduce, tree)
        # One MPI call per dtype (mpi4jax stages each call through the host on GPUs).
        return fused(reduce, tree)

    def _allreduce_others(self, groups: dict[str, dict]) -> dict[str, dict]:
        """Metric sums added across ranks, maxima and minima kept (:mod:`jddp.weighted`)."""
        import mpi4jax

        ops = {"sum": self._MPI.SUM, "max": self._MPI.MAX, "min": self._MPI.MIN}
        return {  # one MPI call per kind and dtype (elementwise: packing them is exact)
            kind: group
            if kind == "mean"
            else fused(partial(mpi4jax.allreduce, op=ops[kind], comm=self.world), group)
            for kind, group in groups.items()
        }

    def bf16_allreduce_sum(self, x: jax.Array) -> jax.Array:
        """Sum over ranks with bfloat16 on the wire: reduce-scatter then all-gather.

        MPI has no bfloat16 type, so values travel bit-cast to uint16; each rank sums its
        chunk in float32. Bytes sent per rank: 2(n-1)/n x 2 bytes per element, half of a
        float32 ring all-reduce.
        """
        import mpi4jax

        p = self.process_count
        flat = x.reshape(-1)
        pad = (-flat.size) % p
        chunks = jnp.pad(flat, (0, pad)).astype(jnp.bfloat16).reshape(p, -1)
        as_bits = partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint16)
        as_bf16 = partial(jax.lax.bitcast_convert_type, new_dtype=jnp.bfloat16)
        # Row j of what arrives is rank j's copy of this rank's chunk.
        received = mpi4jax.alltoall(as_bits(chunks), comm=self.world)
        rows = as_bf16(received).astype(jnp.float32)
        # Explicit adds: XLA:CPU's reduce over a short leading axis was 40x slower here.
        my_sum = functools.reduce(jnp.add, [rows[i] for i in range(p)]).astype(jnp.bfloat16)
        gathered = mpi4jax.allgather(as_bits(my_sum), comm=self.world)
        total = as_bf16(gathered).astype(jnp.float32).reshape(-1)
        return total[: flat.size].reshape(x.shape)

    def compose(
        self,
        grads_stage: GradsStage,
        update_stage: UpdateStage,
        compiler_options: dict[str, str] | None = None,
    ) -> Callable:
        """The local ``shard_map`` stage (one jit over this process's devices), the MPI stage
        (:meth:`_average_across`), then the update (one jit over this process's devices; the
        train state buffers are donated)."""
        grads_jit = jax.jit(grads_stage, compiler_options=compiler_options)
        wire = None if self.grad_dtype == "float32" else DTYPES[self.grad_dtype]
        update_jit = jax.jit(update_stage, donate_argnums=0)

        def step(state: PyTree, batch: PyTree) -> tuple[PyTree, PyTree]:
            mesh = jax.tree.leaves(batch)[0].sharding.mesh
            grads, stats, metrics = grads_jit(state, batch)
            grads, stats, metrics = self._average_across(grads, stats, metrics, mesh, wire)
            return update_jit(state, grads, stats, metrics)

        return step

    def _average_across(
        self, grads: PyTree, stats: PyTree, metrics: PyTree, mesh: Mesh, wire: Any
    ) -> tuple[PyTree, PyTree, PyTree]:
        """The processes' means of the gradients, model state and metrics, on this process's
        devices as they came: each distinct slice of the gradients (one per device under a
        split layout, one copy of a replicated array) averaged in a jit on the device holding
        it, the model state and metric terms with the first device's; one MPI call per dtype
        and device. The devices go in the same order on every process, each waited for before
        the next starts, so every process makes its MPI calls in the same order."""
        leaves, treedef = jax.tree.flatten(grads)
        held: dict[Any, list[tuple[int, Any]]] = {}  # device -> (leaf, its distinct shard)
        for i, x in enumerate(leaves):
            for shard in x.addressable_shards:
                if shard.replica_id == 0:
                    held.setdefault(shard.device, []).append((i, shard))
        rest_in = one_device((stats, metrics))  # replicated: the first device's copies
        first = jax.tree.leaves(rest_in)[0].devices().pop()
        devices = sorted(held.keys() | {first}, key=lambda d: (d != first, d.id))
        averaged: dict[tuple[int, Any], jax.Array] = {}
        rest = None
        for n, device in enumerate(devices):
            items = held.get(device, [])
            mine = [shard.data for _, shard in items]
            if device == first:
                mine, rest = self._mean_with_rest(mine, rest_in, wire)
            else:
                mine = self._mean_jit(mine, wire)
            if n < len(devices) - 1:
                jax.block_until_ready(mine)
            for (i, shard), x in zip(items, mine, strict=True):
                averaged[(i, _index_key(shard.index))] = x
        out = []
        for i, x in enumerate(leaves):
            parts = [
                jax.device_put(averaged[(i, _index_key(s.index))], s.device)
                for s in x.addressable_shards
            ]
            out.append(jax.make_array_from_single_device_arrays(x.shape, x.sharding, parts))
        stats, metrics = jax.device_put(rest, replicated(mesh))
        return jax.tree.unflatten(treedef, out), stats, metrics

    @functools.cached_property
    def _mean_jit(self) -> Callable:
        return jax.jit(self._allreduce_mean, static_argnums=1)

    @functools.cached_property
    def _mean_with_rest(self) -> Callable:
        def mean_with_rest(grads: list, rest: tuple, wire: Any) -> tuple[list, tuple]:
            stats, metrics = rest
            terms = weighted.split(metrics)  # means with the model state, in one call
            stats, terms["mean"] = self._allreduce_mean((stats, terms.get("mean", {})))
            metrics = weighted.merge(self._allreduce_others(terms))
            return self._allreduce_mean(grads, wire), (stats, metrics)

        return jax.jit(mean_with_rest, static_argnums=2)

    def sum_across_processes(self, values: dict[str, float]) -> dict[str, float]:
        """Totals over all ranks (mpi4py, on the host)."""
        ops = {"max": self._MPI.MAX, "min": self._MPI.MIN}
        return {
            k: self.world.allreduce(
                weighted.host_number(v), op=ops.get(weighted.reduction_of(k), self._MPI.SUM)
            )
            for k, v in values.items()
        }

    def allgather_int(self, value: int) -> list[int]:
        """``value`` from every rank, in rank order."""
        return [int(v) for v in self.world.allgather(int(value))]

    def broadcast_state(self, state: PyTree, mesh: Mesh) -> PyTree:
        """Rank 0's initial state on every rank (so replicas start identical by construction)."""
        host = jax.tree.map(lambda x: np.array(x, copy=True, order="C"), to_host(state))
        for leaf in jax.tree.leaves(host):
            self.world.Bcast(leaf, root=0)
        return put_replicated(host, mesh)

    def barrier(self) -> None:
        """Wait for every rank."""
        self.world.Barrier()

    def meet(self, mesh: Mesh) -> None:
        """Nothing to meet: the processes' collectives are MPI's, connected at ``MPI_Init``."""
