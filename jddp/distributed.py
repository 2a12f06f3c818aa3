"""Process setup: join the job's processes with ``jax.distributed`` (or not, for one process).

Where the process group comes from, first match wins:

1. explicit ``dist.coordinator_address`` / ``dist.num_processes`` / ``dist.process_id``;
2. the variables ``python -m jddp.launch`` sets (``JDDP_COORDINATOR_ADDRESS``,
   ``JDDP_NUM_PROCESSES``, ``JDDP_PROCESS_ID``) or JAX's own (``JAX_COORDINATOR_ADDRESS``,
   ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``);
3. torchrun-style variables (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``; what
   ``torchrun`` and Kubeflow's PyTorchJob set): the coordinator is ``MASTER_ADDR`` at
   ``MASTER_PORT`` (plus one under ``torchrun``, whose agent's store holds ``MASTER_PORT``);
   with ``LOCAL_WORLD_SIZE`` > 1 (a process per GPU) each process takes its ``LOCAL_RANK``'th
   GPU;
4. a SLURM job step with several tasks: JAX's cluster detection;
5. SkyPilot (``SKYPILOT_NODE_RANK``, ``SKYPILOT_NODE_IPS``, ``SKYPILOT_NUM_NODES``; one process
   per node): the coordinator is the first node at ``JDDP_COORDINATOR_PORT`` (default
   :data:`DEFAULT_COORDINATOR_PORT`);
6. ``mpirun`` of Open MPI: JAX's cluster detection; ``mpirun`` of MPICH (``PMI_SIZE``): JAX's
   ``mpi4py`` cluster detection;
7. otherwise a single process: nothing to do.

Variables of a launcher that contradict each other (a rank outside the world, a missing
address) are a :class:`~jddp.errors.ConfigError` naming them.

With ``dist.backend=mpi`` processes do not share a JAX runtime (MPI carries the gradients), so
none of this runs. On CPU the cross-process collectives use gloo.
"""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import jax

from jddp.config import DistConfig
from jddp.errors import ConfigError
from jddp.proc import outputs


@dataclass(frozen=True)
class Launch:
    """How this process was started: the ``jax.distributed.initialize`` arguments to use."""

    # "single", "explicit", "torchrun", "skypilot", "slurm", "ompi", "mpich", "mpi" (the MPI
    # backend), "jax.distributed" (joined before jddp looked, e.g. by a library user)
    kind: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None  # the GPUs this process takes (per-GPU)


DEFAULT_COORDINATOR_PORT = 8476
"""The coordinator's port where a launcher names only hosts (SkyPilot); ``JDDP_COORDINATOR_PORT``
sets another."""


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ConfigError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from None
    return None


def _env_str(*names: str) -> str | None:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return None


MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


def require_mpi_launch() -> None:
    """``ConfigError`` unless this process was started by ``mpirun`` and mpi4py/mpi4jax import."""
    if not any(v in os.environ for v in MPI_RANK_VARIABLES):
        if "SLURM_PROCID" in os.environ:  # srun without a PMI plugin: MPI sees no peers
            how = "under SLURM run it as 'srun --mpi=pmi2 ... python -m jddp.train ..."
            other = "dist.backend=xla, which srun alone starts"
        else:
            how = "run it as 'mpirun -np N python -m jddp.train ..."
            other = "dist.backend=xla with python -m jddp.launch"
        raise ConfigError(
            f"dist.backend=mpi needs an MPI launch: {how} dist.backend=mpi' (or use {other})"
        )
    try:
        import mpi4jax  # noqa: F401
        import mpi4py  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"dist.backend=mpi needs mpi4py and mpi4jax ({e}); install them with "
            "'bash scripts/setup.sh', or use dist.backend=xla"
        ) from None


