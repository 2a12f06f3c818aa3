"""MLflow: an MLflow run at ``MLFLOW_TRACKING_URI``."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from jddp.run.trackers.base import Started, flat_config, quiet_tracker_threads, scalars, warn

# MLflow's HTTP client retries 7 times with backoff (minutes) and times out after 120 s; jddp's
# own client (unless these are set) gives up within seconds on a dead server.
MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}


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
