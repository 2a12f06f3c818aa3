"""Experiment trackers (``log.trackers``): TensorBoard, MLflow, Weights & Biases.

Each tracker is a small object with the same methods: ``start(config, run_id)``,
``log(step, scalars)``, ``flush()``, ``finish(result, checkpoint, status)``. :class:`Trackers`
drives them on process 0 with the values ``metrics.jsonl`` gets (train and eval lines, the same
steps), the resolved config, the fields of the final ``jddp: done`` line and the checkpoint path.

TensorBoard writes local files in the loop's thread and follows ``metrics.jsonl``'s resume rule
(event files of steps after the resumed checkpoint are purged). MLflow and W&B are remote: each
runs on its own thread, so a slow or unreachable server never holds a step; the first failure
prints one ``jddp: warning:`` line and that tracker stops (``metrics.jsonl`` is always complete).
Their run id and, per key, the last step they were sent are kept in ``workdir/trackers.json``: a
rerun that resumes continues the same tracked run and sends each (key, step) once — what the
tracker itself holds (MLflow's metric history, an online W&B run's last step) when it can say,
else what the record says; lines of ``metrics.jsonl`` it lacks (a tracker added on resume, a
kill before they were sent) are sent first.

The tracker packages are imported on the tracker's own thread, only when named.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from jddp.errors import ConfigError, one_line
from jddp.workdir import RunFolder

# name -> (the package it imports, the pip extra that installs it)
PACKAGES = {
    "tensorboard": ("tensorboardX", None),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}
FINISH_WAIT_S = 60.0  # what the end of a finished run waits for a remote tracker to send
STOP_WAIT_S = 10.0  # the same for a preempted or failed run (a preemption's grace is short)
# MLflow's HTTP client retries 7 times with backoff (minutes) and times out after 120 s; jddp's
# own client (unless these are set) gives up within seconds on a dead server.
MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
# W&B's own settings jddp chooses unless the user's environment sets them.
# (jddp prints the run's id and where it is; W&B's own lines and console capture are off.)
WANDB_DEFAULTS = {
    "WANDB_CONSOLE": ("console", "off"),
    "WANDB_SILENT": ("silent", True),
    "WANDB_INIT_TIMEOUT": ("init_timeout", 30.0),
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
    """One tracker; ``remote`` ones run on their own thread (see the module docstring)."""

    name: str
    remote: bool

    def start(self, config: dict[str, Any], run_id: str | None) -> Started: ...

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def flush(self) -> None: ...

    def finish(self, result: dict[str, Any], checkpoint: str | None, status: str) -> None: ...


def check_installed(names: list[str]) -> None:
    """``ConfigError`` naming the extra to install for a tracker whose package is missing."""
    for name in names:
        package, extra = PACKAGES[name]
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):  # a broken or blocked package
            found = False
        if not found:
            raise ConfigError(
                f"log.trackers: {name} needs the {package} package, which is not installed: "
                f"pip install 'jddp[{extra}]' (or drop {name} from log.trackers)"
            )


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


class _NotFromTrackers(logging.Filter):
    """Drops log records of jddp's tracker threads (a tracker's failure is one warning)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.threadName.startswith(THREAD_PREFIX)


THREAD_PREFIX = "jddp-tracker-"
_QUIET = _NotFromTrackers()


def quiet_tracker_threads(*loggers: str) -> None:
    """No log lines from the tracker threads through ``loggers`` (their own records and, for
    a logger with handlers, its children's): e.g. urllib3's retries, MLflow's warnings."""
    for name in loggers:
        logger = logging.getLogger(name)
        for target in (logger, *logger.handlers):
            if _QUIET not in target.filters:
                target.addFilter(_QUIET)


def _cause(e: BaseException) -> str:
    text = one_line(e)  # a long one keeps its head and its tail (the root cause)
    return f"{type(e).__name__}: " + (
        text if len(text) <= 240 else f"{text[:110]} ... {text[-110:]}"
    )


# ---------------------------------------------------------------------------------------------
# The trackers


class TensorBoardTracker:
    """Event files in ``workdir/tensorboard`` (tensorboardX); on resume, events of steps after
    the resumed checkpoint are purged, as ``metrics.jsonl`` drops its lines."""

    name, remote = "tensorboard", False

    def __init__(self, folder: Path, resume_step: int):
        self.folder, self.resume_step = folder, resume_step
        self._writer: Any = None

    def start(self, config: dict[str, Any], run_id: str | None) -> Started:
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(str(self.folder), purge_step=self.resume_step + 1)
        return Started("")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def flush(self) -> None:
        self._writer.flush()

    def finish(self, result: dict[str, Any], checkpoint: str | None, status: str) -> None:
        self._writer.close()


