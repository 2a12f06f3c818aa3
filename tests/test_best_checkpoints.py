"""The best checkpoints by an eval key (checkpoint.keep_best, monitor, mode: jddp/checkpoint/
best.py), ``best`` where a step is asked for (jddp.load, --step), and
checkpoint.resume_from=STEP|PATH|best."""

import shutil

import numpy as np
import optax
import pytest
from flax import nnx

import jddp
from jddp import config as config_lib
from jddp.checkpoint.best import RECORD, rank, read_evals
from jddp.checkpoint.find import find_checkpoint
from tests.helpers import (
    QUICK,
    assert_losses_match,
    data,
    fake_devices,
    launch_cmd,
    read_losses,
    read_metrics,
    run,
    run_python,
    snapshot,
    steps_saved,
    train,
)
from tests.user_models import TinyMLP

# Evals every 2 steps, the newest 2 kept and the best 2 by eval/loss, max being better (the
# loss falls: the best are early ones, which the newest-2 rotation alone would delete).
# QUICK's small MLP (no batch statistics): the same losses on any topology; which checkpoints
# are kept, found and resumed is what this module tests, not the steps.
BEST = [
    *QUICK,
    "train.steps=12",
    "train.eval_every_steps=2",
    "checkpoint.keep=2",
    "checkpoint.keep_best=2",
    "checkpoint.mode=max",
    "checkpoint.every_minutes=null",
]


