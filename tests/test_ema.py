"""train.ema_decay (issue 46.2): an exponential moving average of the parameters in the train
state and its checkpoints; every eval also reports it (eval_ema/...); load, predict, evaluate,
export and init_from read it on request; a resume continues it bitwise. The average itself,
under every dist.shard layout: tests/test_shard_update.py."""

import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jddp
from jddp.errors import ConfigError
from tests.helpers import read_metrics, run, train_cmd
from tests.user_models import TinyMLP

BASE = ["data.global_batch_size=16", "log.every_steps=2", "log.progress=off",
        "train.eval_every_steps=4", "checkpoint.every_steps=4"]  # fmt: skip
EMA = "train.ema_decay=0.8"


def data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8, 8, 3)).astype(np.float32), rng.integers(0, 10, n)


def model():
    return TinyMLP(192, 10, nnx.Rngs(0))


def fit(workdir, steps, *overrides, lr=0.1):
    return jddp.fit(
        model(), optax.sgd(lr), data(), data(32), config={"workdir": str(workdir)},
        overrides=[*BASE, f"train.steps={steps}", *overrides],
    )  # fmt: skip


def params(m) -> np.ndarray:
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(nnx.state(m))])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """8 steps with an EMA, uninterrupted (checkpoints 4 and 8, evals at 4 and 8)."""
    wd = tmp_path_factory.mktemp("ema") / "run"
    fit(wd, 8, EMA)
    return wd


def test_every_eval_reports_the_ema_and_the_checkpoint_holds_it(straight, capsys):
    evals = [r for r in read_metrics(straight) if "eval/loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
    for row in evals:
        assert row["eval_ema/count"] == row["eval/count"] == 32
        assert row["eval_ema/loss"] != row["eval/loss"]  # another set of weights
    final = evals[-1]
    # the checkpoint's EMA is what the run evaluated; its parameters are not
    averaged = jddp.load(straight, model=model(), ema=True)
    raw = jddp.load(straight, model=model())
    assert not np.array_equal(params(averaged), params(raw))
    got = jddp.evaluate(averaged, data(32))
    assert got["eval/loss"] == pytest.approx(final["eval_ema/loss"], rel=1e-5)
    assert jddp.evaluate(raw, data(32))["eval/loss"] == pytest.approx(final["eval/loss"], rel=1e-5)
    out = jddp.predict(averaged, data(32)[0])
    assert np.allclose(out, averaged(data(32)[0]), atol=1e-5)


def test_a_resume_continues_the_ema_bitwise(straight, tmp_path):
    wd = tmp_path / "run"
    fit(wd, 4, EMA)
    fit(wd, 8, EMA)  # resumes from 4
    assert np.array_equal(
        params(jddp.load(wd, model=model(), ema=True)),
        params(jddp.load(straight, model=model(), ema=True)),
    )


def test_an_ema_turned_on_at_a_resume_starts_from_the_parameters(tmp_path, capsys):
    wd = tmp_path / "run"
    fit(wd, 4)  # no EMA
    with pytest.raises(ConfigError, match="holds no EMA of the parameters"):
        jddp.load(wd, model=model(), ema=True)
    fit(wd, 8, EMA)
    assert "checkpoint of step 4 has no EMA of the parameters" in capsys.readouterr().out
    assert "eval_ema/loss" in [r for r in read_metrics(wd) if r.get("step") == 8][-1]


def test_init_from_the_ema_of_another_run(straight, tmp_path):
    """checkpoint.init_from_ema: the new run starts at the other run's EMA (lr 0: it stays)."""
    result = fit(
        tmp_path / "run", 1, f"checkpoint.init_from={straight}", "checkpoint.init_from_ema=true",
        lr=0.0,
    )  # fmt: skip
    want = params(jddp.load(straight, model=model(), ema=True))
    assert np.array_equal(params(result.model), want)


@pytest.mark.slow
def test_the_commands_read_the_ema_with_a_flag(tmp_path):
    """python -m jddp.evaluate --ema gives the run's own eval_ema/ line; without a train EMA
    the flag is one line, exit 2."""
    wd = tmp_path / "run"
    out = run(train_cmd(wd, "train.steps=6", "train.ema_decay=0.5"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "EMA weights: loss" in out.stdout  # the final eval's line
    final = [r for r in read_metrics(wd) if "eval_ema/accuracy" in r][-1]
    cmd = [sys.executable, "-m", "jddp.evaluate", "--workdir", str(wd), "--ema"]
    again = run(cmd)
    assert again.returncode == 0, again.stderr[-3000:]
    logged = read_metrics(wd)[-1]
    assert logged["eval_ema/accuracy"] == pytest.approx(final["eval_ema/accuracy"], abs=1e-6)
    assert logged["eval_ema/loss"] == pytest.approx(final["eval_ema/loss"], rel=1e-5)
    assert "(the EMA of its parameters)" in again.stdout
