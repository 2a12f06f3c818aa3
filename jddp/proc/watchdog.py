"""A stalled run ends instead of hanging: ``dist.step_timeout_s`` without progress stops it.

A rank that hangs while alive — an input pipeline stuck on a dead NFS mount, a deadlock in user
code, a wedged accelerator, a peer stopped with SIGSTOP — leaves every other rank waiting in the
step's all-reduce forever: nothing is printed and the allocation burns until something outside
kills the job. PyTorch's NCCL watchdog aborts a collective after its timeout; jddp's is a thread
in every process that watches the run's progress (a step's results read, an eval batch done, a
checkpoint written) and, when none came for ``dist.step_timeout_s`` seconds
(``dist.first_step_timeout_s`` until the first step is done: it compiles), prints one line
naming the stalled step, how long, and what this rank was waiting for, and exits with
:data:`~jddp.errors.STALLED` at once: nothing more is saved (a checkpoint in flight never
appears under a step name), the launcher or SLURM ends the other ranks, and a rerun resumes
from the newest checkpoint. Not 75: a rerun of a job that stalls may stall again — unless a stop
signal (SIGTERM, SIGUSR1, …) had already asked the run to stop: then its sender (SLURM, a
preempting scheduler) is told 75 as for any stop, the line saying that nothing was saved, and a
job whose step stalls where the scheduler stops it is requeued (a SLURM job exiting 124 was not).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from jddp.errors import PREEMPTED, STALLED

# Set once this process's watchdog has fired: what the main thread then raises (its collective
# failing as a peer exits) is a consequence, not news (jddp.cli exits with the watchdog's code,
# without a word).
FIRED = threading.Event()
_FIRED_EXIT = [STALLED]  # the exit code the fired watchdog chose (75 when a stop was asked)


def fired_exit_code() -> int:
    """The exit code of this process's fired watchdog: what the main thread exits with too when
    its collective fails first, within the watchdog's grace (else a rank could say 75 in its
    line and exit 124)."""
    return _FIRED_EXIT[0]


# How long a fired watchdog keeps its process alive before exiting: the peers' watchdogs, whose
# stall began at most a step later, fire meanwhile and say what *they* waited for, instead of
# seeing their all-reduce fail on this process's exit first.
GRACE_S = 10.0
# Process 0 hosts JAX's coordination service: once it is gone, a peer still alive ends with
# SIGABRT and a page of stacks ("Terminating process because the JAX distributed service
# detected fatal errors") instead of its own exit code. So process 0 leaves this much after its
# peers, whose watchdogs fire a poll or a step after its own (a peer that lingered 4 s longer
# than process 0 aborted every time; process 0 lingering 4 s longer lost nothing, 2026-11-28).
LEADER_LAST_S = 5.0

# What a rank may be waiting for, as the stall line says it.
WAITING = {
    "start": "the run to start (restoring, compiling)",
    "input": "the next batch from the input pipeline",
    "step": "the step's results (its computation, or its all-reduce with the other processes)",
    "checkpoint": "a checkpoint to be written",
    "eval": "an eval batch",
    # the step's results while one of this process's own host callbacks still runs: this
    # process is the one that stalled (its peers wait in the all-reduce)
    "callback": "the step's results, held by a host callback of its own",
}
OWN_WAITS = ("input", "callback")  # what only this process can be stuck on (the launcher asks)


def waiting_for(what: str) -> str:
    """What the stall line says this process waited for: :data:`WAITING`'s text for ``what``;
    for a step whose own host callback still runs, that callback (``name (file:line)``)."""
    if what == "step":
        from jddp.compat.jax_backend import running_host_callback

        callback = running_host_callback()
        if callback is not None:
            return f"{WAITING['callback']}: {callback}"
    return WAITING.get(what, what)


class StallWatchdog:
    """Watches progress from a daemon thread (see the module docstring). ``first_timeout_s``
    holds until the first step is done, ``timeout_s`` after it; None is no limit in that phase
    (both None: no thread). Call :meth:`waiting` when the loop starts to wait for something,
    :meth:`progress` when something finished, :meth:`finished` when the run's work is done (a
    tracker's bounded wait at the end is no stall); use as a context manager around the run.
    ``stop_signal()`` names the stop signal the run has received, if any (then a stall exits
    :data:`~jddp.errors.PREEMPTED`, not :data:`~jddp.errors.STALLED`); given, it is asked
    every poll (:meth:`jddp.proc.signals.StopRequest.arrived`, where a second Ctrl-C that came
    while the main thread is blocked ends the process), with or without a time limit."""

    def __init__(
        self,
        timeout_s: float | None,
        first_timeout_s: float | None,
        process_index: int = 0,
        poll_s: float = 0.5,
        after: str = "stopping without saving (exit 124); a rerun resumes from the newest "
        "checkpoint",
        stop_signal: Callable[[], str | None] | None = None,
    ):
        self.after = after  # what the stall line says happens now
        self._asks = stop_signal is not None  # asked every poll, even without a time limit
        self.stop_signal = stop_signal or (lambda: None)
        self.timeout_s = timeout_s
        self.first_timeout_s = first_timeout_s
        self.process_index = process_index
        self.poll_s = poll_s
        self.what = "start"
        self.step = 0  # the step being waited for
        self.first_done = False
        self.last_s = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def waiting(self, what: str, step: int | None = None) -> None:
        """The rank now waits for ``what`` (a key of :data:`WAITING`) of step ``step``."""
        self.what = what
        if step is not None:
            self.step = step

    def progress(self, step_done: bool = False) -> None:
        """Something finished (``step_done``: a step's results were read): the clock restarts."""
        self.last_s = time.monotonic()
        self.first_done = self.first_done or step_done

    def finished(self) -> None:
        """The run's work is done (trained, saved, evaluated): nothing more is watched."""
        self._stop.set()

    def __enter__(self) -> StallWatchdog:
        if self.timeout_s is not None or self.first_timeout_s is not None or self._asks:
            self.last_s = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="jddp-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def overdue(self, now: float | None = None) -> tuple[float, float] | None:
        """``(seconds without progress, the limit)`` when this phase's limit has passed by
        ``now`` (default: the clock's), else None (within it, or no limit in this phase)."""
        limit = self.timeout_s if self.first_done else self.first_timeout_s
        stalled_s = (time.monotonic() if now is None else now) - self.last_s
        return (stalled_s, limit) if limit is not None and stalled_s > limit else None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self._asks:
                self.stop_signal()  # (a second Ctrl-C ends the process there, at once)
            due = self.overdue()
            if due is not None:
                self._fire(*due)

    def _fire(self, stalled_s: float, limit: float) -> None:
        key = "dist.step_timeout_s" if self.first_done else "dist.first_step_timeout_s"
        signal_name, code, after = self.stop_signal(), STALLED, self.after
        if signal_name is not None:  # it was being stopped anyway: tell its sender 75
            code = PREEMPTED
            after = after.replace("exit 124", f"exit 75, as {signal_name} asked")
        line = (
            f"jddp: error: step {self.step} stalled: no progress for {stalled_s:.0f} s "
            f"({key}={limit:g}); process {self.process_index} was waiting for "
            f"{waiting_for(self.what)}; {after}\n"
        )
        _FIRED_EXIT[0] = code
        FIRED.set()
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - the one line below is what matters
            pass
        os.write(2, line.encode())
        time.sleep(self.linger_s(limit))
        os._exit(code)

    def linger_s(self, limit: float) -> float:
        """Seconds a fired watchdog keeps its process alive: :data:`GRACE_S` (at most the
        limit), and process 0 :data:`LEADER_LAST_S` more."""
        return min(GRACE_S, limit) + (LEADER_LAST_S if self.process_index == 0 else 0.0)
