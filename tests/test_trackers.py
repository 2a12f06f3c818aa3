"""log.trackers (jddp/run/trackers.py): a real MLflow tracking server and W&B offline.

One run sends to TensorBoard, MLflow and W&B; it is killed with SIGKILL mid-way, rerun and
stopped with SIGTERM (preempted), rerun to its end: read back through MLflow's client and W&B's
run files, every step is there once with metrics.jsonl's values, in one tracked run. An
unreachable MLflow is one warning and costs the run nothing; bad names and missing packages are
one line, exit 2. The rule itself (what a resumed tracker is sent) is checked in-process.
"""

import json
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from jddp.run.trackers import Started, Trackers
from jddp.workdir import RunFolder
from tests.helpers import (
    TINY,
    read_losses,
    read_metrics,
    run,
    start,
    start_training,
    steps_saved,
    train_cmd,
    with_overrides,
)
from tests.user_models import TinyMLP

ROOT = Path(__file__).resolve().parents[1]
LINEAR = [  # the tests' linear regression, a line every step
    "model.name=tests.user_tasks:linear",
    "data.name=tests.user_tasks:data",
    "train.loss=tests.user_tasks:loss",
    "data.global_batch_size=16",
    "train.steps=100000",
    "log.every_steps=1",
    "log.progress=off",
]
PACE_S = 0.1  # each train step sleeps this long on the host
HOLD = "TRACKERS_TEST_HOLD"  # a file: while it exists, train steps wait


def _pace():
    hold = os.environ.get(HOLD)
    while hold and os.path.exists(hold):
        time.sleep(0.01)
    time.sleep(PACE_S)