def mpi_world() -> Any:
    """MPI's ``COMM_WORLD`` (importing mpi4py initialises MPI once per process)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def detect_launch(cfg: DistConfig) -> Launch:
    """Work out from ``cfg`` and the environment how this process should join the job."""
    address = cfg.coordinator_address or _env_str(
        "JDDP_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS"
    )
    num = cfg.num_processes or _env_int("JDDP_NUM_PROCESSES", "JAX_NUM_PROCESSES")
    pid = (
        cfg.process_id
        if cfg.process_id is not None
        else _env_int("JDDP_PROCESS_ID", "JAX_PROCESS_ID")
    )
    if address is not None or num is not None or pid is not None:
        missing = [
            k
            for k, v in (
                ("dist.coordinator_address", address),
                ("dist.num_processes", num),
                ("dist.process_id", pid),
            )
            if v is None
        ]
        if missing:
            raise ConfigError(
                f"{', '.join(missing)} must be set too: an explicit launch needs "
                "dist.coordinator_address, dist.num_processes and dist.process_id"
            )
        if not 0 <= pid < num:
            raise ConfigError(f"dist.process_id={pid} is not in [0, dist.num_processes={num})")
        return Launch("explicit", address, num, pid)
    torchrun = _torchrun_launch()
    if torchrun is not None:
        return torchrun
    if (_env_int("SLURM_NTASKS", "SLURM_NPROCS") or 1) > 1 and "SLURM_PROCID" in os.environ:
        return Launch("slurm")
    skypilot = _skypilot_launch()
    if skypilot is not None:
        return skypilot
    if (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return Launch("ompi")
    if (_env_int("PMI_SIZE") or 1) > 1:
        return Launch("mpich")
    return Launch("single")


TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
SKYPILOT_VARIABLES = ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_NODES")


def _inconsistent(launcher: str, problem: str) -> ConfigError:
    return ConfigError(f"{launcher} launch: {problem}")


def _torchrun_launch() -> Launch | None:
    """The job ``torchrun`` or a PyTorchJob describes, if ``WORLD_SIZE``/``RANK`` are set."""
    if "WORLD_SIZE" not in os.environ and "RANK" not in os.environ:
        return None
    values = {name: os.environ.get(name) or None for name in TORCHRUN_VARIABLES}
    missing = [name for name, value in values.items() if value is None]
    if missing:
        given = ", ".join(f"{n}={v}" for n, v in values.items() if v is not None)
        raise _inconsistent(
            "torchrun-style", f"{given} set but not {', '.join(missing)}: all four are needed"
        )
    world, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
    port = _env_int("MASTER_PORT")
    if world < 1 or not 0 <= rank < world:
        raise _inconsistent("torchrun-style", f"RANK={rank} is not in [0, WORLD_SIZE={world})")
    if not 0 < port < 65535:
        raise _inconsistent("torchrun-style", f"MASTER_PORT={port} is not a port number")
    if world == 1:
        return None
    local_world = _env_int("LOCAL_WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK")
    devices = None
    # a process per GPU, each seeing them all (none hidden by CUDA_VISIBLE_DEVICES): take one
    if local_world is not None and local_world > 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
        if local_rank is None or not 0 <= local_rank < local_world:
            raise _inconsistent(
                "torchrun-style",
                f"LOCAL_RANK={local_rank} is not in [0, LOCAL_WORLD_SIZE={local_world})",
            )
        if world % local_world:
            raise _inconsistent(
                "torchrun-style",
                f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}",
            )
        devices = (local_rank,)
    # torchrun's agent serves its rendezvous store on MASTER_PORT: the coordinator takes the next
    if "TORCHELASTIC_RUN_ID" in os.environ:
        port += 1
    return Launch("torchrun", f"{values['MASTER_ADDR']}:{port}", world, rank, devices)


def _skypilot_launch() -> Launch | None:
    """The job SkyPilot describes (one process per node), if ``SKYPILOT_NODE_RANK`` is set."""
    if "SKYPILOT_NODE_RANK" not in os.environ:
        return None
    rank = _env_int("SKYPILOT_NODE_RANK")
    ips = (os.environ.get("SKYPILOT_NODE_IPS") or "").split()
    nodes = _env_int("SKYPILOT_NUM_NODES") or len(ips)
    if not ips:
        raise _inconsistent("SkyPilot", f"SKYPILOT_NODE_RANK={rank} set but no SKYPILOT_NODE_IPS")
    if nodes != len(ips):
        raise _inconsistent(
            "SkyPilot", f"SKYPILOT_NUM_NODES={nodes} but SKYPILOT_NODE_IPS lists {len(ips)} nodes"
        )
    if not 0 <= rank < nodes:
        raise _inconsistent("SkyPilot", f"SKYPILOT_NODE_RANK={rank} is not in [0, {nodes})")
    if nodes == 1:
        return None
    port = _env_int("JDDP_COORDINATOR_PORT") or DEFAULT_COORDINATOR_PORT
    return Launch("skypilot", f"{ips[0]}:{port}", nodes, rank)


_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HTTP2_SETTINGS = 0x4  # frame type of the server's first frame
_EMPTY_SETTINGS_FRAME = bytes([0, 0, 0, _HTTP2_SETTINGS, 0, 0, 0, 0, 0])
_PROBE_TIMEOUT_S = 10.0  # how long a connected coordinator may take to send its SETTINGS


def _answers_http2(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the server on ``sock`` speaks HTTP/2, as the gRPC server of JAX's coordination
    service does: send the client connection preface, and the reply must start with a SETTINGS
    frame (9-byte header: 24-bit length, type 0x4, flags without ACK, stream 0)."""
    sock.settimeout(timeout_s)
    try:
        sock.sendall(_HTTP2_PREFACE + _EMPTY_SETTINGS_FRAME)
        header = b""
        while len(header) < 9:
            chunk = sock.recv(9 - len(header))
            if not chunk:  # closed without a frame
                return False
            header += chunk
    except OSError:  # reset, or nothing within timeout_s
        return False
    length = int.from_bytes(header[:3], "big")
    stream = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
    return header[3] == _HTTP2_SETTINGS and not header[4] & 0x1 and stream == 0 and length % 6 == 0


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Return once a JAX coordinator answers at ``address``, or raise after ``timeout_s``.

    JAX's own client aborts the whole process (no Python exception) when the coordinator
    cannot be reached or is something else; probing first turns that into a clear, catchable
    error: ``RuntimeError`` when nothing accepts TCP connections there in time,
    :class:`ConfigError` when something does but does not answer HTTP/2 (gRPC).
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]") or "localhost", int(port)), 2.0) as s:
                probe_s = min(_PROBE_TIMEOUT_S, max(1.0, deadline - time.monotonic()))
                if _answers_http2(s, probe_s):
                    return
                raise ConfigError(
                    f"dist.coordinator_address={address}: something accepts TCP connections "
                    f"there but it is not a JAX coordinator (no HTTP/2 reply within "
                    f"{probe_s:g} s); give process 0's host:port"
                )
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"could not reach the coordinator at {address} within {timeout_s:g} s "
                    f"(dist.init_timeout_s): {e.strerror or e}; is process 0 running there?"
                ) from None
            time.sleep(0.25)


