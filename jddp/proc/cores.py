"""The cores this process owns, as its launcher says, and pinning it to them on CPU.

A machine's cores are divided among the job's processes on it: ``jddp.launch``/``jddp.ray``
(``JDDP_LOCAL_WORLD_SIZE``), torchrun (``LOCAL_WORLD_SIZE``), mpirun, or a SLURM step's tasks on
this node (at most ``--cpus-per-task`` each). XLA:CPU sizes its compute (Eigen) thread pool from
the process's CPU affinity and has no flag for the size (jaxlib 0.10.2), so on CPU
:func:`size_cpu_threads` narrows the affinity to the process's share before XLA starts; the
input workers take the same share (:func:`cores_per_process`).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping

GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm70_plugin")
CPU_THREADS_VAR = "JDDP_CPU_THREADS"  # set once jddp has sized this process (size_cpu_threads)


# processes on this machine: jddp.launch and jddp.ray, torchrun, Open MPI, MPICH
_LOCAL_SIZE_VARS = (
    "JDDP_LOCAL_WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
)


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list in order: ``"node[01-03,07],gpu5"`` is ``node01, node02,
    node03, node07, gpu5``; ranges keep their zero padding, several bracket groups in one name
    (``"r[1-2]n[1-2]"``) multiply out. A malformed list gives ``[]``."""
    names: list[str] = []
    for part in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):
        expansions = [""]
        for text, group in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            choices = [""]
            if group:
                choices = []
                for item in group.split(","):
                    low, _, high = item.partition("-")
                    if not low.isdigit() or (high and not high.isdigit()):
                        return []
                    last = int(high) if high else int(low)
                    choices += [str(n).zfill(len(low)) for n in range(int(low), last + 1)]
            expansions = [e + text + c for e in expansions for c in choices]
        names += expansions
    return names


def slurm_step_tasks_here(environ: Mapping[str, str] | None = None) -> int | None:
    """Tasks of this SLURM job step on this node, or None outside a step.

    ``srun`` writes them per node of the *step* in ``SLURM_STEP_TASKS_PER_NODE`` ("2",
    "4(x2),3": two nodes of 4 then one of 3), in the order of ``SLURM_STEP_NODELIST``; this
    node is ``SLURMD_NODENAME`` there. (``SLURM_NODEID`` counts the *job's* nodes: a step on
    some of them only, e.g. ``srun -N2 -w node[3-4]`` in a 4-node job, would read another
    node's count; it is used only where the step's node list does not name this node.)
    ``SLURM_NTASKS_PER_NODE`` is set only when the job asked ``--ntasks-per-node``. The batch
    script itself (no step) gets None: it is one process whatever the job's task count."""
    env = os.environ if environ is None else environ
    counts: list[int] = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", "").split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            counts = []
            break
        counts += [int(match[1])] * int(match[2] or 1)
    nodes = expand_hostlist(env.get("SLURM_STEP_NODELIST", ""))
    here = env.get("SLURMD_NODENAME")
    if counts and here in nodes and len(nodes) == len(counts):
        return counts[nodes.index(here)]
    node = env.get("SLURM_NODEID", "0")
    if counts and node.isdigit() and int(node) < len(counts):
        return counts[int(node)]
    if "SLURM_STEP_ID" in env:
        text = env.get("SLURM_NTASKS_PER_NODE", "")
        if text.isdigit() and int(text) > 0:
            return int(text)
    return None


def _launcher_local_count() -> int | None:
    """Processes on this machine as jddp.launch, jddp.ray, torchrun or mpirun (also inside
    ``salloc``) say."""
    for var in _LOCAL_SIZE_VARS:
        text = os.environ.get(var, "")
        if text.isdigit() and int(text) > 0:
            return int(text)
    if os.environ.get("JDDP_LOCAL_RANK") is not None:  # an older jddp.launch: one machine
        return max(1, int(os.environ.get("JDDP_NUM_PROCESSES", "1")))
    return None


def cores_per_process() -> int:
    """The cores this process owns: the ones its CPU affinity allows (SLURM, taskset, mpirun
    binding set it), divided among the job's processes on this machine (as jddp.launch, mpirun
    or srun say, else 1); once :func:`size_cpu_threads` has pinned the process,
    the number it pinned."""
    pinned = os.environ.get(CPU_THREADS_VAR, "")
    if pinned.isdigit() and int(pinned) > 0:
        return int(pinned)
    local = _launcher_local_count()
    slurm_tasks = None if local else slurm_step_tasks_here()
    share = max(1, len(os.sched_getaffinity(0)) // (local or slurm_tasks or 1))
    # A task of srun without CPU binding (TaskPlugin=task/none) sees every core of the node in
    # its affinity but owns only --cpus-per-task of them: other jobs may run on the rest.
    allocated = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm_tasks is not None and allocated.isdigit() and int(allocated) > 0:
        share = min(share, int(allocated))
    return share


LOCAL_RANK_VARIABLES = (
    "JDDP_LOCAL_RANK",
    "LOCAL_RANK",  # torchrun's worker (under srun, SLURM_LOCALID is its agent's)
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "PMI_LOCAL_RANK",
)


def _local_rank(environ: dict[str, str]) -> int:
    for name in LOCAL_RANK_VARIABLES:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return 0


def runs_on_cpu(environ: Mapping[str, str]) -> bool:
    """Whether JAX will compute on the CPU: ``JAX_PLATFORMS`` names it first, or no GPU plugin
    is installed."""
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(importlib.util.find_spec(p) for p in GPU_PLUGINS)


def size_cpu_threads(cpu_threads: int | None, environ: dict[str, str] | None = None) -> list[int]:
    """Pin this process to the cores it owns before XLA:CPU starts (its thread pool is sized
    from the affinity); returns the cores pinned to ([] when nothing changed).

    ``cpu_threads`` (``dist.cpu_threads``): how many; None: the affinity divided among the
    machine's processes (:func:`cores_per_process`, which the input workers
    use too). Process ``local_rank`` takes the ``cpu_threads`` cores after those of the ranks
    before it. Nothing changes off CPU, with ``JDDP_XLA_DEFAULTS=0``, or when the process owns
    no more cores than asked (a launcher bound it already).
    """
    env = os.environ if environ is None else environ
    if env.get("JDDP_XLA_DEFAULTS", "1") == "0" or not runs_on_cpu(env):
        return []
    allowed = sorted(os.sched_getaffinity(0))
    wanted = cpu_threads or cores_per_process()
    if wanted >= len(allowed):
        return []
    first = (_local_rank(env) * wanted) % len(allowed)
    cores = [allowed[(first + i) % len(allowed)] for i in range(wanted)]
    os.sched_setaffinity(0, cores)
    env[CPU_THREADS_VAR] = str(wanted)  # the input workers' share: not divided again
    return cores
