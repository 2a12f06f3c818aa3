"""Runs that must not lose work or report a false success: starting over, rerunning a finished
run, changed configs on resume, every step skipped, Ctrl-C."""

import json
import os
import signal
import time

import pytest
from flax import nnx

import jddp
from jddp.errors import ConfigError, NonFiniteLoss
from jddp.run.hooks import STOP_SIGNALS, StopRequest
from tests.helpers import (
    TINY,
    data,
    read_losses,
    run,
    start_training,
    steps_saved,
    train,
    train_cmd,
)
from tests.user_models import NanModel, TinyMLP


def fit(workdir, *overrides, model=None, seed=0):
    return jddp.fit(
        model or TinyMLP(192, 2, nnx.Rngs(seed)),
        train_data=data(64),
        config={"workdir": str(workdir)},
        overrides=[
            "data.global_batch_size=16",
            "log.progress=off",
            "log.every_steps=1",
            "optim.schedule=constant",
            f"train.seed={seed}",
            *overrides,
        ],
    )


def rows(workdir):
    return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_resume_false_moves_the_earlier_run_aside(tmp_path):
    wd = tmp_path / "run"
    fit(wd, "train.steps=2")
    first = read_losses(wd)
    fit(wd, "train.steps=2", "checkpoint.resume=false", seed=1)
    second = read_losses(wd)
    assert sorted(second) == [1, 2] and second != first  # only the new run's lines
    (previous,) = (wd / "previous").iterdir()
    assert read_losses(previous) == first  # nothing written is lost
    assert steps_saved(previous) == [2] and steps_saved(wd) == [2]
    # A later resume finds the new run's checkpoint, not the older run's.
    result = fit(wd, "train.steps=3", seed=1)
    assert result.step == 3 and sorted(read_losses(wd)) == [1, 2, 3]
    assert read_losses(wd)[2] == second[2]


def test_rerunning_a_finished_run_logs_its_eval_once(tmp_path):
    wd = tmp_path / "run"
    fit(wd, "train.steps=2")
    again = fit(wd, "train.steps=2")
    assert again.step == 2 and again.eval["eval/count"] == 64
    assert [r["step"] for r in rows(wd) if "eval/loss" in r] == [2]


def test_a_changed_config_is_refused_and_nothing_is_written(tmp_path):
    wd = tmp_path / "run"
    fit(wd, "train.steps=2")
    before = (wd / "config.yaml").read_text(), (wd / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="data.global_batch_size: 16 there, 32 now"):
        fit(wd, "train.steps=4", "data.global_batch_size=32")
    assert ((wd / "config.yaml").read_text(), (wd / "metrics.jsonl").read_text()) == before
    result = fit(
        wd, "train.steps=3", "data.global_batch_size=32", "checkpoint.allow_config_change=true"
    )
    assert result.step == 3


def test_a_run_that_skipped_every_step_fails(tmp_path):
    model = NanModel(192, 2, nnx.Rngs(0))
    with pytest.raises(NonFiniteLoss, match="all 3 steps of this run"):
        fit(tmp_path / "run", "train.steps=3", "train.on_nonfinite=skip", model=model)


@pytest.mark.slow
def test_ctrl_c_saves_like_sigterm(tmp_path):
    wd = tmp_path / "run"
    job = start_training(train_cmd(wd, "train.steps=100000"), wd, steps=3)
    job.send_signal(signal.SIGINT)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 75, err[-2000:]
    stopped = int(out.split("preempted at step ")[1].split()[0])
    assert steps_saved(wd)[-1] == stopped and not (wd / ".jddp.lock").exists()


@pytest.mark.parametrize("sig", STOP_SIGNALS)
def test_every_stop_signal_is_recorded(sig):
    with StopRequest() as stop:
        os.kill(os.getpid(), sig)
        time.sleep(0.01)  # the handler runs in this thread between bytecodes
        assert stop.signal_name == signal.Signals(sig).name
        assert stop.flags(2)["sys/stop"].tolist() == [1.0, 1.0]


def test_a_second_ctrl_c_interrupts_at_once():
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs in this thread between bytecodes
        assert stop.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs (root with mount rights only; skipped elsewhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = run(["mount", "-t", "tmpfs", "-o", "size=3M", "tmpfs", str(mount)])
    if made.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights)")
    try:
        yield mount
    finally:
        run(["umount", "-l", str(mount)])


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_older_ones(small_disk):
    """Room for one checkpoint (~0.6 MB) and its metrics, not two: the second save fails."""
    stat = os.statvfs(small_disk)
    (small_disk / "fill").write_bytes(b"\0" * (stat.f_bavail * stat.f_frsize - 900 * 1024))
    wd = small_disk / "run"
    out = train(wd, "train.steps=6", "checkpoint.every_steps=2", base=TINY)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
    assert "checkpoints/4 could not be written (No space left on device)" in lines[0]
    assert "intact: [2]" in lines[0] and steps_saved(wd) == [2]
