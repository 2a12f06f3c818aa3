"""One rank held on its node for a remote launcher (``python -m jddp.ray``'s Ray actors).

:class:`RankProcess` starts one command as a subprocess of the process it lives in (a Ray
actor), in its own session, buffers its output lines for the launcher to fetch
(:meth:`RankProcess.poll`), forwards signals to its process group and reaps whatever it leaves.
It imports nothing of Ray: the launcher wraps it with ``ray.remote``.

The rank dies with the process that holds it, as under ``python -m jddp.launch``: it is started
with ``PR_SET_PDEATHSIG=SIGKILL`` from a thread that lives until the rank ends, and
``JDDP_LAUNCHER_PID`` names the holder, which ``jddp.train`` watches (:func:`watch_launcher`).
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence

from jddp.launch import find_free_port, merge_xla_flags
from jddp.launch.supervise import (
    HELD_SIGNALS,
    READER_JOIN_TIMEOUT,
    REAP_TIMEOUT,
    STARTUP_GRACE_S,
    catches,
    held_signals,
    proc_group_has_live_member,
    pump,
)
from jddp.proc.lifeline import LAUNCHER_PID_ENV, die_with_parent, load_prctl

MAX_BUFFERED_LINES = 20_000  # per rank, between two polls; older lines are dropped beyond
PYTHON_NAMES = ("python", "python3")  # a command starting with these runs this interpreter


class _Buffer:
    """The rank's output lines as ``(stream, text)``, oldest dropped past a bound; thread-safe."""

    def __init__(self) -> None:
        self._lines: deque[tuple[str, str]] = deque()
        self._lock = threading.Lock()
        self.dropped = 0

    def sink(self, stream: str) -> _Sink:
        """A writer for :func:`jddp.launch.supervise.pump` that files lines under ``stream``."""
        return _Sink(self, stream)

    def add(self, stream: str, text: str) -> None:
        with self._lock:
            self._lines.append((stream, text))
            if len(self._lines) > MAX_BUFFERED_LINES:
                self._lines.popleft()
                self.dropped += 1

    def take(self) -> list[tuple[str, str]]:
        with self._lock:
            lines = list(self._lines)
            self._lines.clear()
            if self.dropped:
                note = f"({self.dropped} lines dropped: output faster than the launcher read)\n"
                lines.insert(0, ("stderr", note))
                self.dropped = 0
            return lines


class _Sink:
    def __init__(self, buffer: _Buffer, stream: str) -> None:
        self._buffer, self._stream = buffer, stream

    def write(self, text: str) -> None:
        self._buffer.add(self._stream, text)


