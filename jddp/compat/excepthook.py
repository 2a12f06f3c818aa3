"""The exit of a script whose ``jddp.fit`` raised a jddp error it did not catch: Python's
``sys.excepthook``, chained (:func:`exit_code_on_uncaught_jddp_error`), for the call of ``fit``
and after it only when a :class:`~jddp.errors.JddpError` left it
(:func:`exiting_on_uncaught_jddp_error`).

No library's internals: a hook of the whole process, installed by ``jddp.fit`` (jddp's
commands map every :class:`~jddp.errors.JddpError` to its line and exit code themselves,
:func:`jddp.cli.run`). Goes when Python lets an exception choose the exit code of an uncaught
exit (it has no such protocol: an uncaught exception is a traceback and exit 1) and nothing else
would.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from jddp.errors import JddpError, Preempted, one_line

MARK = "jddp_preempted_exits"  # the hook's attribute: installed already (the name it had)


def exit_code_on_uncaught_jddp_error() -> None:
    """Make a :class:`~jddp.errors.JddpError` that no caller catches end the script as
    ``python -m jddp.train`` ends: one line on stderr, ``jddp: error: <the message>``, and the
    error's exit code (2 for a :class:`~jddp.errors.ConfigError`: a bad key or value, an
    unsupported combination; 1 for the others), no traceback. A
    :class:`~jddp.errors.Preempted` is exit 75 and nothing more: the trainer printed its line
    (``jddp: preempted at step N (SIGTERM); checkpoint ... saved; rerun the same command to
    continue``). Both were a traceback and exit 1, which no scheduler requeues and no script
    tells from a crash.

    Installed once (by :func:`jddp.fit`, through :func:`exiting_on_uncaught_jddp_error`), as
    ``sys.excepthook`` chained to the hook before it (which still gets every other exception);
    the exception itself is unchanged, so a caller can catch it. A ``SystemExit`` raised in the
    hook is the interpreter's exit code, after the normal teardown (atexit handlers, flushed
    output). Only Python's top level calls the hook: an uncaught exception in another thread,
    or in IPython/Jupyter, is shown as before.
    """
    if getattr(sys.excepthook, MARK, False):
        return
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if issubclass(kind, JddpError):
            if not issubclass(kind, Preempted):  # (the trainer said a preemption in its line)
                sys.stdout.flush()
                print(f"jddp: error: {one_line(value)}", file=sys.stderr, flush=True)
            sys.exit(getattr(value, "exit_code", 1))
        previous(kind, value, tb)

    setattr(excepthook, MARK, True)
    sys.excepthook = excepthook


@contextlib.contextmanager
def exiting_on_uncaught_jddp_error() -> Iterator[None]:
    """:func:`exit_code_on_uncaught_jddp_error` for the block (a library call in the user's
    process): when the block ends, ``sys.excepthook`` is the hook before it again, unless a
    :class:`~jddp.errors.JddpError` leaves the block. That one may reach the top level, where
    the hook is what turns it into its line and exit code, so the hook stays (for the rest of
    the process: it acts on nothing but an uncaught ``JddpError``). A hook someone else
    installed over jddp's within the block is left in place."""
    before = sys.excepthook
    exit_code_on_uncaught_jddp_error()
    installed = sys.excepthook
    raised = False
    try:
        yield
    except JddpError:
        raised = True
        raise
    finally:
        if not raised and sys.excepthook is installed:
            sys.excepthook = before


# The names these had while they acted on a preemption alone.
exit_75_on_uncaught_preemption = exit_code_on_uncaught_jddp_error
exiting_75_on_uncaught_preemption = exiting_on_uncaught_jddp_error
