"""When a run saves: one policy the loop asks after every step.

* every ``checkpoint.every_steps`` steps;
* while that is 0, when ``checkpoint.every_minutes`` have passed since the last save. Each
  process reads its own clock and puts the answer in its rows of the next batch
  (:data:`SAVE_KEY`); the step's metrics bring back the max over processes one step late
  (:meth:`SavePolicy.heard`), so every process saves at the same step whatever its clock said;
* at every eval step when the best checkpoints are kept (``checkpoint.keep_best``): an eval's
  checkpoint must exist to be kept;
* not asked here: the step a stop signal ends the run at, and the last step, are saved by the
  run's end whatever the policy says (``jddp/run/trainer.py``, ``_finish``).

A step that is saved has its metrics line logged first (the loop reads it before the save):
a run killed before the next step has every step up to its newest checkpoint logged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

SAVE_KEY = "sys/save"  # per-row "a checkpoint is due by the clock" (checkpoint.every_minutes)


class SavePolicy:
    """Whether the run saves after a step (:meth:`due`); told of each save (:meth:`saved`).

    ``clock``: seconds, monotonic (a test passes its own). The clock's "save now" is asked
    once per period: the flag of step ``t`` was raised before step ``t`` ran, so any save at
    step ``t`` or later answers it (the flags of the steps dispatched before that save, read
    after it, are not a new request: that read had saved twice, at consecutive steps).
    """

    def __init__(
        self,
        *,
        every_steps: int,
        every_minutes: float | None = None,
        eval_every_steps: int = 0,
        save_at_evals: bool = False,
        start_step: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.every_steps = every_steps
        # checkpoint.every_minutes only while checkpoint.every_steps is 0 (every_steps wins)
        self.every_s = every_minutes * 60 if every_minutes and not every_steps else None
        self.eval_every = eval_every_steps if save_at_evals else 0
        self._clock = clock
        self._last_save_s = clock()
        self._last_saved = start_step  # the step of the last save (or the resumed one)
        self._asked: int | None = None  # the first step whose flag asked, not yet answered

    def flags(self, rows: int) -> dict[str, np.ndarray]:
        """This process's rows of the next batch's save flags (none without a clock)."""
        if self.every_s is None:
            return {}
        import numpy as np

        due = self._clock() - self._last_save_s >= self.every_s
        return {SAVE_KEY: np.full(rows, float(due), np.float32)}

    def heard(self, step: int, asked: bool) -> None:
        """Step ``step``'s flag, the max over processes (every process reads the same)."""
        if asked and step > self._last_saved and self._asked is None:
            self._asked = step

    def due(self, step: int) -> bool:
        """Whether the run saves after step ``step`` (the same answer on every process)."""
        return (
            (self.every_steps > 0 and step % self.every_steps == 0)
            or (self.eval_every > 0 and step % self.eval_every == 0)
            or (self._asked is not None and self._asked <= step)
        )

    def saved(self, step: int) -> None:
        """A save of ``step`` started: it answers every request raised before it; the clock
        starts again."""
        self._last_saved = max(self._last_saved, step)
        if self._asked is not None and self._asked <= step:
            self._asked = None
        self._last_save_s = self._clock()
