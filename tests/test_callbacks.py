"""Callbacks and early stopping (issue 46.3): your code at a log line, an eval, a checkpoint and
the end, on process 0, outside the step; a callback's stop ends the run as a finished one;
early stopping decides from the eval lines, the same after a resume."""

import gc
from pathlib import Path

import numpy as np
import optax
import pytest
from flax import nnx

import jddp
from tests.helpers import read_metrics, snapshot, train
from tests.user_models import TinyMLP

BASE = ["data.global_batch_size=16", "log.every_steps=1", "log.progress=off",
        "train.eval_every_steps=2", "checkpoint.every_steps=4"]  # fmt: skip


def data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8, 8, 3)).astype(np.float32), rng.integers(0, 10, n)


def fit(workdir, steps, *overrides, callbacks=(), lr=0.0):
    """TinyMLP with SGD at ``lr`` (0: every eval the same, nothing improves)."""
    return jddp.fit(
        TinyMLP(192, 10, nnx.Rngs(0)), optax.sgd(lr), data(), data(32),
        config={"workdir": str(workdir)}, overrides=[*BASE, f"train.steps={steps}", *overrides],
        callbacks=callbacks,
    )  # fmt: skip


class Recorder(jddp.Callback):
    def __init__(self, stop_at_log=None):
        self.calls, self.stop_at_log = [], stop_at_log

    def on_start(self, step, history):
        self.calls.append(("start", step, len(history)))
        self.gc_threshold = gc.get_threshold()

    def on_log(self, step, metrics):
        self.calls.append(("log", step))
        return step == self.stop_at_log

    def on_eval(self, step, metrics):
        self.calls.append(("eval", step, round(metrics["eval/loss"], 6)))

    def on_checkpoint(self, step, path):
        # Told once the checkpoint is complete on disk (it was told at the save's start, in
        # the background: a kill right after lost the checkpoint it was told about).
        complete = (Path(path) / "_CHECKPOINT_METADATA").is_file() and all(
            (Path(path) / item / "commit_success.txt").is_file()
            for item in ("state", "manifest", "config")
        )
        assert complete, sorted(p.name for p in Path(path).parent.iterdir())
        self.calls.append(("checkpoint", step, path.endswith(f"checkpoints/{step}")))

    def on_end(self, result):
        self.calls.append(("end", result.step))


def test_callbacks_see_each_line_and_a_stop_ends_the_run_as_finished(tmp_path, capsys):
    """on_log returning True at step 5 (read one step late, as every line) stops every process
    after the next step the flag reaches: saved, evaluated, exit 0, the summary says why."""
    rec = Recorder(stop_at_log=5)
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # Python's own: fit collects less often, then puts them back
    try:
        result = fit(tmp_path / "run", 20, callbacks=[rec], lr=0.1)
        assert rec.gc_threshold == (50_000, 10, 10) and gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*before)
    # the flag rides in the next batch dispatched (step 7), read with it one step late: 8
    assert result.step == 8
    kinds = [c[0] for c in rec.calls]
    assert kinds[0] == "start" and kinds[-1] == "end" and rec.calls[-1] == ("end", 8)
    assert [c[1] for c in rec.calls if c[0] == "log"] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [c[1] for c in rec.calls if c[0] == "eval"] == [2, 4, 6, 8]  # 8: the final eval
    assert ("checkpoint", 4, True) in rec.calls and ("checkpoint", 8, True) in rec.calls
    assert "jddp: stopped at step 8: Recorder" in capsys.readouterr().out
    assert (tmp_path / "run" / "checkpoints" / "8").is_dir()


