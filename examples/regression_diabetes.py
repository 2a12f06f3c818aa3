"""Regression: disease progression from 10 clinical measurements (scikit-learn's diabetes data).

    python examples/regression_diabetes.py [key=value ...]
    python -m jddp.launch --nproc 2 -- python examples/regression_diabetes.py

An MLP maps the 10 standardised features of each of the 442 patients to one number; the loss is
the squared error on the standardised target, and the metrics are the mean squared and absolute
errors in the target's own units (a quantitative measure of progression one year after
baseline). The batch is a tuple ``(features [B, 10], target [B])``; the last 88 patients are
held out, evaluated in padded batches with every patient counted once.

Expected (2-core VM, the defaults: 400 steps of 32): ``jddp: done step=400 eval/loss=0.5023
eval/mae=41.8466 eval/mse=2909.3534`` in about 3 s; predicting the mean of the training targets
gives an MAE of 70.6 (printed as the baseline; experiments/RESULTS.md, "Any task").
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from sklearn.datasets import load_diabetes

import jddp

HELD_OUT = 88

DEFAULTS = {
    "workdir": "runs/regression_diabetes",
    "data": {"global_batch_size": 32},
    "optim": {"name": "adamw", "lr": 3e-3, "weight_decay": 1e-4, "schedule": "cosine"},
    "train": {"steps": 400, "eval_every_steps": 100},
    "log": {"every_steps": 50},
}


def data(config: dict | None = None, seed: int = 0) -> tuple[tuple, tuple, dict]:
    """Train and held-out ``(features, target)``: features standardised with the train split's
    statistics, the target standardised too; and ``{"mean", "std"}`` of the target."""
    x, y = load_diabetes(return_X_y=True)
    x, y = x.astype(np.float32), y.astype(np.float32)
    x_train, y_train, x_eval, y_eval = x[:-HELD_OUT], y[:-HELD_OUT], x[-HELD_OUT:], y[-HELD_OUT:]
    mean, std = x_train.mean(0), x_train.std(0)
    target = {"mean": float(y_train.mean()), "std": float(y_train.std())}

    def scaled(xs, ys):
        return (xs - mean) / std, (ys - target["mean"]) / target["std"]

    return scaled(x_train, y_train), scaled(x_eval, y_eval), target


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, features: int = 10, hidden: int = 64):
        self.hidden = nnx.Linear(features, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 1, rngs=rngs)

    def __call__(self, x_BxF: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.hidden(x_BxF)))[:, 0]


def make_task(target_std: float):
    """The loss (squared error of the standardised target) and the metrics (errors in the
    target's units)."""

    def loss(model: MLP, batch: tuple) -> jax.Array:
        x_BxF, y_B = batch
        return (model(x_BxF) - y_B) ** 2

    def metrics(model: MLP, batch: tuple) -> dict[str, jax.Array]:
        x_BxF, y_B = batch
        error_B = (model(x_BxF) - y_B) * target_std
        return {"mse": error_B**2, "mae": jnp.abs(error_B)}

    return loss, metrics


def main(argv: list[str]) -> jddp.RunResult:
    jddp.initialize()  # joins the other processes under jddp.launch / mpirun / SLURM
    cfg = jddp.load_config(DEFAULTS, argv)
    train, evals, target = data(seed=cfg.train.seed)
    loss, metrics = make_task(target["std"])
    model = MLP(nnx.Rngs(cfg.train.seed))
    # optimizer None: the config's optim section (adamw, cosine schedule)
    result = jddp.fit(model, None, train, evals, loss=loss, metrics=metrics, config=cfg)
    if jax.process_index() == 0:
        baseline = np.abs(evals[1] - train[1].mean()).mean() * target["std"]
        print(
            f"regression_diabetes: held-out MAE {result.eval['eval/mae']:.1f}, MSE "
            f"{result.eval['eval/mse']:.0f} (predicting the train mean: MAE {baseline:.1f})"
        )
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
