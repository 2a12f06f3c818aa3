"""The three any-task examples, end to end: a byte-level GPT on the standard library's sources
(weighted by tokens), a regression on scikit-learn's diabetes data (a tuple batch) and a
two-input model on a dict batch from the command line (``configs/digits_two_inputs.yaml``).

Each runs as one process with 2 devices (the reference run), under ``jddp.launch --nproc 2``
(the same per-step losses, rel 1e-5, gentle configs) and killed with SIGKILL mid-run then rerun
(every step's loss equal to the reference bit for bit); its final eval equals a plain
numpy/JAX computation of the same weighted means with the trained model (rel 1e-5)."""

import signal
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jddp
from tests.helpers import (
    assert_losses_match,
    assert_resumed_bitwise,
    fake_devices,
    read_losses,
    read_metrics,
    run,
    start,
    steps_saved,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40
# Gentle (small constant lr, 16 rows per device), a line every step; checkpoints every few steps
# only in the run a kill interrupts (``KILLED``: ten saves cost the lm run ~1.6 of its ~8 CPU-s,
# 2026-11-28, and the losses do not depend on them).
COMMON = [
    f"train.steps={STEPS}",
    "data.global_batch_size=32",
    "optim.name=adamw",
    "optim.lr=0.001",
    "optim.weight_decay=0.0",
    "optim.schedule=constant",
    "optim.warmup_steps=0",
    "train.eval_every_steps=0",
    "log.every_steps=1",
    "log.progress=off",
]
KILLED = ["checkpoint.every_steps=4"]
LM = [
    "data.options.seq_len=32",
    "data.options.max_files=40",
    "model.options.seq_len=32",
    "model.options.width=32",
    "model.options.layers=2",
    "model.options.heads=2",
]
EXAMPLES = {
    "lm": [sys.executable, "examples/lm_stdlib.py", *LM],
    "regression": [sys.executable, "examples/regression_diabetes.py"],
    "two_inputs": [
        sys.executable,
        *("-m", "jddp.train", "--config", "configs/digits_two_inputs.yaml"),
        "optim.b2=0.999",
    ],
}


def command(name, workdir, *extra):
    return [*EXAMPLES[name], f"workdir={workdir}", *COMMON, *extra]


@pytest.fixture(scope="module", params=sorted(EXAMPLES))
def reference(request, tmp_path_factory):
    """The example as one process with 2 devices, uninterrupted: (name, workdir, output)."""
    name = request.param
    workdir = tmp_path_factory.mktemp(name) / "one_by_two"
    out = run(command(name, workdir), env=fake_devices(2), cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(read_losses(workdir)) == list(range(1, STEPS + 1))
    return name, workdir, out


def test_two_processes_give_the_same_losses(reference, tmp_path):
    name, one_by_two, _ = reference
    workdir = tmp_path / "two_by_one"
    launch = [sys.executable, "-m", "jddp.launch", "--nproc", "2", "--devices-per-proc", "1"]
    out = run([*launch, "--", *command(name, workdir)], cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_losses_match(read_losses(workdir), read_losses(one_by_two), range(1, STEPS + 1), 1e-5)
    final = [r for r in read_metrics(workdir) if "eval/loss" in r][-1]
    want = [r for r in read_metrics(one_by_two) if "eval/loss" in r][-1]
    assert final["eval/count"] == want["eval/count"]
    assert final["eval/loss"] == pytest.approx(want["eval/loss"], rel=1e-5)


def test_a_run_killed_mid_way_resumes_bitwise(reference, tmp_path):
    name, one_by_two, _ = reference
    workdir = tmp_path / "killed"
    cmd = command(name, workdir, *KILLED)
    job = start(cmd, env=fake_devices(2), cwd=ROOT)
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and job.poll() is None:
        if metrics.exists() and len(read_losses(workdir)) >= 6 and steps_saved(workdir):
            break  # a checkpoint is complete (saves run in the background) and steps go on
        time.sleep(0.01)
    job.send_signal(signal.SIGKILL)
    job.wait()
    logged = read_losses(workdir)
    assert job.returncode == -signal.SIGKILL and max(logged) < STEPS, (
        f"the run was not killed mid-way (exit {job.returncode}, {len(logged)} steps logged)"
    )
    resumed = steps_saved(workdir)[-1]
    out = run(cmd, env=fake_devices(2), cwd=ROOT, timeout=900)
    assert_resumed_bitwise(out, workdir, one_by_two, resumed, STEPS)


def _trained(workdir, template):
    return jddp.load(workdir, model=template)


def _lm_eval(workdir):
    from examples import lm_stdlib

    options = {"seq_len": 32, "max_files": 40}
    _, evals = lm_stdlib.data({"options": options})
    model = _trained(workdir, lm_stdlib.GPT(32, 32, 2, 2, rngs=nnx.Rngs(0)))
    tokens = evals["tokens"].astype(np.int32)
    ce_sum = correct = count = 0.0
    for start_row in range(0, len(tokens), 256):
        rows = slice(start_row, start_row + 256)
        lengths = evals["lengths"][rows]
        logits = np.asarray(model(jnp.asarray(tokens[rows, :-1]), jnp.asarray(lengths)))
        targets = tokens[rows, 1:]
        real = np.arange(targets.shape[1])[None, :] < (lengths[:, None] - 1)
        log_p = logits.astype(np.float64) - np.log(
            np.exp(logits.astype(np.float64)).sum(-1, keepdims=True)
        )
        ce = -np.take_along_axis(log_p, targets[..., None], -1)[..., 0]
        ce_sum += (ce * real).sum()
        correct += ((logits.argmax(-1) == targets) * real).sum()
        count += real.sum()
    return {
        "eval/loss": ce_sum / count,
        "eval/accuracy": correct / count,
        "eval/tokens": count,
        "eval/count": len(tokens),
    }


def _regression_eval(workdir):
    from examples import regression_diabetes as ex

    _, (x, y), target = ex.data()
    model = _trained(workdir, ex.MLP(nnx.Rngs(0)))
    error = np.asarray(model(jnp.asarray(x)), np.float64) - y
    return {
        "eval/loss": (error**2).mean(),
        "eval/mse": ((error * target["std"]) ** 2).mean(),
        "eval/mae": np.abs(error * target["std"]).mean(),
        "eval/count": len(y),
    }


def _two_inputs_eval(workdir):
    from examples import two_inputs as ex

    _, evals = ex.data({"options": {"side_noise": 0.05}})
    template = ex.model({"num_classes": 10, "options": {"width": 16}}, None, nnx.Rngs(0))
    model = _trained(workdir, template)
    logits = np.asarray(model(jnp.asarray(evals["image"]), jnp.asarray(evals["side"])))
    ce = optax.softmax_cross_entropy_with_integer_labels(
        jnp.asarray(logits, jnp.float32), jnp.asarray(evals["label"])
    )
    return {
        "eval/loss": np.asarray(ce, np.float64).mean(),
        "eval/accuracy": (logits.argmax(-1) == evals["label"]).mean(),
        "eval/count": len(evals["label"]),
    }


def test_eval_is_the_weighted_mean_over_every_eval_example(reference):
    """The final eval line equals the same weighted means computed directly with the trained
    model, every eval example once (the last batch padded: none of the three eval sets is a
    multiple of the global batch)."""
    name, workdir, out = reference
    want = {"lm": _lm_eval, "regression": _regression_eval, "two_inputs": _two_inputs_eval}[name](
        workdir
    )
    (got,) = [r for r in read_metrics(workdir) if "eval/loss" in r]
    assert want["eval/count"] % 32, "the eval set should end in a padded batch"
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key
    done = [line for line in out.stdout.splitlines() if line.startswith("jddp: done")]
    assert len(done) == 1 and f"eval/loss={got['eval/loss']:.4f}" in done[0]
    if name == "regression":  # no accuracy where there is none
        assert "accuracy" not in done[0] and "img_per_s" not in done[0]
        assert "examples_per_s=" in done[0]
    if name == "lm":
        assert "tokens_per_s=" in done[0] and got["eval/tokens"] == want["eval/tokens"]
