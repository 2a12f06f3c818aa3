"""Local multi-process launcher for ``jax.distributed`` (like ``torchrun --nproc_per_node``).

Usage::

    python -m jddp.launch --nproc N [--devices-per-proc K] [--port P] [--kill-timeout S] \\
        -- <command ...>

Starts ``N`` copies of ``<command>``, each in its own session / process group, with the
environment that :mod:`jddp.distributed` reads:

* ``JDDP_COORDINATOR_ADDRESS=localhost:<port>`` (a free port unless ``--port`` is given),
* ``JDDP_NUM_PROCESSES=N``, ``JDDP_PROCESS_ID=<i>``, ``JDDP_LOCAL_RANK=<i>``,
* ``PYTHONUNBUFFERED=1``, ``JDDP_LAUNCHER_PID=<the launcher's pid>``,
* with ``--devices-per-proc K``: ``XLA_FLAGS`` gets ``--xla_force_host_platform_device_count=K``
  (replacing any existing value of that flag) and ``JAX_PLATFORMS=cpu`` unless already set.

Every line a child writes is forwarded to the launcher's stdout / stderr with a ``[rank i] ``
prefix. Children read from ``/dev/null``. SIGINT and SIGTERM received by the launcher are
forwarded to every child's process group (a second signal escalates to SIGKILL).

Fail-fast: when a child exits nonzero, the launcher reports it on stderr, sends SIGTERM to the
other children's process groups, SIGKILLs whatever is still alive after ``--kill-timeout``
seconds and exits with that rank's code (``128 + signal`` for a signal death). If every child
exits 0 the launcher exits 0. Leftover grandchildren in the children's process groups are
terminated before the launcher returns, and every child is reaped.

Children die with the launcher even when it cannot forward anything (``kill -9``, OOM killer):
on Linux each child is started with ``PR_SET_PDEATHSIG=SIGKILL``; elsewhere, and for a rank
started through a wrapper that forks, :func:`watch_launcher` (which ``python -m jddp.train``
calls) ends the rank once its parent process changes.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any, NoReturn

PROG = "jddp.launch"
DEFAULT_KILL_TIMEOUT = 10.0
# Caps --kill-timeout so that the launcher always exits within 60 s of the first failure.
MAX_KILL_TIMEOUT = 45.0
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count="

_POLL_INTERVAL = 0.05
_READER_JOIN_TIMEOUT = 5.0  # after all children are reaped, how long to wait for EOF on pipes
_REAP_TIMEOUT = 2.0  # after SIGKILL, how long to wait for a child / group to disappear
_READ_LIMIT = 1 << 16  # longest piece of a newline-less line forwarded at once
LAUNCHER_PID_ENV = "JDDP_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_WATCH_INTERVAL = 1.0  # seconds between a rank's checks that its parent is still there


class _UsageError(Exception):
    """Raised by the argument parser instead of exiting; carries a one-line message."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are a single line (raised as :class:`_UsageError`)."""

    def error(self, message: str) -> NoReturn:
        """Raise a one-line usage error instead of printing usage and exiting."""
        raise _UsageError(message)


