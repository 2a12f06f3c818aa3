"""One rank of a ``jddp-mpi`` group, started by ``mpirun``: pin and choose GPUs by rank before
jax loads, run :func:`.jddp_worker.worker_jddp`, abort the whole MPI job on any failure."""

from __future__ import annotations

import os
import sys
import traceback

from .jddp_worker import worker_jddp

MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")  # as jddp.comm's


def mpi_worker_main(spec: dict) -> int:
    """One rank of a ``jddp-mpi`` group under ``mpirun``. Before jax loads: pin (``-pin``: rank
    i to CPU i) and, on GPUs, choose this rank's devices. Only rank 0 keeps stdout (the reply
    channel); any exception in any rank aborts the whole MPI job, so no rank waits forever in a
    collective and ``mpirun`` exits with the traceback in its log."""
    rank = next((int(os.environ[v]) for v in MPI_RANK_VARIABLES if v in os.environ), None)
    if rank is None:
        print("jddp-mpi worker: no MPI rank in the environment (run by mpirun)", file=sys.stderr)
        return 2
    if rank != 0:
        os.dup2(2, 1)  # other ranks' stray prints go to the log, never between rank 0's replies
    if spec["pin_by_rank"]:
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    if spec["work"]["platform"] == "gpu" and spec["nproc"] > 1:
        first = rank * spec["per_proc"]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(
            map(str, range(first, first + spec["per_proc"]))
        )
    try:
        worker_jddp(spec)
    except BaseException:
        traceback.print_exc()
        print(f"jddp-mpi worker rank {rank} failed: aborting the MPI job", file=sys.stderr)
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
    return 0
