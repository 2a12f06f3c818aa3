"""The library API: jddp.fit with custom models, losses, metrics and data; user model factories
from the CLI; the runnable examples (also under jddp.launch)."""

import importlib.util
import sys
from pathlib import Path

import optax
import pytest
from flax import nnx

import jddp
from tests.helpers import data, read_metrics, run, run_python
from tests.user_models import TinyMLP

ROOT = Path(__file__).resolve().parents[1]


def test_public_names_are_documented():
    for name in jddp.__all__:
        obj = getattr(jddp, name)
        assert obj.__doc__, name


def test_fit_with_arrays_custom_loss_and_metric(tmp_path):
    calls = []

    def loss_fn(logits, labels):
        calls.append(1)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)

    result = jddp.fit(
        TinyMLP(192, 2, nnx.Rngs(0)),
        optax.adam(1e-2),
        train_data=data(512),
        eval_data=data(40, seed=1),
        loss_fn=loss_fn,
        metrics_fn=lambda logits, labels: {"mean_logit": logits.mean(axis=-1)},
        config={"workdir": str(tmp_path / "run"), "train": {"steps": 60}},
        overrides=["data.global_batch_size=16", "log.progress=off", "log.every_steps=10"],
    )
    assert calls and result.step == 60
    assert result.eval["eval/count"] == 40  # every eval example once
    assert result.eval["eval/accuracy"] > 0.7
    rows = read_metrics(tmp_path / "run")
    assert any("train/mean_logit" in r for r in rows)
    assert (tmp_path / "run" / "checkpoints" / "60").is_dir()


def test_fit_with_grain_source_record_list_and_iterable(tmp_path):
    import grain

    x, y = data()
    records = [(x[i], int(y[i])) for i in range(len(x))]  # len + [i]: a random-access source
    grain_ds = grain.MapDataset.source(records).map(lambda r: {"image": r[0], "label": r[1]})
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]  # an iterable
    for name, train in [("grain", grain_ds), ("records", records), ("iterable", iter(batches))]:
        result = jddp.fit(
            TinyMLP(192, 2, nnx.Rngs(0)),
            optax.sgd(0.1),
            train_data=train,
            config={"workdir": str(tmp_path / name)},
            overrides=["train.steps=3", "data.global_batch_size=16", "log.progress=off"],
        )
        assert result.step == 3 and result.eval["eval/count"] == 64


@pytest.mark.slow
def test_user_model_factory_from_the_cli(tmp_path):
    out = run_python(
        *("-m", "jddp.train", f"workdir={tmp_path / 'run'}"),
        *("model.name=tests.user_models:tiny_mlp", "data.name=synthetic", "data.image_size=8"),
        *("data.global_batch_size=16", "train.steps=3", "log.progress=off"),
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "jddp: done step=3" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher, script, min_accuracy",
    [
        ([], "custom_cnn_digits.py", 0.9),
        pytest.param(  # two processes: alone on the machine (tests/conftest.py)
            [sys.executable, "-m", "jddp.launch", "--nproc", "2", "--"],
            "custom_cnn_digits.py",
            0.9,
            marks=pytest.mark.serial,
        ),
        ([], "label_smoothing_loss.py", 0.9),
    ],
)
def test_examples_run(tmp_path, launcher, script, min_accuracy):
    out = run(
        [*launcher, sys.executable, str(ROOT / "examples" / script)],
        cwd=tmp_path,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    done = [line for line in out.stdout.splitlines() if "jddp: done" in line]
    assert len(done) == 1
    accuracy = float(done[0].split("eval/accuracy=")[1].split()[0])
    assert accuracy >= min_accuracy


def test_evaluate_is_the_library_call_and_the_cli_module():
    """``jddp.evaluate`` is the documented function, and ``python -m jddp.evaluate`` finds the
    CLI module of that name (runpy resolves it without binding ``jddp.evaluate``)."""
    from jddp.evaluation import evaluate_model

    assert jddp.evaluate is evaluate_model
    assert importlib.util.find_spec("jddp.evaluate").origin.endswith("jddp/evaluate.py")
    assert jddp.evaluate is evaluate_model
