"""The GPT of ``examples/lm_stdlib.py`` (2 layers, dropout 0.1) on 4 fake devices, 6 steps with
2 micro-batches each, under ``dist.shard`` none and full from the same start on the same
batches; prints ``{kind: [loss, ...]}`` as JSON (``test_shard_update.py`` compares them), with
``"memory"``: XLA's memory analysis of a wider GPT's fully sharded step, whose parameters
outweigh its activations (compiled, not run), and its parameters' bytes.

``python gpt_layout_worker.py`` in a subprocess with 4 fake devices, from the repository root.
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # examples.lm_stdlib, as from the repository root

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jddp import XlaComm, load_config  # noqa: E402
from jddp.build import build_layout, build_model, build_steps  # noqa: E402
from jddp.data.loader import batch_layout, place_batch  # noqa: E402
from jddp.mesh import make_mesh  # noqa: E402
from jddp.optimizer import make_optimizer  # noqa: E402
from jddp.state import create_train_state  # noqa: E402

ROWS = 64


def gpt_config(kind: str, rows: int, *overrides: str):
    return load_config(str(ROOT / "configs" / "lm_stdlib.yaml"), [
        f"data.global_batch_size={rows}", f"dist.shard={kind}", *overrides
    ])  # fmt: skip


def full_step_memory(mesh) -> dict[str, int]:
    """The compiled ``dist.shard=full`` step of a 4-layer GPT of width 256 at 2 sequences of
    16 bytes per device, plain SGD: its temporaries, and its parameters' whole bytes."""
    rows = 8
    cfg = gpt_config("full", rows, "model.options.width=256", "model.options.layers=4",
                     "model.options.heads=4", "model.options.seq_len=16", "optim.name=sgd",
                     "optim.momentum=0")  # fmt: skip
    comm = XlaComm()
    tx, schedule = make_optimizer(cfg.optim, rows, 100)
    model_def, state = create_train_state(build_model(cfg, nnx.Rngs(0)), tx, mesh)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    layout = build_layout(cfg, mesh, comm)
    state = layout.place(state)
    step, _ = build_steps(cfg, model_def, tx, mesh, comm, schedule=schedule, layout=layout)
    batch = {"tokens": np.ones((rows, 17), np.uint8), "lengths": np.full(rows, 17, np.int32)}
    placed = {"data": place_batch(batch, mesh, batch_layout(mesh, rows))}
    stats = step.lower(state, placed).compile().memory_analysis()
    return {"temp_bytes": int(stats.temp_size_in_bytes), "param_bytes": int(param_bytes)}


def main() -> None:
    mesh = make_mesh(jax.devices()[:4])
    rng = np.random.default_rng(0)
    batches = [
        {
            "tokens": rng.integers(1, 256, (ROWS, 33)).astype(np.uint8),
            "lengths": rng.integers(2, 34, ROWS).astype(np.int32),
        }
        for _ in range(6)
    ]
    losses = {}
    for kind in ("none", "full"):
        cfg = gpt_config(kind, ROWS, "model.options.width=64", "model.options.layers=2",
                         "model.options.heads=2", "model.options.seq_len=32",
                         "model.options.dropout=0.1", "train.grad_accum_steps=2")  # fmt: skip
        comm = XlaComm()
        tx, schedule = make_optimizer(cfg.optim, ROWS, 100)
        model_def, state = create_train_state(build_model(cfg, nnx.Rngs(0)), tx, mesh)
        layout = build_layout(cfg, mesh, comm)
        state = layout.place(state)
        step, _ = build_steps(cfg, model_def, tx, mesh, comm, schedule=schedule, layout=layout)
        where = batch_layout(mesh, ROWS)
        losses[kind] = []
        for batch in batches:
            state, metrics = step(state, {"data": place_batch(batch, mesh, where)})
            losses[kind].append(float(metrics["train/loss"]))
    print(json.dumps({**losses, "memory": full_step_memory(mesh)}))


if __name__ == "__main__":
    main()
