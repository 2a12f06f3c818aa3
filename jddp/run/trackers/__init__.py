"""Experiment trackers (``log.trackers``): TensorBoard, MLflow, Weights & Biases — one module
each beside this one, one interface (:mod:`jddp.run.trackers.base`) — driven for a run.

:class:`Trackers` drives them on process 0 with the values ``metrics.jsonl`` gets (train and
eval lines, the same steps), the resolved config, the fields of the final ``jddp: done`` line
and the checkpoint path.

TensorBoard writes local files in the loop's thread and follows ``metrics.jsonl``'s resume rule
(event files of steps after the resumed checkpoint are purged). MLflow and W&B are remote: each
runs on its own thread, so a slow or unreachable server never holds a step; the first failure
prints one ``jddp: warning:`` line and that tracker stops (``metrics.jsonl`` is always complete).
Their run id and, per key, the last step they were sent are kept in ``workdir/trackers.json``: a
rerun that resumes continues the same tracked run and sends each (key, step) once — what the
tracker itself holds (MLflow's metric history, an online W&B run's last step) when it can say,
else what the record says; lines of ``metrics.jsonl`` it lacks (a tracker added on resume, a
kill before they were sent) are sent first.

``mlflow`` and ``wandb`` are imported on their tracker's thread, only when named.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jddp.errors import ConfigError
from jddp.metrics import metrics_rows
from jddp.run.trackers.base import (
    PACKAGES,
    THREAD_PREFIX,
    Started,
    Tracker,
    describe_failure,
    scalars,
    warn,
)
from jddp.run.trackers.mlflow import MlflowTracker
from jddp.run.trackers.tensorboard import TensorBoardTracker
from jddp.run.trackers.wandb import WandbTracker
from jddp.workdir import RunFolder

__all__ = ["Started", "Tracker", "Trackers", "check_installed", "scalars"]

# The remote trackers' threads import their libraries (mlflow, wandb) one at a time: two threads
# importing packages that share dependencies at once can fail in Python's import machinery
# (a module seen half-initialised, or its deadlock detection), more likely on a loaded machine.
# Seen once under load (2026-11-26, load 8 on 2 cores): a resumed run's MLflow thread ended
# before its first request and the MLflow run stayed KILLED.
_IMPORTS = threading.Lock()

FINISH_WAIT_S = 60.0  # what the end of a finished run waits for a remote tracker to send
STOP_WAIT_S = 10.0  # the same for a preempted or failed run (a preemption's grace is short)


def check_installed(names: Iterable[str]) -> None:
    """``ConfigError`` naming the extra to install for a tracker whose package is missing."""
    for name in names:
        package, extra = PACKAGES[name]
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):  # a broken or blocked package
            found = False
        if not found:
            install = f"pip install 'jddp[{extra}]'" if extra else f"pip install {package}"
            raise ConfigError(
                f"log.trackers: {name} needs the {package} package, which is not installed: "
                f"{install} (or drop {name} from log.trackers)"
            )


@dataclass
class _Record:
    """``workdir/trackers.json``: per remote tracker, its run id and per key the last step sent."""

    path: Path
    data: dict[str, dict[str, Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def read(cls, path: Path) -> _Record:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        return cls(path, data if isinstance(data, dict) else {})

    def entry(self, name: str) -> dict[str, Any]:
        with self.lock:
            entry = self.data.get(name)
            return dict(entry) if isinstance(entry, dict) else {}

    def save(self, name: str, run_id: str, steps: dict[str, int]) -> None:
        with self.lock:
            self.data[name] = {"run_id": run_id, "steps": dict(steps)}
            tmp = self.path.with_suffix(f".tmp{threading.get_ident()}")
            tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
            tmp.replace(self.path)


class _Sender:
    """Runs one tracker: inline (TensorBoard) or on its own daemon thread (remote ones), with
    the per-key rule of remote trackers; the first exception is one warning and ends it."""

    def __init__(self, tracker: Tracker, record: _Record, replay: Callable[[], Iterator]):
        self.tracker, self.record, self.replay = tracker, record, replay
        self.name = tracker.name
        self.failed = False
        self.run_id = ""
        self.sent: dict[str, int] = {}  # per key, the last step sent (remote trackers)
        self.floor = 0
        self.where = ""  # the tracker's server, page or folder, for messages
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, config: dict[str, Any]) -> None:
        if not self.tracker.remote:  # inline (TensorBoard): refilled as it starts
            self._call(self.tracker.start, config, None)
            for step, values in self.replay():  # metrics.jsonl's lines up to the resumed step
                self._call(self.tracker.log, step, values)
            return
        self._thread = threading.Thread(
            target=self._serve, args=(config,), daemon=True, name=THREAD_PREFIX + self.name
        )
        self._thread.start()

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.failed:
            return
        if self._thread is None:
            self._call(self.tracker.log, step, values)
        else:
            self._queue.put(("log", step, values))

    def finish(self, result: dict[str, Any], checkpoint: str | None, status: str) -> None:
        if self._thread is None:
            self._call(self.tracker.finish, result, checkpoint, status)
        else:
            self._queue.put(("finish", result, checkpoint, status))

    def wait(self, deadline: float) -> None:
        """Wait for a remote tracker to send what is queued, until ``deadline``."""
        if self._thread is not None:
            self._thread.join(max(deadline - time.monotonic(), 0.0))
            if self._thread.is_alive() and not self.failed:
                self.failed = True
                warn(
                    f"log.trackers: {self.name}: still sending at the end of the run "
                    f"({self.where or 'no answer yet'}); not waiting longer: it may lack the "
                    "last values (metrics.jsonl holds every value)"
                )

    def _call(self, method: Callable, *args: Any) -> None:
        if self.failed:
            return
        try:
            method(*args)
        except Exception as e:  # noqa: BLE001 - a tracker never stops the run
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        self.failed = True
        where = self.where or getattr(self.tracker, "where", "")
        at = f" at {where}" if where else ""
        warn(
            f"log.trackers: {self.name}{at} failed ({describe_failure(e)}); training goes on "
            "without it (metrics.jsonl holds every value)"
        )

    def _serve(self, config: dict[str, Any]) -> None:
        try:
            library = getattr(self.tracker, "library", None)  # mlflow, wandb
            if library is not None:  # before any request: one thread at a time imports
                with _IMPORTS:
                    importlib.import_module(library)
            self._start_remote(config)
            while True:
                items = [self._queue.get()]
                while True:  # everything queued meanwhile: one request where the tracker can
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                for item in items:
                    if item[0] == "log":
                        self._send(item[1], item[2])
                    else:
                        self._commit()
                        self.tracker.finish(*item[1:])
                        return
                self._commit()
        except Exception as e:  # noqa: BLE001 - a tracker never stops the run
            self._fail(e)

    def _start_remote(self, config: dict[str, Any]) -> None:
        entry = self.record.entry(self.name)
        started = self.tracker.start(config, entry.get("run_id"))
        if started.run_id != entry.get("run_id"):
            entry = {}  # a new tracked run: nothing sent to it yet
        recorded = {k: int(v) for k, v in (entry.get("steps") or {}).items()}
        self.sent = recorded if started.last_steps is None else dict(started.last_steps)
        self.floor, self.run_id, self.where = started.floor, started.run_id, started.where
        self.record.save(self.name, self.run_id, self.sent)  # the run id, before anything else
        resumed = " (resumed)" if entry else ""
        print(f"jddp: {self.name}: run {self.run_id}{resumed}; {self.where}", flush=True)
        for step, values in self.replay():  # metrics.jsonl's lines up to the resumed step
            self._send(step, values)
        self._commit()

    def _send(self, step: int, values: dict[str, float]) -> None:
        fresh = {k: v for k, v in values.items() if step > self.sent.get(k, self.floor)}
        if fresh:
            self.tracker.log(step, fresh)
            self.sent.update(dict.fromkeys(fresh, step))

    def _commit(self) -> None:
        self.tracker.flush()
        self.record.save(self.name, self.run_id, self.sent)


class Trackers:
    """The run's trackers on process 0 (none elsewhere): :meth:`start` before the loop,
    :meth:`log` from :class:`~jddp.metrics.MetricsLog`, :meth:`finish` once at the end."""

    def __init__(
        self, trackers: list[Tracker], folder: RunFolder | None = None, resume_step: int = 0
    ):
        self.folder, self.resume_step = folder, resume_step
        path = folder.trackers_json if folder is not None else Path(os.devnull)
        record = _Record.read(path) if any(t.remote for t in trackers) else _Record(path)
        self._senders = [_Sender(t, record, self._replay) for t in trackers]
        self._finished = False

    @classmethod
    def of(
        cls,
        names: list[str],
        folder: RunFolder,
        resume_step: int,
        experiment: str | None,
        writer: bool,
    ) -> Trackers:
        """The trackers ``names`` (``log.trackers``) of the run in ``folder``; none unless
        ``writer`` (process 0)."""
        if not writer:
            return cls([])
        workdir = str(folder.root.absolute())
        run_name = folder.root.absolute().name
        made = {
            "tensorboard": lambda: TensorBoardTracker(folder.tensorboard, resume_step),
            "mlflow": lambda: MlflowTracker(experiment, run_name, workdir),
            "wandb": lambda: WandbTracker(experiment, run_name, workdir),
        }
        return cls([made[name]() for name in names], folder, resume_step)

    @property
    def names(self) -> list[str]:
        """The trackers' names, in ``log.trackers`` order."""
        return [s.name for s in self._senders]

    def start(self, config: dict[str, Any]) -> None:
        """Start every tracker with the resolved ``config`` (remote ones on their threads)."""
        for sender in self._senders:
            sender.start(config)

    def log(self, step: int, values: dict[str, Any]) -> None:
        """A ``metrics.jsonl`` line's values at ``step``, to every tracker."""
        numbers = scalars(values)
        if numbers:
            for sender in self._senders:
                sender.log(int(step), numbers)

    def finish(
        self,
        result: dict[str, Any] | None = None,
        checkpoint: str | None = None,
        status: str = "finished",
    ) -> None:
        """Send the ``jddp: done`` line's ``result`` fields and the ``checkpoint`` path, end the
        tracked runs (``status``: finished, preempted or failed) and wait for them, within
        :data:`FINISH_WAIT_S` (:data:`STOP_WAIT_S` unless finished); once."""
        if self._finished:
            return
        self._finished = True
        for sender in self._senders:
            sender.finish(result or {}, checkpoint, status)
        deadline = time.monotonic() + (FINISH_WAIT_S if status == "finished" else STOP_WAIT_S)
        for sender in self._senders:
            sender.wait(deadline)

    def _replay(self) -> Iterator[tuple[int, dict[str, float]]]:
        """``metrics.jsonl``'s lines up to the resumed step (read on the tracker's thread)."""
        if self.folder is None or self.resume_step <= 0:
            return
        try:
            rows = [row for _, row in metrics_rows(self.folder.metrics_jsonl)]
        except OSError:
            return
        for row in rows:
            step = row.get("step")
            if isinstance(step, int) and 0 < step <= self.resume_step:
                values = scalars(row)
                if values:
                    yield step, values