def test_early_stopping_stops_and_decides_the_same_after_a_resume(tmp_path, capsys):
    """train.early_stop_metric=eval/loss, patience 3, nothing improving (lr 0): evals at 2
    (best), 4, 6, 8 (the third without improvement): the flag rides in step 9, read at 10.
    A run that ended at step 6 and is resumed to 20 reads its evals back and stops at step 10
    too. A rerun of the stopped run stays stopped, saying so (it trained on to the next eval
    and replaced the final checkpoint and eval); with another patience it trains on."""
    keys = ["train.early_stop_metric=eval/loss", "train.early_stop_patience=3"]
    straight = fit(tmp_path / "straight", 20, *keys)
    assert straight.step == 10
    fit(tmp_path / "resumed", 6, *keys)
    resumed = fit(tmp_path / "resumed", 20, *keys)
    assert resumed.step == 10
    losses = [r["train/loss"] for r in read_metrics(tmp_path / "resumed") if "train/loss" in r]
    assert len(losses) == 10  # each step once
    wd = tmp_path / "straight"
    before = snapshot(wd / "checkpoints"), (wd / "metrics.jsonl").read_text()
    capsys.readouterr()
    again = fit(wd, 20, *keys)
    assert again.step == 10 and again.eval == straight.eval
    assert (snapshot(wd / "checkpoints"), (wd / "metrics.jsonl").read_text()) == before
    said = [line for line in capsys.readouterr().out.splitlines() if "stays stopped" in line]
    (best,) = [r["eval/loss"] for r in read_metrics(wd) if r["step"] == 2 and "eval/loss" in r]
    assert said == [
        "jddp: this run stopped early at step 10 (early stopping: eval/loss did not improve "
        f"for 3 evals (best {best:.6g} at step 2)); it stays stopped (change "
        f"train.early_stop_*, or remove {wd / '.jddp.stopped'}, to train on)"
    ], said
    longer = fit(wd, 20, "train.early_stop_metric=eval/loss", "train.early_stop_patience=5")
    assert longer.step == 14  # evals 2 (best) .. 12: the fifth without improvement at 12


def test_a_nan_eval_is_never_the_best():
    """A first eval of NaN stayed "the best" (no comparison with it holds): a run whose metric
    then improved was stopped, "best nan at step 2". NaN counts as an eval without
    improvement; what follows is judged against the numbers."""
    stopper = jddp.EarlyStopping("eval/loss", patience=2)
    evals = [(2, float("nan")), (4, 2.0), (6, 1.5), (8, 1.4), (10, 1.3)]
    assert [stopper.on_eval(step, {"eval/loss": v}) for step, v in evals] == [False] * 5
    assert (stopper.best, stopper.best_step) == (1.3, 10)
    assert stopper.on_eval(12, {"eval/loss": float("nan")}) is False
    assert stopper.on_eval(14, {"eval/loss": 1.3}) is True
    assert stopper.reason().endswith("(best 1.3 at step 10)")
    nothing = jddp.EarlyStopping("eval/loss", patience=1)
    assert nothing.on_eval(2, {"eval/loss": float("nan")}) is True
    assert nothing.reason().endswith("(none was a number)")


def test_a_callback_that_raises_stops_the_run_with_its_own_error_and_keeps_the_checkpoint(
    tmp_path,
):
    """The run stops like on any other error: the callback's exception, as raised (its
    traceback is Python's, once), the checkpoint before it kept, the next run resumes."""

    class Broken(jddp.Callback):
        def on_log(self, step, metrics):
            if step == 6:
                raise ZeroDivisionError("the callback's own bug")

    with pytest.raises(ZeroDivisionError, match="the callback's own bug"):
        fit(tmp_path / "run", 20, callbacks=[Broken()])
    assert (tmp_path / "run" / "checkpoints" / "4").is_dir()
    assert fit(tmp_path / "run", 8).step == 8  # resumed from 4


