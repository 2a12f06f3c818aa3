"""Gradient averaging backends: where gradients are averaged across devices and processes.

A backend is one swappable piece. The step calls two of its hooks:

* :meth:`Comm.average_grads` / :meth:`Comm.average` run *inside* the ``shard_map`` step and
  average over the mesh axis ``data`` (``pmean``; NCCL on GPUs, gloo or in-process on CPUs);
* :meth:`Comm.compose` turns the two stages of a step — ``grads_stage`` (per-device
  forward/backward + the averages above) and ``update_stage`` (the optimizer) — into the step.

The loop uses the host-side hooks (process rank, eval sums, barriers, config and replica
checks), so it never asks which backend it runs on.

``xla``: the mesh spans every device of every process (``jax.distributed``), so ``pmean`` is
already the global mean and both stages fuse into one jitted program.

``mpi``: processes share no JAX runtime. The mesh holds this process's devices; ``pmean``
averages over them, then each gradient leaf is summed across processes with
``mpi4jax.allreduce`` in a jit over one device (mpi4jax cannot run inside ``shard_map`` or on
multi-device arrays), the identical update is applied on every process, and the new state is
copied back to all local devices.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jddp.errors import ConfigError
from jddp.mesh import DATA_AXIS, put_replicated, replicated, to_host

PyTree = Any
GradsStage = Callable[[PyTree, PyTree], tuple[PyTree, ...]]
UpdateStage = Callable[..., tuple[PyTree, PyTree]]
WIRE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _cast_floats(tree: PyTree, dtype: Any) -> PyTree:
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def allreduce_bytes(grads: PyTree, wire_dtype: str) -> int:
    """Bytes of one gradient all-reduce payload when sent as ``wire_dtype``."""
    itemsize = jnp.dtype(WIRE_DTYPES[wire_dtype]).itemsize
    return sum(int(np.prod(x.shape)) * itemsize for x in jax.tree.leaves(grads))


def config_fingerprint(config: dict[str, Any]) -> int:
    """A 63-bit hash of a config dict, equal on every process that was given the same config."""
    text = json.dumps(config, sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


class XlaComm:
    """All devices of all processes in one XLA program; ``pmean`` over ``data`` averages.

    ``grad_dtype`` is the wire dtype of the gradient all-reduce (``bfloat16`` halves the bytes).
    """

    name = "xla"

    def __init__(self, grad_dtype: str = "float32"):
        self.grad_dtype = grad_dtype
        self.process_index = jax.process_index()
        self.process_count = jax.process_count()

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this process calls orbax's save: all of them under ``jax.distributed``
        (orbax makes process 0 the primary host)."""
        return True

    # -- inside the step --------------------------------------------------------------------
    def average(self, tree: PyTree) -> PyTree:
        """``pmean`` over the ``data`` mesh axis (every device of every process)."""
        return jax.lax.pmean(tree, DATA_AXIS)

    def device_index(self) -> jax.Array:
        """This device's index among all devices of the job (inside the step)."""
        return jax.lax.axis_index(DATA_AXIS)

    def average_grads(self, grads: PyTree) -> PyTree:
        """The gradient mean, sent in ``grad_dtype`` and returned in the gradients' dtype."""
        if self.grad_dtype == "float32":
            return self.average(grads)
        wire = WIRE_DTYPES[self.grad_dtype]
        return jax.tree.map(lambda g: self.average(g.astype(wire)).astype(g.dtype), grads)

    def compose(self, grads_stage: GradsStage, update_stage: UpdateStage) -> Callable:
        """One jitted program; the train state buffers are donated."""

        def step(state: PyTree, batch: PyTree) -> tuple[PyTree, PyTree]:
            return update_stage(state, *grads_stage(state, batch))

        return jax.jit(step, donate_argnums=0)

    # -- host side --------------------------------------------------------------------------
    def sum_across_processes(self, values: dict[str, float]) -> dict[str, float]:
        """Host totals: eval sums are already global under ``xla``."""
        return values

    def allgather_int(self, value: int) -> list[int]:
        """``value`` from every process, in rank order."""
        if self.process_count == 1:
            return [value]
        from jax.experimental import multihost_utils

        got = multihost_utils.process_allgather(np.array([value], np.int64))
        return [int(v) for v in np.asarray(got).reshape(-1)]

    def broadcast_state(self, state: PyTree, mesh: Mesh) -> PyTree:
        """Replicas are one global array; every process built the same initial values."""
        return state

    def barrier(self) -> None:
        """Wait for every process."""
        if self.process_count > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jddp")


