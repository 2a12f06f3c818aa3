"""The trackers of ``log.trackers``: TensorBoard, MLflow, Weights & Biases.

Each is a small object with the same methods — ``start(config, run_id)``, ``log(step,
scalars)``, ``flush()``, ``finish(result, checkpoint, status)`` — driven by
:class:`jddp.run.trackers.Trackers` (process 0, resume rule, threads). Their packages are
imported in ``start``, only when named.
"""

from __future__ import annotations

import logging
import os
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from jddp.errors import one_line

# name -> (the package it imports, the pip extra that installs it)
PACKAGES = {
    "tensorboard": ("tensorboardX", None),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}
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


def _records(path: Path) -> Iterator[bytes]:
    """The records of a TFRecord file (an event file), up to the first torn one (a writer
    killed mid-record)."""
    data = path.read_bytes()
    at = 0
    while at + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        end = at + 12 + length + 4
        if end > len(data):
            return
        yield data[at + 12 : at + 12 + length]
        at = end


def tensorboard_points(folder: Path) -> dict[str, set[int]]:
    """Per scalar tag, the steps TensorBoard shows from the event files in ``folder``: the files
    read in the order they were written, a purge (a writer started with ``purge_step``)
    hiding every earlier point at or after its step, as TensorBoard does."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    points: dict[str, set[int]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for record in _records(path):
            try:
                event = Event.FromString(record)
            except Exception:  # noqa: BLE001 - a damaged record: what follows is unreadable
                break
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                for steps in points.values():
                    steps.difference_update({s for s in steps if s >= event.step})
            for value in event.summary.value:
                points.setdefault(value.tag, set()).add(int(event.step))
    return points


class TensorBoardTracker:
    """Event files in ``workdir/tensorboard`` (tensorboardX), on disk within a second of each
    log line (its writer thread flushes every second, not every 120 s). On resume, events of
    steps after the resumed checkpoint are purged, as ``metrics.jsonl`` drops its lines, and
    the points of earlier steps that the files lack (what a ``kill -9`` caught in the writer's
    queue) are refilled from ``metrics.jsonl``: each step once, one value."""

    name, remote = "tensorboard", False

    def __init__(self, folder: Path, resume_step: int):
        self.folder, self.resume_step = folder, resume_step
        self._writer: Any = None
        self._shown: dict[str, set[int]] = {}  # points up to the resumed step already there

    def start(self, config: dict[str, Any], run_id: str | None) -> Started:
        from tensorboardX import SummaryWriter

        if self.resume_step > 0 and self.folder.is_dir():
            self._shown = tensorboard_points(self.folder)
        self._writer = SummaryWriter(
            str(self.folder), purge_step=self.resume_step + 1, flush_secs=1
        )
        return Started("")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            if step <= self.resume_step and step in self._shown.get(key, ()):
                continue  # a refilled step the files already show
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
    library = "mlflow"  # imported first, one tracker thread at a time (jddp.run.trackers)
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
            if run is None or run.info.lifecycle_stage == "deleted":
                run = None
                warn(
                    f"log.trackers: mlflow: run {run_id} (workdir/trackers.json) is not at {uri} "
                    "(or was deleted); starting a new MLflow run"
                )
        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        if run is None:
            run = client.create_run(
                self._experiment_id(name),
                run_name=self.run_name,
                tags={
                    "jddp.workdir": self.workdir,
                    # what to rerun to resume, as typed (python -m jddp.train ...)
                    "jddp.command": " ".join(getattr(sys, "orig_argv", sys.argv))[:5000],
                    "mlflow.source.name": sys.argv[0][:500],
                },
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
        # ended, with an end time (update_run left it open: the UI showed no duration)
        self._client.set_terminated(self._run_id, status=self.STATUS[status])


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
