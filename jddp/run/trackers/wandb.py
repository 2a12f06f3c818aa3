"""Weights & Biases: a W&B run (online, or offline under ``workdir/wandb``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jddp.run.trackers.base import Started

# W&B's own settings jddp chooses unless the user's environment sets them.
# (jddp prints the run's id and where it is; W&B's own lines and console capture are off.)
WANDB_DEFAULTS = {
    "WANDB_CONSOLE": ("console", "off"),
    "WANDB_SILENT": ("silent", True),
    "WANDB_INIT_TIMEOUT": ("init_timeout", 30.0),
}


class WandbTracker:
    """A W&B run (``WANDB_MODE``, ``WANDB_PROJECT`` or ``log.experiment``, ``WANDB_DIR`` —
    default: the workdir —, ``WANDB_API_KEY``... as W&B reads them): metrics per step, the
    config, ``done/<field>`` and ``checkpoint`` in the run's summary."""

    name, remote = "wandb", True
    library = "wandb"
    EXIT_CODE = {"finished": 0, "preempted": 75, "failed": 1}

    def __init__(self, project: str | None, run_name: str, workdir: str):
        self.project, self.run_name, self.workdir = project, run_name, workdir
        self._run: Any = None

    def start(self, config: dict[str, Any], run_id: str | None) -> Started:
        import wandb

        chosen = {
            opt: value for env, (opt, value) in WANDB_DEFAULTS.items() if env not in os.environ
        }
        again = {"id": run_id, "resume": "allow"} if run_id else {}
        self._run = run = wandb.init(
            **again,
            project=self.project,
            name=self.run_name,
            dir=None if os.environ.get("WANDB_DIR") else self.workdir,
            settings=wandb.Settings(**chosen),
        )
        run.config.update(config, allow_val_change=True)
        if run.disabled:
            return Started(run.id, None, where="disabled (WANDB_MODE=disabled)")
        if run.offline:
            folder = Path(run.dir).parent
            return Started(run.id, None, where=f"offline in {folder} (wandb sync {folder})")
        # Online, a resumed run starts after the server's last step: what it holds.
        floor = run.starting_step - 1 if run.resumed and run.starting_step else 0
        return Started(run.id, {}, floor, where=run.url or "")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def flush(self) -> None:
        pass  # W&B sends from its own process

    def finish(self, result: dict[str, Any], checkpoint: str | None, status: str) -> None:
        summary = {f"done/{k}": v for k, v in result.items()}
        if checkpoint:
            summary["checkpoint"] = checkpoint
        self._run.summary.update(summary)
        if status == "preempted":
            self._run.mark_preempting()
        self._run.finish(exit_code=self.EXIT_CODE[status])
