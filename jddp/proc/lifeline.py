"""Ranks die with their launcher: ``PR_SET_PDEATHSIG`` set between fork and exec, and a parent
watch in the rank (where the platform has no prctl, or behind a wrapper that forks). Input
worker processes die with their rank the same way (:func:`worker_lifeline`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from typing import Any

LAUNCHER_PID_ENV = "JDDP_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_WATCH_INTERVAL = 1.0  # seconds between a rank's checks that its parent is still there


def load_prctl() -> Any:
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


def die_with_parent(prctl: Any, parent: int) -> None:
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

    return _die_when_parent_changes(parent, interval, "jddp.launch-watch")


def _die_when_parent_changes(parent: int, interval: float, name: str) -> threading.Thread:
    """A daemon thread that SIGKILLs this process once its parent is no longer ``parent``."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.start()
    return thread


def worker_lifeline(worker_index: int = 0, worker_count: int = 0) -> None:
    """grain's ``worker_init_fn`` for jddp's input worker processes: the worker ends (SIGKILL)
    within a second of its run's process, whatever ended that (``kill -9``, the OOM killer,
    the launcher's PDEATHSIG); with the workers gone, multiprocessing's resource tracker sees
    its last user go and exits too. Ctrl-C is the run's to handle (it saves, then stops the
    workers): a worker ignores SIGINT instead of printing a traceback of its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_when_parent_changes(os.getppid(), _WATCH_INTERVAL, "jddp.worker-lifeline")
