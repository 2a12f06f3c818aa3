"""Shared pieces of the end-to-end tests: the tiny run, how to start and read it, the fake-device
environment and the one way to run a command."""

import atexit
import contextlib
import gzip
import hashlib
import json
import os
import re
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from jddp.launch import merge_xla_flags
from jddp.metrics import read_metrics
from tests import preload

# A tiny run: ResNet-18 of width 4 on 8x8 synthetic images, constant lr, a line every step.
TINY = [
    "model.name=resnet10",  # a ResNet's every kind of layer, half resnet18's collectives
    "model.width=4",
    "data.name=synthetic",
    "data.image_size=8",
    "data.global_batch_size=16",
    "optim.schedule=constant",
    "optim.lr=0.05",
    "log.every_steps=1",
    "log.progress=off",
]
# Global-batch BatchNorm: results independent of the topology.
# Augmentation and host workers on: batch k must still be the same pixels on every topology and
# after a resume.
TINY_SYNC = [*TINY, "model.sync_batchnorm=true", "data.augment=cifar", "data.workers=2"]
# The shared 2 x 2 run's length and checkpoints (tests/conftest.py ``two_by_two``).
TWO_BY_TWO = ("train.steps=20", "checkpoint.every_steps=4", "checkpoint.keep=5")


def with_overrides(base, *overrides) -> list[str]:
    """``base`` then ``overrides``, dropping the base entries whose key an override sets (the CLI
    refuses a key given twice)."""
    keys = {o.split("=", 1)[0] for o in overrides if "=" in o}
    return [b for b in base if b.split("=", 1)[0] not in keys] + list(overrides)


# TINY_SYNC's run (its images, augmentation and host workers) with a small MLP for a model
# (tests/user_models.py ``tiny_mlp``): for the tests of what happens around the steps -- stop
# signals, dead peers, a killed launcher, locks -- not of what the steps compute. Tracing,
# compiling and running the ResNet-10 took half of such a job's CPU: a 2-process job of 6 steps
# 19.5 -> 10 CPU-s, its compilation cache warm (2026-11-29, the 2-core VM).
QUICK = with_overrides(TINY_SYNC, "model.name=tests.user_models:tiny_mlp",
                       "model.sync_batchnorm=false")  # fmt: skip


def train_cmd(workdir, *overrides, base=TINY_SYNC) -> list[str]:
    """``python -m jddp.train workdir=... <base> <overrides>`` (an override replaces a base
    entry of the same key)."""
    return [
        sys.executable,
        "-m",
        "jddp.train",
        f"workdir={workdir}",
        *with_overrides(base, *overrides),
    ]


def launch_cmd(nproc, devices, workdir, *overrides, base=TINY_SYNC) -> list[str]:
    """The same under ``python -m jddp.launch --nproc N --devices-per-proc K``."""
    launcher = [sys.executable, "-m", "jddp.launch", "--nproc", str(nproc)]
    return [
        *launcher,
        "--devices-per-proc",
        str(devices),
        "--",
        *train_cmd(workdir, *overrides, base=base),
    ]


MPIRUN = str(Path(sys.executable).parent / "mpirun")  # PyPI MPICH's, next to the venv's python


def mpirun_cmd(nproc, workdir, *overrides, base=TINY_SYNC) -> list[str]:
    """The train command under ``mpirun -np N``."""
    return [MPIRUN, "-np", str(nproc), *train_cmd(workdir, *overrides, base=base)]


def failure_text(stderr: str, limit: int = 3000) -> str:
    """A failed run's stderr for an assertion's message: from a fatal error's report on
    (faulthandler's dump names the crashing thread first: its tail would show only the last
    thread, the main one), else its last ``limit`` characters."""
    at = stderr.find("Fatal Python error")
    return stderr[at : at + 2 * limit] if at >= 0 else stderr[-limit:]