class MpiComm(XlaComm):
    """Hierarchical averaging: ``pmean`` over local devices, ``mpi4jax.allreduce`` across."""

    name = "mpi"

    def __init__(self, grad_dtype: str = "float32"):
        super().__init__(grad_dtype)
        from mpi4py import MPI

        self._MPI = MPI
        self.world = MPI.COMM_WORLD
        self.process_index = self.world.Get_rank()
        self.process_count = self.world.Get_size()

    @property
    def writes_checkpoints(self) -> bool:
        """Rank 0 alone: without a shared JAX runtime every rank would act as orbax's primary
        host; the others only restore (the directory must be shared)."""
        return self.process_index == 0

    def device_index(self) -> jax.Array:
        """Rank-major index over every rank's local devices (inside the local step)."""
        local = jax.lax.axis_index(DATA_AXIS)
        return self.process_index * jax.lax.psum(1, DATA_AXIS) + local

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

        return jax.tree.map(reduce, tree)

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

    def compose(self, grads_stage: GradsStage, update_stage: UpdateStage) -> Callable:
        """Local shard_map stage, then one single-device jit that all-reduces and updates."""
        grads_jit = jax.jit(grads_stage)
        wire = None if self.grad_dtype == "float32" else WIRE_DTYPES[self.grad_dtype]

        def reduce_and_update(state, grads, stats, metrics):
            grads = self._allreduce_mean(grads, wire)
            stats, metrics = self._allreduce_mean((stats, metrics))
            return update_stage(state, grads, stats, metrics)

        update_jit = jax.jit(reduce_and_update)

        def one_device(tree: PyTree) -> PyTree:
            return jax.tree.map(lambda x: x.addressable_data(0), tree)

        def step(state: PyTree, batch: PyTree) -> tuple[PyTree, PyTree]:
            mesh = batch["images"].sharding.mesh
            grads, stats, metrics = grads_jit(state, batch)
            new_state, metrics = update_jit(
                one_device(state), one_device(grads), one_device(stats), one_device(metrics)
            )
            return jax.device_put(new_state, replicated(mesh)), metrics

        return step

    def sum_across_processes(self, values: dict[str, float]) -> dict[str, float]:
        """Totals over all ranks (mpi4py, on the host)."""
        return {k: self.world.allreduce(float(v)) for k, v in values.items()}

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


MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


def make_comm(backend: str, grad_dtype: str = "float32") -> XlaComm:
    """The backend named by ``dist.backend``; ``ConfigError`` if ``mpi`` cannot work here."""
    if backend == "xla":
        return XlaComm(grad_dtype)
    if backend != "mpi":
        raise ConfigError(f"dist.backend: {backend!r} is not available; choose xla or mpi")
    if not any(v in os.environ for v in MPI_RANK_VARIABLES):
        raise ConfigError(
            "dist.backend=mpi needs an MPI launch: run it as "
            "'mpirun -np N python -m jddp.train ... dist.backend=mpi' "
            "(or use dist.backend=xla with python -m jddp.launch)"
        )
    try:
        import mpi4jax  # noqa: F401
        import mpi4py  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"dist.backend=mpi needs mpi4py and mpi4jax ({e}); install them with "
            "'bash scripts/setup.sh', or use dist.backend=xla"
        ) from None
    return MpiComm(grad_dtype)
