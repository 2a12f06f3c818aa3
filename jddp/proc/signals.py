"""Stop signals to a stop every process agrees on: :class:`StopRequest` records SIGTERM, SIGUSR1,
SIGINT and SIGHUP; each batch carries the flag (:data:`STOP_KEY`), so all processes stop and
save at the same step. Light on purpose (no JAX): ``python -m jddp.train`` installs it first
thing, so a signal that arrives while JAX starts or the job assembles is kept, not fatal. The
commands that save nothing (evaluate, export) turn Ctrl-C into exit 130 instead:
:mod:`jddp.proc.interrupt`, free of numpy so they install it in their first statement."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np

from jddp.errors import STOP_SIGNALS
from jddp.proc.interrupt import exit_interrupted

STOP_KEY = "sys/stop"  # per-row stop request in a batch; > 0 in the metrics if any process asked
FINISH_KEY = "sys/finish"  # per-row "end the run as finished" (a callback's wish)
SAVE_KEY = "sys/save"  # per-row "a checkpoint is due by the clock" (checkpoint.every_minutes)
SECOND_CTRL_C = " again: stopped at once, not saved (the last checkpoint is kept)"


class TimedSaves:
    """``checkpoint.every_minutes``: a checkpoint when that long has passed since the last one.
    Each process looks at its own clock and puts the answer in its rows of the batch
    (:data:`SAVE_KEY`); the step's max over processes comes back with the step's metrics, so
    every process saves at the same step (:meth:`take`), whatever its clock said."""

    def __init__(self, every_minutes: float | None):
        self.every_s = every_minutes * 60 if every_minutes else None
        self.last = time.monotonic()
        self.requested = False  # set from a step's metrics (jddp.run.hooks.StepReporter)

    def flags(self, rows: int) -> dict[str, np.ndarray]:
        """This process's rows of the batch's save flags (none when off)."""
        if self.every_s is None:
            return {}
        due = time.monotonic() - self.last >= self.every_s
        return {SAVE_KEY: np.full(rows, float(due), np.float32)}

    def take(self) -> bool:
        """Whether every process is to save now (once per request)."""
        requested, self.requested = self.requested, False
        return requested

    def saved(self) -> None:
        """A checkpoint was saved: the clock starts again."""
        self.last = time.monotonic()


def _say_finishing(name: str, what: str) -> None:
    """One line on stderr (from a signal handler: ``os.write``, no buffered stream)."""
    again = "; Ctrl-C again stops at once" if name == "SIGINT" else ""
    os.write(2, f"jddp: {name} after the last step: finishing the {what}{again}\n".encode())


class StopRequest:
    """Records SIGTERM/SIGUSR1 (SLURM's warning before a time-out), Ctrl-C (SIGINT) and SIGHUP
    (:data:`~jddp.errors.STOP_SIGNALS`) while installed; every batch carries the flag so all
    processes agree on the step at which to stop and save. A second SIGINT ends the process at
    once: one line, exit 130, no checkpoint (a ``KeyboardInterrupt`` raised inside a JAX call
    came out as a traceback and a 2,000-character ``JaxRuntimeError``, exit 1)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.finish_reason: str | None = None  # a callback's early end (saved, exit 0)
        self._previous: dict[int, Any] = {}
        self._finishing: str | None = None  # what the run does after its last step

    def __enter__(self) -> StopRequest:
        self.install()
        return self

    def install(self) -> None:
        """Install the handlers (again): ``jax.distributed.initialize`` installs its own SIGTERM
        handler (TSL's preemption notifier), which would take SIGTERM from the run unless this
        runs after it; ``__exit__`` restores what was there before the first install."""
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous.setdefault(sig, signal.signal(sig, self._handle))

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.signal_name == name:  # the second Ctrl-C: now
            exit_interrupted(signum, frame, SECOND_CTRL_C)
        self.signal_name = name
        if self._finishing is not None:  # no step left to stop at: say what happens instead
            _say_finishing(name, self._finishing)

    def finishing(self, what: str) -> None:
        """The run has taken its last step and now does ``what`` (its final save and eval): a
        stop signal from here on (or one that came after the last step) no longer stops it
        at a step; it is said in one line (it was ignored without a word)."""
        self._finishing = what
        if self.signal_name is not None:
            _say_finishing(self.signal_name, what)

    def __exit__(self, *exc: Any) -> None:
        self._finishing = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def finish(self, reason: str) -> None:
        """End the run early as a finished one (a callback's wish, e.g. early stopping)."""
        self.finish_reason = self.finish_reason or reason

    def flags(self, rows: int) -> dict[str, np.ndarray]:
        """This process's rows of the batch's flags: :data:`STOP_KEY` for a stop signal,
        :data:`FINISH_KEY` for :meth:`finish`. Two keys, each > 0 when any process asked: the
        step averages its metrics over processes (a value's meaning would not survive a
        mean); a signal wins (save and exit 75) when both came."""
        return {
            STOP_KEY: np.full(rows, self.signal_name is not None, np.float32),
            FINISH_KEY: np.full(rows, self.finish_reason is not None, np.float32),
        }
