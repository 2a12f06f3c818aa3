"""Before and after the loop: the trained model in hand (fit, load), predict, evaluate,
warm start, progress lines."""

import runpy
import sys
from unittest import mock

import jax
import numpy as np
import pytest
from flax import nnx

import jddp
from tests.helpers import data
from tests.user_models import TinyMLP


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A TinyMLP fitted on a learnable 2-class problem: (model, result, workdir, eval data)."""
    import optax

    workdir = tmp_path_factory.mktemp("fit") / "run"
    model = TinyMLP(192, 2, nnx.Rngs(0))
    evals = data(40, seed=1)
    result = jddp.fit(
        model,
        optax.adam(1e-2),
        train_data=data(512),
        eval_data=evals,
        config={"workdir": str(workdir), "train": {"steps": 30}},
        overrides=["data.global_batch_size=16", "log.progress=off", "log.every_steps=10"],
    )
    return model, result, workdir, evals


def accuracy(model, x, y):
    model.eval()
    return float((np.asarray(model(x)).argmax(-1) == y).mean())


def test_fit_leaves_the_trained_weights_in_the_passed_model_and_load_gives_them_back(fitted):
    model, result, workdir, (x, y) = fitted
    assert result.model is model
    assert accuracy(model, x, y) == pytest.approx(result.eval["eval/accuracy"], abs=1e-6)
    assert accuracy(TinyMLP(192, 2, nnx.Rngs(0)), x, y) != accuracy(model, x, y)
    want = np.asarray(model(x))
    for path in (workdir, result.checkpoint_dir):  # a workdir or one checkpoint folder
        loaded = jddp.load(path, model=TinyMLP(192, 2, nnx.Rngs(7)))
        np.testing.assert_allclose(np.asarray(loaded(x)), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(jddp.ConfigError, match="no checkpoint of step 7"):
        jddp.load(workdir, step=7, model=TinyMLP(192, 2, nnx.Rngs(7)))
    with pytest.raises(jddp.ConfigError, match="other shapes.*out"):
        jddp.load(workdir, model=TinyMLP(192, 3, nnx.Rngs(7)))
    # a model given to fit: its config.yaml says so (fit.model), and load says what to pass
    with pytest.raises(
        jddp.ConfigError,
        match=r"given to jddp.fit; model.name=resnet18 did not .*jddp.load\(W, model=\.\.\.\)",
    ):
        jddp.load(workdir)  # fit's model: the config cannot build it


def test_load_builds_the_model_the_checkpoint_config_names(tmp_path):
    from jddp.run.trainer import train_and_evaluate

    cfg = jddp.load_config(
        {"workdir": str(tmp_path / "run")},
        [
            "model.name=tests.user_models:dropout_mlp",
            "data.name=synthetic",
            "data.image_size=8",
            "data.global_batch_size=16",
            "train.steps=3",
            "log.progress=off",
        ],
    )
    result = train_and_evaluate(cfg)
    loaded = jddp.load(tmp_path / "run", trust_code=True)  # its config names its factory
    assert int(loaded.calls[...]) == int(result.model.calls[...]) == 3  # model state too
    x = data(5)[0]
    result.model.eval()
    np.testing.assert_allclose(np.asarray(loaded(x)), np.asarray(result.model(x)), rtol=1e-6)

    # Raw uint8 pixels given with the run are normalised as the run trained (its checkpoint
    # records the train split's mean/std), not merely scaled to [0, 1].
    from jddp.build import load_data

    splits = load_data(cfg)
    raw, labels = splits.eval.images[:24], splits.eval.labels[:24]
    assert raw.dtype == np.uint8 and not np.allclose(splits.train.std, 1.0)
    by_run = jddp.predict(tmp_path / "run", raw, trust_code=True)
    stats = {"mean": splits.train.mean, "std": splits.train.std}
    np.testing.assert_allclose(by_run, jddp.predict(loaded, raw, **stats), rtol=1e-5, atol=1e-5)
    assert not np.allclose(by_run, jddp.predict(loaded, raw), atol=1e-3)
    by_arrays = jddp.evaluate(tmp_path / "run", (raw, labels), trust_code=True)
    by_source = jddp.evaluate(  # scale only
        tmp_path / "run", jddp.as_source((raw, labels)), trust_code=True
    )
    from jddp.data.source import ArraySource

    sub = ArraySource(raw, labels, splits.eval.num_classes, stats["mean"], stats["std"], "sub")
    want = jddp.evaluate(tmp_path / "run", sub, trust_code=True)
    assert by_arrays["eval/loss"] == pytest.approx(want["eval/loss"], rel=1e-5)
    assert by_source["eval/loss"] != pytest.approx(want["eval/loss"], rel=1e-3)


def test_predict_keeps_input_order_and_pads_the_last_batch(fitted):
    model, _, _, (x, _) = fitted
    model.eval()
    want = np.asarray(model(x))
    got = jddp.predict(model, x, batch_size=16)  # 40 = 16 + 16 + 8 (padded)
    assert got.shape == (40, 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    pixels = np.random.default_rng(0).integers(0, 256, size=(5, 8, 8, 3), dtype=np.uint8)
    normalised = ((pixels / 255.0 - 0.5) / 0.25).astype(np.float32)
    np.testing.assert_allclose(
        jddp.predict(model, pixels, mean=[0.5] * 3, std=[0.25] * 3),
        np.asarray(model(normalised)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_library_evaluate_matches_fit_and_reports_no_top5_for_two_classes(fitted):
    model, result, workdir, evals = fitted
    got = jddp.evaluate(model, evals, batch_size=16)
    assert got["eval/count"] == 40
    assert got["eval/accuracy"] == pytest.approx(result.eval["eval/accuracy"], abs=1e-6)
    assert got["eval/loss"] == pytest.approx(result.eval["eval/loss"], rel=1e-5)
    assert "eval/top5_accuracy" not in got and "eval/top5_accuracy" not in result.eval


@pytest.mark.slow
def test_train_progress_lines_then_evaluate_cli(tmp_path):
    """A CLI run with stdout piped prints progress lines (train, eval, epoch end) and logs
    grad/param norms. Evaluating its checkpoint from the CLI gives the run's final eval (loss,
    top-5 for 10 classes), appended to metrics.jsonl; a missing step or checkpoint is exit 2."""
    from tests.helpers import read_metrics, run_python

    def main(argv: list[str]) -> int:
        """``python -m jddp.evaluate ARGV``, run in this process: its exit code."""
        with mock.patch.object(sys, "argv", ["jddp.evaluate", *argv]):
            with pytest.raises(SystemExit) as stop:
                runpy.run_module("jddp.evaluate", run_name="__main__")
        return stop.value.code

    workdir = tmp_path / "run"
    train = [
        *("model.name=tests.user_models:tiny_mlp", "data.name=synthetic", "data.image_size=8"),
        *("data.global_batch_size=128", "train.steps=10", "train.eval_every_steps=5"),
        "log.every_steps=4",  # 1024 examples: 8 steps per epoch
    ]
    out = run_python("-m", "jddp.train", f"workdir={workdir}", *train)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "jddp: step 8/10 epoch 1.00, loss " in out.stdout, out.stdout
    assert ", lr 0.0" in out.stdout and " img/s, ETA 0:00:" in out.stdout
    assert "jddp: eval at step 5 epoch 0.62: loss " in out.stdout
    assert "jddp: epoch 1 done at step 8/10: loss " in out.stdout
    rows = [r for r in read_metrics(workdir) if "train/loss" in r]
    assert [r["step"] for r in rows] == [4, 8, 10]
    assert all(r["train/grad_norm"] > 0 and r["train/param_norm"] > 0 for r in rows)

    out = run_python("-m", "jddp.evaluate", "--workdir", str(workdir), "--trust-code")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "jddp: eval step=10 " in out.stdout
    final, appended = [r for r in read_metrics(workdir) if "eval/loss" in r][-2:]
    assert appended["step"] == final["step"] == 10 and appended["eval/data"] == "synthetic"
    for key in ("eval/loss", "eval/accuracy", "eval/top5_accuracy", "eval/count"):
        assert appended[key] == pytest.approx(final[key], rel=1e-6), key
    assert main(["--workdir", str(workdir), "--step", "7", "--trust-code"]) == 2
    assert main(["--workdir", str(tmp_path), "--trust-code"]) == 2  # no run there
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "config.yaml").write_text((workdir / "config.yaml").read_text())
    assert main(["--workdir", str(tmp_path / "fresh"), "--trust-code"]) == 2  # no checkpoint


def test_init_from_another_run(fitted, tmp_path, capsys):
    """Step 0, the other run's weights (sgd(0) keeps them), fresh optimizer; a new head of
    another class count re-initialised and named; other mismatches refused naming arrays."""
    import optax

    source, _, source_dir, _ = fitted

    def fit(model, name, images=None):
        return jddp.fit(
            model,
            optax.sgd(0.0),
            train_data=data(64) if images is None else images,
            config={"workdir": str(tmp_path / name), "train": {"steps": 1}},
            overrides=[f"checkpoint.init_from={source_dir}", "data.global_batch_size=16"],
        )

    same = fit(TinyMLP(192, 2, nnx.Rngs(9)), "same")
    assert same.step == 1
    for a, b in zip(jax_leaves(same.model), jax_leaves(source), strict=True):
        np.testing.assert_array_equal(a, b)
    fresh_head = TinyMLP(192, 3, nnx.Rngs(9))
    want_head = np.asarray(fresh_head.out.kernel[...])
    three = fit(fresh_head, "three")
    out = capsys.readouterr().out
    assert "re-initialised params['out']['bias'], params['out']['kernel']" in out, out
    assert "class dimension 2 -> 3" in out
    np.testing.assert_array_equal(three.model.out.kernel[...], want_head)
    np.testing.assert_array_equal(three.model.hidden.kernel[...], source.hidden.kernel[...])
    small = (data(64)[0][:, :4, :4], data(64)[1])
    with pytest.raises(jddp.ConfigError, match=r"init_from.*params\['hidden'\]\['kernel'\]"):
        fit(TinyMLP(48, 2, nnx.Rngs(9)), "other", small)


def jax_leaves(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


def test_lists_of_batches_and_float_labels():
    from jddp.data.source import as_source

    (x1, y1), (x2, y2) = data(16), data(8, seed=1)
    for batches in ([(x1, y1), (x2, y2)], ((x1, y1), (x2, y2))):
        source = as_source(batches)
        assert len(source) == 24 and source.num_classes == 2
        np.testing.assert_array_equal(source.get_batch(np.arange(16, 24))[1], y2)
    whole = as_source([(x1, y1.astype(np.float32))])  # whole-number floats are class indices
    np.testing.assert_array_equal(whole.get_batch(np.arange(16))[1], y1)
    with pytest.raises(jddp.ConfigError, match="train_data: labels must be integer"):
        jddp.fit(TinyMLP(192, 2, nnx.Rngs(0)), train_data=(x1, y1 + 0.5))
