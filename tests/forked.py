"""A command forked from a process that imported its libraries once (:mod:`tests.preload`),
instead of a new interpreter that imports them again: the ranks of a ``python -m jddp.launch``
that the tests' CLI server forked (:func:`fork_ranks`; jddp.launch itself starts every rank as a
new interpreter, as CI's users lane runs it). tests/test_preload.py checks that the tests' forked
commands behave as new interpreters would.

The child is what :class:`subprocess.Popen` would have started with ``start_new_session=True``,
``stdin=DEVNULL``, ``stdout=PIPE``, ``stderr=PIPE`` and the launcher's ``preexec_fn``: its own
session and process group, PDEATHSIG tied to the launcher, no other file descriptor of the
launcher's children. :class:`ForkedRank` is the ``Popen`` the launcher supervises.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO

from jddp.errors import STOP_SIGNALS

if __package__:  # tests.forked, in pytest's processes
    from . import preload
else:  # beside tests/cli_server.py, which imports the same module as ``preload``
    import preload

_WAIT_INTERVAL_S = 0.01


class ForkedRank:
    """The part of :class:`subprocess.Popen` the launcher uses, for a forked child."""

    def __init__(self, pid: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code (``-N`` for signal N) once the child ended, else None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: nothing more to learn
                pid, status = self.pid, 255 << 8
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end, at most ``timeout`` seconds (``subprocess.TimeoutExpired``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(_WAIT_INTERVAL_S)
        assert self.returncode is not None
        return self.returncode


def start_forked(
    python_args: Sequence[str],
    env: Mapping[str, str],
    in_child: Callable[[], None],
    launchers_fds: Iterable[int],
    cwd: str | None = None,
) -> ForkedRank:
    """Fork ``python PYTHON_ARGS`` (``["-m", MODULE, *ARGS]`` or ``[SCRIPT, *ARGS]``:
    :func:`tests.preload.become`) with environment ``env`` in the folder ``cwd`` (default:
    this process's); ``in_child`` runs in the child first (the launcher's PDEATHSIG),
    ``launchers_fds`` (its other children's pipes) are closed there. The launcher's stop
    signals wait, blocked, until the child has its handlers reset: a signal the launcher
    forwards meanwhile reaches the rank's defaults, never the launcher's handler copied into
    the child."""
    launchers_fds = list(launchers_fds)
    folder = cwd or os.getcwd()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    ready_r, ready_w = os.pipe()
    preload.flush_output()  # nothing buffered here is written again by the child
    pid = -1
    try:
        pid = os.fork()
        if pid == 0:
            try:  # the child never goes back up into the launcher's code
                inherited = [out_r, err_r, ready_r, *launchers_fds]
                _child(python_args, env, folder, in_child, inherited, (out_w, err_w), ready_w,
                       blocked)  # fmt: skip
            finally:
                os._exit(1)
    finally:
        if pid != 0:
            for fd in (out_w, err_w, ready_w):
                os.close(fd)
            if pid > 0:
                os.read(ready_r, 1)  # EOF once the child has reset its handlers (or ended)
            else:  # the fork failed: its OSError goes up
                os.close(out_r)
                os.close(err_r)
            os.close(ready_r)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return ForkedRank(pid, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))


def _child(python_args, env, cwd, in_child, close_fds, outputs, ready_w, blocked) -> None:
    """The forked child: never returns into the launcher's code; ends by ``os._exit``."""
    code = 1
    try:
        preload.reset_signal_handlers()
        os.setsid()
        os.close(ready_w)
        in_child()
        for fd in close_fds:
            os.close(fd)
        preload.become(python_args, env, cwd, outputs)
        # A stop signal that came meanwhile reaches the command as it starts, as one that
        # reaches a new interpreter before the command's first statement.
        unblock = functools.partial(signal.pthread_sigmask, signal.SIG_SETMASK, blocked)
        code = preload.run_as_main(python_args, first=unblock)
    except BaseException:
        try:
            why = f"jddp.launch: a forked rank failed to start: {sys.exc_info()[1]!r}\n"
            os.write(2, why.encode())
        except OSError:
            pass
    finally:
        os._exit(code)


def fork_ranks() -> None:
    """In a ``python -m jddp.launch`` the tests' CLI server forked: its ranks of jddp's commands
    and the repository's scripts (:func:`tests.preload.forked_args`) forked from the libraries
    the server imported, as the server forks commands, instead of new interpreters that import them
    again (~3.9 CPU-s a rank on the 2-core VM, 2026-11-29). Each rank still runs as ``python -m
    MODULE ARGS`` would (:func:`start_forked`); one whose environment the imports read
    (:meth:`tests.preload.Imports.allows`), or started while another thread runs here (a
    restart, the previous ranks' output still read: a fork copies only the calling thread),
    is a new interpreter. What this cannot give: ``/proc/PID/environ`` holds the server's
    environment, not the rank's (tests of that run the launcher anew: ``fresh=True``)."""
    from jddp.launch import local

    imports = preload.preload()
    spawn = local.Launcher._start_rank
    if imports is None or getattr(spawn, "forks", False):
        return

    def start_rank(self, env, die_with_launcher):
        python_args = preload.forked_args(self.command, env, os.getcwd())
        if python_args is None or threading.active_count() != 1 or not imports.allows(env):
            return spawn(self, env, die_with_launcher)
        pipes = [pipe.fileno() for proc in self.procs for pipe in (proc.stdout, proc.stderr)]
        return start_forked(python_args, env, die_with_launcher, pipes)

    start_rank.forks = True  # type: ignore[attr-defined]
    local.Launcher._start_rank = start_rank