@dataclass(frozen=True)
class Job:
    """Who this process is in the job: the one owner of process identity.

    ``process_index``/``process_count`` count the job's processes: JAX's under
    ``jax.distributed``, the MPI rank and world size under ``dist.backend=mpi`` (processes then
    share no JAX runtime). Process 0 is the writer: it prints and writes the run's outputs.
    """

    launch: Launch
    process_index: int = 0
    process_count: int = 1

    @property
    def is_writer(self) -> bool:
        """Only process 0 prints and writes run outputs."""
        return self.process_index == 0

    @property
    def uses_mpi(self) -> bool:
        """Whether gradients cross processes over MPI (``dist.backend=mpi``)."""
        return self.launch.kind == "mpi"


def current_job(cfg: DistConfig) -> Job:
    """The :class:`Job` of this process as it runs now (after :func:`initialize`, or a single
    process that never needed it); reads the runtime, stores nothing."""
    if cfg.backend == "mpi":
        world = mpi_world()
        rank, size = world.Get_rank(), world.Get_size()
        return Job(Launch("mpi", num_processes=size, process_id=rank), rank, size)
    kind = "single" if jax.process_count() == 1 else "jax.distributed"
    return Job(Launch(kind), jax.process_index(), jax.process_count())


HEARTBEAT_AFTER_WATCHDOG_S = 60  # the watchdog's line and its grace come before the heartbeat
HEARTBEAT_WITHOUT_WATCHDOG_S = 100


def heartbeat_timeout_s(cfg: DistConfig) -> int:
    """``dist.heartbeat_timeout_s``, or its default: a minute past the watchdog's longer limit
    (``dist.step_timeout_s``, ``dist.first_step_timeout_s``), so that when a rank hangs (SIGSTOP,
    a wedged device) — while compiling as well as mid-run — its peers' watchdogs say so in one
    line and exit 124 before JAX's heartbeat ends every process with a dump (it came first
    before the first step: 660 s < 1,800 s). 100 s without a step timeout: nothing else would
    find a hung rank after the first step. (A rank that dies under ``jddp.launch``, torchrun or
    ``srun --kill-on-bad-exit`` takes the job down at once; among plain processes the peers'
    watchdogs or the heartbeat end it.)"""
    if cfg.heartbeat_timeout_s is not None:
        return int(cfg.heartbeat_timeout_s)
    if cfg.step_timeout_s is None:
        return HEARTBEAT_WITHOUT_WATCHDOG_S
    longest = max(cfg.step_timeout_s, cfg.first_step_timeout_s or 0)
    return int(math.ceil(longest)) + HEARTBEAT_AFTER_WATCHDOG_S


