"""Ctrl-C as one line ``jddp: interrupted`` and exit 130, for the commands that save nothing
(``python -m jddp.evaluate``, ``python -m jddp.export``).

Dependency-free on purpose: it imports only ``os``, ``signal`` and :mod:`jddp.errors` (which
imports only ``signal``), so a command can install the handler in its first statement, before
argparse, numpy or JAX load. A ``KeyboardInterrupt`` raised inside ``import jax`` printed a
40-line traceback, inside one of XLA's garbage-collection callbacks it was swallowed (the command
went on to exit 0), and one raised while ``jddp/__init__.py`` was still importing ``typing``
printed a traceback and exit -2 (the handler was installed only once numpy had loaded).
"""

from __future__ import annotations

import os
import signal

from jddp.errors import INTERRUPTED


def exit_interrupted(signum: int, frame: object, why: str = "") -> None:
    """The SIGINT handler: write one line (``jddp: interrupted``, then ``why``) and end the
    process at once with exit 130 (no ``KeyboardInterrupt`` that library code could swallow or
    turn into a traceback)."""
    os.write(2, f"jddp: interrupted{why}\n".encode())
    os._exit(INTERRUPTED)


class interrupts_exit:
    """While installed, Ctrl-C at any moment is one line ``jddp: interrupted`` and exit 130.

    ``install()`` puts the handler in place and keeps the one it replaces (installing again is a
    no-op); leaving a ``with`` block restores that one (a command run in-process, as the tests
    do). A command installs it as its first statement, ``interrupts_exit().install()``, and
    wraps its ``main`` in ``with`` the same object: "any moment" is then from the moment the
    command's module runs — after Python's own start-up and ``jddp/__init__.py`` (which imports
    nothing that takes time), before anything else loads.
    """

    def __init__(self) -> None:
        self._previous: object = None
        self._installed = False

    def install(self) -> interrupts_exit:
        """Install the handler unless it already is (call it from the main thread: Python sets
        signal handlers nowhere else); returns ``self``."""
        if not self._installed:
            self._previous = signal.signal(signal.SIGINT, exit_interrupted)
            self._installed = True
        return self

    def __enter__(self) -> interrupts_exit:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]
            self._installed = False
