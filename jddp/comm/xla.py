"""``xla``: every device of every process in one XLA program; ``pmean`` averages (NCCL on GPUs,
gloo or in-process on CPUs)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp.comm.base import Comm, GradsStage, PyTree, UpdateStage
from jddp.config import DistConfig
from jddp.distributed import Job, current_job
from jddp.mesh import DATA_AXES, DTYPES


class XlaComm(Comm):
    """All devices of all processes in one XLA program; ``pmean`` over ``data`` averages.

    ``pmean`` is the global mean: the mesh spans every device of every process
    (``jax.distributed``), so both stages of the step fuse into one jitted program.
    """

    name = "xla"

    @staticmethod
    def current_job() -> Job:
        """JAX's processes (one, or those joined by ``jax.distributed``)."""
        return current_job(DistConfig(backend="xla"))

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this process calls orbax's save: all of them under ``jax.distributed``
        (orbax makes process 0 the primary host)."""
        return True

    # -- inside the step --------------------------------------------------------------------
    def device_index(self) -> jax.Array:
        """This device's index among all devices of the job (inside the step)."""
        return jax.lax.axis_index(DATA_AXES)

    def average_grads(self, grads: PyTree) -> PyTree:
        """The gradient mean, sent in ``grad_dtype`` and returned in the gradients' dtype."""
        if self.grad_dtype == "float32":
            return self.average(grads)
        wire = DTYPES[self.grad_dtype]
        sent = self.average(jax.tree.map(lambda g: g.astype(wire), grads))
        return jax.tree.map(lambda m, g: m.astype(g.dtype), sent, grads)

    def compose(
        self,
        grads_stage: GradsStage,
        update_stage: UpdateStage,
        compiler_options: dict[str, str] | None = None,
    ) -> Callable:
        """One jitted program (with ``compiler_options``); the train state buffers are
        donated."""

        def step(state: PyTree, batch: PyTree) -> tuple[PyTree, PyTree]:
            return update_stage(state, *grads_stage(state, batch))

        return jax.jit(step, donate_argnums=0, compiler_options=compiler_options)

    # -- host side --------------------------------------------------------------------------
    def sum_across_processes(self, values: dict[str, float]) -> dict[str, float]:
        """Host totals: eval sums are already global under ``xla``."""
        return values

    def allgather_int(self, value: int) -> list[int]:
        """``value`` from every process, in rank order."""
        if self.process_count == 1:
            return [value]
        got = multihost_utils.process_allgather(np.array([value], np.int64))
        return [int(v) for v in np.asarray(got).reshape(-1)]

    def broadcast_state(self, state: PyTree, mesh: Mesh) -> PyTree:
        """Replicas are one global array; every process built the same initial values."""
        return state

    def barrier(self) -> None:
        """Wait for every process."""
        if self.process_count > 1:
            multihost_utils.sync_global_devices("jddp")

    def meet(self, mesh: Mesh) -> None:
        """One tiny all-reduce over ``mesh``'s devices, before any step compiles.

        On CPUs each new set of devices in a collective first meets in a gloo rendezvous that
        waits 30 s for the last process (hard-coded in gloo, not settable from JAX); once met,
        an all-reduce waits up to 30 min. A step's first run comes after its compile, which
        can end 30 s later on one process than on another (a loaded machine; a compilation
        cache hit on one process only): that killed jobs with "Gloo context initialization
        failed: ... GetKeyValue() timed out". Meeting here, where the processes are in step,
        leaves the compile skew to the 30 min wait."""
        if self.process_count == 1 or jax.default_backend() != "cpu":
            return
        ones = jax.make_array_from_callback(
            (mesh.size,), NamedSharding(mesh, P(DATA_AXES)), lambda _: np.ones(1, np.int32)
        )
        psum = jax.shard_map(
            lambda x: jax.lax.psum(x, DATA_AXES), mesh=mesh, in_specs=P(DATA_AXES), out_specs=P()
        )
        jax.block_until_ready(jax.jit(psum)(ones))
