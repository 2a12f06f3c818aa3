"""Any task through the library and the CLI: ``jddp.fit(loss=, metrics=)`` on batch pytrees, exact
weighted means, the task's own outputs (no accuracy where there is none), predict / evaluate /
load of custom-task runs, dropout, and bad input naming the leaf or the function."""

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jddp
from jddp import weighted
from jddp.data.pipeline import epoch_permutation
from jddp.errors import DataConfigError, DataError, NonFiniteLoss, TaskError
from tests import user_tasks
from tests.helpers import (
    assert_losses_match,
    fake_devices,
    launch_cmd,
    mpirun_cmd,
    read_losses,
    read_metrics,
    run,
    run_python,
)

ROOT = Path(__file__).resolve().parents[1]
FIT = ["data.global_batch_size=16", "log.progress=off", "log.every_steps=1"]


def fit(workdir, loss, metrics=None, steps=12, data=None):
    """``jddp.fit`` of the tests' linear regression (tests/user_tasks.py), SGD 0.05, batch 16."""
    train, evals = data or user_tasks.data({})
    return jddp.fit(
        user_tasks.Linear(nnx.Rngs(0)),
        optax.sgd(0.05),
        train,
        evals,
        loss=loss,
        metrics=metrics,
        config={"workdir": str(workdir), "train": {"steps": steps}},
        overrides=FIT,
    )


def weighted_numpy(model, split, w=None):
    """``Σ w·x / Σ w`` of the squared and absolute errors of ``model`` over a whole split, and
    the sums, maxima and minima of ``tests.user_tasks.error_metrics``."""
    error = np.asarray(model(jnp.asarray(split["x"])), np.float64) - split["y"]
    w = np.ones_like(error) if w is None else np.asarray(w, np.float64)
    return {
        "loss": (w * error**2).sum() / w.sum(),
        "mae": np.abs(error).mean(),
        "wmse": (split["w"] * error**2).sum() / split["w"].sum(),
        "wsse": (split["w"] * error**2).sum(),
        "max_error": error.max(),
        "max_error_w3": error[split["w"] == 3].max(),
        "min_error": error.min(),
        "big_errors": float((np.abs(error) > 1).sum()),
    }


METRIC_KEYS = ("loss", "mae", "wmse", "wsse", "max_error", "max_error_w3", "min_error")


def test_weighted_means_of_unequal_devices_are_the_global_mean():
    """Per-device ``(Σ w·x / n, Σ w / n)`` terms, averaged (as pmean does) and divided once, give
    ``Σ w·x / Σ w`` over all rows, however the weight is spread; the mean of per-device means
    would not."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=32).astype(np.float32)
    w = np.concatenate([np.full(16, 5.0), np.full(16, 0.5)]).astype(np.float32)
    halves = (slice(0, 16), slice(16, 32))
    terms = [
        weighted.means({"v": weighted.Metric(jnp.asarray(x[d]), jnp.asarray(w[d]))}) for d in halves
    ]
    averaged = {k: (terms[0][k] + terms[1][k]) / 2 for k in terms[0]}
    values, weights = weighted.divide(averaged)
    assert float(values["v"]) == pytest.approx((w * x).sum() / w.sum(), rel=1e-6)
    assert float(weights["v"]) == pytest.approx(w.mean())
    per_device_means = np.mean([(w[:16] * x[:16]).sum() / 80, (w[16:] * x[16:]).sum() / 8])
    assert abs(per_device_means - float(values["v"])) > 1e-3  # the wrong way is really wrong


def test_sums_and_extremes_combine_by_their_own_operation():
    """Two devices' (or micro-batches') terms of each reduction, combined: the sum, max and min
    of all rows; a zero weight leaves a row out of a max or min; a max of no rows is NaN (as a
    mean whose weights sum to 0)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=32).astype(np.float32)
    w = (np.arange(32) % 3).astype(np.float32)  # 0, 1, 2, ...
    named = lambda d: {  # noqa: E731
        "s": weighted.Metric(jnp.asarray(x[d]), jnp.asarray(w[d]), "sum"),
        "hi": weighted.Metric(jnp.asarray(x[d]), reduce="max"),
        "hi_w": weighted.Metric(jnp.asarray(x[d]), jnp.asarray(w[d]), "max"),
        "lo": weighted.Metric(jnp.asarray(x[d]), reduce="min"),
        "none": weighted.Metric(jnp.asarray(x[d]), jnp.zeros(16), "max"),
        "m": weighted.Metric(jnp.asarray(x[d])),
    }
    halves = [weighted.means(named(d)) for d in (slice(0, 16), slice(16, 32))]
    assert set(weighted.split(halves[0])) == {"mean", "sum", "max", "min"}
    both = weighted.scale_means(weighted.combine(*halves), 1 / 2)
    values, _ = weighted.divide(both)
    assert float(values["s"]) == pytest.approx((w * x).sum(), rel=1e-6)
    assert float(values["hi"]) == x.max() and float(values["lo"]) == x.min()
    assert float(values["hi_w"]) == x[w != 0].max() and np.isnan(float(values["none"]))
    assert float(values["m"]) == pytest.approx(x.mean(), rel=1e-6)


