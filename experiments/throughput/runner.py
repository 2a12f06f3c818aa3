"""The driver's side of the workers: a :class:`Group` of processes per configuration (or one
``mpirun``), their environment (:func:`worker_env`), and :func:`run_block`, which starts the
groups one at a time and interleaves their timed rounds."""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from . import common
from .specs import NO_YNN_CONV_XLA_FLAG, ONE_THREAD_XLA_FLAGS, GroupSpec

REPLY_TIMEOUT_S = 900


class Group:
    """The running processes of one :class:`GroupSpec`, talking over pipes.

    One pipe pair per process, or for a ``jddp-mpi`` group one ``mpirun -np P`` whose rank 0
    relays the commands to the other ranks and sends all P replies, in rank order."""

    def __init__(self, spec: GroupSpec, args: argparse.Namespace, tmp: Path):
        self.spec = spec
        self.procs: list[subprocess.Popen] = []
        self.queues: list[queue.Queue] = []
        self.logs: list[Path] = []
        self.ready: list[dict] = []
        self.runs: list[list[dict]] = []  # per round, per rank
        self.profile: list[dict] = []
        self.final: list[dict] = []
        self.per_queue = spec.nproc if spec.mpi else 1  # replies per pipe and command
        port = free_port()
        work = asdict(spec.work)
        ncpu = os.cpu_count() or 1
        for rank in range(1 if spec.mpi else spec.nproc):
            wspec = {
                "framework": spec.framework,
                "backend": spec.backend,
                "nproc": spec.nproc,
                "per_proc": spec.per_proc,
                "variant": spec.variant,
                "work": work,
                "warmup": args.warmup,
                "threads": spec.per_proc,
                "pin_by_rank": spec.mpi and spec.has("pin"),
                "trace_dir": str(tmp / f"trace-{spec.name}-{spec.work.dtype}"),
                "dump_dir": str(tmp / f"hlo-{spec.name}-{spec.work.dtype}-r{rank}"),
            }
            env = worker_env(spec, rank, port, args, wspec["dump_dir"])
            cmd = [sys.executable, str(common.PACKAGE_DIR), "--_worker", json.dumps(wspec)]
            if spec.mpi:
                cmd[:0] = [str(mpirun_path()), "-np", str(spec.nproc)]
            elif spec.has("pin"):
                cmd[2:2] = ["--_pin", str(rank % ncpu)]
            who = "mpirun" if spec.mpi else f"rank{rank}"
            log = tmp / f"{spec.name}-{spec.work.dtype}-{who}.log"
            self.logs.append(log)
            proc = subprocess.Popen(
                cmd,
                cwd=common.REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(log, "w"),
                text=True,
                bufsize=1,
                start_new_session=spec.mpi,  # a Ctrl-C goes to the driver, which stops mpirun
            )
            q: queue.Queue = queue.Queue()
            threading.Thread(target=pump, args=(proc, q, log), daemon=True).start()
            self.procs.append(proc)
            self.queues.append(q)

    def replies(self) -> list[dict]:
        out = []
        for i, q in enumerate(self.queues):
            for _ in range(self.per_queue):
                try:
                    msg = q.get(timeout=REPLY_TIMEOUT_S)
                except queue.Empty:
                    msg = None
                if msg is None:
                    raise self._failure(i)
                out.append(msg)
        return out

    def _failure(self, i: int) -> RuntimeError:
        """The error for a worker (or ``mpirun``) that closed its pipe or did not answer."""
        try:
            rc = self.procs[i].wait(timeout=10)
        except subprocess.TimeoutExpired:
            rc = None
        what = f"no reply in {REPLY_TIMEOUT_S} s" if rc is None else f"exit status {rc}"
        if self.spec.mpi:  # all ranks' output is in the one log, hydra's verdict at its end
            who = f"mpirun -np {self.spec.nproc} ({what}; a failed rank ends the whole job)"
        else:
            who = f"rank {i} ({what})"
        tail = self.logs[i].read_text(errors="replace")[-3000:]
        return RuntimeError(f"{self.spec.key}: {who}; log tail:\n{tail}")

    def command(self, text: str) -> list[dict]:
        for p in self.procs:
            p.stdin.write(text + "\n")
            p.stdin.flush()
        return self.replies()

    def stop(self) -> None:
        for p in self.procs:
            if self.spec.mpi:
                stop_mpirun(p)
                continue
            if p.poll() is None:
                p.kill()
            p.wait()


def mpirun_path() -> Path:
    """The ``mpirun`` next to this Python (the virtualenv's MPICH), as jddp's tests use it."""
    return Path(sys.executable).parent / "mpirun"


def descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children[int(fields[1])].append(int(stat.split("/")[2]))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def stop_mpirun(p: subprocess.Popen) -> None:
    """End an ``mpirun`` and every rank below it. MPICH's hydra starts each rank in a session of
    its own, so a process group kill would miss them: SIGTERM to ``mpirun`` (hydra ends the
    ranks), then SIGKILL, by process id, to whatever of its process tree is still there."""
    below = descendants(p.pid)
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    deadline = time.monotonic() + 10
    while True:
        alive = [pid for pid in below if Path(f"/proc/{pid}").exists()]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def pump(proc: subprocess.Popen, q: queue.Queue, log: Path) -> None:
    with open(log, "a") as f:
        for line in proc.stdout:
            if line.startswith(common.TAG):
                q.put(json.loads(line[len(common.TAG) :]))
            else:
                f.write(line)
    q.put(None)


# JAX's GPU allocator settings: any one of them set by the user is kept as it is.
GPU_MEMORY_VARS = (
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
)


def gpu_memory_env(env: dict[str, str]) -> None:
    """A jddp worker on GPU allocates as it goes instead of taking JAX's default 75% of the GPU
    at start, so the PyTorch peer (and other jddp groups) alive at the same time find memory:
    ``XLA_PYTHON_CLIENT_PREALLOCATE=false``, unless the user set one of :data:`GPU_MEMORY_VARS`
    (e.g. ``XLA_PYTHON_CLIENT_MEM_FRACTION=.45`` for a fixed share)."""
    if not any(k in env for k in GPU_MEMORY_VARS):
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"


def worker_env(spec: GroupSpec, rank: int, port: int, args, dump_dir: str) -> dict[str, str]:
    """The same base environment for every worker, plus the configuration's own variables."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(common.REPO), env.get("PYTHONPATH")]))
    for key in (
        "JDDP_COORDINATOR_ADDRESS",
        "JDDP_NUM_PROCESSES",
        "JDDP_PROCESS_ID",
        "JAX_COORDINATOR_ADDRESS",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        env.pop(key, None)
    xla_flags = env.get("XLA_FLAGS", "").split()
    if spec.framework == "jddp":
        env["JAX_PLATFORMS"] = "cuda" if spec.work.platform == "gpu" else "cpu"
        if spec.work.platform == "cpu":
            xla_flags = [
                f for f in xla_flags if not f.startswith("--xla_force_host_platform_device_count")
            ]
            xla_flags.append(f"--xla_force_host_platform_device_count={spec.per_proc}")
        else:
            gpu_memory_env(env)
            if spec.nproc > 1 and not spec.mpi:  # one process per group of GPUs (mpi: by rank)
                first = rank * spec.per_proc
                gpus = range(first, first + spec.per_proc)
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        if spec.nproc > 1 and not spec.mpi:  # mpi: mpirun tells each rank its place
            env.update(
                JDDP_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JDDP_NUM_PROCESSES=str(spec.nproc),
                JDDP_PROCESS_ID=str(rank),
                JDDP_LOCAL_RANK=str(rank),
            )
        if spec.has("1t"):
            xla_flags += ONE_THREAD_XLA_FLAGS.split()
        if spec.has("noynnconv"):
            xla_flags.append(NO_YNN_CONV_XLA_FLAG)
        if args.profile:
            xla_flags += [
                "--xla_cpu_enable_xprof_traceme=true",
                f"--xla_dump_to={dump_dir}",
                "--xla_dump_hlo_as_text",
                "--xla_dump_hlo_module_re=.*jit_step.*",
            ]
        env["XLA_FLAGS"] = " ".join(xla_flags)
    else:
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(spec.nproc),
        )
    env.update(spec.extra_env)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slowest(per_rank: list[list[float]]) -> list[float]:
    return [max(ts) for ts in zip(*per_rank, strict=True)]


def run_block(specs: list[GroupSpec], args, tmp: Path, log) -> list[Group]:
    """Start every group of one block (one at a time), interleave the rounds, stop them."""
    groups: list[Group] = []
    try:
        for spec in specs:
            t = time.perf_counter()
            log(f"start {spec.key} ({spec.nproc} proc) ...")
            g = Group(spec, args, tmp)
            groups.append(g)
            g.ready = g.replies()
            r0 = g.ready[0]
            comp = f"compile {r0['compile_s']:.1f} s, " if r0.get("compile_s") else ""
            warm = ", ".join(f"{x:.2f}" for x in slowest([r["warmup_s"] for r in g.ready]))
            log(f"  ready in {time.perf_counter() - t:.0f} s ({comp}warm-up steps {warm} s)")
        if args.profile:
            for g in groups:
                g.profile = [r["profile"] for r in g.command("profile")]
                log(f"  profiled {g.spec.key}: {json.dumps(g.profile[0])[:2000]}")
        else:
            for rnd in range(args.rounds):
                for g in groups:
                    replies = g.command(f"run {args.steps_per_round}")
                    g.runs.append(replies)
                    ts = ", ".join(f"{x:.2f}" for x in slowest([r["step_s"] for r in replies]))
                    log(f"  round {rnd + 1}/{args.rounds} {g.spec.key}: {ts} s")
        for g in groups:
            g.final = g.command("quit")
    finally:
        for g in groups:
            for p in g.procs if g.final else []:  # told to quit: let them end on their own
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
            g.stop()
    return groups
