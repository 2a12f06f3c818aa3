"""Train steps of a small CNN on N fake CPU devices under each ``dist.shard`` (none,
optimizer, full), for each case; save what test_shard_update.py compares.

``python shard_update_worker.py N OUT.json CASE [CASE ...]``, in a subprocess
with N fake devices (``tests.helpers.fake_devices``). A case is ``name:override,override``
(config overrides). Each case runs 5 steps from the same start on the same batches, the 4th
batch holding a NaN (the update must be dropped), in the three layouts (results under
``replicated``, ``sharded`` and ``full``); steps are built by
``jddp.build.build_steps``, the state laid out by ``build_layout(...).place``, as the trainer
does. A case named ``broken-...`` runs only sharded, with LARS/LAMB trust ratios from each
slice's own norms (the psum over devices dropped: the bug the tests must catch). The first
case's final states also go through a checkpoint, each restored in another's layout.
"""

import dataclasses
import json
import re
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jddp.optimizer
from jddp.api import load_config
from jddp.build import build_layout, build_steps
from jddp.checkpoint import Checkpoints
from jddp.comm import XlaComm
from jddp.data.loader import batch_layout, place_batch
from jddp.errors import ConfigError
from jddp.layout import state_bytes_per_device
from jddp.mesh import make_mesh, to_host
from jddp.optimizer import make_optimizer
from jddp.proc.xla import enable_compilation_cache
from jddp.sharded_update import optimizer_state_bytes
from jddp.state import TrainState, create_train_state

# jddp's persistent compilation cache, as `python -m jddp.train` uses it: a rerun of the suite
# loads these programs instead of compiling them again.
enable_compilation_cache(load_config().train.compilation_cache_dir)

STEPS, NAN_STEP, ROWS_PER_DEVICE = 5, 3, 16


class SmallCnn(nnx.Module):
    """Arrays split along different axes on 4 devices (kernels HWIO along I or O, the dense
    kernel along its input) and one kept whole (the 10-class bias); BatchNorm statistics."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.conv2 = nnx.Conv(8, 8, (3, 3), strides=(2, 2), rngs=rngs)
        self.head = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv1(x)))
        return self.head(nnx.relu(self.conv2(x)).mean(axis=(1, 2)))


def batches(global_rows: int) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for step in range(STEPS):
        images = rng.normal(size=(global_rows, 8, 8, 3)).astype(np.float32)
        if step == NAN_STEP:
            images[1, 2, 3, 0] = np.nan
        out.append({"images": images, "labels": rng.integers(0, 10, global_rows).astype(np.int32)})
    return out


KINDS = {"replicated": "none", "sharded": "optimizer", "full": "full", "full-gloo": "full"}


def label_kind(label: str, kind: str) -> str:
    """The run() kind of a KINDS entry: ``full-gloo`` keeps its suffix."""
    return f"{kind}-gloo" if label.endswith("-gloo") else kind


def run(overrides: list[str], num_devices: int, kind: str) -> tuple[dict, TrainState]:
    mesh = make_mesh(jax.devices()[:num_devices])
    rows = ROWS_PER_DEVICE * num_devices
    cfg = load_config(
        overrides=[
            f"data.global_batch_size={rows}",
            "optim.schedule=constant",
            f"dist.shard={kind.removesuffix('-gloo')}",
            *overrides,
        ]
    )
    comm = XlaComm(cfg.dist.grad_allreduce_dtype)
    tx, schedule = make_optimizer(cfg.optim, rows, STEPS)
    ema = cfg.train.ema_decay > 0
    model_def, state = create_train_state(SmallCnn(nnx.Rngs(0)), tx, mesh, ema=ema)
    layout = build_layout(cfg, mesh, comm)
    if kind.endswith("-gloo"):  # the path processes on CPUs take (gloo): gather_packed
        layout = dataclasses.replace(layout, reduce_scatter=False)
    state = layout.place(state)
    step, _ = build_steps(cfg, model_def, tx, mesh, comm, schedule=schedule, layout=layout)
    where = batch_layout(mesh, rows)
    out: dict = {"loss": [], "grad_norm": [], "param_norm": [], "nonfinite": [], "clipped": []}
    params_per_step = [flat(state.params)]  # with an EMA: what it averages, step by step
    for batch in batches(rows):
        state, metrics = step(state, {"data": place_batch(batch, mesh, where)})
        for key in out:
            out[key].append(float(metrics.get(f"train/{key}", -1)))
        if ema:
            params_per_step.append(flat(state.params))
    if kind.endswith("-gloo"):
        first = {"data": place_batch(batches(rows)[0], mesh, where)}
        out["collectives"] = collectives(step.lower(state, first).compile().as_text())
    if ema:
        out["params_per_step"] = params_per_step
        out["ema"] = flat(state.ema_params)
        out["ema_specs"] = sorted({str(x.sharding.spec) for x in jax.tree.leaves(state.ema_params)})
    params = to_host(state.params)
    out["params"] = np.concatenate([np.ravel(x) for x in jax.tree.leaves(params)]).tolist()
    opt = to_host(state.opt_state)  # assembled whole, as a checkpoint's manifest reads it
    out["opt_state"] = np.concatenate([np.ravel(x) for x in jax.tree.leaves(opt)]).tolist()
    out["opt_bytes_per_device"] = optimizer_state_bytes(state)
    out["opt_bytes_total"] = sum(np.asarray(x).nbytes for x in jax.tree.leaves(opt))
    out["opt_specs"] = sorted({str(x.sharding.spec) for x in jax.tree.leaves(state.opt_state)})
    out["params_replicated"] = all(x.is_fully_replicated for x in jax.tree.leaves(state.params))
    out["param_specs"] = sorted({str(x.sharding.spec) for x in jax.tree.leaves(state.params)})
    out["state_bytes_per_device"] = state_bytes_per_device(state)
    out["state_bytes_total"] = sum(np.asarray(x).nbytes for x in jax.tree.leaves(to_host(state)))
    return out, state


def collectives(hlo: str) -> list[list]:
    """Each all-gather and all-reduce of a compiled program's text: [op, operand count]."""
    found = re.findall(r"\b(all-gather|all-reduce)(?:-start)?\(([^)]*)\)", hlo)
    return [[op, operands.count("%")] for op, operands in found]