def initialize(cfg: DistConfig) -> Job:
    """Join the distributed job if this process is part of one; returns this process's Job.

    Under ``dist.backend=mpi`` nothing joins (MPI carries the gradients); the launch is checked
    (:func:`require_mpi_launch`) and the rank and size are read from MPI.
    """
    if cfg.backend == "mpi":
        require_mpi_launch()
        return current_job(cfg)
    launch = detect_launch(cfg)
    if launch.kind == "single":
        return Job(launch)
    # Harmless on GPU machines: only the CPU client reads it. Must precede backend creation.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service installs its own SIGTERM handler as the job joins (TSL's
    # preemption notifier), which took a SIGTERM that arrived before jddp's handler was back
    # (logged by JAX, the run trained on). jddp's stop signals ride in the batches instead
    # (jddp.proc.signals): JAX's service stays off.
    jax.config.update("jax_enable_preemption_service", False)
    kwargs = dict(
        initialization_timeout=cfg.init_timeout_s,
        heartbeat_timeout_seconds=heartbeat_timeout_s(cfg),
    )
    if launch.coordinator_address is not None:  # explicit, torchrun-style, SkyPilot
        if launch.process_id != 0:
            wait_for_coordinator(launch.coordinator_address, cfg.init_timeout_s)
        if launch.local_device_ids is not None:
            kwargs["local_device_ids"] = list(launch.local_device_ids)
        jax.distributed.initialize(
            launch.coordinator_address, launch.num_processes, launch.process_id, **kwargs
        )
    elif launch.kind == "mpich":
        jax.distributed.initialize(cluster_detection_method="mpi4py", **kwargs)
    else:
        jax.distributed.initialize(**kwargs)
    return Job(launch, jax.process_index(), jax.process_count())


LAUNCHERS = {  # Launch.kind -> who said this process is one of several
    "explicit": "dist.num_processes, JDDP_NUM_PROCESSES (python -m jddp.launch, jddp.ray) or "
    "JAX_NUM_PROCESSES",
    "torchrun": "torchrun's WORLD_SIZE",
    "skypilot": "SkyPilot's SKYPILOT_NUM_NODES",
    "slurm": "SLURM's job step",
    "ompi": "Open MPI's mpirun",
    "mpich": "MPICH's mpirun",
}


def join_if_launched(cfg: DistConfig, caller: str = "jddp.fit") -> None:
    """For a library call that trains (``caller``) in a script: when a launcher started this
    process as one of several and the script has not joined the job (:func:`initialize`, which
    ``jddp.initialize()`` calls), join it now if JAX's backend has not started yet; if it has,
    JAX runs as a single process and cannot join any more (each rank would train alone, and the
    second would stop on the workdir lock): a :class:`~jddp.errors.ConfigError` saying what to
    call first. Nothing under ``dist.backend=mpi`` or for a single process."""
    from jddp.compat.jax_backend import backend_started

    if cfg.backend == "mpi" or jax.distributed.is_initialized():
        return
    launch = detect_launch(cfg)
    if launch.kind == "single":
        return
    if not backend_started():
        initialize(cfg)
        return
    size = f"{launch.num_processes} processes" if launch.num_processes else "several processes"
    said = LAUNCHERS.get(launch.kind, launch.kind)
    raise ConfigError(
        f"{caller}: this process is one of a job of {size} ({said}), "
        "but JAX started as a single process before the job was joined: call "
        "jddp.initialize() first in the script, before building the model or touching any "
        "JAX array (jax.devices() too)"
    )


def abort_job(job: Job, exit_code: int) -> None:
    """Under the MPI backend, take every rank down with this one (a lone failure would leave
    the others blocked in their next collective). Elsewhere a no-op: ``jax.distributed``'s
    heartbeats and ``jddp.launch`` stop the peers."""
    if job.uses_mpi and job.process_count > 1:
        # mpiexec exits at the abort: the line this rank just printed must reach it first.
        outputs.wait_until_read()
        mpi_world().Abort(exit_code)