def assert_resumed_bitwise(out, workdir, straight, resumed: int, last_step: int) -> None:
    """``out`` (the rerun after a kill) resumed at ``resumed`` and then logged exactly the losses
    of the uninterrupted run in ``straight``, every step once."""
    assert out.returncode == 0, failure_text(out.stderr)
    assert f"at step {resumed}" in out.stdout
    got, want = read_losses(workdir), read_losses(straight)
    assert sorted(got) == list(range(1, last_step + 1))
    assert_losses_match(got, want, range(resumed + 1, last_step + 1), rel=0)


def snapshot(folder) -> dict[str, str]:
    """Every file under ``folder``: its relative path -> the SHA-256 of its bytes."""
    folder = Path(folder)
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def read_losses(workdir) -> dict[int, float]:
    """``{step: train/loss}`` of a run."""
    return {r["step"]: r["train/loss"] for r in read_metrics(workdir) if "train/loss" in r}


def traced_steps(profile_folder) -> list[int]:
    """The steps marked in the one ``jax.profiler`` trace under ``profile_folder`` (jddp marks
    each traced step's dispatch: ``"train"``, ``step_num``)."""
    (trace,) = Path(profile_folder).rglob("*.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    return [int(e["args"]["step_num"]) for e in events if e.get("name") == "train"]


def steps_saved(workdir) -> list[int]:
    """Steps of the complete checkpoints in ``workdir/checkpoints``, oldest first."""
    d = Path(workdir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def wait_for(predicate, timeout_s: float) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def start_training(cmd, workdir, steps=2, timeout_s=300, **popen_kwargs) -> subprocess.Popen:
    """Start ``cmd`` (output captured as text) and return it once ``workdir/metrics.jsonl`` holds
    ``steps`` train lines."""
    job = start(cmd, **popen_kwargs)
    metrics = Path(workdir) / "metrics.jsonl"
    if not wait_for(lambda: metrics.exists() and len(read_losses(workdir)) >= steps, timeout_s):
        job.kill()
        raise AssertionError(f"no {steps} train lines in {metrics} within {timeout_s} s")
    return job


def run_pids(workdir, exclude: int | None = None) -> list[int]:
    """Pids of the processes whose command line names ``workdir=<workdir>`` (the job's ranks)."""
    out = run(["pgrep", "-f", f"workdir={workdir}"])
    return [int(p) for p in out.stdout.split() if int(p) != exclude]


def pid_gone(pid: int, timeout: float = 5.0) -> bool:
    """True once ``pid`` no longer exists or is a zombie (the launcher is gone, so not ours)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return True
        state = next((ln for ln in status.splitlines() if ln.startswith("State:")), "")
        if "Z" in state.split(":", 1)[-1].split()[:1]:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def kill_leftovers(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` that is still there (a test's cleanup)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def fake_devices(count: int, env=None) -> dict[str, str]:
    """``env`` (default: this process's) for a process that sees ``count`` fake CPU devices: the
    device-count flag in ``XLA_FLAGS`` set as ``jddp.launch`` sets it, JAX on the CPU."""
    env = dict(os.environ if env is None else env)
    env["XLA_FLAGS"] = merge_xla_flags(env.get("XLA_FLAGS"), count)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def optimized_xla(env=None) -> dict[str, str]:
    """``env`` (default: this process's) with XLA's LLVM at -O1 instead of the suite's -O0
    (tests/conftest.py): for a run whose steps, not its compiles, take the CPU (examples trained
    to their documented accuracy, a convergence test: label_smoothing_loss.py took 27 CPU-s at
    -O1 and 90 at -O0, 2026-11-27)."""
    env = dict(os.environ if env is None else env)
    flags = re.sub(r"--xla_backend_optimization_level=\S*", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags.strip()} --xla_backend_optimization_level=1".strip()
    return env


REPO = Path(__file__).resolve().parents[1]
# jddp's commands that :func:`run` forks from the worker's CLI server (tests/cli_server.py,
# tests/preload.py), and the launcher itself, which forks its ranks of those in turn
# (tests/forked.py ``fork_ranks``).
FORKED_MODULES = (*preload.FORKED_MODULES, "jddp.launch")
FORKED_SCRIPTS = preload.FORKED_SCRIPTS  # the repository's own scripts, forked too
_CLI_SERVER: dict = {}  # this worker's: "job", "socket", "env", "read", "set" (cli_server.py)
forked_cpu_s = 0.0  # CPU seconds of the commands the server ran for this process (JDDP_TEST_USAGE)


def _cli_server() -> dict:
    """This worker's CLI server, started on first use (its imports, once)."""
    job = _CLI_SERVER.get("job")
    if job is None or job.poll() is not None:
        folder = Path(tempfile.mkdtemp(prefix="jddp-cli-server-"))
        sock, server_err = folder / "socket", folder / "server.err"
        with open(server_err, "w") as err:
            # Room in its arguments for a forked command's own (tests/preload.py's
            # show_command_line): ``ps`` and ``pgrep -f workdir=...`` (run_pids) see them.
            # By its path, not ``-m tests.cli_server``: the ``tests`` package not imported there,
            # a forked script finds only what a new process would on its own sys.path.
            command = [sys.executable, str(REPO / "tests" / "cli_server.py"), str(sock), " " * 8192]
            job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
        ready, printed = job.stdout.readline(), server_err.read_text()
        # The imports print nothing: a warning there would be in every command's "one line".
        assert ready.startswith('{"ready": true') and not printed, f"CLI server: {ready} {printed}"
        atexit.register(_stop_cli_server, job, folder)
        said = json.loads(ready)
        _CLI_SERVER.update(job=job, socket=sock, env=dict(os.environ), read=set(said["read"]),
                           set=said["set"])  # fmt: skip
    return _CLI_SERVER


def _stop_cli_server(job: subprocess.Popen, folder: Path) -> None:
    job.kill()
    job.wait()
    job.stdout.close()
    shutil.rmtree(folder, ignore_errors=True)


def _forkable(cmd, env, cwd) -> list[str] | None:
    """The arguments after ``python`` in ``cmd`` (``["-m", MODULE, ...]`` or ``[SCRIPT, ...]``)
    when it runs one of :data:`FORKED_MODULES` or :data:`FORKED_SCRIPTS` with this interpreter and
    the CLI server can run it as a new process would (the environment differs from the server's
    only in variables that its imports did not read: :meth:`tests.preload.Imports.allows`),
    else None."""
    cmd = [str(arg) for arg in cmd]
    if len(cmd) < 2 or cmd[0] != sys.executable or os.environ.get("JDDP_TEST_AS_USERS_RUN") == "1":
        return None  # (CI's "as users run" lane: every command a new interpreter)
    if cmd[1] == "-m":
        if len(cmd) < 3 or cmd[2] not in FORKED_MODULES:
            return None
    elif (Path(cwd or os.getcwd()) / cmd[1]).resolve() not in FORKED_SCRIPTS:
        return None
    server = _cli_server()
    imports = preload.Imports(server["read"], server["set"], server["env"])
    return cmd[1:] if imports.allows(os.environ if env is None else env) else None


class ForkedJob:
    """A command the worker's CLI server forked (:func:`start`, :func:`run`): the part of
    ``subprocess.Popen`` the tests use. Its stdout and stderr are pipes read here (``stdout``,
    ``stderr``: unbuffered binary files; :meth:`communicate` gives text, undecodable bytes
    replaced) or the file descriptors given; ``returncode`` as ``subprocess`` reports it
    (``-N`` for a signal) once the server answered that the command ended."""

    def __init__(self, cmd, python_args, env=None, cwd=None, outputs=(None, None), session=False):
        self.args, self.returncode = cmd, None
        request = {
            "python_args": python_args,
            "env": dict(os.environ if env is None else env),
            "cwd": os.path.abspath(cwd or os.getcwd()),
            "session": session,
        }
        pipes = [os.pipe() if target is None else None for target in outputs]
        writes = [t if p is None else p[1] for t, p in zip(outputs, pipes, strict=True)]
        self._buffer, self._chunks = b"", {}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(str(_cli_server()["socket"]))
            payload = json.dumps(request).encode() + b"\n"
            socket.send_fds(self._conn, [payload[:1]], writes)
            self._conn.sendall(payload[1:])
        except BaseException:
            for pipe in pipes:
                if pipe is not None:
                    os.close(pipe[0])
            raise
        finally:
            for pipe in pipes:
                if pipe is not None:
                    os.close(pipe[1])
        self.stdout, self.stderr = (None if p is None else open(p[0], "rb", 0) for p in pipes)
        self.pid = json.loads(self._answer(None))["pid"]

    def _answer(self, timeout) -> bytes | None:
        """The server's next line, or None if none came within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            if not select.select([self._conn], [], [], left)[0]:
                return None
            data = self._conn.recv(1 << 12)
            if not data:
                raise ConnectionError(f"the CLI server went away while running {self.args}")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _ended(self, timeout) -> int | None:
        global forked_cpu_s
        if self.returncode is None:
            line = self._answer(timeout)
            if line is not None:
                done = json.loads(line)
                self.returncode = done["code"]
                forked_cpu_s += done["cpu_s"]
                self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._ended(0)

    def wait(self, timeout=None) -> int:
        if self._ended(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout=None) -> tuple[str | None, str | None]:
        """The pipes read to their ends (as ``subprocess.run`` does: until the command and
        every process that inherited them ended), then the command's end; ``TimeoutExpired``
        after ``timeout`` seconds, what was read kept for the next call."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for f in (self.stdout, self.stderr):
                if f is not None and not f.closed:
                    selector.register(f, selectors.EVENT_READ)
            while selector.get_map():
                left = None if deadline is None else max(deadline - time.monotonic(), 0)
                ready = selector.select(left)
                if not ready:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in ready:
                    data = os.read(key.fd, 1 << 16)
                    self._chunks.setdefault(key.fileobj, []).append(data)
                    if not data:
                        selector.unregister(key.fileobj)
                        key.fileobj.close()
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 1.0))
        text = [
            None if f is None else b"".join(self._chunks.get(f, [])).decode("utf-8", "replace")
            for f in (self.stdout, self.stderr)
        ]
        return text[0], text[1]

    def send_signal(self, sig) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # ended, the server not yet said so
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run(
    cmd, env=None, timeout=600, cwd=None, check=False, fresh=False
) -> subprocess.CompletedProcess:
    """Run ``cmd`` to the end, capturing its output as text (undecodable bytes replaced).

    ``python -m jddp.<command> ...`` (:data:`FORKED_MODULES`) and ``python SCRIPT ...``
    (:data:`FORKED_SCRIPTS`) are forked from this worker's CLI server unless ``fresh``: a new
    interpreter with the libraries imported, its outcome the same. ``fresh=True`` for what only
    a new process shows (what the imports print, their time)."""
    python_args = None if fresh else _forkable(cmd, env, cwd)
    if python_args is not None:
        job = ForkedJob(cmd, python_args, env, cwd)
        try:
            stdout, stderr = job.communicate(timeout)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
            raise
        out = subprocess.CompletedProcess(cmd, job.returncode, stdout, stderr)
        if check:
            out.check_returncode()
        return out
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="replace",
        env=env,
        timeout=timeout,
        cwd=cwd,
        check=check,
    )


def run_python(
    *args, env=None, timeout=600, cwd=None, check=False, fresh=False
) -> subprocess.CompletedProcess:
    """``python ARGS`` (this interpreter: ``"-m", "jddp.train", ...`` or ``"-c", SCRIPT``), run
    to the end as :func:`run` does."""
    return run([sys.executable, *args], env=env, timeout=timeout, cwd=cwd, check=check, fresh=fresh)


def start(cmd, fresh=False, **popen_kwargs) -> subprocess.Popen | ForkedJob:
    """Start ``cmd`` in the background, its output piped unless ``popen_kwargs`` say
    otherwise (``stdout=``, ``stderr=``, ``env=``, ``start_new_session=``, ...); ``communicate``
    gives text. ``python -m jddp.<command> ...`` (:data:`FORKED_MODULES`) and ``python SCRIPT``
    (:data:`FORKED_SCRIPTS`) are forked from this worker's CLI server (a :class:`ForkedJob`,
    whose pipes are binary files) unless ``fresh`` or a Popen option other than ``env``,
    ``cwd``, ``start_new_session`` and ``stdout``/``stderr`` to a file is given."""
    outputs = [popen_kwargs.get(name, subprocess.PIPE) for name in ("stdout", "stderr")]
    known = set(popen_kwargs) <= {"env", "cwd", "start_new_session", "stdout", "stderr"}
    pipes_or_files = all(o == subprocess.PIPE or hasattr(o, "fileno") for o in outputs)
    forkable = known and pipes_or_files and not fresh
    env, cwd = popen_kwargs.get("env"), popen_kwargs.get("cwd")
    python_args = _forkable(cmd, env, cwd) if forkable else None
    if python_args is not None:
        fds = [None if o == subprocess.PIPE else o.fileno() for o in outputs]
        session = popen_kwargs.get("start_new_session", False)
        return ForkedJob(cmd, python_args, env, cwd, fds, session)
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    return subprocess.Popen(cmd, **{**options, **popen_kwargs})


def train(workdir, *overrides, base=TINY_SYNC, env=None, timeout=600, fresh=False):
    """``python -m jddp.train`` on ``base`` + ``overrides``, run to the end (forked from the CLI
    server unless ``fresh``: :func:`run`)."""
    return run(train_cmd(workdir, *overrides, base=base), env=env, timeout=timeout, fresh=fresh)


def assert_losses_match(got, want, steps, rel=1e-4) -> None:
    """Per-step losses ``got`` equal ``want`` at ``steps`` (within ``rel``; bitwise for
    ``rel=0``), naming the first step that differs."""
    for step in steps:
        if rel == 0:
            assert got[step] == want[step], step
        else:
            assert got[step] == pytest.approx(want[step], rel=rel), step


def data(n=64, seed=0):
    """``n`` float images 8x8x3 with labels linear in the pixels (learnable)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8, 8, 3)).astype(np.float32)
    return x, (x.mean(axis=(1, 2, 3)) > 0).astype(np.int32)


def toy_source(n=50, classes=7):
    """An in-memory source whose image ``i`` holds the value ``i`` (label ``i % classes``)."""
    from jddp.data.source import ArraySource

    images = np.arange(n, dtype=np.float32).reshape(n, 1, 1, 1) * np.ones((1, 2, 2, 1), np.float32)
    return ArraySource(
        images,
        np.arange(n, dtype=np.int32) % classes,
        classes,
        mean=np.zeros(1, np.float32),
        std=np.ones(1, np.float32),
        name="toy",
    )


# Run as `python -c THREADS_PROBE` by a launcher: jddp sizes the process as the CLI does, XLA:CPU
# starts; prints the cores pinned, XLA's compute (Eigen) threads, the input workers' share and
# the affinity.
THREADS_PROBE = """
import collections, os, sys
from jddp.proc.cores import size_cpu_threads
pinned = size_cpu_threads(None)
import jax, jax.numpy as jnp
x = jnp.ones((256, 256)); (x @ x).block_until_ready()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
eigen = sum(n.startswith("tf_XLAEigen") for n in names)
print(len(pinned), eigen, os.environ.get("JDDP_CPU_THREADS"), sorted(os.sched_getaffinity(0)))
"""


def failing_commit(after_s: float):
    """One of orbax's commit threads whose write fails (a full disk) after ``after_s``."""
    from jddp.compat.orbax_writes import CommitThread  # orbax's private class, found there

    def write() -> None:
        time.sleep(after_s)
        raise ValueError('RESOURCE_EXHAUSTED: Error writing "params.w/0": No space left on device')

    thread = CommitThread(target=write, send_signals=[], receive_signals=[])
    thread.start()
    return thread