# A Ray worker ignores SIGINT and SIGQUIT and blocks SIGINT in its threads; a rank inherits
# both across exec, and would never see a forwarded Ctrl-C.
_RESET_SIGNALS = (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


def _child_setup(prctl: object, parent: int) -> None:
    """Run in the rank between fork and exec: default signal dispositions and an empty signal
    mask, then die with ``parent`` (:func:`jddp.proc.lifeline.die_with_parent`)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    for sig in _RESET_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    die_with_parent(prctl, parent)


def node_address() -> str:
    """This node's IP address as the cluster knows it (Ray's view where Ray runs)."""
    try:
        import ray.util

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray: the address of the host name
        return socket.gethostbyname(socket.gethostname())


def rank_command(command: Sequence[str]) -> list[str]:
    """``command`` with a leading ``python``/``python3`` replaced by this interpreter: on a
    cluster node ``python`` on the PATH need not be the one that has jddp and Ray."""
    command = list(command)
    if command and command[0] in PYTHON_NAMES:
        command[0] = sys.executable
    return command


def rank_env(
    base: Mapping[str, str], updates: Mapping[str, str], devices_per_proc: int | None
) -> dict[str, str]:
    """``base`` (the node's environment) with ``updates`` and, for ``devices_per_proc``, the
    fake-CPU-device flag that ``python -m jddp.launch --devices-per-proc`` sets."""
    env = {**base, **updates}
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    env["PYTHONUNBUFFERED"] = "1"
    if devices_per_proc is not None:
        env["XLA_FLAGS"] = merge_xla_flags(env.get("XLA_FLAGS"), devices_per_proc)
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


class RankProcess:
    """Starts, watches and stops one rank on this node; every method returns at once."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._output = _Buffer()
        self._readers: list[threading.Thread] = []
        self._started_at = 0.0
        self._exited_at: float | None = None
        self._held: int | None = None  # a signal held until the rank catches it
        self._held_signals: tuple[int, ...] = HELD_SIGNALS  # which ones (the command's)

    def node(self) -> tuple[str, str]:
        """``(IP address, host name)`` of this node."""
        return node_address(), socket.gethostname()

    def free_port(self) -> int:
        """A TCP port free on this node a moment ago (the coordinator's, on rank 0's node)."""
        return find_free_port()

    def start(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None,
        devices_per_proc: int | None = None,
    ) -> tuple[int, str]:
        """Start ``command`` with ``env`` added to this node's environment, in ``cwd`` where it
        exists here; returns ``(pid, note)``, the note naming a fallback folder ('' if none).
        Raises ``OSError`` when the command cannot be started."""
        note = ""
        if cwd is not None and not os.path.isdir(cwd):
            note = f"the launcher's folder {cwd} is not on this node; running in {os.getcwd()}"
            cwd = None
        started = threading.Event()
        failure: list[OSError] = []
        self._held_signals = held_signals(rank_command(command))

        def hold() -> None:
            # PDEATHSIG fires when the thread that forked ends: this one waits for the rank.
            try:
                self._proc = subprocess.Popen(
                    rank_command(command),
                    env=rank_env(os.environ, env, devices_per_proc),
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=functools.partial(_child_setup, load_prctl(), os.getpid()),
                )
            except OSError as e:
                failure.append(e)
                return
            finally:
                started.set()
            self._proc.wait()
            self._exited_at = time.monotonic()

        threading.Thread(target=hold, name="jddp.remote-rank", daemon=True).start()
        started.wait()
        if failure:
            raise failure[0]
        proc = self._proc
        assert proc is not None and proc.stdout is not None and proc.stderr is not None
        self._started_at = time.monotonic()
        for pipe, stream in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
            reader = threading.Thread(
                target=pump, args=(pipe, "", self._output.sink(stream)), daemon=True
            )
            reader.start()
            self._readers.append(reader)
        return proc.pid, note

    def poll(self) -> tuple[list[tuple[str, str]], int | None, bool]:
        """The output lines since the last call; the rank's ``returncode`` as soon as it has
        exited (None before); and whether its output is all read (``drained``: its pipes closed,
        or ``READER_JOIN_TIMEOUT`` after the exit), so that no line comes after this call.

        The exit is told at once, not after the output: a killed rank's pipes can stay open a
        while (a process of its group still holds them), and a launcher that learned of the
        kill only then would see first its peers fail in their collectives, and blame them."""
        self._send_held()
        returncode, drained = None, False
        if self._exited_at is not None and self._proc is not None:
            returncode = self._proc.returncode
            readers_done = not any(t.is_alive() for t in self._readers)
            drained = readers_done or time.monotonic() - self._exited_at > READER_JOIN_TIMEOUT
        return self._output.take(), returncode, drained  # taken after `drained` is known

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the rank's process group; SIGUSR1 and SIGHUP (SIGTERM too for a
        rank of jddp's commands: :func:`~jddp.launch.supervise.held_signals`), which kill a
        process without a handler, wait (at most ``STARTUP_GRACE_S`` after the start) until
        the rank catches them."""
        proc = self._proc
        if proc is None:
            return
        young = time.monotonic() - self._started_at < STARTUP_GRACE_S
        if sig in self._held_signals and young and not catches(proc.pid, sig):
            self._held = sig
            return
        self._signal_group(sig)

    def _send_held(self) -> None:
        if self._held is not None and self._proc is not None:
            young = time.monotonic() - self._started_at < STARTUP_GRACE_S
            if not young or catches(self._proc.pid, self._held):
                sig, self._held = self._held, None
                self._signal_group(sig)

    def _signal_group(self, sig: int) -> None:
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def group_alive(self) -> bool:
        """Whether a process of the rank's group (the rank, its input workers) still runs."""
        if self._proc is None:
            return False
        return proc_group_has_live_member(self._proc.pid)

    def reap(self, grace_s: float) -> bool:
        """End what is left of the rank's group: SIGTERM, SIGKILL after ``grace_s``; returns
        whether the group is gone."""
        if self._proc is None:
            return True
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, REAP_TIMEOUT)):
            if not self.group_alive():
                return True
            self._signal_group(sig)
            deadline = time.monotonic() + wait_s
            while self.group_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        return not self.group_alive()
