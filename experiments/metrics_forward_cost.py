"""What a task's metrics cost the train step: XLA's FLOPs of the compiled step, three ways.

    .venv/bin/python experiments/metrics_forward_cost.py [--machine NAME] [--out PATH]

Per example model, the trainer's step (one device, a ``CustomTask``) compiled with (a) the loss
alone, (b) the loss and a separate ``metrics(model, batch)`` and (c) a loss returning the same
metrics from its own forward pass; XLA:CPU's ``cost_analysis()`` FLOPs and the ratio to (a).
Deterministic counts, no timing. Writes ``results/metrics-forward-<date>-<machine>.json``.
"""

from __future__ import annotations

import argparse
import sys

import benchlib

BATCH = 16


def step_flops(model, task, data) -> float:
    """FLOPs of the trainer's train step for ``model`` and ``task`` on a batch of ``data``."""
    import optax

    from jddp import XlaComm, create_train_state, make_mesh, make_train_step
    from jddp.data.loader import place_batch, process_rows_of

    mesh = make_mesh()
    tx = optax.sgd(0.1)
    model_def, state = create_train_state(model, tx, mesh)
    step = make_train_step(model_def, tx, mesh, XlaComm(), task=task)
    batch = place_batch({"data": data}, mesh, process_rows_of(mesh, BATCH))
    return float(benchlib.xla_cost(step.lower(state, batch).compile())["flops"])


def cases():
    """``(name, model factory, batch, loss, metrics, loss returning metrics)`` per example."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from examples import lm_stdlib, regression_diabetes, two_inputs

    train, _ = two_inputs.data({})

    def two_loss_and_metrics(model, batch):
        logits = two_inputs._logits(model, batch)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        return ce, None, {"accuracy": jnp.argmax(logits, -1) == batch["label"]}

    yield (
        "two_inputs CNN",
        lambda: two_inputs.model({"num_classes": 10, "options": {"width": 16}}, None, nnx.Rngs(0)),
        {k: v[:BATCH] for k, v in train.items()},
        two_inputs.loss,
        two_inputs.metrics,
        two_loss_and_metrics,
    )
    (x, y), _, _ = regression_diabetes.data()
    loss, metrics = regression_diabetes.make_task(1.0)

    def reg_loss_and_metrics(model, batch):
        error = model(batch[0]) - batch[1]
        return error**2, None, {"mse": error**2, "mae": jnp.abs(error)}

    yield (
        "regression MLP",
        lambda: regression_diabetes.MLP(nnx.Rngs(0)),
        (x[:BATCH], y[:BATCH]),
        loss,
        metrics,
        reg_loss_and_metrics,
    )
    tokens, _ = lm_stdlib.data({"options": {"seq_len": 64, "max_files": 20}})
    options = {"seq_len": 64, "width": 64, "layers": 2, "heads": 2}

    def lm_loss_only(model, batch):
        return lm_stdlib.loss(model, batch)[:2]

    def lm_metrics(model, batch):
        return lm_stdlib.loss(model, batch)[2]

    yield (
        "lm_stdlib GPT (2 layers, width 64, 64 bytes)",
        lambda: lm_stdlib.gpt({"options": options}, None, nnx.Rngs(0)),
        {k: v[:BATCH] for k, v in tokens.items()},
        lm_loss_only,
        lm_metrics,
        lm_stdlib.loss,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    benchlib.output_args(ap)
    args = ap.parse_args(argv)
    from jddp.tasks.custom import CustomTask

    rows = []
    for name, make, data, loss, metrics, loss_and_metrics in cases():
        tasks = {"loss_only": CustomTask(loss), "separate_metrics": CustomTask(loss, metrics),
                 "metrics_from_loss": CustomTask(loss_and_metrics)}  # fmt: skip
        rows.append({"model": name, **{k: step_flops(make(), t, data) for k, t in tasks.items()}})
    print("| model | loss alone (MFLOP) | + metrics(model, batch) | metrics returned by the loss |")
    print("|---|---:|---:|---:|")
    for r in rows:
        base = r["loss_only"]
        print(
            f"| {r['model']} | {base / 1e6:,.1f} | {r['separate_metrics'] / base:.4f}x | "
            f"{r['metrics_from_loss'] / base:.4f}x |"
        )
    machine = benchlib.machine_info(args.machine)
    result = {"machine": machine, "batch": BATCH, "rows": rows}
    benchlib.save_result("metrics-forward", machine["name"], result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