def _build_parser() -> _Parser:
    parser = _Parser(
        prog=f"python -m {PROG}",
        usage=(
            f"python -m {PROG} --nproc N [--devices-per-proc K] [--port P] "
            "[--kill-timeout S] -- <command ...>"
        ),
        description="Start N local copies of a command wired for jax.distributed.",
    )
    parser.add_argument(
        "--nproc", type=int, required=True, help="number of processes to start (>= 1)"
    )
    parser.add_argument(
        "--devices-per-proc",
        type=int,
        default=None,
        metavar="K",
        help="force K host (CPU) devices per process via XLA_FLAGS; sets JAX_PLATFORMS=cpu "
        "unless JAX_PLATFORMS is already set",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help="coordinator port on localhost (default: a free port)",
    )
    parser.add_argument(
        "--kill-timeout",
        type=float,
        default=DEFAULT_KILL_TIMEOUT,
        metavar="S",
        help=f"seconds between SIGTERM and SIGKILL when stopping processes "
        f"(default {DEFAULT_KILL_TIMEOUT:g}, at most {MAX_KILL_TIMEOUT:g})",
    )
    return parser


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split ``argv`` at the first ``--`` and parse the launcher flags.

    Returns the parsed flags and the command. Raises :class:`_UsageError` with a one-line
    message naming the offending flag on bad usage.
    """
    argv = list(argv)
    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1 :]
    else:
        own, command = argv, []
    parser = _build_parser()
    try:
        args = parser.parse_args(own)
    except _UsageError as e:
        msg = str(e)
        if "unrecognized arguments" in msg and "--" not in argv:
            msg += " (put the command after '--')"
        raise _UsageError(msg) from None
    if args.nproc < 1:
        raise _UsageError(f"--nproc must be >= 1, got {args.nproc}")
    if args.devices_per_proc is not None and args.devices_per_proc < 1:
        raise _UsageError(f"--devices-per-proc must be >= 1, got {args.devices_per_proc}")
    if args.port is not None and not 1 <= args.port <= 65535:
        raise _UsageError(f"--port must be in 1..65535, got {args.port}")
    if not 0 <= args.kill_timeout <= MAX_KILL_TIMEOUT:
        raise _UsageError(
            f"--kill-timeout must be between 0 and {MAX_KILL_TIMEOUT:g} seconds, "
            f"got {args.kill_timeout:g}"
        )
    if not command:
        raise _UsageError("no command given after '--' (usage: ... --nproc N -- <command ...>)")
    return args, command


def find_free_port() -> int:
    """Return a TCP port on localhost that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def merge_xla_flags(existing: str | None, device_count: int) -> str:
    """Return ``existing`` XLA flags with the host-platform device count set to ``device_count``.

    Any existing ``--xla_force_host_platform_device_count=`` flag is replaced; other flags are
    kept in order and the new flag is appended.
    """
    kept = [f for f in (existing or "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    kept.append(f"{DEVICE_COUNT_FLAG}{device_count}")
    return " ".join(kept)


def child_env(
    base: Mapping[str, str],
    *,
    rank: int,
    nproc: int,
    port: int,
    devices_per_proc: int | None = None,
) -> dict[str, str]:
    """Return the environment for child ``rank``: ``base`` plus the JDDP_* wiring variables."""
    env = dict(base)
    env["JDDP_COORDINATOR_ADDRESS"] = f"localhost:{port}"
    env["JDDP_NUM_PROCESSES"] = str(nproc)
    env["JDDP_PROCESS_ID"] = str(rank)
    env["JDDP_LOCAL_RANK"] = str(rank)
    env["PYTHONUNBUFFERED"] = "1"
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    if devices_per_proc is not None:
        env["XLA_FLAGS"] = merge_xla_flags(env.get("XLA_FLAGS"), devices_per_proc)
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def describe_exit(returncode: int) -> str:
    """Describe a ``Popen.returncode``: ``exited with code 3`` / ``killed by signal SIGKILL``."""
    if returncode < 0:
        return f"killed by signal {_signal_name(-returncode)}"
    return f"exited with code {returncode}"


def exit_code_for(returncode: int) -> int:
    """Map a child's ``Popen.returncode`` to a shell-style exit status (128+N for signals)."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _proc_group_has_live_member(pgid: int) -> bool:
    """Scan ``/proc`` for a non-zombie process in group ``pgid`` (True if ``/proc`` is absent)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile, or not readable
        # "pid (comm) state ppid pgrp ...": comm may contain spaces or parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _load_prctl() -> Any:
    """libc's ``prctl`` as a ctypes function, or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def _die_with_parent(prctl: Any, parent: int) -> None:
    """Run in the child between fork and exec: SIGKILL this process when ``parent`` dies.

    PDEATHSIG survives ``exec`` and fires when the *thread* that forked exits, so the launcher
    forks from the thread that then waits for the children. If the launcher died before the
    ``prctl`` took effect, the child is already orphaned: it ends itself at once.
    """
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def watch_launcher(interval: float = _WATCH_INTERVAL) -> threading.Thread | None:
    """In a rank started by ``python -m jddp.launch``: end this process (SIGKILL) once its
    parent changes, i.e. the launcher (or a wrapper between it and the rank) is gone.

    The fallback to ``PR_SET_PDEATHSIG`` where the platform has none, and the guard for ranks
    started through a wrapper that forks (``bash -c "...; ..."``), which PDEATHSIG does not
    reach. A no-op (returns None) outside the launcher; otherwise returns the daemon thread.
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    if not launcher.isdigit():
        return None
    parent = os.getppid()
    try:
        os.kill(int(launcher), 0)
    except ProcessLookupError:  # the launcher died before this rank got here
        os.kill(os.getpid(), signal.SIGKILL)
    except OSError:
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name=f"{PROG}-watch", daemon=True)
    thread.start()
    return thread


class _Output:
    """Line-atomic, thread-safe writer to the launcher's stdout or stderr."""

    def __init__(self, name: str) -> None:
        self._name = name
        # Reentrant: the signal handler may write while the main thread holds the lock.
        self._lock = threading.RLock()
        self._broken = False

    def write(self, text: str) -> None:
        """Write ``text`` and flush; swallow broken pipes (children keep being drained)."""
        with self._lock:
            if self._broken:
                return
            stream: IO[str] | None = getattr(sys, self._name)
            if stream is None:
                return
            try:
                try:
                    stream.write(text)
                except UnicodeEncodeError:
                    enc = getattr(stream, "encoding", None) or "ascii"
                    stream.write(text.encode(enc, "backslashreplace").decode(enc))
                stream.flush()
            except (BrokenPipeError, ValueError):
                self._broken = True
            except OSError:
                pass


def _pump(pipe: IO[bytes], prefix: str, out: _Output) -> None:
    """Forward ``pipe`` to ``out`` line by line, each line prefixed; close the pipe at EOF."""
    try:
        while True:
            chunk = pipe.readline(_READ_LIMIT)
            if not chunk:
                break
            text = chunk.decode("utf-8", errors="replace")
            if not text.endswith("\n"):
                text += "\n"
            out.write(prefix + text)
    except (OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


class _Launcher:
    """State for one launch: the children, their reader threads and the stop logic."""

    def __init__(self, command: list[str], nproc: int, kill_timeout: float) -> None:
        self.command = command
        self.nproc = nproc
        self.kill_timeout = kill_timeout
        self.stdout = _Output("stdout")
        self.stderr = _Output("stderr")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.readers: list[threading.Thread] = []
        # Process groups we may still signal (pgid == child pid since start_new_session=True).
        self.live_groups: set[int] = set()
        self.signal_received: int | None = None
        self.stop_deadline: float | None = None  # when to escalate to SIGKILL
        self.killed_at: float | None = None  # when kill_all() first ran
        self.returncodes: dict[int, int] = {}  # rank -> Popen.returncode, filled by wait()

    # -- signalling -------------------------------------------------------------------------
    def signal_groups(self, sig: int) -> None:
        """Send ``sig`` to every process group we have not yet seen empty."""
        for pgid in list(self.live_groups):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                self._forget_group_if_reaped(pgid)
            except PermissionError:
                pass

    def _forget_group_if_reaped(self, pgid: int) -> None:
        for p in self.procs:
            if p.pid == pgid and p.returncode is not None:
                self.live_groups.discard(pgid)

    def _group_alive(self, pgid: int) -> bool:
        """Whether process group ``pgid`` has a member that is not a zombie.

        Orphaned grandchildren are reparented to init, which may reap them lazily; their
        zombies still count for ``killpg(pgid, 0)``, so on Linux we look at ``/proc`` instead.
        """
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return _proc_group_has_live_member(pgid)

    def _prune_groups(self) -> None:
        """Forget groups whose leader is reaped and that have no members left."""
        for p in self.procs:
            if p.returncode is not None and p.pid in self.live_groups:
                if not self._group_alive(p.pid):
                    self.live_groups.discard(p.pid)

    def begin_stop(self, sig: int) -> None:
        """Send ``sig`` to all groups and arm the SIGKILL escalation after ``kill_timeout``."""
        self.signal_groups(sig)
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.kill_timeout

    def kill_all(self) -> None:
        """SIGKILL every remaining process group."""
        if self.killed_at is None:
            self.killed_at = time.monotonic()
        self.signal_groups(signal.SIGKILL)

    def on_signal(self, signum: int, frame: object) -> None:
        """Signal handler: forward the first SIGINT/SIGTERM, escalate to SIGKILL on the next."""
        if self.signal_received is None and self.stop_deadline is None:
            self.signal_received = signum
            self.stderr.write(
                f"{PROG}: received {_signal_name(signum)}; forwarding to "
                f"{self._alive_count()} processes\n"
            )
            self.begin_stop(signum)
        else:
            if self.signal_received is None:
                self.signal_received = signum
            self.stderr.write(f"{PROG}: received {_signal_name(signum)} again; killing all\n")
            self.kill_all()

    def _alive_count(self) -> int:
        """Children not yet seen exited (no poll(): reaping stays in :meth:`wait`)."""
        return len(self.procs) - len(self.returncodes)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, envs: list[dict[str, str]]) -> None:
        """Start the children (stopping early if a signal arrives meanwhile), then their output
        readers: the forks happen while no reader thread runs, since the ``preexec_fn`` that
        ties each child's life to the launcher's is only safe without other threads."""
        die_with_launcher = functools.partial(_die_with_parent, _load_prctl(), os.getpid())
        try:
            for env in envs:
                if self.signal_received is not None:
                    break
                proc = subprocess.Popen(
                    self.command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=die_with_launcher,
                )
                self.procs.append(proc)
                self.live_groups.add(proc.pid)
                if self.signal_received is not None:  # arrived while Popen ran: forward it too
                    try:
                        os.killpg(proc.pid, self.signal_received)
                    except OSError:
                        pass
        finally:
            for rank, proc in enumerate(self.procs):
                prefix = f"[rank {rank}] "
                for pipe, out in ((proc.stdout, self.stdout), (proc.stderr, self.stderr)):
                    assert pipe is not None
                    t = threading.Thread(
                        target=_pump,
                        args=(pipe, prefix, out),
                        name=f"{PROG}-rank{rank}",
                        daemon=True,
                    )
                    t.start()
                    self.readers.append(t)

    def wait(self) -> int:
        """Supervise the children until all have exited; return the launcher's exit code."""
        failure: int | None = None  # exit code of the first failed rank
        while len(self.returncodes) < len(self.procs):
            exited = []
            for rank, proc in enumerate(self.procs):
                if rank not in self.returncodes and proc.poll() is not None:
                    self.returncodes[rank] = proc.returncode
                    exited.append(rank)
            for rank in exited:
                rc = self.returncodes[rank]
                if rc == 0 or failure is not None or self.signal_received is not None:
                    continue  # success, or an expected death while stopping
                failure = exit_code_for(rc)
                self.stderr.write(
                    f"{PROG}: rank {rank} {describe_exit(rc)}; "
                    f"stopping the other {self._alive_count()} processes\n"
                )
                # Also signals the failed rank's own group, in case it left grandchildren.
                self.begin_stop(signal.SIGTERM)
            if len(self.returncodes) == len(self.procs):
                break
            now = time.monotonic()
            if self.killed_at is not None and now - self.killed_at > _REAP_TIMEOUT:
                # Something survives SIGKILL (e.g. uninterruptible sleep): give up on it so the
                # launcher still exits within its time bound.
                self.stderr.write(f"{PROG}: some processes did not die after SIGKILL\n")
                break
            if (
                self.stop_deadline is not None
                and self.killed_at is None
                and now >= self.stop_deadline
            ):
                self.kill_all()
            time.sleep(_POLL_INTERVAL)
        self._cleanup_groups()
        self._join_readers()
        if failure is not None:
            return failure
        if self.signal_received is not None:
            return 128 + self.signal_received
        return 0

    def _cleanup_groups(self) -> None:
        """Terminate grandchildren left in the children's process groups."""
        self._prune_groups()
        if not self.live_groups:
            return
        if self.killed_at is None:
            self.begin_stop(signal.SIGTERM)
            assert self.stop_deadline is not None
            while self.live_groups and time.monotonic() < self.stop_deadline:
                time.sleep(_POLL_INTERVAL)
                self._prune_groups()
            self.kill_all()
        deadline = time.monotonic() + _REAP_TIMEOUT
        while self.live_groups and time.monotonic() < deadline:
            time.sleep(_POLL_INTERVAL)
            self._prune_groups()

    def _join_readers(self) -> None:
        deadline = time.monotonic() + _READER_JOIN_TIMEOUT
        for t in self.readers:
            t.join(max(0.0, deadline - time.monotonic()))

    def abort(self) -> None:
        """Kill and reap everything started so far (used when startup fails)."""
        self.kill_all()
        for p in self.procs:
            try:
                p.wait(_REAP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        self._join_readers()


def launch(
    command: Sequence[str],
    nproc: int,
    *,
    devices_per_proc: int | None = None,
    port: int | None = None,
    kill_timeout: float = DEFAULT_KILL_TIMEOUT,
) -> int:
    """Run ``nproc`` copies of ``command`` wired for ``jax.distributed``; return the exit code.

    SIGINT / SIGTERM handlers are installed for the duration of the call when it runs on the
    main thread (and restored afterwards).
    """
    if port is None:
        port = find_free_port()
    envs = [
        child_env(os.environ, rank=i, nproc=nproc, port=port, devices_per_proc=devices_per_proc)
        for i in range(nproc)
    ]
    launcher = _Launcher(list(command), nproc, kill_timeout)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, launcher.on_signal)
    try:
        try:
            launcher.start(envs)
        except OSError as e:
            launcher.stderr.write(f"{PROG}: cannot start {command[0]!r}: {e}\n")
            launcher.abort()
            return 127 if isinstance(e, FileNotFoundError) else 126
        return launcher.wait()
    except BaseException:
        launcher.abort()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (2 on bad usage)."""
    if argv is None:
        argv = sys.argv[1:]
    try:
        args, command = parse_args(argv)
    except _UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    return launch(
        command,
        args.nproc,
        devices_per_proc=args.devices_per_proc,
        port=args.port,
        kill_timeout=args.kill_timeout,
    )


if __name__ == "__main__":
    sys.exit(main())