def flat(tree) -> list[float]:
    """Every leaf of ``tree``, assembled whole on the host, as one flat list."""
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(to_host(tree))]).tolist()


def round_trip(saved: TrainState, like: TrainState, folder: Path) -> bool:
    """``saved`` written as a checkpoint and restored in ``like``'s layout: bitwise the same
    arrays (their checksums verified on the way), laid out as ``like``."""
    ckpts = Checkpoints(
        folder, every_steps=1, keep=1, async_save=False, damaged_directory=folder / "damaged"
    )
    ckpts.save(1, saved, {})
    ckpts.wait()
    restored, _ = ckpts.restore_newest_good(like)
    ckpts.close()
    layout = [x.sharding for x in jax.tree.leaves(restored)]
    same = jax.tree.map(np.array_equal, to_host(restored), to_host(saved))
    return all(jax.tree.leaves(same)) and layout == [x.sharding for x in jax.tree.leaves(like)]


def slice_sq_norms(*trees):
    """:func:`jddp.optimizer.layer_sq_norms` without the psum: each slice's own norm."""
    return [jnp.sum(jnp.real(x * jnp.conj(x))) for t in trees for x in jax.tree.leaves(t)]


def main() -> None:
    num_devices, path = int(sys.argv[1]), sys.argv[2]
    results = {}
    for case in sys.argv[3:]:
        name, _, text = case.partition(":")
        overrides = [o for o in text.split(",") if o]
        if name.startswith("broken-"):  # the trust ratios' psum dropped; sharded only
            correct, jddp.optimizer.layer_sq_norms = jddp.optimizer.layer_sq_norms, slice_sq_norms
            results[name] = {"sharded": run(overrides, num_devices, "optimizer")[0]}
            jddp.optimizer.layer_sq_norms = correct
            continue
        outs, states = {}, {}
        for label, kind in KINDS.items():
            try:
                outs[label], states[label] = run(overrides, num_devices, label_kind(label, kind))
            except ConfigError as e:  # a combination the layout refuses, in one line
                outs[label] = {"refused": str(e)}
        results[name] = outs
        if len(results) == 1:  # checkpoints of any layout restore in any other
            with tempfile.TemporaryDirectory() as tmp:
                results["round_trip"] = {
                    f"{a}->{b}": round_trip(states[a], states[b], Path(tmp) / f"{a}-{b}")
                    for a in states
                    for b in states
                    if a != b
                }
    with open(path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
