"""Run outputs written by process 0 (``metrics.jsonl``, ``config.yaml``, progress bar, stdout)
and what the loop measures for them (input wait)."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from jddp.errors import JddpError
from jddp.workdir import RunFolder


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _row(step: int, values: dict[str, Any]) -> dict[str, Any]:
    """One ``metrics.jsonl`` line: the step, then the values as plain JSON numbers."""
    return {"step": int(step), **{k: _plain(v) for k, v in values.items()}}


def metrics_rows(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(line, row)`` for each line of a ``metrics.jsonl`` that holds a JSON object, in file
    order; any other line (a torn last line, bad JSON, a non-object) is skipped. Raises
    ``OSError`` when the file cannot be read."""
    with Path(path).open(encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                yield line, row


def read_metrics(workdir: str | Path) -> list[dict[str, Any]]:
    """The lines of ``workdir/metrics.jsonl`` as dicts, in file order (see
    :func:`metrics_rows`: a torn or foreign line is skipped)."""
    return [row for _, row in metrics_rows(RunFolder(workdir).metrics_jsonl)]


class MetricsSink(Protocol):
    """What else gets every line (the run's trackers, :mod:`jddp.run.trackers`)."""

    def log(self, step: int, values: dict[str, Any]) -> None: ...


class MetricsLog:
    """Appends one JSON object per line to ``workdir/metrics.jsonl`` (process 0 only), and
    hands each line's values to ``sink`` (the run's trackers: TensorBoard, MLflow, W&B).

    On resume, lines from steps after the checkpoint being resumed are dropped first, so the
    file never holds two lines for one step of the same kind.
    """

    def __init__(
        self,
        folder: RunFolder,
        resume_step: int = 0,
        writer: bool = True,
        sink: MetricsSink | None = None,
    ):
        self.path = folder.metrics_jsonl
        self._file = None
        self._sink = sink
        self._keys_at: dict[int, set[str]] = {}  # keys already logged, by step
        if not writer:
            return
        kept = []
        try:
            if self.path.exists():
                for line, row in metrics_rows(self.path):
                    if row.get("step", 0) <= resume_step:
                        kept.append(line)
                        self._keys_at.setdefault(row.get("step", 0), set()).update(row)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(self.path)
            self._file = self.path.open("a", buffering=1)
        except OSError as e:
            raise self._cannot_write(e) from None

    def logged(self, step: int, key: str) -> bool:
        """Whether a line for ``step`` holding ``key`` is already in the file."""
        return key in self._keys_at.get(step, ())

    def write(self, step: int, values: dict[str, Any]) -> None:
        """Write ``{"step": step, **values}`` as one line (and hand it to the sink)."""
        if self._file is not None:
            self._keys_at.setdefault(int(step), set()).update(values)
            row = _row(step, values)
            try:
                if not self.path.exists():  # deleted while the run writes: lines would vanish
                    self._file.close()
                    self._file = self.path.open("a", buffering=1)
                self._file.write(json.dumps(row) + "\n")
            except OSError as e:
                raise self._cannot_write(e) from None
            if self._sink is not None:
                self._sink.log(int(step), row)

    def _cannot_write(self, e: OSError) -> JddpError:
        return JddpError(f"{self.path}: cannot write the run's metrics ({e.strerror or e})")

    def close(self) -> None:
        """Flush and close the file (the sink is closed by its owner)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def append_metrics(folder: RunFolder, step: int, values: dict[str, Any]) -> None:
    """Append ``{"step": step, **values}`` to ``metrics.jsonl`` (``jddp.evaluate``, no run)."""
    with folder.metrics_jsonl.open("a") as f:
        f.write(json.dumps(_row(step, values)) + "\n")


def _eval_means(metrics: dict[str, Any], prefix: str, weight_unit: str | None) -> str:
    parts = [f"loss {metrics[prefix + 'loss']:.4f}"]
    for key, value in metrics.items():
        if not key.startswith(prefix):
            continue
        name = key.removeprefix(prefix)
        if name in ("loss", "count", "data", weight_unit) or not isinstance(value, float):
            continue
        parts.append(f"{EVAL_LABELS.get(name, name)} {value:.4f}")
    return ", ".join(parts)


def describe_eval(metrics: dict[str, Any], weight_unit: str | None = None) -> str:
    """``loss 0.1234, accuracy 0.9876, top-5 0.9990 over N examples``: the loss, then each of the
    task's metrics, then the examples (and the loss weights' sum, ``weight_unit``); with an EMA
    of the parameters (``eval_ema/...``) also ``; EMA weights: loss ..., accuracy ...``."""
    weights = metrics.get(f"eval/{weight_unit}") if weight_unit else None
    total = f" ({weights:.0f} {weight_unit})" if weights is not None else ""
    line = _eval_means(metrics, "eval/", weight_unit)
    line += f" over {metrics['eval/count']} examples{total}"
    if "eval_ema/loss" in metrics:
        line += f"; EMA weights: {_eval_means(metrics, 'eval_ema/', weight_unit)}"
    return line


EVAL_LABELS = {"top5_accuracy": "top-5"}  # how a metric is named in console lines


def nonfinite_eval(metrics: dict[str, Any]) -> str | None:
    """``eval/loss=nan, ...`` for the non-finite values of an eval result, or None: such a
    result is not a result (NaN/Inf in the eval images, labels or weights)."""
    bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    return ", ".join(f"{k}={metrics[k]}" for k in bad) if bad else None


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Process 0's view of the run while it trains (``log.progress``).

    On a terminal (``auto`` with stdout and stderr terminals, or ``on``): a tqdm bar on stderr
    with loss and img/s. Elsewhere (``auto`` with stdout a log file or a pipe, e.g. under
    SLURM, or ``lines``): plain lines on stdout — one per ``log.every_steps`` train line
    (step, epoch, loss, lr, images/s, ETA), one per eval and one at the end of each epoch.
    ``off``, and processes other than 0: nothing.
    """

    def __init__(
        self,
        *,
        mode: str,
        total: int,
        initial: int,
        writer: bool = True,
        steps_per_epoch: int = 0,
        console: Console | None = None,
        unit: str = "img",
        weight_unit: str | None = None,
    ):
        terminal = sys.stdout.isatty()
        self.lines = writer and (mode == "lines" or (mode == "auto" and not terminal))
        bar = writer and (mode == "on" or (mode == "auto" and terminal and sys.stderr.isatty()))
        self.bar = tqdm(
            total=total,
            initial=initial,
            disable=not bar,
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
        )
        self.total, self.steps_per_epoch = total, steps_per_epoch
        self.unit, self.weight_unit = unit, weight_unit  # of the rates shown (img/s, tokens/s)
        self.console = console or Console(writer)
        self.epoch_start_s = time.perf_counter()
        self.epoch_start_step = initial

    def update(self, n: int = 1) -> None:
        """``n`` more steps done."""
        self.bar.update(n)

    def _epoch(self, step: int) -> str:
        return f" epoch {step / self.steps_per_epoch:.2f}" if self.steps_per_epoch else ""

    def train(self, step: int, host: dict[str, float], logged: bool) -> None:
        """Step ``step``'s metrics (read on the host); ``logged``: a train line was written."""
        if logged:
            loss, rate = host["train/loss"], host.get(f"train/{self.unit}_per_s")
            self.bar.set_postfix(loss=f"{loss:.4f}", **{f"{self.unit}_s": f"{rate or 0:.0f}"})
        if not self.lines:
            return
        if logged:
            parts = [f"jddp: step {step}/{self.total}{self._epoch(step)}", f"loss {loss:.4f}"]
            if "train/lr" in host:
                parts.append(f"lr {host['train/lr']:.4g}")
            if rate:
                parts.append(f"{rate:.1f} {self.unit}/s")
            weight_rate = host.get(f"train/{self.weight_unit}_per_s")
            if weight_rate:
                parts.append(f"{weight_rate:.0f} {self.weight_unit}/s")
            if "train/step_time_s" in host:
                eta = (self.total - step) * host["train/step_time_s"]
                parts.append(f"ETA {_duration(eta)}")
            self.console.say(", ".join(parts))
        if self.steps_per_epoch and step % self.steps_per_epoch == 0:
            now = time.perf_counter()
            steps = step - self.epoch_start_step
            self.console.say(
                f"jddp: epoch {step // self.steps_per_epoch} done at step {step}/{self.total}: "
                f"loss {host['train/loss']:.4f}, {steps} steps in {now - self.epoch_start_s:.1f} s"
            )
            self.epoch_start_s, self.epoch_start_step = now, step

    def eval(self, step: int, metrics: dict[str, Any]) -> None:
        """One line for an eval during the run."""
        if self.lines:
            self.console.say(
                f"jddp: eval at step {step}{self._epoch(step)}: "
                f"{describe_eval(metrics, self.weight_unit)}"
            )

    def close(self) -> None:
        """Close the bar."""
        self.bar.close()


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
