"""Train steps of a dropout model on 2 fake CPU devices and on 1; print what they did as JSON.

Used by test_model_state.py in a subprocess with 2 fake devices (``tests.helpers.fake_devices``:
the device count is fixed at JAX import): ``python model_state_worker.py RATE ACCUM``.
"""

import json
import sys

import jax
import numpy as np
import optax
from flax import nnx

from jddp.api import load_config
from jddp.build import build_steps
from jddp.comm import XlaComm
from jddp.data.loader import place_batch, process_rows_of
from jddp.mesh import make_mesh
from jddp.proc.xla import enable_compilation_cache
from jddp.state import create_train_state
from tests.user_models import DropoutMLP

# jddp's persistent compilation cache, as `python -m jddp.train` uses it: a rerun loads these
# programs instead of compiling them again.
enable_compilation_cache(load_config().train.compilation_cache_dir)


def run(num_devices: int, images: np.ndarray, rate: float, accum: int, steps: int) -> dict:
    """``steps`` steps with lr 0 (so only dropout masks can change the loss) on one batch."""
    mesh = make_mesh(jax.devices()[:num_devices])
    tx = optax.sgd(0.0)
    model_def, state = create_train_state(DropoutMLP(192, 4, nnx.Rngs(0), rate=rate), tx, mesh)
    cfg = load_config(overrides=[f"train.grad_accum_steps={accum}"])
    step, _ = build_steps(cfg, model_def, tx, mesh, XlaComm())
    local = {"images": images, "labels": np.zeros(len(images), np.int32)}
    batch = {"data": place_batch(local, mesh, process_rows_of(mesh, len(images)))}
    losses, counts, calls = [], [], []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["train/loss"]))
        counts.append(int(state.model_state["drop"]["rngs"]["count"][...]))
        calls.append(int(state.model_state["calls"][...]))
    return {"losses": losses, "counts": counts, "calls": calls}


def main() -> None:
    rate, accum = float(sys.argv[1]), int(sys.argv[2])
    half = np.random.default_rng(0).normal(size=(4 * accum, 8, 8, 3)).astype(np.float32)
    # Both devices get the same rows: any difference between them comes from dropout masks.
    two = run(2, np.concatenate([half, half]), rate, accum, steps=3)
    one = run(1, half, rate, accum, steps=1)
    print(json.dumps({"two_devices": two, "one_device": one}))


if __name__ == "__main__":
    main()