class MlflowTracker:
    """An MLflow run at ``MLFLOW_TRACKING_URI`` (MLflow's default without it), in experiment
    ``log.experiment`` (else ``MLFLOW_EXPERIMENT_NAME``, else ``Default``): metrics per step,
    the config as params, ``done/<field>`` metrics and the ``jddp.checkpoint`` tag at the end."""

    name, remote = "mlflow", True
    STATUS = {"finished": "FINISHED", "preempted": "KILLED", "failed": "FAILED"}

    def __init__(self, experiment: str | None, run_name: str, workdir: str):
        self.experiment, self.run_name, self.workdir = experiment, run_name, workdir
        self._client: Any = None
        self._run_id = ""
        self._pending: list[Any] = []
        self._held: dict[str, int] = {}
        self.where = ""  # the tracking URI, once known

    def start(self, config: dict[str, Any], run_id: str | None) -> Started:
        for key, value in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        import mlflow
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        quiet_tracker_threads("urllib3.connectionpool", "mlflow")
        self._client = client = mlflow.MlflowClient()
        self.where = uri = mlflow.get_tracking_uri()
        run = None
        if run_id:
            try:
                run = client.get_run(run_id)
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                warn(
                    f"log.trackers: mlflow: run {run_id} (workdir/trackers.json) is not at {uri}; "
                    "starting a new MLflow run"
                )
        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        if run is None:
            run = client.create_run(
                self._experiment_id(name),
                run_name=self.run_name,
                tags={"jddp.workdir": self.workdir},
            )
            self._held = {}
        else:
            client.update_run(run.info.run_id, status="RUNNING")
            self._held = {
                key: max(m.step for m in client.get_metric_history(run.info.run_id, key))
                for key in run.data.metrics
            }
        self._run_id = run.info.run_id
        have = run.data.params  # params are immutable: a resume adds only new keys
        params = [Param(k, str(v)[:6000]) for k, v in flat_config(config).items() if k not in have]
        for i in range(0, len(params), 100):
            client.log_batch(self._run_id, params=params[i : i + 100])
        return Started(self._run_id, dict(self._held), where=f"{uri}, experiment {name!r}")

    def _experiment_id(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        found = self._client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self._client.create_experiment(name)
        except MlflowException:  # created by another run in between
            return self._client.get_experiment_by_name(name).experiment_id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending.extend(Metric(k, v, now, step) for k, v in scalars.items())

    def flush(self) -> None:
        while self._pending:  # MLflow takes at most 1000 metrics per request
            self._client.log_batch(self._run_id, metrics=self._pending[:1000])
            del self._pending[:1000]

    def finish(self, result: dict[str, Any], checkpoint: str | None, status: str) -> None:
        step = int(result.get("step", 0))
        done = {f"done/{k}": v for k, v in scalars(result, skip="").items()}
        self.log(step, {k: v for k, v in done.items() if step > self._held.get(k, -1)})
        self.flush()
        if checkpoint:
            self._client.set_tag(self._run_id, "jddp.checkpoint", checkpoint)
        self._client.set_tag(self._run_id, "jddp.status", status)
        self._client.update_run(self._run_id, status=self.STATUS[status])


class WandbTracker:
    """A W&B run (``WANDB_MODE``, ``WANDB_PROJECT`` or ``log.experiment``, ``WANDB_DIR`` —
    default: the workdir —, ``WANDB_API_KEY``... as W&B reads them): metrics per step, the
    config, ``done/<field>`` and ``checkpoint`` in the run's summary."""

    name, remote = "wandb", True
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
        if run.offline or run.disabled:
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


# ---------------------------------------------------------------------------------------------
# Driving them


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
        if not self.tracker.remote:
            self._call(self.tracker.start, config, None)
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
        warn(
            f"log.trackers: {self.name}{f' at {where}' if where else ''} failed ({_cause(e)}); "
            "training goes on without it (metrics.jsonl holds every value)"
        )

    def _serve(self, config: dict[str, Any]) -> None:
        try:
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
            lines = self.folder.metrics_jsonl.read_text().splitlines()
        except OSError:
            return
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            step = row.get("step") if isinstance(row, dict) else None
            if isinstance(step, int) and 0 < step <= self.resume_step:
                values = scalars(row)
                if values:
                    yield step, values
