"""Run outputs written by process 0: ``metrics.jsonl``, ``config.yaml``, progress bar, stdout."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from jddp import distributed


def is_writer() -> bool:
    """Only process 0 prints and writes run outputs."""
    return distributed.process_index() == 0


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsLog:
    """Appends one JSON object per line to ``workdir/metrics.jsonl`` (process 0 only).

    On resume, lines from steps after the checkpoint being resumed are dropped first, so the
    file never holds two lines for one step of the same kind.
    """

    def __init__(self, workdir: str | Path, resume_step: int = 0):
        self.path = Path(workdir) / "metrics.jsonl"
        self._file = None
        if not is_writer():
            return
        kept = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= resume_step:
                        kept.append(line)
                except json.JSONDecodeError:
                    continue
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)
        self._file = self.path.open("a", buffering=1)
        # TensorBoard event files next to metrics.jsonl (tensorboard --logdir WORKDIR).
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(str(Path(workdir) / "tensorboard"), purge_step=resume_step + 1)

    def write(self, step: int, values: dict[str, Any]) -> None:
        """Write ``{"step": step, **values}`` as one line (and as TensorBoard scalars)."""
        if self._file is not None:
            row = {"step": int(step), **{k: _plain(v) for k, v in values.items()}}
            self._file.write(json.dumps(row) + "\n")
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, int(step))

    def close(self) -> None:
        """Flush and close the files."""
        if self._file is not None:
            self._file.close()
            self._file = None
            self._tb.close()


def make_progress(mode: str, total: int, initial: int) -> tqdm:
    """A tqdm bar with step, loss, img/s and ETA; ``auto`` shows it only on a terminal."""
    enabled = is_writer() and (mode == "on" or (mode == "auto" and sys.stderr.isatty()))
    return tqdm(
        total=total,
        initial=initial,
        disable=not enabled,
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
    )


def say(message: str) -> None:
    """Print one line on stdout from process 0 (through tqdm, so a bar is not broken)."""
    if is_writer():
        tqdm.write(message, file=sys.stdout)
        sys.stdout.flush()