class PacedMLP(TinyMLP):
    """TinyMLP whose train steps wait on the host (the loss is TinyMLP's): ``PACE_S`` each,
    and as long as the file named by ``$TRACKERS_TEST_HOLD`` exists, so a signal lands where
    the test wants it, after the trackers started."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deterministic = True  # model.train() sets it False: evals are not paced

    def __call__(self, x):
        if not self.deterministic:
            jax.debug.callback(_pace)
        return super().__call__(x)


def paced_mlp(config: dict, dtype, rngs) -> PacedMLP:
    return PacedMLP(8 * 8 * 3, config["num_classes"], rngs, dtype=dtype)


STEPS = 24
RUN = [
    "model.name=tests.test_trackers:paced_mlp",
    f"train.steps={STEPS}",
    "train.eval_every_steps=8",
    "checkpoint.every_steps=4",
    "checkpoint.keep=10",
]
# Per-step timings: a step after the resumed checkpoint that a tracker already had keeps its
# first attempt's value; every other value is the same number in metrics.jsonl and the tracker.
TIMINGS = {"train/img_per_s", "train/step_time_s", "perf/input_wait_fraction", "train/compile_s"}


class Fake:
    """A remote tracker that remembers what it was sent; ``holds``: what it says it holds."""

    name, remote = "fake", True

    def __init__(self, holds=None, floor=0, fail_at=None, new_id=None):
        self.holds, self.floor, self.fail_at, self.new_id = holds, floor, fail_at, new_id
        self.got, self.ended = [], None

    def start(self, config, run_id):
        return Started(self.new_id or run_id or "r1", self.holds, self.floor)

    def log(self, step, scalars):
        if step == self.fail_at:
            raise ConnectionError("server gone")
        self.got += [(k, step) for k in scalars]

    def flush(self):
        pass

    def finish(self, result, checkpoint, status):
        self.ended = (result, checkpoint, status)


def _attempt(folder, tracker, resume_step, steps):
    trackers = Trackers([tracker], folder, resume_step)
    trackers.start({"train": {"steps": 8}})
    for step in steps:
        trackers.log(step, {"train/loss": float(step)})
        if step == 4:
            trackers.log(step, {"eval/loss": 0.5, "eval/count": 3})
    trackers.finish({"step": steps[-1]}, "ckpt", "finished")
    return tracker


def test_a_resumed_tracker_gets_each_key_and_step_once(tmp_path, capsys):
    folder = RunFolder(tmp_path)
    lines = [{"step": s, "train/loss": float(s)} for s in range(1, 5)]
    lines.insert(4, {"step": 4, "eval/loss": 0.5, "eval/count": 3})
    folder.metrics_jsonl.write_text("".join(json.dumps(r) + "\n" for r in lines))

    first = _attempt(folder, Fake(), 0, range(1, 7))  # killed after 6: the record says so
    assert first.got[-1] == ("train/loss", 6) and first.ended[2] == "finished"
    assert _record(tmp_path)["fake"] == {
        "run_id": "r1",
        "steps": {"train/loss": 6, "eval/loss": 4, "eval/count": 4},
    }
    # Resumed at 4: steps up to 6 were sent (the record), 7 and 8 are new.
    again = _attempt(folder, Fake(), 4, range(5, 9))
    assert again.got == [("train/loss", 7), ("train/loss", 8)]
    # A tracker that says what it holds (MLflow's history) is believed over the record: what
    # it lacks of metrics.jsonl (up to the resumed step) is sent first.
    holds = _attempt(folder, Fake(holds={"train/loss": 2}), 4, range(5, 7))
    assert holds.got[:4] == [
        ("train/loss", 3),
        ("train/loss", 4),
        ("eval/loss", 4),
        ("eval/count", 4),
    ]
    assert holds.got[4:] == [("train/loss", 5), ("train/loss", 6)]
    # Another run id (a new tracked run): everything.
    fresh = _attempt(folder, Fake(new_id="r2"), 4, range(5, 6))
    assert [s for k, s in fresh.got if k == "train/loss"] == [1, 2, 3, 4, 5]
    # A tracker that fails: one warning, the others go on, the run is not held.
    capsys.readouterr()
    broken = _attempt(folder, Fake(fail_at=6), 4, range(5, 9))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "log.trackers: fake failed (ConnectionError: server gone)" in err[0]
    assert broken.ended is None


def test_only_process_0_tracks(tmp_path):
    trackers = Trackers.of(["tensorboard", "mlflow"], RunFolder(tmp_path), 0, None, writer=False)
    assert trackers.names == []
    trackers = Trackers.of(["tensorboard", "mlflow"], RunFolder(tmp_path), 0, None, writer=True)
    assert trackers.names == ["tensorboard", "mlflow"]


def test_jddp_imports_no_tracker_package():
    code = (
        "import sys, jddp, jddp.run.trainer, jddp.run.trackers; "
        "print(sorted(m for m in ('mlflow', 'wandb') if m in sys.modules))"
    )
    out = run([sys.executable, "-c", code])
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["log.trackers=[tensorboard,neptune]"],
            ["log.trackers", "'neptune'", "tensorboard, mlflow, wandb"],
        ),
        (
            ["log.trackers=wandb", "--blocked", "wandb"],
            ["wandb package", "pip install 'jddp[wandb]'"],
        ),
    ],
    ids=["unknown", "missing"],
)
def test_bad_tracker_is_one_line_exit_2(tmp_path, args, words):
    blocked = args[args.index("--blocked") + 1] if "--blocked" in args else None
    args = [a for a in args if a not in ("--blocked", blocked)]
    # A package that is not installed: blocked in sys.modules before jddp runs.
    block = f"sys.modules[{blocked!r}] = None; " if blocked else ""
    script = f"import sys; {block}from jddp.train import main; sys.exit(main(sys.argv[1:]))"
    workdir = tmp_path / "w"
    overrides = train_cmd(workdir, *args, "train.steps=2", base=TINY)[3:]
    out = run([sys.executable, "-c", script, *overrides], timeout=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not workdir.exists()  # refused before anything was written


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def mlflow_server(request, tmp_path_factory):
    """A real MLflow tracking server on 127.0.0.1 (sqlite), started with the module's first
    test (it boots while the quick tests run) and stopped at the end: (process, uri, log).
    Not started where no selected test of the module needs it (``-m "not slow"``)."""
    here = [item for item in request.session.items if item.path == request.path]
    if not any("mlflow_uri" in getattr(item, "fixturenames", ()) for item in here):
        yield None
        return
    root = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    mlflow = Path(sys.executable).parent / "mlflow"
    log = root / "server.log"
    with log.open("w") as out:
        server = start(
            [mlflow, "server", "--backend-store-uri", f"sqlite:///{root}/db.sqlite"]
            + ["--default-artifact-root", str(root / "artifacts"), "--host", "127.0.0.1"]
            + ["--port", str(port), "--workers", "1"],
            cwd=root,
            # Without MLflow's job runner: its seven huey consumers took ~17 CPU-s of the 2-core
            # VM's suite while tracking never uses them (2026-11-27).
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield server, f"http://127.0.0.1:{port}", log
    finally:
        os.killpg(server.pid, signal.SIGKILL)  # a test server: nothing to shut down cleanly
        server.wait(30)


@pytest.fixture(scope="module")
def mlflow_uri(mlflow_server):
    """The server's URI, once it answers."""
    server, uri, log = mlflow_server
    deadline = time.monotonic() + 180
    while not _healthy(uri):
        assert server.poll() is None, log.read_text()[-2000:]
        assert time.monotonic() < deadline, "the MLflow server did not start in 180 s"
        time.sleep(0.2)
    return uri


