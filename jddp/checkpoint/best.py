"""The best checkpoints of a run by an eval key (``checkpoint.keep_best``, ``checkpoint.monitor``,
``checkpoint.mode``), and ``best`` wherever a checkpoint step is asked for.

Every eval of a run that keeps its best checkpoints is recorded in
``workdir/checkpoints/best.json`` (process 0 writes it, atomically, after each eval line:
``{"monitor": ..., "mode": ..., "evals": {step: {key: value}}}``); the best are ranked among
the checkpoints that exist, so a run killed between an eval and its save, or a checkpoint
deleted by hand, only leaves a step that no longer counts. A NaN is never the best.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from jddp.errors import ConfigError, JddpError

RECORD = "best.json"


def rank(
    evals: dict[int, dict[str, float]], steps: Iterable[int], monitor: str, mode: str, n: int
) -> list[int]:
    """The (up to) ``n`` best of ``steps`` by ``evals[step][monitor]``, best first (``mode``:
    min or max is better; ties: the earlier step). Steps without a number there are not
    ranked."""
    scored = []
    for step in steps:
        value = evals.get(step, {}).get(monitor)
        if isinstance(value, int | float) and not math.isnan(value):
            scored.append((value if mode == "min" else -value, step))
    return [step for _, step in sorted(scored)[:n]]


def read_evals(path: Path) -> dict[str, Any] | None:
    """The record at ``path`` (None when there is none or it cannot be read)."""
    try:
        record = json.loads(path.read_text())
        evals = {int(step): dict(values) for step, values in record["evals"].items()}
        return {"monitor": str(record["monitor"]), "mode": str(record["mode"]), "evals": evals}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


class BestCheckpoints:
    """The record of a training run's evals, and which of its checkpoints are the best
    ``keep_best`` by ``monitor``: the checkpoints rotation never deletes
    (:class:`KeepNewestAndBest`). Every process keeps the record (each computes what orbax
    deletes); ``writer`` (process 0) writes it."""

    def __init__(
        self,
        directory: Path,
        *,
        monitor: str,
        mode: str,
        keep_best: int,
        writer: bool,
    ):
        self.path = Path(directory) / RECORD
        self.monitor, self.mode, self.keep_best, self.writer = monitor, mode, keep_best, writer
        self.evals = (read_evals(self.path) or {"evals": {}})["evals"]

    def resumed_at(self, step: int) -> None:
        """The run resumed at ``step``: the evals after it belong to steps it computes again."""
        self.evals = {s: v for s, v in self.evals.items() if s <= step}

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        """Step ``step``'s eval line (its numbers)."""
        self.evals[step] = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        if not self.writer:
            return
        tmp = self.path.with_suffix(".json.tmp")
        text = json.dumps(
            {
                "monitor": self.monitor,
                "mode": self.mode,
                "evals": {str(s): v for s, v in sorted(self.evals.items())},
            }
        )
        try:
            tmp.write_text(text)
            tmp.replace(self.path)
        except OSError as e:
            raise JddpError(
                f"{self.path}: cannot record the evals of the best checkpoints "
                f"({e.strerror or e}); the checkpoints so far are kept"
            ) from None

    def best(self, steps: Iterable[int]) -> list[int]:
        """The best ``keep_best`` of ``steps`` (checkpoints that exist), best first."""
        return rank(self.evals, steps, self.monitor, self.mode, self.keep_best)


class KeepNewestAndBest:
    """Orbax's rotation (a ``PreservationPolicy``): keep the newest ``keep`` checkpoints and
    the best ones of :class:`BestCheckpoints`; delete the others."""

    def __init__(self, keep: int, best: BestCheckpoints):
        self.keep, self.best_of = keep, best

    def should_preserve(self, checkpoints: Any, *, context: Any = None) -> list[bool]:
        steps = [info.step for info in checkpoints]
        kept = set(sorted(steps)[-self.keep :]) | set(self.best_of.best(steps))
        return [step in kept for step in steps]


def best_step(
    directory: Path, steps: list[int], key: str, monitor: str | None = None, mode: str | None = None
) -> int:
    """The best of ``steps`` (checkpoints in ``directory``) by the run's record (``monitor``
    and ``mode``: by these instead of the record's); ``ConfigError`` naming ``key`` when the
    run kept no record or none of them has a number."""
    record = read_evals(Path(directory) / RECORD)
    listed = ", ".join(map(str, steps)) or "none"
    if record is None:
        raise ConfigError(
            f"{key}: best: {directory} holds no record of its evals (its run had "
            f"checkpoint.keep_best=0); give a step: {listed}"
        )
    monitor, mode = monitor or record["monitor"], mode or record["mode"]
    ranked = rank(record["evals"], steps, monitor, mode, 1)
    if not ranked:
        raise ConfigError(
            f"{key}: best: none of the checkpoints in {directory} ({listed}) has an eval of "
            f"{monitor} that is a number; give a step"
        )
    return ranked[0]
