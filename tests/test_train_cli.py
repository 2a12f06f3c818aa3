"""The CLI end to end on a tiny model: outputs, metrics, checkpoints, resume, exit codes."""

import pytest
import yaml

from tests.helpers import TINY, assert_losses_match, read_losses, read_metrics, traced_steps
from tests.helpers import train as train_run


def train(workdir, *overrides, fresh=False):
    return train_run(workdir, *overrides, base=TINY, fresh=fresh)


@pytest.mark.slow
def test_train_writes_outputs(tmp_path):
    wd = tmp_path / "run"
    out = train(
        wd,
        "train.steps=6",
        "train.eval_every_steps=3",
        "checkpoint.every_steps=3",
        "log.profile_steps=2:4",
        fresh=True,  # the CLI as users start it, not forked from the tests' CLI server
    )
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("jddp: done step=6 eval/accuracy=")
    cfg = yaml.safe_load((wd / "config.yaml").read_text())
    assert cfg["train"]["steps"] == 6 and cfg["workdir"] == str(wd)
    rows = read_metrics(wd)
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["train/loss"] > 0 and 0 <= r["train/accuracy"] <= 1 for r in train_rows)
    # Throughput windows exclude compilation (step 1) and eval time (eval ran at step 3).
    assert all(r["train/img_per_s"] > 0 for r in train_rows if r["step"] not in (1, 3))
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(r["eval/count"] == 256 for r in evals)  # every synthetic eval example once
    assert sorted(int(p.name) for p in (wd / "checkpoints").iterdir()) == [3, 6]
    assert list((wd / "tensorboard").glob("events.out.tfevents.*"))
    # log.profile_steps=2:4: steps 2 and 3 traced, each marked with its number
    assert traced_steps(wd / "profile") == [2, 3]
    assert "jddp: profile of steps 2..3" in out.stdout
    assert "jddp: summary" in out.stdout and "img/s on 1 devices (1 process)\n" in out.stdout
    # the summary names the policy in force (it said skip under the default halt)
    assert "gradient, train.on_nonfinite=halt)" in out.stdout
    # the state's memory, once (issue 43): the first step's row and one line
    assert "jddp: memory per device: state " in out.stdout
    first = next(r for r in rows if "train/compile_s" in r)
    assert first["mem/state_bytes_per_device"] > 0 and first["mem/step_bytes_per_device"] > 0
    assert sum("mem/state_bytes_per_device" in r for r in rows) == 1
    assert not (wd / ".jddp.lock").exists()  # released at the end


@pytest.mark.slow
def test_resume_continues_the_same_trajectory(tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    # (That a restart loads its step from the compilation cache: test_fault_tolerance.py.)
    assert train(straight, "train.steps=6").returncode == 0
    first = train(interrupted, "train.steps=4", "checkpoint.every_steps=2")
    assert first.returncode == 0, first.stderr
    again = train(interrupted, "train.steps=6", "checkpoint.every_steps=2")
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout and "at step 4" in again.stdout
    assert again.stdout.strip().splitlines()[-1].startswith("jddp: done step=6")
    a, b = read_losses(straight), read_losses(interrupted)
    assert sorted(b) == [1, 2, 3, 4, 5, 6]  # no duplicated or lost lines
    assert_losses_match(b, a, (5, 6), rel=1e-6)
    # The same command once more: nothing left to do, same final step, exit 0.
    done = train(interrupted, "train.steps=6", "checkpoint.every_steps=2")
    assert done.returncode == 0 and "done step=6" in done.stdout


@pytest.mark.slow
def test_bad_runtime_input_exits_nonzero_with_one_line(tmp_path):
    out = train(tmp_path / "r", "data.name=cifar10", f"data.path={tmp_path / 'nothing'}")
    assert out.returncode == 2
    assert "data.path" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = train(tmp_path / "r", "data.global_batch_size=4096", "train.steps=1")
    assert out.returncode == 2
    assert "global_batch_size=4096" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["halt", "skip"])
def test_non_finite_loss(tmp_path, policy):
    """lr=1e30 blows the parameters up after step 1, so step 2's loss is not finite."""
    wd = tmp_path / "run"
    out = train(
        wd,
        "optim.lr=1e30",
        "train.steps=4",
        "checkpoint.every_steps=1",
        f"train.on_nonfinite={policy}",
    )
    rows = {r["step"]: r for r in read_metrics(wd) if "train/loss" in r}
    if policy == "halt":
        assert out.returncode == 1
        line = out.stderr.strip().splitlines()[-1]
        assert "non-finite loss or gradient at step 2" in line and "checkpoints/" in line
        assert sorted(rows) == [1]  # nothing logged past the bad step
    else:  # every update after step 1 dropped: more than train.max_skipped_fraction (0.1)
        assert out.returncode == 1, out.stderr[-2000:]
        # One line from jddp; a loaded machine may add XLA's own log lines (slow-compile notes).
        ours = [ln for ln in out.stderr.splitlines() if ln.startswith("jddp:")]
        assert ours == out.stderr.strip().splitlines()[-1:], out.stderr[-2000:]
        line = ours[0]
        assert "3 of 4 steps (75%)" in line and "checkpoints/4 is saved" in line
        assert rows[2]["train/nonfinite"] == 1 and rows[4]["train/skipped_steps"] == 3
    saved = sorted(int(p.name) for p in (wd / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and (policy == "skip" or saved[0] == 1)  # halt keeps the last good one