def test_an_unknown_early_stop_metric_is_one_line_before_training(tmp_path):
    """Refused before the first step (it was at the first eval, after training to it), naming
    the eval keys there are; the classification task's from the model's outputs (top-5 with
    more than 5). So is early stopping that can never stop (no eval before the end)."""
    with pytest.raises(jddp.ConfigError) as e:
        fit(tmp_path / "run", 4, "train.early_stop_metric=eval/acc")
    assert str(e.value) == (
        "train.early_stop_metric: 'eval/acc' is not an eval metric of this run (its eval lines "
        "hold eval/loss, eval/accuracy, eval/top5_accuracy, eval/count); did you mean "
        "'eval/accuracy'?"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / "checkpoints" / "2").exists()
    never = "needs evals during the run: set train.eval_every_steps > 0"
    with pytest.raises(jddp.ConfigError, match=f"train.early_stop_metric=eval/loss {never}"):
        fit(tmp_path / "run", 4, "train.early_stop_metric=eval/loss", "train.eval_every_steps=0")
    stopper = jddp.EarlyStopping("eval/loss")
    with pytest.raises(jddp.ConfigError, match=f"EarlyStopping\\(metric=...\\)=eval/loss {never}"):
        fit(tmp_path / "run", 4, "train.eval_every_steps=0", callbacks=[stopper])
    with pytest.raises(jddp.ConfigError, match="EarlyStopping.*'loss' is not an eval metric"):
        fit(tmp_path / "run", 4, callbacks=[jddp.EarlyStopping("loss")])


CUSTOM = ["model.name=tests.user_tasks:linear", "data.name=tests.user_tasks:data",
          "train.loss=tests.user_tasks:weighted_loss", "train.metrics=tests.user_tasks:metrics",
          "data.global_batch_size=16", "log.progress=off", "train.steps=4",
          "train.eval_every_steps=2"]  # fmt: skip


@pytest.mark.slow
def test_a_custom_tasks_eval_keys_are_known_before_training(tmp_path):
    """A custom task's eval keys from its eval terms' structure (traced, not run), with the
    EMA's: a misspelt one is exit 2 and one line before anything trains."""
    wd = tmp_path / "run"
    out = train(wd, *CUSTOM, "train.ema_decay=0.9", "log.weight_unit=tokens",
                "train.early_stop_metric=eval_ema/wmsee", base=[])  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    line = out.stderr.strip()
    assert "\n" not in line and line.startswith(
        "jddp: error: train.early_stop_metric: 'eval_ema/wmsee' is not an eval metric of this "
        "run (its eval lines hold eval/loss, eval/"
    ), line
    assert "eval/wmse, eval/wsse, eval/count, eval/tokens, eval_ema/loss" in line, line
    assert line.endswith("; did you mean 'eval_ema/wmse'?"), line
    assert not (wd / "metrics.jsonl").exists()


class PacedMLP(TinyMLP):
    """TinyMLP whose every forward pass takes 50 ms of host time (a callback in the step)."""

    def __call__(self, x):
        import time

        import jax

        jax.debug.callback(lambda: time.sleep(0.05))
        return super().__call__(x)


def test_checkpoints_by_the_clock_bound_what_a_kill_loses(tmp_path):
    """checkpoint.every_minutes (every_steps 0): a 50 ms step and saves due every 0.15 s give
    checkpoints between the start and the end (the clock's flag rides in the batch, so every
    process saves at the same step); every_steps set: the clock is not asked."""
    saves = Recorder()
    jddp.fit(
        PacedMLP(192, 10, nnx.Rngs(0)), optax.sgd(0.1), data(),
        config={"workdir": str(tmp_path / "timed")},
        overrides=[*BASE[:3], "train.steps=24", "checkpoint.every_steps=0",
                   "checkpoint.every_minutes=0.0025", "checkpoint.keep=30"],
        callbacks=[saves],
    )  # fmt: skip
    timed = [c[1] for c in saves.calls if c[0] == "checkpoint"]
    assert len(timed) >= 3 and timed[-1] == 24, timed  # some before the end, then the end
    # One save per period: never at consecutive steps (the flag of the step dispatched before
    # a save, read after it, had saved again: 3/4, 10/11, ...); the end saves anyway.
    assert all(b - a > 1 for a, b in zip(timed[:-2], timed[1:-1], strict=True)), timed
    assert sorted(int(p.name) for p in (tmp_path / "timed" / "checkpoints").iterdir()) == timed
    by_steps = Recorder()
    fit(tmp_path / "steps", 8, "checkpoint.every_minutes=0.0001", callbacks=[by_steps])
    assert [c[1] for c in by_steps.calls if c[0] == "checkpoint"] == [4, 8]
