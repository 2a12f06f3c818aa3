"""Run outputs written by process 0 (``metrics.jsonl``, ``config.yaml``, progress bar, stdout)
and what the loop measures for them (input wait)."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from tqdm import tqdm

from jddp.workdir import RunFolder


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

    def __init__(self, folder: RunFolder, resume_step: int = 0, writer: bool = True):
        self.path = folder.metrics_jsonl
        self._file = None
        self._keys_at: dict[int, set[str]] = {}  # keys already logged, by step
        if not writer:
            return
        kept = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if row.get("step", 0) <= resume_step:
                    kept.append(line)
                    self._keys_at.setdefault(row.get("step", 0), set()).update(row)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)
        self._file = self.path.open("a", buffering=1)
        # TensorBoard event files next to metrics.jsonl (tensorboard --logdir WORKDIR).
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(str(folder.tensorboard), purge_step=resume_step + 1)

    def logged(self, step: int, key: str) -> bool:
        """Whether a line for ``step`` holding ``key`` is already in the file."""
        return key in self._keys_at.get(step, ())

    def write(self, step: int, values: dict[str, Any]) -> None:
        """Write ``{"step": step, **values}`` as one line (and as TensorBoard scalars)."""
        if self._file is not None:
            self._keys_at.setdefault(int(step), set()).update(values)
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


def append_metrics(folder: RunFolder, step: int, values: dict[str, Any]) -> None:
    """Append ``{"step": step, **values}`` to ``metrics.jsonl`` (``jddp.evaluate``, no run)."""
    row = {"step": int(step), **{k: _plain(v) for k, v in values.items()}}
    with folder.metrics_jsonl.open("a") as f:
        f.write(json.dumps(row) + "\n")


def make_progress(mode: str, total: int, initial: int, writer: bool = True) -> tqdm:
    """A tqdm bar with step, loss, img/s and ETA; ``auto`` shows it only on a terminal."""
    enabled = writer and (mode == "on" or (mode == "auto" and sys.stderr.isatty()))
    return tqdm(
        total=total,
        initial=initial,
        disable=not enabled,
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
    )


class Console:
    """What a run prints on stdout: process 0's lines only (``enabled``), through tqdm so a
    progress bar is not broken."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def say(self, message: str) -> None:
        """Print ``message`` (one or more lines) if this process is the writer."""
        if self.enabled:
            tqdm.write(message, file=sys.stdout)
            sys.stdout.flush()


class InputWait:
    """Wall time the training loop spends blocked getting the next batch from the input pipeline.

    :meth:`timed` wraps the batch iterator and adds the time of every ``next()`` to the current
    window; :meth:`end_window` turns it into ``perf/input_wait_fraction`` (wait seconds / wall
    seconds of the window) and accumulates run totals for :attr:`mean_fraction`. It is measured
    on the host: with the prefetch thread ahead of the loop it stays near 0; a slow loader shows
    up here (the device may still be busy with the step before, so it is an upper bound on the
    time the device idles for lack of input).
    """

    KEY = "perf/input_wait_fraction"

    def __init__(self) -> None:
        self.window_s = 0.0  # waiting in the current window
        self.total_wait_s = 0.0  # over all closed windows
        self.total_wall_s = 0.0

    def timed(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Yield from ``batches``, timing each fetch; closing this closes ``batches``."""
        it = iter(batches)
        try:
            while True:
                start = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    return
                finally:
                    self.window_s += time.perf_counter() - start
                yield batch
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()  # stop the prefetch thread as soon as the loop ends

    def restart(self) -> None:
        """Start a new window (its wall time is measured by the caller)."""
        self.window_s = 0.0

    def end_window(self, wall_s: float) -> float:
        """The wait fraction of a window that lasted ``wall_s``; counted in the run's mean."""
        self.total_wait_s += self.window_s
        self.total_wall_s += wall_s
        return self.window_s / wall_s if wall_s > 0 else 0.0

    @property
    def mean_fraction(self) -> float:
        """Wait seconds / wall seconds over every closed window of the run."""
        return self.total_wait_s / self.total_wall_s if self.total_wall_s > 0 else 0.0
