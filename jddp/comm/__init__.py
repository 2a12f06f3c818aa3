"""Gradient averaging backends: where gradients are averaged across devices and processes.

A backend is one swappable piece. The step calls two of its hooks:

* :meth:`Comm.average_grads` / :meth:`Comm.average` run *inside* the ``shard_map`` step and
  average over the mesh axis ``data`` (``pmean``; NCCL on GPUs, gloo or in-process on CPUs);
* :meth:`Comm.compose` turns the two stages of a step — ``grads_stage`` (per-device
  forward/backward + the averages above) and ``update_stage`` (the optimizer) — into the step.

The loop uses the host-side hooks (process rank, eval sums, barriers, config and replica
checks), so it never asks which backend it runs on.

``xla`` (:mod:`jddp.comm.xla`): one XLA program over every device of every process.
``mpi`` (:mod:`jddp.comm.mpi`): ``pmean`` over local devices, then ``mpi4jax`` across processes.
"""

from __future__ import annotations

from jddp.comm.base import Comm, allreduce_bytes, config_fingerprint
from jddp.comm.mpi import MpiComm  # needs no mpi4py until an MpiComm is made
from jddp.comm.xla import XlaComm
from jddp.distributed import Job, require_mpi_launch
from jddp.errors import ConfigError

__all__ = [
    "Comm",
    "MpiComm",
    "XlaComm",
    "allreduce_bytes",
    "config_fingerprint",
    "make_comm",
]


def make_comm(
    job: Job, backend: str, grad_dtype: str = "float32", fuse: bool | None = None
) -> Comm:
    """The backend named by ``dist.backend`` for ``job`` (from ``distributed.initialize``);
    ``grad_dtype`` and ``fuse`` are ``dist.grad_allreduce_dtype`` and ``dist.fuse_allreduce``."""
    if backend == "xla":
        return XlaComm(grad_dtype, job, fuse)
    if backend != "mpi":
        raise ConfigError(f"dist.backend: {backend!r} is not available; choose xla or mpi")
    require_mpi_launch()
    return MpiComm(grad_dtype, job, fuse)
