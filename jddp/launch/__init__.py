"""Local multi-process launcher for ``jax.distributed`` (like ``torchrun --nproc_per_node``).

Usage::

    python -m jddp.launch --nproc N [--devices-per-proc K] [--port P] [--kill-timeout S] \\
        [--max-restarts K] [--restart-delay S] -- <command ...>

Starts ``N`` copies of ``<command>``, each a new process (``subprocess.Popen`` with
``start_new_session=True``, as torchrun starts its workers) in its own session / process group,
with the environment that :mod:`jddp.distributed` reads, in its own environment (a rank's id is
in ``/proc/PID/environ``, where tools look for it):

* ``JDDP_COORDINATOR_ADDRESS=localhost:<port>`` (a free port unless ``--port`` is given),
* ``JDDP_NUM_PROCESSES=N``, ``JDDP_PROCESS_ID=<i>``, ``JDDP_LOCAL_RANK=<i>``,
* ``PYTHONUNBUFFERED=1``, ``JDDP_LAUNCHER_PID=<the launcher's pid>``,
* with ``--devices-per-proc K``: ``XLA_FLAGS`` gets ``--xla_force_host_platform_device_count=K``
  (replacing any existing value of that flag) and ``JAX_PLATFORMS=cpu`` unless already set.

Every line a child writes is forwarded to the launcher's stdout / stderr with a ``[rank i] ``
prefix. Children read from ``/dev/null``. The signals ``jddp.train`` treats as preemption
(SIGINT, SIGTERM, SIGUSR1, SIGHUP; :data:`jddp.errors.STOP_SIGNALS`) received by the launcher are
forwarded to every child's process group (a second signal, or 120 s without an end, escalates to
SIGKILL: time for the ranks' next step and checkpoint); when every rank
then exits 75 (preempted: checkpoint saved), so does the launcher, else it exits 128 + signal.
SIGUSR1 and SIGHUP, which kill a process that has no handler for them, are held for a child in
its first seconds until it catches them (a rank still starting Python would die of them).

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
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from jddp.errors import INTERRUPTED, PREEMPTED, STOP_SIGNALS
from jddp.launch.local import Launcher as _Launcher
from jddp.launch.restarts import (
    Restarts,
    workdir_of,
)
from jddp.launch.supervise import (
    PROG,
    STOP_GRACE_S,
    Wakeup,
    describe_exit,
    exit_code_for,
    signal_name,
)
from jddp.proc.lifeline import LAUNCHER_PID_ENV, watch_launcher

__all__ = [
    "LAUNCHER_PID_ENV",
    "child_env",
    "describe_exit",
    "exit_code_for",
    "launch",
    "main",
    "merge_xla_flags",
    "watch_launcher",
]

DEFAULT_KILL_TIMEOUT = 10.0
DEFAULT_RESTART_DELAY = 3.0
# Caps --kill-timeout so that the launcher always exits within 60 s of the first failure.
MAX_KILL_TIMEOUT = 45.0
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count="


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
            "[--kill-timeout S] [--max-restarts K] [--restart-delay S] "
            "-- <command ...>"
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
        help=f"seconds between SIGTERM and SIGKILL when stopping processes after a failure "
        f"(default {DEFAULT_KILL_TIMEOUT:g}, at most {MAX_KILL_TIMEOUT:g}); after a forwarded "
        f"stop signal the ranks get {STOP_GRACE_S:g} s to save, a second signal kills at once",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="when a rank dies (a signal, a stall, a dead peer), stop the group and start it "
        "again, resuming from the newest checkpoint, at most K times (default 0); a "
        "preemption (exit 75), bad input (2) or a stop signal to the launcher is not restarted",
    )
    parser.add_argument(  # every rank is a new interpreter: kept for older command lines
        "--spawn", action="store_true", help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--restart-delay",
        type=float,
        default=DEFAULT_RESTART_DELAY,
        metavar="S",
        help=f"seconds to wait before a restart (default {DEFAULT_RESTART_DELAY:g})",
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
    if args.max_restarts < 0:
        raise _UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not 0 <= args.restart_delay <= 3600:
        raise _UsageError(f"--restart-delay must be in 0..3600 s, got {args.restart_delay:g}")
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
    env["JDDP_LOCAL_WORLD_SIZE"] = str(nproc)  # one machine: every process is local
    env["PYTHONUNBUFFERED"] = "1"
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    if devices_per_proc is not None:
        env["XLA_FLAGS"] = merge_xla_flags(env.get("XLA_FLAGS"), devices_per_proc)
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def launch(
    command: Sequence[str],
    nproc: int,
    *,
    devices_per_proc: int | None = None,
    port: int | None = None,
    kill_timeout: float = DEFAULT_KILL_TIMEOUT,
    max_restarts: int = 0,
    restart_delay: float = DEFAULT_RESTART_DELAY,
) -> int:
    """Run ``nproc`` copies of ``command`` wired for ``jax.distributed``; return the exit code.
    With ``max_restarts``, a group whose rank died is started again (:mod:`.restarts`).

    Handlers for the stop signals (SIGINT, SIGTERM, SIGUSR1, SIGHUP) are installed for the
    duration of the call when it runs on the main thread (and restored afterwards).
    """
    # (the config is read only for restarts: a rank may be the one meant to read it first)
    restarts = Restarts(max_restarts, workdir_of(command) if max_restarts else None)
    with _SignalsBetweenStarts(keep=_keep_handlers) as between:
        while True:
            if between.received is not None:  # before any rank started, or between restarts
                name = signal_name(between.received)
                sys.stderr.write(f"{PROG}: received {name} with no process running; stopped\n")
                return INTERRUPTED if between.received == signal.SIGINT else PREEMPTED
            code = _start_group(command, nproc, kill_timeout, devices_per_proc, port, restarts)
            if code is not None:
                between.ended(code)
                return code
            between.wait(restart_delay)


class _SignalsBetweenStarts:
    """The launcher's stop signals while no rank runs (its own start, a restart's delay, and
    once the ranks are gone): a SIGTERM then ends the launcher in one line (exit 75, 130 for
    Ctrl-C), not by the signal's default (killed, no line). Once the group has ended
    (:meth:`ended`), a stop signal is one line and the launcher's exit code at once
    (``keep``: the command's process; its handlers then stay until the process ends,
    :func:`exit_now`: a second Ctrl-C after the ranks had saved and exited 75 met Python's
    default handler, a ``KeyboardInterrupt`` traceback, or the interpreter's teardown, which
    puts the signal's default back: killed, no line, exit -2)."""

    def __init__(self, keep: bool = False) -> None:
        self.keep = keep
        self._code: int | None = None
        self._previous: dict[int, Any] = {}
        self._wakeup = Wakeup()

    def __enter__(self) -> _SignalsBetweenStarts:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    @property
    def received(self) -> int | None:
        """The first stop signal that came, if any."""
        return self._wakeup.received

    def _record(self, signum: int, frame: object) -> None:
        if self._code is not None:
            self._after_the_end(signum)
        self._wakeup.wake(signum)

    def ended(self, code: int) -> None:
        """The group has ended with the launcher's exit ``code``: what a stop signal says from
        now on (one that came since the ranks ended is said now)."""
        self._code = code
        if self.received is not None:
            self._after_the_end(self.received)

    def _after_the_end(self, signum: int) -> None:
        os.write(
            2,
            f"{PROG}: received {signal_name(signum)} after every process ended; exiting with "
            f"code {self._code}\n".encode(),
        )
        if self.keep:
            exit_now(self._code or 0)

    def wait(self, seconds: float) -> bool:
        """Sleep ``seconds``, or until a stop signal arrives (one that came before returns at
        once); whether one did."""
        if self.received is None:
            self._wakeup.sleep(seconds)
        return self.received is not None

    def __exit__(self, *exc: object) -> None:
        if self.keep and exc[0] is None:
            return  # until the process ends (exit_now)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._wakeup.close()


_keep_handlers = False  # python -m jddp.launch: the stop signals' handlers stay to the end


def exit_now(code: int) -> NoReturn:
    """End the launcher's process with ``code`` now: its output flushed, without the
    interpreter's teardown (which puts every signal's default back, so a Ctrl-C during it
    killed the launcher: no line, exit -2; the launcher has nothing else to tear down)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _start_group(
    command: Sequence[str],
    nproc: int,
    kill_timeout: float,
    devices_per_proc: int | None,
    port: int | None,
    restarts: Restarts,
) -> int | None:
    """One start of the group; its exit code, or None when it is to be started again."""
    launcher = _Launcher(list(command), nproc, kill_timeout)
    code = _launch_once(launcher, command, nproc, devices_per_proc, port, restarts.watch)
    cause = launcher.cause or f"rank 0 {describe_exit(code)}"
    refusal = restarts.refusal(code, launcher.signal_received, cause)
    if refusal is not None:
        if refusal:
            launcher.stderr.write(f"{PROG}: {refusal}\n")
        return code
    launcher.stderr.write(f"{PROG}: {restarts.restarting(cause)}\n")
    return None


def _launch_once(
    launcher: _Launcher,
    command: Sequence[str],
    nproc: int,
    devices_per_proc: int | None,
    port: int | None,
    on_poll: Callable[[], None] = lambda: None,
) -> int:
    """One start of the group under ``launcher``; its exit code (``on_poll``: called as the
    launcher polls its ranks)."""
    if port is None:
        port = find_free_port()
    envs = [
        child_env(os.environ, rank=i, nproc=nproc, port=port, devices_per_proc=devices_per_proc)
        for i in range(nproc)
    ]
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            previous[sig] = signal.signal(sig, launcher.on_signal)
    try:
        try:
            launcher.start(envs)
        except OSError as e:
            launcher.stderr.write(f"{PROG}: cannot start {command[0]!r}: {e}\n")
            launcher.abort()
            return 127 if isinstance(e, FileNotFoundError) else 126
        return launcher.wait(on_poll)
    except BaseException:
        launcher.abort()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def command() -> NoReturn:
    """``python -m jddp.launch``: :func:`main`, its stop signals' handlers kept until the
    process ends (:func:`exit_now`), so that a stop signal after the ranks ended is one line
    and the launcher's exit code."""
    global _keep_handlers
    _keep_handlers = True
    exit_now(main())


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
        max_restarts=args.max_restarts,
        restart_delay=args.restart_delay,
    )