@pytest.fixture(scope="module")
def best_run(tmp_path_factory):
    """One 2-process run of BEST (every process ranks the checkpoints it rotates): its
    workdir."""
    wd = tmp_path_factory.mktemp("best") / "run"
    out = run(launch_cmd(2, 1, wd, base=BEST), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return wd


def evals_of(wd) -> dict[int, float]:
    return {r["step"]: r["eval/loss"] for r in read_metrics(wd) if "eval/loss" in r}


@pytest.mark.slow
def test_the_best_are_kept_beside_the_newest(best_run):
    """Kept: the newest 2 and the best 2 by the monitored eval (never deleted by rotation);
    every eval step was saved; the record holds each eval line."""
    evals = evals_of(best_run)
    assert sorted(evals) == [2, 4, 6, 8, 10, 12]
    best = sorted(evals, key=lambda s: -evals[s])[:2]
    assert steps_saved(best_run) == sorted({10, 12, *best}), (evals, steps_saved(best_run))
    record = read_evals(best_run / "checkpoints" / RECORD)
    assert (record["monitor"], record["mode"]) == ("eval/loss", "max")
    assert {s: v["eval/loss"] for s, v in record["evals"].items()} == evals


@pytest.mark.slow
def test_step_best_in_load_evaluate_and_export(best_run, tmp_path):
    """jddp.load(W, step="best"), python -m jddp.evaluate/export --step best: the best kept
    checkpoint by the run's record (its monitor and mode). (The run's model is the tests' own:
    each command trusts its code.)"""
    evals = evals_of(best_run)
    best = max(steps_saved(best_run), key=lambda s: evals[s])
    assert find_checkpoint(best_run, "best", "path") == (best_run / "checkpoints", best)
    by_name = nnx.state(jddp.load(best_run, step="best", trust_code=True), nnx.Param)
    by_step = nnx.state(jddp.load(best_run, step=best, trust_code=True), nnx.Param)
    assert all(
        np.array_equal(a, b) for a, b in zip(jax_leaves(by_name), jax_leaves(by_step), strict=True)
    )
    trusted = ["--workdir", str(best_run), "--trust-code", "--step", "best"]
    out = run_python("-m", "jddp.evaluate", *trusted)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"jddp: eval step={best} " in out.stdout
    out = run_python("-m", "jddp.export", *trusted, "--format", "stablehlo",
                     str(tmp_path / "model.stablehlo"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"exported checkpoint {best_run}/checkpoints/{best} " in out.stdout
    # A run that kept no record: one line naming the flag and the steps there are.
    plain = tmp_path / "plain"
    shutil.copytree(best_run, plain)
    (plain / "checkpoints" / RECORD).unlink()
    out = run_python("-m", "jddp.evaluate", "--workdir", str(plain), "--trust-code", "--step",
                     "best")  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip() == (
        f"jddp: error: --step: best: {plain}/checkpoints holds no record of its evals (its "
        "run had checkpoint.keep_best=0); give a step: " + ", ".join(map(str, steps_saved(plain)))
    )


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


@pytest.mark.slow
def test_resume_from_best_sets_the_newer_aside_once_on_any_topology(best_run, tmp_path):
    """checkpoint.resume_from=best (by the run's monitor, the mode given now): the newer
    checkpoints and a copy of metrics.jsonl go to previous/, the run resumes there (here on 2
    devices of 1 process, dist.shard=optimizer: checkpoints hold full arrays) and logs the
    same losses; a rerun of the same command continues from the newest."""
    wd = tmp_path / "run"
    shutil.copytree(best_run, wd)
    evals, kept = evals_of(wd), steps_saved(wd)
    mode = next(m for m in ("min", "max") if rank({s: {"l": evals[s]} for s in kept},
                                                  kept, "l", m, 1)[0] != kept[-1])  # fmt: skip
    (best,) = rank({s: {"eval/loss": evals[s]} for s in kept}, kept, "eval/loss", mode, 1)
    command = [f"checkpoint.mode={mode}", "checkpoint.resume_from=best", "dist.shard=optimizer"]
    out = train(wd, *command, base=BEST, env=fake_devices(2))
    assert out.returncode == 0, out.stderr[-3000:]
    newer = [s for s in kept if s > best]
    (moved,) = (wd / "previous").iterdir()
    assert (
        f"jddp: checkpoint.resume_from=best: resuming from {wd}/checkpoints/{best}; the newer "
        f"checkpoints ({', '.join(map(str, newer))}) went to {moved}"
    ) in out.stdout
    assert f"resumed from {wd}/checkpoints/{best} at step {best}" in out.stdout
    assert steps_saved(moved) == newer and read_losses(moved) == read_losses(best_run)
    assert sorted(read_losses(wd)) == list(range(1, 13))  # each step once
    assert_losses_match(read_losses(wd), read_losses(best_run), range(best + 1, 13))
    again = train(wd, *command, base=BEST, env=fake_devices(2))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "checkpoint.resume_from=best was applied by an earlier run of this workdir" in (
        again.stdout
    )
    assert f"resumed from {wd}/checkpoints/12 at step 12" in again.stdout


@pytest.mark.slow
def test_resume_from_another_runs_checkpoint_starts_from_a_copy(best_run, tmp_path):
    wd = tmp_path / "run"
    source = best_run / "checkpoints" / "10"
    out = train(wd, f"checkpoint.resume_from={source}", base=BEST)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        f"jddp: checkpoint.resume_from={source}: starting from {wd}/checkpoints/10, a copy of "
        f"checkpoint {source}"
    ) in out.stdout
    assert sorted(read_losses(wd)) == [11, 12]
    assert_losses_match(read_losses(wd), read_losses(best_run), [11, 12])
    assert (source / "state").is_dir()  # the other run's is untouched


@pytest.mark.slow
@pytest.mark.parametrize(
    "value, said",
    [
        ("7", "no checkpoint of step 7 in {wd}/checkpoints (there are: {steps})"),
        ("{tmp}/nowhere", "{tmp}/nowhere is neither a run's workdir nor a checkpoint folder"),
    ],
)
def test_resume_from_what_is_not_there_is_one_line(best_run, tmp_path, value, said):
    wd = tmp_path / "run"
    shutil.copytree(best_run, wd)
    before = snapshot(wd)
    value = value.format(tmp=tmp_path)
    out = train(wd, f"checkpoint.resume_from={value}", base=BEST)
    steps = ", ".join(map(str, steps_saved(wd)))
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip() == (
        "jddp: error: checkpoint.resume_from: " + said.format(wd=wd, tmp=tmp_path, steps=steps)
    )
    assert snapshot(wd) == before  # nothing moved, nothing written


def test_keep_best_without_evals_and_resume_from_without_resume_are_refused():
    with pytest.raises(jddp.ConfigError, match=r"checkpoint.keep_best=2 needs evals during the "
                       r"run: set train.eval_every_steps > 0"):  # fmt: skip
        config_lib.load(None, ["checkpoint.keep_best=2"])
    with pytest.raises(jddp.ConfigError, match="checkpoint.resume_from=best with "
                       "checkpoint.resume=false"):  # fmt: skip
        config_lib.load(None, ["checkpoint.resume_from=best", "checkpoint.resume=false"])
    assert config_lib.load(None, ["checkpoint.resume_from=4"]).checkpoint.resume_from == 4


def test_a_misspelt_monitor_is_refused_before_training(tmp_path):
    with pytest.raises(jddp.ConfigError) as e:
        jddp.fit(TinyMLP(192, 10, nnx.Rngs(0)), optax.sgd(0.1), data(64), data(32),
                 config={"workdir": str(tmp_path / "run")},
                 overrides=["data.global_batch_size=16", "log.progress=off", "train.steps=4",
                            "train.eval_every_steps=2", "checkpoint.keep_best=1",
                            "checkpoint.monitor=eval/acuracy"])  # fmt: skip
    assert str(e.value) == (
        "checkpoint.monitor: 'eval/acuracy' is not an eval metric of this run (its eval lines "
        "hold eval/loss, eval/accuracy, eval/top5_accuracy, eval/count); did you mean "
        "'eval/accuracy'?"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
