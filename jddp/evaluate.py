"""Evaluation: loss and accuracy over every example of an eval source exactly once."""

from __future__ import annotations

from collections.abc import Callable

from jax.sharding import Mesh

from jddp.comm import Comm
from jddp.data.loader import BatchLayout, eval_batches
from jddp.mesh import to_host
from jddp.state import TrainState


def evaluate(
    eval_step: Callable,
    state: TrainState,
    source,
    global_batch_size: int,
    mesh: Mesh,
    layout: BatchLayout,
    comm: Comm,
) -> dict:
    """``eval/loss``, ``eval/accuracy`` and ``eval/count`` over every example of ``source``
    exactly once (the last batch is padded and masked), summed over every process."""
    totals = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
    for batch in eval_batches(source, global_batch_size, mesh, layout):
        sums = to_host(eval_step(state, batch))
        for k in totals:
            totals[k] += float(sums[k])
    totals = comm.sum_across_processes(totals)
    count = max(totals["count"], 1.0)
    return {
        "eval/loss": totals["loss_sum"] / count,
        "eval/accuracy": totals["correct"] / count,
        "eval/count": int(totals["count"]),
    }
