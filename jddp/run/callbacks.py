"""Your own code at a log line, an eval, a checkpoint and the end of a run (Lightning's
callbacks), and early stopping as one of them.

``jddp.fit(..., callbacks=[...])`` takes :class:`Callback` objects; each method runs on process
0 only, in the training loop's thread, outside the jitted step, after the line it is about was
written to ``metrics.jsonl``. ``on_log`` or ``on_eval`` returning True asks the run to stop: the
request travels in the next batch's stop flag (:class:`~jddp.proc.signals.StopRequest`), read
with that step's metrics one step late, so every process stops after the same step (two after
the line that asked); the run then saves, evaluates and ends as a finished
run (exit 0), its summary saying why.

Early stopping (``train.early_stop_metric``, ``..._patience``, ``..._mode``, or
:class:`EarlyStopping` in ``callbacks``) decides from the eval lines, which are the same on
every topology; on a resume it first reads the eval lines ``metrics.jsonl`` kept, so a run
killed and resumed decides as the uninterrupted one.
"""

from __future__ import annotations

import math
from typing import Any

from jddp.errors import ConfigError

Metrics = dict[str, float]


class Callback:
    """Override what you need; the defaults do nothing. Runs on process 0 only."""

    def on_start(self, step: int, history: list[dict[str, Any]]) -> None:
        """Before the first step: ``step`` the run starts from (0, or the resumed checkpoint's)
        and ``history`` the ``metrics.jsonl`` lines up to it (empty for a fresh run)."""

    def on_log(self, step: int, metrics: Metrics) -> bool | None:
        """A train line of ``metrics.jsonl`` (``train/loss``, ...); True: stop the run."""

    def on_eval(self, step: int, metrics: Metrics) -> bool | None:
        """An eval line (``eval/loss``, ...); True: stop the run."""

    def on_checkpoint(self, step: int, path: str) -> None:
        """The checkpoint of ``step`` at ``path`` is complete on disk (written in the
        background, it is told once orbax has committed it: at a later step, or at the end)."""

    def on_end(self, result: Any) -> None:
        """The run finished (:class:`~jddp.run.trainer.RunResult`), after its summary."""


class EarlyStopping(Callback):
    """Stop when ``metric`` (an eval line's key, e.g. ``eval/loss``) has not improved by more
    than ``min_delta`` for ``patience`` evals in a row (``mode``: min or max is better)."""

    def __init__(self, metric: str, patience: int = 3, mode: str = "min", min_delta: float = 0.0):
        if mode not in ("min", "max"):
            raise ConfigError(f"train.early_stop_mode: {mode!r}; expected min or max")
        if patience < 1:
            raise ConfigError(f"train.early_stop_patience: must be >= 1, got {patience}")
        self.metric, self.patience, self.mode, self.min_delta = metric, patience, mode, min_delta
        self.best: float | None = None
        self.best_step = 0
        self.bad_evals = 0

    def on_start(self, step: int, history: list[dict[str, Any]]) -> None:
        for row in history:  # the evals before a resume, as the uninterrupted run saw them
            if self.metric in row:
                self._judge(int(row["step"]), float(row[self.metric]))

    def on_eval(self, step: int, metrics: Metrics) -> bool:
        if self.metric not in metrics:
            raise ConfigError(
                f"train.early_stop_metric: {self.metric!r} is not in the eval results "
                f"({', '.join(sorted(metrics))})"
            )
        return self._judge(step, float(metrics[self.metric]))

    def _judge(self, step: int, value: float) -> bool:
        """Whether the evals so far, ``value`` at ``step`` the newest, ask to stop. A NaN is
        never the best (every comparison with it fails: a first eval of NaN stayed the best,
        and a run that then improved was stopped); it counts as an eval without improvement."""
        better = not math.isnan(value) and (
            self.best is None
            or (self.mode == "min" and value < self.best - self.min_delta)
            or (self.mode == "max" and value > self.best + self.min_delta)
        )
        if better:
            self.best, self.best_step, self.bad_evals = value, step, 0
        else:
            self.bad_evals += 1
        return self.bad_evals >= self.patience

    def reason(self) -> str:
        """Why it stopped, for the run's summary."""
        best = (
            f"best {self.best:.6g} at step {self.best_step}"
            if self.best is not None
            else "none was a number"
        )
        return f"early stopping: {self.metric} did not improve for {self.patience} evals ({best})"


EARLY_STOP_KEYS = (
    "early_stop_metric",
    "early_stop_patience",
    "early_stop_mode",
    "early_stop_min_delta",
)


def early_stop_keys(train: Any) -> dict[str, Any]:
    """The ``train.early_stop_*`` values of config section ``train``: a run stopped early
    stays stopped on a rerun under the same ones (:mod:`jddp.workdir`, ``.jddp.stopped``)."""
    return {f"train.{k}": getattr(train, k) for k in EARLY_STOP_KEYS}


class Callbacks:
    """The run's callbacks, fed every ``metrics.jsonl`` line (a metrics sink beside the
    trackers); a stop asked for goes to ``stop`` (the run's :class:`StopRequest`)."""

    def __init__(self, callbacks: list[Callback], stop: Any, enabled: bool):
        self.callbacks = list(callbacks) if enabled else []
        self.stop = stop
        self.reason: str | None = None

    def start(self, step: int, history: list[dict[str, Any]]) -> None:
        """:meth:`Callback.on_start` of each."""
        for callback in self.callbacks:
            callback.on_start(step, history)

    def log(self, step: int, values: dict[str, Any]) -> None:
        """A ``metrics.jsonl`` line: an eval line to ``on_eval``, a train line to ``on_log``."""
        metrics = {k: v for k, v in values.items() if k != "step"}
        is_eval = any(k.startswith("eval/") for k in metrics)
        if not is_eval and "train/loss" not in metrics:
            return
        for callback in self.callbacks:
            method = callback.on_eval if is_eval else callback.on_log
            if method(step, metrics) and self.reason is None:
                reason = getattr(callback, "reason", None)
                self.reason = reason() if callable(reason) else f"{type(callback).__name__}"
                self.stop.finish(self.reason)

    def checkpoint(self, step: int, path: str) -> None:
        """:meth:`Callback.on_checkpoint` of each."""
        for callback in self.callbacks:
            callback.on_checkpoint(step, path)

    def end(self, result: Any) -> None:
        """:meth:`Callback.on_end` of each."""
        for callback in self.callbacks:
            callback.on_end(result)


class Fanout:
    """A metrics sink handing each line to several (the trackers, then the callbacks)."""

    def __init__(self, *sinks: Any):
        self.sinks = sinks

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Each sink's ``log``."""
        for sink in self.sinks:
            sink.log(step, values)
