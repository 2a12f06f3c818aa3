"""What predict and evaluate do with the user's arrays: channels, integer pixels, mean/std, no
images, the run's eval transform; a non-finite eval from the CLI."""

import numpy as np
import optax
import pytest

import jddp
from jddp.build import load_data
from jddp.errors import ConfigError, DataConfigError


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step tiny-MLP run on 8x8 synthetic uint8 images trained with ``augment=imagenet``
    (its eval takes the centre crop): (workdir, config, eval images, eval labels). Its config
    names the model's factory: reading the run takes consent (trust_code=True)."""
    from jddp.run.trainer import train_and_evaluate

    workdir = tmp_path_factory.mktemp("pixels") / "run"
    cfg = jddp.load_config(
        {"workdir": str(workdir)},
        [
            "model.name=tests.user_models:tiny_mlp",
            "data.name=synthetic",
            "data.image_size=8",
            "data.global_batch_size=16",
            "data.augment=imagenet",
            "train.steps=2",
            "log.progress=off",
        ],
    )
    train_and_evaluate(cfg)
    evals = load_data(cfg).eval
    assert evals.images.dtype == np.uint8
    return workdir, cfg, evals.images[:24], evals.labels[:24]


def test_one_channel_images_for_a_three_channel_run_are_refused(run):
    workdir, _, raw, labels = run
    grey = raw[..., :1]
    with pytest.raises(DataConfigError, match=r"images: expected images \[N, H, W, 3\].*"):
        jddp.predict(workdir, grey, trust_code=True)
    with pytest.raises(DataConfigError, match=r"data: .*\[N, H, W, 3\].*\[24, 8, 8, 1\]"):
        jddp.evaluate(workdir, (grey, labels), trust_code=True)


def test_integer_pixels_of_any_dtype_are_pixels(run):
    workdir, _, raw, labels = run
    want = jddp.predict(workdir, raw, trust_code=True)
    np.testing.assert_array_equal(
        jddp.predict(workdir, raw.astype(np.int64), trust_code=True), want
    )
    by_int64 = jddp.evaluate(workdir, (raw.astype(np.int64), labels), trust_code=True)
    assert by_int64 == jddp.evaluate(workdir, (raw, labels), trust_code=True)
    wide = raw.astype(np.int64)
    wide[3, 0, 0, 0] = 300
    with pytest.raises(DataConfigError, match=r"images: .*0\.\.255.*int64 values in \[0, 300"):
        jddp.predict(workdir, wide, trust_code=True)
    with pytest.raises(DataConfigError, match=r"data: .*0\.\.255"):
        jddp.evaluate(workdir, (wide, labels), trust_code=True)


def test_a_label_out_of_range_names_the_models_classes(run):
    """The range comes from the model's 10 outputs, not from the labels given (a -3 among
    labels up to 8 once read "outside [0, 9)")."""
    workdir, _, raw, labels = run
    bad = np.minimum(labels, 8)
    bad[5] = -3
    with pytest.raises(DataConfigError, match=r"outside \[0, 10\).*class indices 0\.\.9"):
        jddp.evaluate(workdir, (raw, bad), trust_code=True)


def test_labels_must_be_class_indices_and_a_column_of_them_is_taken(run):
    """One-hot labels were 'ValueError: ArraySource ...: labels shape (24, 10) does not match
    24 images' with no hint; a column [N, 1] (sklearn's habit) is the same labels as [N]."""
    workdir, _, raw, labels = run
    with pytest.raises(
        ConfigError,
        match=r"data: labels must be class indices of shape \[N\], "
        r"got shape \[24, 10\] \(one-hot\? pass labels.argmax\(-1\)\)",
    ):
        jddp.evaluate(workdir, (raw, np.eye(10, dtype=np.float32)[labels]), trust_code=True)
    assert jddp.evaluate(workdir, (raw, labels[:, None]), trust_code=True) == jddp.evaluate(
        workdir, (raw, labels), trust_code=True
    )


def test_mean_without_std_is_refused(run):
    workdir, _, raw, _ = run
    with pytest.raises(jddp.ConfigError, match="mean was given without std; pass both"):
        jddp.predict(workdir, raw, mean=[0.5] * 3, trust_code=True)
    with pytest.raises(jddp.ConfigError, match="std was given without mean; pass both"):
        jddp.predict(workdir, raw, std=[0.5] * 3, trust_code=True)


def test_no_images(run):
    workdir, cfg, raw, labels = run
    assert jddp.predict(workdir, raw[:0], trust_code=True).shape == (0, cfg.model.num_classes)
    with pytest.raises(DataConfigError, match="data: no examples"):
        jddp.evaluate(workdir, (raw[:0], labels[:0]), trust_code=True)


def cross_entropy(logits, labels):
    return float(optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean())


def test_predict_takes_the_eval_transform_of_an_imagenet_run(run):
    """The run's own eval (centre crop), evaluate on the same arrays and predict agree."""
    workdir, cfg, _, _ = run
    evals = load_data(cfg).eval
    logits = jddp.predict(workdir, evals.images, trust_code=True)
    by_run = jddp.evaluate(workdir, trust_code=True)  # its eval split, through the eval pipeline
    assert by_run["eval/count"] == len(evals)
    assert by_run["eval/loss"] == pytest.approx(cross_entropy(logits, evals.labels), rel=1e-5)
    by_arrays = jddp.evaluate(workdir, (evals.images, evals.labels), trust_code=True)
    assert by_arrays["eval/loss"] == pytest.approx(by_run["eval/loss"], rel=1e-5)
    accuracy = float((logits.argmax(-1) == evals.labels).mean())
    assert by_arrays["eval/accuracy"] == pytest.approx(accuracy, abs=1e-6)


def test_a_nonfinite_eval_fails_the_evaluate_cli(run, tmp_path):
    """A NaN eval image: exit 1 and one line naming the metric (a subprocess: the CLI ends a
    failed process with os._exit)."""
    from tests.helpers import run_python

    workdir, _, raw, labels = run
    x = raw.astype(np.float32) / 255.0
    x[5, 2, 2, 1] = np.nan
    bad = tmp_path / "nan.npz"
    np.savez(bad, x_train=x, y_train=labels, x_test=x, y_test=labels)
    before = (workdir / "metrics.jsonl").read_text()
    out = run_python(
        *("-m", "jddp.evaluate", "--workdir", str(workdir), "--trust-code"),
        *("data.name=npz", f"data.path={bad}"),
    )
    assert out.returncode == 1, out.stderr[-2000:]
    err = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert "eval/loss=nan" in err[0] and "checkpoints/2" in err[0] and "npz" in err[0]
    assert (workdir / "metrics.jsonl").read_text() == before
