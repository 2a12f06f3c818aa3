"""Stop signals to a stop every process agrees on: :class:`StopRequest` records SIGTERM, SIGUSR1,
SIGINT and SIGHUP; each batch carries the flag (:data:`STOP_KEY`), so all processes stop and
save at the same step. Light on purpose (no JAX, NumPy only when a batch's flags are made):
``python -m jddp.train`` installs it in its first statement, so a signal that arrives while the
command's libraries load, JAX starts or the job assembles is kept, not fatal. The
commands that save nothing (evaluate, export) turn Ctrl-C into exit 130 instead:
:mod:`jddp.proc.interrupt`, free of numpy so they install it in their first statement."""

from __future__ import annotations

import os
import signal
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

from jddp.errors import STOP_SIGNALS
from jddp.proc.interrupt import exit_interrupted

STOP_KEY = "sys/stop"  # per-row stop request in a batch; > 0 in the metrics if any process asked
FINISH_KEY = "sys/finish"  # per-row "end the run as finished" (a callback's wish)
_STOP_NUMBERS = frozenset(int(sig) for sig in STOP_SIGNALS)  # as the wakeup fd writes them
SECOND_CTRL_C = " again: stopped at once, not saved (the last checkpoint is kept)"


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
        self._wakeup: tuple[int, int] | None = None  # (read, write) ends of a wakeup-fd pipe
        self._wakeup_lock = threading.RLock()  # (the handler reads too, maybe inside __exit__)
        self._arrived: str | None = None  # seen on the pipe, before the handler ran
        self._ctrl_cs = 0  # SIGINTs seen on the pipe (two while blocked: one handler call)

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
            self._watch_arrivals()

    def _watch_arrivals(self) -> None:
        """Python runs a signal's handler in the main thread between bytecodes: while that
        thread waits in a JAX call (a step that never ends) the handler waits too. The C-level
        handler also writes the signal's number to the wakeup fd at once: a pipe here, read by
        :meth:`arrived` from another thread (the stall watchdog). Left alone when the process
        has a wakeup fd already (asyncio's)."""
        if self._wakeup is not None:
            return
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        os.set_blocking(write_end, False)
        try:
            previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        except ValueError:
            previous = None
        if previous != -1:  # someone else's, or none possible: theirs stays
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(read_end)
            os.close(write_end)
            return
        self._wakeup = (read_end, write_end)

    def arrived(self) -> str | None:
        """The stop signal this process has received, if any — from any thread, even while the
        main thread is blocked and its handler has not run yet (then read from the wakeup
        pipe; the handler still runs when the main thread is back). A second Ctrl-C seen there
        ends the process at once, as the handler would (the stall watchdog asks every poll:
        Python runs the handler once for two SIGINTs that came while the main thread waited in
        a JAX call, and only once it is back)."""
        with self._wakeup_lock:  # read every time: a second Ctrl-C is counted here
            if self._wakeup is not None:
                try:
                    numbers = os.read(self._wakeup[0], 512)
                except OSError:  # nothing written (EAGAIN)
                    numbers = b""
                stops = [n for n in numbers if n in _STOP_NUMBERS]
                if stops and self._arrived is None:
                    self._arrived = signal.Signals(stops[0]).name
                self._ctrl_cs += stops.count(signal.SIGINT)
                if self._ctrl_cs >= 2:  # Python runs the handler once for both while blocked
                    exit_interrupted(signal.SIGINT, None, SECOND_CTRL_C)
        return self.signal_name or self._arrived

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        self.arrived()  # (two Ctrl-C while the main thread was blocked: one call, two bytes)
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
        with self._wakeup_lock:
            if self._wakeup is not None:
                signal.set_wakeup_fd(-1)
                for end in self._wakeup:
                    os.close(end)
                self._wakeup = None

    def finish(self, reason: str) -> None:
        """End the run early as a finished one (a callback's wish, e.g. early stopping)."""
        self.finish_reason = self.finish_reason or reason

    def flags(self, rows: int) -> dict[str, np.ndarray]:
        """This process's rows of the batch's flags: :data:`STOP_KEY` for a stop signal,
        :data:`FINISH_KEY` for :meth:`finish`. Two keys, each > 0 when any process asked: the
        step averages its metrics over processes (a value's meaning would not survive a
        mean); a signal wins (save and exit 75) when both came."""
        import numpy as np

        return {
            STOP_KEY: np.full(rows, self.signal_name is not None, np.float32),
            FINISH_KEY: np.full(rows, self.finish_reason is not None, np.float32),
        }
