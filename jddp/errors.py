"""jddp's exceptions and the process exit code each one stands for (the CLI's contract).

Every error jddp raises on purpose is a :class:`JddpError`; the CLI prints its message as one
line on stderr and exits with its ``exit_code``. Nothing matches message text or sniffs
attributes: the class says what kind of failure it is.
"""

from __future__ import annotations

import signal

SUCCESS = 0
FAILURE = 1  # any other failure; one-line cause on stderr
BAD_INPUT = 2  # bad config or command line; the message names the key
PREEMPTED = 75  # EX_TEMPFAIL: a stop signal arrived, a checkpoint was saved; rerun to continue
INTERRUPTED = 130  # a second Ctrl-C: stopped at once, without a checkpoint
STALLED = 124  # no progress for dist.step_timeout_s: stopped at once, without saving (as timeout)

# The signals a run treats as preemption (save, exit PREEMPTED) and that ``jddp.launch``
# forwards to its ranks: SIGTERM (schedulers, ``kill``), SIGUSR1 (SLURM's warning before a
# time limit), SIGINT (Ctrl-C), SIGHUP (the terminal or ssh session went away).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


class JddpError(Exception):
    """A failure jddp diagnosed itself; ``str(e)`` is one line naming the key, file or peer."""

    exit_code = FAILURE


class ConfigError(JddpError, ValueError):
    """A bad config key or value, command line or launch; the message names the key and what is
    allowed (exit 2)."""

    exit_code = BAD_INPUT


class DataError(JddpError, ValueError):
    """A data set is damaged or inconsistent at run time (a corrupt file; exit 1)."""


class DataConfigError(DataError, ConfigError):
    """A data set cannot be used as configured: ``data.path`` is missing or holds another
    layout, labels exceed ``model.num_classes`` (exit 2)."""

    exit_code = BAD_INPUT


class TaskError(ConfigError):
    """A task's own code — a loss, a metrics function, a data factory — returned something jddp
    cannot use (a scalar loss, the wrong shape or dtype, a clashing metric name); the message
    names the function and what is expected (exit 2)."""


class UserCodeError(JddpError):
    """The user's own code that jddp calls to build the run (a ``model.name`` or ``data.name``
    factory) raised; the message names it, the exception and where it was raised (exit 1; the
    original exception is chained for library callers)."""


class CheckpointError(JddpError):
    """Checkpoints exist but none can be used, or one cannot be written (exit 1)."""


class CheckpointDamaged(CheckpointError):
    """One checkpoint cannot be read, or what it holds fails its checksums (exit 1)."""

    def __init__(self, where: object, problem: str):
        super().__init__(f"checkpoint {where} is damaged: {problem}")
        self.problem = problem


class CheckpointGone(CheckpointError):
    """A checkpoint was deleted while it was read: a live run's ``checkpoint.keep`` rotation
    removed it (exit 1)."""

    def __init__(self, where: object):
        super().__init__(
            f"checkpoint {where} was deleted while it was read (a running trainer keeps only "
            "its newest checkpoint.keep checkpoints)"
        )


class ExportError(JddpError):
    """A model cannot be exported: the converter cannot express one of its operations, or the
    export computes something else than the model (``python -m jddp.export``; exit 1)."""


class NonFiniteLoss(JddpError):
    """``train.on_nonfinite=halt`` and a step's loss or gradient was not finite, or
    ``python -m jddp.evaluate`` measured a non-finite eval metric (exit 1)."""


class EvalFailed(JddpError):
    """The final eval of a run failed after its final checkpoint was saved (exit 1); the message
    names the checkpoint and the command that evaluates it again."""


class WorkdirLost(JddpError):
    """The run's workdir lock was removed or taken by another run while it trained: it stops
    without writing or deleting anything more (exit 1)."""


class OutOfMemory(JddpError):
    """A device ran out of memory in the train step (XLA's ``RESOURCE_EXHAUSTED``); the message
    names what the step needs and what would need less (exit 1)."""


class ReplicasDiverged(JddpError):
    """``dist.check_sync_every`` found devices or processes holding different parameters."""


class Preempted(JddpError):
    """The run stopped early on a stop signal after saving a checkpoint (exit 75)."""

    exit_code = PREEMPTED

    def __init__(self, step: int):
        super().__init__(f"preempted at step {step}")
        self.step = step


def one_line(text: object) -> str:
    """``text`` (an exception's message, say) on one line; an exception without a message
    gives its class name."""
    line = " ".join(str(text).split())
    return line or (type(text).__name__ if isinstance(text, BaseException) else "")