def _healthy(uri: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def _timed(cmd, env):
    began = time.monotonic()
    out = run(cmd, env=env, timeout=300)
    return out, time.monotonic() - began


@pytest.mark.serial  # compares wall times
@pytest.mark.slow
def test_unreachable_mlflow_is_one_warning_and_costs_nothing(tmp_path):
    uri = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    quick = with_overrides(TINY, "model.name=tests.user_models:tiny_mlp", "train.steps=8")
    plain, plain_s = _timed(train_cmd(tmp_path / "plain", base=quick), env)
    assert plain.returncode == 0, plain.stderr[-2000:]
    cmd = train_cmd(tmp_path / "down", "log.trackers=[tensorboard,mlflow]", base=quick)
    down, down_s = _timed(cmd, env)
    assert down.returncode == 0, down.stderr[-2000:]
    (line,) = down.stderr.strip().splitlines()
    assert line.startswith(f"jddp: warning: log.trackers: mlflow at {uri} failed (")
    assert "Connection refused" in line
    assert "training goes on without it" in line
    assert read_losses(tmp_path / "down") == read_losses(tmp_path / "plain")  # complete
    assert down.stdout.strip().splitlines()[-1].startswith("jddp: done step=8")
    print(f"unreachable MLflow: {down_s:.1f} s, no tracker: {plain_s:.1f} s")
    # Bounded: the failure surfaces in seconds (MLflow's import, ~3 s of retries), which a run
    # shorter than that waits for at its end; unbounded, MLflow retries for minutes.
    assert down_s < plain_s + 30


@pytest.mark.slow
def test_a_preemption_waiting_for_a_slow_tracker_is_no_stall(tmp_path):
    """SIGTERM, the checkpoint saved, then the bounded wait for an MLflow server that takes
    connections and never answers: longer than dist.step_timeout_s, and the watchdog said
    "stalled ... waiting for a checkpoint to be written; stopping without saving" before the
    line saying the checkpoint was saved. Now the preemption's line alone, exit 75."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # connections wait in its backlog: requests are sent, never answered
    workdir = tmp_path / "run"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{silent.getsockname()[1]}"}
    cmd = train_cmd(workdir, "log.trackers=[mlflow]", "dist.step_timeout_s=2", base=LINEAR)
    try:
        job = start_training(cmd, workdir, steps=2, env=env, cwd=ROOT)
        job.send_signal(signal.SIGTERM)
        out, err = job.communicate(timeout=120)
    finally:
        silent.close()
    assert job.returncode == 75, err[-3000:]
    assert "stalled" not in err, err[-3000:]
    assert "jddp: warning: log.trackers: mlflow: still sending at the end of the run" in err
    last = out.strip().splitlines()[-1]
    assert last.startswith("jddp: preempted at step ") and " saved; rerun the same" in last


def _wait(job, predicate, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert job.poll() is None, f"the run ended before {what}: {job.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"no {what} in {timeout_s} s"
        time.sleep(0.02)


def _record(workdir) -> dict:
    try:
        return json.loads((Path(workdir) / "trackers.json").read_text())
    except (OSError, ValueError):
        return {}


@pytest.fixture(scope="module")
def tracked(mlflow_uri, tmp_path_factory):
    """The run sent to TensorBoard, MLflow (experiment jddp-test) and W&B offline: killed with
    SIGKILL after its step-4 checkpoint and a step sent to both trackers, rerun and stopped
    with SIGTERM (exit 75) after two more steps (its trackers started), rerun to its end.
    (workdir, env, the record after the kill, the last run's output)."""
    base = tmp_path_factory.mktemp("tracked")
    workdir = base / "run"
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": mlflow_uri,
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(base),
    }
    env.pop("WANDB_API_KEY", None)
    cmd = train_cmd(
        workdir,
        *RUN,
        "log.trackers=[tensorboard,mlflow,wandb]",
        "log.experiment=jddp-test",
        base=TINY,
    )
    hold = base / "hold"
    env[HOLD] = str(hold)
    hold.touch()  # the first step waits until both trackers started
    began = time.monotonic()
    job = start(cmd, env=env)

    def sent_to_both(steps):
        rec = _record(workdir)
        return all(
            rec.get(t, {}).get("steps", {}).get("train/loss", 0) >= steps
            for t in ("mlflow", "wandb")
        )

    _wait(job, lambda: {"mlflow", "wandb"} <= set(_record(workdir)), "the trackers' start")
    hold.unlink()
    _wait(job, lambda: steps_saved(workdir) and sent_to_both(5), "checkpoint and sent steps")
    job.send_signal(signal.SIGKILL)
    job.wait()
    killed_at = max(read_losses(workdir))
    assert killed_at < STEPS, "the run ended before the kill"
    after_kill = _record(workdir)
    print(f"killed at step {killed_at} after {time.monotonic() - began:.1f} s")

    # The rerun's steps wait again until both trackers said they started in it: on a loaded
    # machine (load 8 on 2 cores) W&B was still starting when the SIGTERM came and the run
    # ended 10 s later, so W&B's service closed the run with its own exit code 0 (2026-11-27).
    hold.touch()
    out_path = base / "rerun.out"
    with open(out_path, "w") as out:
        job = start(cmd, env=env, stdout=out)

        def both_started() -> bool:
            said = out_path.read_text()
            return all(f"jddp: {t}: run " in said for t in ("mlflow", "wandb"))

        _wait(job, both_started, "the rerun's trackers' start")
        hold.unlink()
        _wait(job, lambda: max(read_losses(workdir)) >= killed_at + 2, "steps after the kill")
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=120)
    assert job.returncode == 75, err[-2000:]
    assert max(read_losses(workdir)) < STEPS, "the rerun ended before SIGTERM"
    print(f"preempted at step {max(read_losses(workdir))} after {time.monotonic() - began:.1f} s")

    out = run(cmd, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "log.trackers" not in out.stderr, out.stderr[-3000:]  # no tracker failed or lagged
    print(f"finished after {time.monotonic() - began:.1f} s")
    return workdir, env, after_kill, out


def _expected(workdir) -> dict[str, dict[int, float]]:
    """metrics.jsonl as {key: {step: value}}, asserting no (key, step) is there twice."""
    want: dict[str, dict[int, float]] = {}
    for row in read_metrics(workdir):
        for key, value in row.items():
            if key != "step":
                assert row["step"] not in want.setdefault(key, {}), (key, row["step"])
                want[key][row["step"]] = float(value)
    return want


@pytest.mark.slow
def test_mlflow_has_every_step_once_in_one_run_across_kill_and_preemption(tracked, mlflow_uri):
    from mlflow import MlflowClient

    workdir, _, after_kill, out = tracked
    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("jddp-test")
    (found,) = client.search_runs([experiment.experiment_id])  # one run: the same after reruns
    run_id = found.info.run_id
    assert run_id == after_kill["mlflow"]["run_id"] == _record(workdir)["mlflow"]["run_id"]
    assert found.info.status == "FINISHED" and found.info.run_name == "run"
    # ended with an end time (the UI's duration; update_run left it open), and how to rerun it
    assert found.info.end_time is not None and found.info.end_time >= found.info.start_time
    assert "jddp.train" in found.data.tags["jddp.command"]
    want = _expected(workdir)
    assert sorted(want["train/loss"]) == list(range(1, STEPS + 1))
    assert sorted(want["eval/loss"]) == [8, 16, 24]
    for key, by_step in want.items():
        history = client.get_metric_history(run_id, key)
        steps = [m.step for m in history]
        assert len(set(steps)) == len(steps), key  # each step once
        if key in TIMINGS:  # a step it had before a resume keeps its first attempt's keys
            assert set(by_step) <= set(steps), key
        else:  # every step, with metrics.jsonl's value
            assert {m.step: m.value for m in history} == by_step, key
    params = found.data.params
    assert params["train.steps"] == str(STEPS) and params["model.name"].endswith("paced_mlp")
    assert params["log.trackers"] == str(["tensorboard", "mlflow", "wandb"])
    assert found.data.tags["jddp.checkpoint"] == str(workdir / "checkpoints" / str(STEPS))
    assert found.data.metrics["done/step"] == STEPS
    assert found.data.metrics["done/eval/accuracy"] == want["eval/accuracy"][STEPS]
    assert f"jddp: mlflow: run {run_id} (resumed)" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("jddp: done step=24")
    assert any((workdir / "tensorboard").iterdir())  # the default tracker still writes


def _tensorboard_steps(folder: Path, tag: str) -> list[int]:
    """Every step of ``tag`` TensorBoard shows from ``folder``'s event files, with repeats: the
    files in order, a purge hiding the earlier points at or after its step."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    from jddp.run.trackers.tensorboard import _records

    shown: list[int] = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for record in _records(path):
            event = Event.FromString(record)
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                shown = [s for s in shown if s < event.step]
            shown += [int(event.step) for v in event.summary.value if v.tag == tag]
    return sorted(shown)


@pytest.mark.slow
def test_tensorboard_has_every_step_once_across_kill_and_preemption(tracked):
    """Flushed at every log line and refilled on resume: after a kill -9, a preemption and the
    final rerun, TensorBoard shows each step's loss once, its value metrics.jsonl's (the event
    file was 0 bytes after a kill and the rerun started at step 25)."""
    workdir, *_ = tracked
    assert _tensorboard_steps(workdir / "tensorboard", "train/loss") == list(range(1, STEPS + 1))


def test_tensorboard_refills_what_an_older_run_lost(tmp_path):
    """Event files that lack steps (an older jddp flushed every 120 s; a kill lost them): the
    resumed tracker writes the missing steps from metrics.jsonl, each once, not those there."""
    from tensorboardX import SummaryWriter

    folder = RunFolder(tmp_path)
    folder.tensorboard.mkdir(parents=True)
    old = SummaryWriter(str(folder.tensorboard))
    for step in (1, 2, 3):
        old.add_scalar("train/loss", 1.0 / step, step)
    old.close()
    folder.metrics_jsonl.write_text(
        "".join(json.dumps({"step": s, "train/loss": 1.0 / s}) + "\n" for s in range(1, 7))
    )
    time.sleep(1.1)  # tensorboardX names files by the second: the new one sorts after
    trackers = Trackers.of(["tensorboard"], folder, 5, None, writer=True)
    trackers.start({})
    trackers.log(6, {"train/loss": 1.0 / 6})
    trackers.finish()
    assert _tensorboard_steps(folder.tensorboard, "train/loss") == [1, 2, 3, 4, 5, 6]


def test_a_nan_reaches_tensorboard_without_tensorboardx_warnings(tmp_path, capfd, caplog):
    """A non-finite step's NaN values are written (TensorBoard shows them), but tensorboardX's
    "NaN or Inf found in input tensor." (one per value: three lines before jddp's own) is not
    said; a NaN written by the user's own tensorboardX still is."""
    from tensorboardX import SummaryWriter
    from tensorboardX.proto.event_pb2 import Event

    from jddp.run.trackers.tensorboard import _records

    folder = RunFolder(tmp_path)
    trackers = Trackers.of(["tensorboard"], folder, 0, None, writer=True)
    trackers.start({})
    trackers.log(1, {"train/loss": float("nan"), "train/grad_norm": float("inf")})
    trackers.log(2, {"train/loss": 0.5})
    trackers.finish()
    assert "NaN or Inf" not in capfd.readouterr().err
    assert not [r for r in caplog.records if "NaN or Inf" in r.getMessage()]
    values = {}
    for path in folder.tensorboard.glob("events.out.tfevents.*"):
        for record in _records(path):
            for value in Event.FromString(record).summary.value:
                values[(value.tag, Event.FromString(record).step)] = value.simple_value
    assert math.isnan(values[("train/loss", 1)]) and values[("train/grad_norm", 1)] == math.inf
    assert values[("train/loss", 2)] == 0.5
    own = SummaryWriter(str(tmp_path / "own"))
    own.add_scalar("x", float("nan"), 1)
    own.close()
    assert [r for r in caplog.records if "NaN or Inf" in r.getMessage()]


def _wandb_records(path: Path):
    """The protobuf records of a W&B ``.wandb`` file (a LevelDB-style log of 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def _items(items) -> dict:
    """``{key: value}`` of a W&B record's items (a key is ``key`` or its ``nested_key``)."""
    return {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in items}


@pytest.mark.slow
def test_wandb_offline_continues_one_run_without_duplicates(tracked):
    workdir, env, after_kill, _ = tracked
    run_id = after_kill["wandb"]["run_id"]
    assert _record(workdir)["wandb"]["run_id"] == run_id
    files = sorted(Path(env["WANDB_DIR"]).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 3 and all(f.name == f"run-{run_id}.wandb" for f in files)
    got: dict[str, dict[int, float]] = {}
    config, summary, exits = {}, {}, []
    for path in files:
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                step = record.history.step.num
                for key, value in _items(record.history.item).items():
                    if not key.startswith("_"):
                        assert step not in got.setdefault(key, {}), (key, step)  # once
                        got[key][step] = value
            elif kind == "run":
                config.update(_items(record.run.config.update))
            elif kind == "config":
                config.update(_items(record.config.update))
            elif kind == "summary":
                summary.update(_items(record.summary.update))
            elif kind == "exit":
                exits.append(record.exit.exit_code)
    want = _expected(workdir)
    # W&B writes its file every 15 s: what it held when killed is lost; from there on, all.
    sent_before_kill = after_kill["wandb"]["steps"]["train/loss"]
    assert set(range(sent_before_kill + 1, STEPS + 1)) <= set(got["train/loss"])
    for key, by_step in got.items():
        assert set(by_step) <= set(want[key]), key
        if key not in TIMINGS:
            assert by_step == {s: want[key][s] for s in by_step}, key
    assert got["eval/loss"][STEPS] == want["eval/loss"][STEPS]
    assert config["train"]["steps"] == STEPS and config["log"]["trackers"][1] == "mlflow"
    assert summary["done/step"] == STEPS
    assert summary["checkpoint"] == str(workdir / "checkpoints" / str(STEPS))
    assert sorted(exits) == [0, 75]  # preempted, then finished (the killed one said nothing)