def test_integer_sums_add_as_integers():
    """A count (integer or boolean values, integer or no weights) adds in int32 on the devices
    and int64 on the host: float32 lost the digits past 2^24 (16 x (2^26 + 1) came out
    1073741824, not 1073741840), and an eval's total past 2^31 fits the host's int64."""
    big = jnp.full(16, user_tasks.BIG, jnp.int32)
    twos = jnp.full(16, 2, jnp.int32)
    terms = weighted.means(
        {
            "n": weighted.Metric(big, reduce="sum"),
            "nw": weighted.Metric(big // 2, twos, reduce="sum"),
            "flags": weighted.Metric(big > 0, reduce="sum"),
            "real": weighted.Metric(big, jnp.ones(16), reduce="sum"),  # float weights: floats
        }
    )
    assert terms["n~sum"].dtype == jnp.int32 and int(terms["n~sum"]) == 16 * user_tasks.BIG
    assert int(terms["nw~sum"]) == 16 * 2 * (user_tasks.BIG // 2)
    assert terms["flags~sum"].dtype == jnp.int32 and int(terms["flags~sum"]) == 16
    assert terms["real~sum"].dtype == jnp.float32
    mask = jnp.asarray(np.arange(16) < 10, jnp.float32)  # a padded eval batch: 10 real rows
    sums = weighted.masked_sums({"n": weighted.Metric(big, reduce="sum")}, mask)
    assert int(sums["n~sum"]) == 10 * user_tasks.BIG
    batches = [{"n~sum": weighted.host_term(np.asarray(terms["n~sum"]))} for _ in range(3)]
    total = weighted.combine(weighted.combine(*batches[:2], np), batches[2], np)
    values, _ = weighted.divide(total, np)
    assert weighted.host_number(values["n"]) == 48 * user_tasks.BIG  # past 2^31, every digit


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """``jddp.fit`` of the tests' linear regression with a weighted loss and two metrics."""
    workdir = tmp_path_factory.mktemp("fit") / "run"
    train, evals = user_tasks.data({})
    result = fit(workdir, user_tasks.weighted_loss, user_tasks.metrics)
    return result, workdir, train, evals


def test_fit_any_task_logs_the_exact_weighted_means(fitted):
    result, workdir, train, evals = fitted
    rows = read_metrics(workdir)
    first = next(r for r in rows if r["step"] == 1 and "train/loss" in r)
    # Step 1: the loss of the initial model over global batch 1 (16 examples, weights 1..3).
    batch = epoch_permutation(0, 0, user_tasks.TRAIN)[:16]
    initial = user_tasks.Linear(nnx.Rngs(0))
    rows1 = {k: v[batch] for k, v in train.items()}
    want = weighted_numpy(initial, rows1, rows1["w"])
    for key in METRIC_KEYS:
        assert first[f"train/{key}"] == pytest.approx(want[key], rel=1e-5), key
    assert first["train/big_errors"] == want["big_errors"]
    # The task's own keys only: no accuracy, no images.
    assert "train/accuracy" not in first
    assert all("img_per_s" not in r and "eval/accuracy" not in r for r in rows)
    assert any("train/examples_per_s" in r for r in rows)
    # Eval: every one of the 40 examples once (the last batch of 16 padded), weighted means.
    final = result.eval
    want = weighted_numpy(result.model, evals, evals["w"])
    assert final["eval/count"] == user_tasks.EVAL
    for key in METRIC_KEYS:  # sums, maxima, minima: the padding rows never count
        assert final[f"eval/{key}"] == pytest.approx(want[key], rel=1e-5), key
    assert final["eval/big_errors"] == want["big_errors"]
    assert result.eval == {k: v for k, v in rows[-1].items() if k != "step"}


def test_metrics_returned_by_the_loss_are_the_metrics_functions(fitted, tmp_path):
    """``loss`` may return ``(loss_B, weight_B, metrics)`` from its one forward pass: the same
    lines as ``loss`` and ``metrics`` apart."""
    result, workdir, _, _ = fitted
    again = fit(tmp_path / "run", user_tasks.loss_and_metrics)
    assert again.eval == result.eval
    keys = ("train/loss", "train/mae", "train/wmse")
    want = [[r[k] for k in keys] for r in read_metrics(workdir) if "train/loss" in r]
    got = [[r[k] for k in keys] for r in read_metrics(tmp_path / "run") if "train/loss" in r]
    assert got == want


def test_evaluate_and_predict_a_custom_task(fitted):
    result, workdir, _, evals = fitted
    again = jddp.evaluate(
        result.model,
        evals,
        loss=user_tasks.weighted_loss,
        metrics=user_tasks.metrics,
        batch_size=16,
    )
    assert again == pytest.approx(result.eval, rel=1e-6)
    model = jddp.load(workdir, model=user_tasks.Linear(nnx.Rngs(1)))
    inputs = {"x": evals["x"][:37]}  # model(**inputs); 37: the last batch padded
    got = jddp.predict(model, inputs, batch_size=16)
    np.testing.assert_allclose(got, np.asarray(model(jnp.asarray(evals["x"][:37]))), rtol=1e-6)
    assert jddp.predict(model, {"x": evals["x"][:0]}).shape == (0,)
    # A negative loss weight in the eval data: refused as training refuses it (averaged in
    # silently before)
    negative = {**evals, "w": np.where(np.arange(user_tasks.EVAL) == 37, -1.0, evals["w"])}
    with pytest.raises(DataError, match="negative weights on the eval data .* must be >= 0"):
        jddp.evaluate(model, negative, loss=user_tasks.weighted_loss, batch_size=16)
    # A metric's negative weights, a sum's as a mean's: refused as the loss's are
    with pytest.raises(DataError, match="metric 'wsse' returned negative weights on the eval"):
        jddp.evaluate(model, evals, loss=user_tasks.loss,
                      metrics=user_tasks.negative_sum_weight_metrics, batch_size=16)  # fmt: skip
    # An integer sum over every eval example: exact, an int past 2^31 (float32 lost digits)
    counted = jddp.evaluate(
        model, evals, loss=user_tasks.loss, metrics=user_tasks.big_count_metrics, batch_size=16
    )
    assert counted["eval/big"] == user_tasks.EVAL * user_tasks.BIG
    assert isinstance(counted["eval/big"], int)
    # A custom task's data without its loss: one line saying what to pass.
    with pytest.raises(TypeError, match="custom task's batch: give its loss \\(jddp.fit\\(loss="):
        jddp.evaluate(model, evals)
    # ... and as (inputs, labels) with the inputs a dict (a raw KeyError: 'label' before)
    with pytest.raises(TypeError, match=r"train_data: \(dict of arrays, labels\) is a custom"):
        jddp.fit(model, None, ({"x": evals["x"]}, np.zeros(len(evals["x"]), np.int32)))


def test_every_data_form_gives_the_same_run(tmp_path):
    """A dict of arrays, a list of example dicts, a grain MapDataset of them and an iterator of
    batches are the same data: the same per-step losses and eval."""
    import grain

    train, evals = user_tasks.data({})
    records = [{k: v[i] for k, v in train.items()} for i in range(user_tasks.TRAIN)]
    batches = iter([{k: v[i : i + 32] for k, v in train.items()} for i in range(0, 96, 32)])
    forms = {
        "arrays": train,
        "records": records,
        "grain": grain.MapDataset.source(records),
        "batches": batches,
    }
    runs = {}
    for name, form in forms.items():
        result = fit(tmp_path / name, user_tasks.weighted_loss, steps=4, data=(form, evals))
        runs[name] = (read_losses(tmp_path / name), result.eval)
    assert all(run == runs["arrays"] for run in runs.values()), runs


class DropoutLinear(user_tasks.Linear):
    """Dropout of nearly every feature: training sees almost nothing, eval everything."""

    def __init__(self, rngs):
        super().__init__(rngs)
        self.drop = nnx.Dropout(0.99, rngs=rngs)

    def __call__(self, x):
        return super().__call__(self.drop(x))


def test_the_loss_runs_in_train_mode_and_eval_in_eval_mode(tmp_path):
    train, evals = user_tasks.data({})
    result = jddp.fit(
        DropoutLinear(nnx.Rngs(0)),
        optax.sgd(0.0),  # nothing learned: the model stays as built
        train,
        evals,
        loss=user_tasks.loss,
        config={"workdir": str(tmp_path / "run"), "train": {"steps": 1}},
        overrides=FIT,
    )
    plain = user_tasks.Linear(nnx.Rngs(0))  # the same weights, no dropout
    want = weighted_numpy(plain, evals)["loss"]
    assert result.eval["eval/loss"] == pytest.approx(want, rel=1e-5)  # eval: deterministic
    rows = {k: v[epoch_permutation(0, 0, user_tasks.TRAIN)[:16]] for k, v in train.items()}
    first = read_losses(tmp_path / "run")[1]
    assert first != pytest.approx(weighted_numpy(plain, rows)["loss"], rel=1e-2)  # train: dropout


BAD_FITS = [
    # (loss, metrics, data change, error, words)
    ("scalar_loss", None, None, TaskError, ["the loss given to jddp.fit", "scalar", "[16]"]),
    ("int_loss", None, None, TaskError, ["int32", "floating"]),
    ("column_loss", None, None, TaskError, ["[16, 1]", "expected shape [16]"]),
    ("quadruple_loss", None, None, TaskError, ["tuple of 4", "(values [16], weights [16])"]),
    ("loss_with_list_metrics", None, None, TaskError, ["(its metrics)", "expected a dict"]),
    ("missing_key_loss", None, None, TaskError, ["the loss given to jddp.fit", "'features'"]),
    ("loss", "clashing_metrics", None, TaskError, ["'loss'", "clashes"]),
    ("loss", "list_metrics", None, TaskError, ["got a list", "expected a dict"]),
    ("loss", None, "ragged", DataConfigError, ["train_data['y'] has 90", "train_data['w']"]),
    ("loss", None, "string", DataConfigError, ["train_data['name']", "a str is not an array"]),
]


@pytest.mark.parametrize(
    "loss, metrics, change, error, words", BAD_FITS, ids=[f"{b[0]}-{b[1]}-{b[2]}" for b in BAD_FITS]
)
def test_bad_task_is_one_line_naming_it_before_anything_runs(
    fitted, loss, metrics, change, error, words
):
    """Refused before the first step, and the finished run in the workdir is untouched."""
    _, workdir, train, evals = fitted
    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    train = dict(train)
    if change == "ragged":
        train["y"] = train["y"][:90]
    elif change == "string":
        train["name"] = "regression"
    with pytest.raises(error) as raised:
        loss, metrics = getattr(user_tasks, loss), metrics and getattr(user_tasks, metrics)
        fit(workdir, loss, metrics, steps=14, data=(train, evals))
    message = str(raised.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)
    assert {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize(
    "loss, error, words",
    [
        ("negative_weight_loss", DataError, ["step 1", "negative weights"]),
        ("zero_weight_loss", DataError, ["step 1", "sum to 0", "16 examples"]),
        ("nan_weight_loss", DataError, ["step 1", "non-finite weights", "NaN or Inf weight"]),
        ("nan_loss", NonFiniteLoss, ["non-finite loss", "step 1"]),
        ("negative_sum_weight_metrics", DataError, ["step 1: metric 'wsse'", "negative weights"]),
    ],
)
def test_bad_weights_or_values_stop_the_run_naming_the_step(tmp_path, loss, error, words):
    loss, metrics = (user_tasks.loss, loss) if loss.endswith("_metrics") else (loss, None)
    with pytest.raises(error) as raised:
        fit(tmp_path / "run", getattr(user_tasks, loss) if isinstance(loss, str) else loss,
            getattr(user_tasks, metrics) if metrics else None, steps=3)  # fmt: skip
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


CLI_TASK = [
    "model.name=tests.user_tasks:linear",
    "data.name=tests.user_tasks:data",
    "train.loss=tests.user_tasks:weighted_loss",
    "train.metrics=tests.user_tasks:metrics",
    "optim.name=sgd",
    "optim.lr=0.05",
    "optim.momentum=0.0",
    "optim.weight_decay=0.0",
    "optim.schedule=constant",
    "log.weight_unit=samples",
    *FIT,
]


@pytest.mark.slow
def test_a_custom_task_from_the_command_line_evaluate_load_predict(tmp_path):
    """train.loss/train.metrics/data.name factories on the CLI; then python -m jddp.evaluate,
    jddp.load (the factory builds the model) and jddp.predict of the run."""
    workdir = tmp_path / "cli"
    out = run_python("-m", "jddp.train", f"workdir={workdir}", *CLI_TASK, "train.steps=6", cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    (done,) = [line for line in out.stdout.splitlines() if line.startswith("jddp: done")]
    assert "eval/mae=" in done and "eval/wmse=" in done and "examples_per_s=" in done
    assert "samples_per_s=" in done and "accuracy" not in done
    rows = read_metrics(workdir)
    assert all(r["train/samples"] > 0 for r in rows if "train/loss" in r)
    final = [r for r in rows if "eval/loss" in r][-1]
    evals = user_tasks.arrays(user_tasks.EVAL, 1)
    assert final["eval/samples"] == pytest.approx(evals["w"].sum())
    again = run_python("-m", "jddp.evaluate", "--workdir", str(workdir), "--trust-code", cwd=ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    line = again.stdout.strip().splitlines()[-1]
    assert line.startswith("jddp: eval step=6") and f"eval/count={user_tasks.EVAL}" in line
    assert f"eval/loss={final['eval/loss']:.6g}" in line
    sys.path.insert(0, str(ROOT))  # the factories, as the CLI imported them
    model = jddp.load(workdir, trust_code=True)  # the run's own config names its factories
    assert isinstance(model, user_tasks.Linear)
    want = weighted_numpy(model, evals, evals["w"])
    assert final["eval/loss"] == pytest.approx(want["loss"], rel=1e-5)
    got = jddp.predict(workdir, evals["x"], batch_size=16, trust_code=True)  # fed as it is
    np.testing.assert_allclose(got, np.asarray(model(jnp.asarray(evals["x"]))), rtol=1e-6)
    plots = run_python("-m", "jddp.plot", str(workdir), cwd=ROOT)
    names = {Path(p).name for p in plots.stdout.split()}
    assert {"loss.png", "mae.png", "wmse.png", "throughput.png", "samples_per_s.png"} <= names
    assert "accuracy.png" not in names and "samples.png" not in names


DROPOUT = [
    "model.name=tests.user_models:dropout_mlp",
    "data.name=synthetic",
    "data.image_size=8",
    "data.global_batch_size=32",
    "optim.schedule=constant",
    "optim.lr=0.01",
    "log.every_steps=1",
    "log.progress=off",
]


@pytest.mark.slow
def test_dropout_same_device_count_same_losses_and_resume(tmp_path):
    """Dropout draws its masks per device (the device's index folded into the key): the same
    number of devices gives the same per-step losses however they are split into processes, a
    resume continues the masks bit for bit, and another device count draws other masks."""
    train = [sys.executable, "-m", "jddp.train", *DROPOUT]
    one_by_two = tmp_path / "1x2"
    assert (
        run(
            [*train, f"workdir={one_by_two}", "train.steps=8"], env=fake_devices(2), cwd=ROOT
        ).returncode
        == 0
    )
    launch = [sys.executable, "-m", "jddp.launch", "--nproc", "2", "--devices-per-proc", "1"]
    two_by_one = tmp_path / "2x1"
    out = run([*launch, "--", *train, f"workdir={two_by_one}", "train.steps=8"], cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_losses_match(read_losses(two_by_one), read_losses(one_by_two), range(1, 9), 1e-5)
    resumed = tmp_path / "resumed"
    for steps in (4, 8):  # stop after 4, continue to 8
        out = run(
            [*train, f"workdir={resumed}", f"train.steps={steps}"], env=fake_devices(2), cwd=ROOT
        )
        assert out.returncode == 0, out.stderr[-3000:]
    assert_losses_match(read_losses(resumed), read_losses(one_by_two), range(1, 9), rel=0)
    one_by_one = tmp_path / "1x1"
    out = run([*train, f"workdir={one_by_one}", "train.steps=2"], env=fake_devices(1), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert read_losses(one_by_one)[1] != pytest.approx(read_losses(one_by_two)[1], rel=1e-5)


@pytest.mark.slow
def test_sums_and_extremes_are_exact_on_2x2_with_micro_batches_and_under_mpi(tmp_path):
    """The task's sums, maxima and minima (``jddp.Metric``) over each step's global batch and
    over every eval example once: 2 processes x 2 devices with 2 micro-batches each (gloo), and
    the same under mpirun with the MPI backend, against numpy."""
    overrides = [*CLI_TASK, "train.steps=6", "train.grad_accum_steps=2", "checkpoint.every_steps=2"]
    xla = tmp_path / "xla"
    out = run(launch_cmd(2, 2, xla, *overrides, base=[]), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(xla)
    sys.path.insert(0, str(ROOT))  # the factories, as the CLI imported them
    train, evals = user_tasks.data({})
    # Step 5 ran the model of checkpoint 4 on rows 64..79 of epoch 0's order.
    order = epoch_permutation(0, 0, user_tasks.TRAIN)[64:80]
    rows5 = {k: v[order] for k, v in train.items()}
    want = weighted_numpy(jddp.load(xla, step=4, trust_code=True), rows5, rows5["w"])
    step5 = next(r for r in rows if r["step"] == 5 and "train/loss" in r)
    for key in METRIC_KEYS:
        assert step5[f"train/{key}"] == pytest.approx(want[key], rel=1e-5), key
    assert step5["train/big_errors"] == want["big_errors"]
    final = [r for r in rows if "eval/loss" in r][-1]
    want = weighted_numpy(jddp.load(xla, trust_code=True), evals, evals["w"])
    for key in METRIC_KEYS:
        assert final[f"eval/{key}"] == pytest.approx(want[key], rel=1e-5), key
    assert final["eval/big_errors"] == want["big_errors"]
    mpi = tmp_path / "mpi"
    out = run(mpirun_cmd(2, mpi, *overrides, "dist.backend=mpi", base=[]), env=fake_devices(2))
    assert out.returncode == 0, out.stderr[-3000:]
    task_keys = {
        f"{split}/{k}" for split in ("train", "eval") for k in (*METRIC_KEYS, "big_errors")
    }
    for got, theirs in zip(read_metrics(mpi), rows, strict=True):
        keys = task_keys & set(theirs)
        assert {k: got[k] for k in keys} == pytest.approx({k: theirs[k] for k in keys}, rel=1e-5)
