"""What every tracker of ``log.trackers`` is: the :class:`Tracker` interface — ``start(config,
run_id)``, ``log(step, scalars)``, ``flush()``, ``finish(result, checkpoint, status)`` — and what
they share (the :class:`Started` answer, scalars, warnings, quiet threads). One module per
tracker beside it (:mod:`.tensorboard`, :mod:`.mlflow`, :mod:`.wandb`); :mod:`jddp.run.trackers`
drives them for a run (process 0, resume rule, threads). Their packages are imported in
``start``, only when named.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Protocol

from jddp.errors import one_line

# name -> (the package it imports, the pip extra that installs it)
PACKAGES = {
    "tensorboard": ("tensorboardX", None),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}


@dataclass
class Started:
    """What a tracker's ``start`` returns: its run id, and what it already holds of that run
    (``last_steps``: per key, the last step; ``floor``: every key up to this step), or None
    where it cannot tell (then the workdir's record says what was sent)."""

    run_id: str
    last_steps: dict[str, int] | None = None
    floor: int = 0
    where: str = ""  # for the console line: the server, the run's page or folder


class Tracker(Protocol):
    """One tracker; ``remote`` ones run on their own thread (:mod:`jddp.run.trackers`)."""

    name: str
    remote: bool

    def start(self, config: dict[str, Any], run_id: str | None) -> Started: ...

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def flush(self) -> None: ...

    def finish(self, result: dict[str, Any], checkpoint: str | None, status: str) -> None: ...


def scalars(values: dict[str, Any], skip: str = "step") -> dict[str, float]:
    """The numbers of a ``metrics.jsonl`` line but ``skip`` (NaN/Inf, written there as
    strings, included)."""
    out = {}
    for key, value in values.items():
        if key == skip or isinstance(value, bool):
            continue
        if isinstance(value, str) and value in ("nan", "inf", "-inf"):
            value = float(value)
        if isinstance(value, (int, float)):
            out[key] = float(value)
    return out


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model.name": "resnet18", ...}``: the config's leaves under dotted keys."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def warn(message: str) -> None:
    """One ``jddp: warning:`` line on stderr (any thread)."""
    print(f"jddp: warning: {message}", file=sys.stderr, flush=True)


THREAD_PREFIX = "jddp-tracker-"  # the names of the trackers' threads


class _NotFromTrackers(logging.Filter):
    """Drops log records of jddp's tracker threads (a tracker's failure is one warning)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.threadName.startswith(THREAD_PREFIX)


_QUIET = _NotFromTrackers()


def quiet_tracker_threads(*loggers: str) -> None:
    """No log lines from the tracker threads through ``loggers`` (their own records and, for
    a logger with handlers, its children's): e.g. urllib3's retries, MLflow's warnings."""
    for name in loggers:
        logger = logging.getLogger(name)
        for target in (logger, *logger.handlers):
            if _QUIET not in target.filters:
                target.addFilter(_QUIET)


def describe_failure(e: BaseException) -> str:
    """``Type: message``, a long message cut in its middle (the root cause is at its end)."""
    text = one_line(e)  # a long one keeps its head and its tail (the root cause)
    return f"{type(e).__name__}: " + (
        text if len(text) <= 240 else f"{text[:110]} ... {text[-110:]}"
    )
