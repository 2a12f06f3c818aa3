"""The exit code of a script whose ``jddp.fit`` was preempted and did not catch it: Python's
``sys.excepthook``, chained (:func:`exit_75_on_uncaught_preemption`), for the call of ``fit``
and after it only when a ``Preempted`` left it (:func:`exiting_75_on_uncaught_preemption`).

No library's internals: a hook of the whole process, installed by ``jddp.fit`` (jddp's
commands map :class:`~jddp.errors.Preempted` to its exit code themselves, :func:`jddp.cli.run`).
Goes when Python lets an exception choose the exit code of an uncaught exit (it has no such
protocol: an uncaught exception is exit 1) and nothing else would.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from jddp.errors import PREEMPTED, Preempted


def exit_75_on_uncaught_preemption() -> None:
    """Make a :class:`~jddp.errors.Preempted` that no caller catches end the script as
    ``python -m jddp.train`` ends: exit 75 (a scheduler requeues on it), no traceback after the
    trainer's one line ``jddp: preempted at step N (SIGTERM); checkpoint ... saved; rerun the
    same command to continue``. It was a traceback and exit 1, which no scheduler requeues.

    Installed once (by :func:`jddp.fit`, through :func:`exiting_75_on_uncaught_preemption`), as
    ``sys.excepthook`` chained to the hook before it (which still gets every other exception);
    the exception itself is unchanged, so a caller can catch it. A ``SystemExit`` raised in the
    hook is the interpreter's exit code, after the normal teardown (atexit handlers, flushed
    output). Only Python's top level calls the hook: an uncaught exception in another thread,
    or in IPython/Jupyter, is shown as before.
    """
    if getattr(sys.excepthook, "jddp_preempted_exits", False):
        return
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if issubclass(kind, Preempted):
            sys.exit(PREEMPTED)  # the trainer printed the one line; nothing more to say
        previous(kind, value, tb)

    excepthook.jddp_preempted_exits = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook


@contextlib.contextmanager
def exiting_75_on_uncaught_preemption() -> Iterator[None]:
    """:func:`exit_75_on_uncaught_preemption` for the block (a library call in the user's
    process): when the block ends, ``sys.excepthook`` is the hook before it again, unless a
    :class:`~jddp.errors.Preempted` leaves the block. That one may reach the top level, where
    the hook is what turns it into exit 75, so the hook stays (for the rest of the process: it
    acts on nothing but an uncaught ``Preempted``). A hook someone else installed over jddp's
    within the block is left in place."""
    before = sys.excepthook
    exit_75_on_uncaught_preemption()
    installed = sys.excepthook
    preempted = False
    try:
        yield
    except Preempted:
        preempted = True
        raise
    finally:
        if not preempted and sys.excepthook is installed:
            sys.excepthook = before
