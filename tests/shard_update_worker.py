"""Train steps of a small CNN under each ``dist.shard`` layout and group, for each case; save
what test_shard_update.py compares.

``python shard_update_worker.py OUT.json RUN [RUN ...]``, in a process with fake CPU devices
(``tests.helpers.fake_devices``), alone or as the ranks of ``python -m jddp.launch`` (the
processes join with ``jddp.initialize``; process 0 writes OUT.json). A run is
``label=case/kind[/group]``: ``case`` one of :data:`CASES` (config overrides, the optim
section's optimizer) or :data:`CHAINS` (an optax chain, as given to ``jddp.fit``), ``kind`` a
``dist.shard`` value, ``group`` a ``dist.shard_group`` (default ``all``); ``kind`` may end in
``-gloo`` (one process taking the path processes on CPUs take: no reduce-scatter) or
``-local`` (the chain's update computed by each device on its own slices, every statistic of a
split array a slice's: the bug the tests must catch). Each run takes 5 steps from the same
start on the same batches (a case's 4th batch holds a NaN: the update must be dropped); steps
are built by ``jddp.build.build_steps``, the state laid out by ``build_layout(...).place``, as
the trainer does. ``--round-trip LABEL...``: those runs' final states also go through a
checkpoint, each restored in every other's layout.
"""

import json
import re
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

import jddp
from jddp.api import load_config
from jddp.build import build_layout, build_mesh, build_steps
from jddp.checkpoint import Checkpoints
from jddp.comm import XlaComm
from jddp.data.loader import place_batch
from jddp.errors import ConfigError
from jddp.mesh import to_host
from jddp.optimizer import make_optimizer
from jddp.proc.xla import enable_compilation_cache
from jddp.shard.specs import bytes_held, split_specs
from jddp.state import create_train_state

# jddp's persistent compilation cache, as `python -m jddp.train` uses it: a rerun of the suite
# loads these programs instead of compiling them again.
enable_compilation_cache(load_config().train.compilation_cache_dir)

STEPS, NAN_STEP, ROWS_PER_DEVICE = 5, 3, 16
CASES = {
    # with an EMA of the parameters (its warm-up decays: 0.1, 0.18, 0.25, -, 0.36)
    "sgd-accum": "optim.lr=0.05,train.grad_accum_steps=2,train.ema_decay=0.6",
    "lamb-bf16": "optim.name=lamb,optim.lr=0.01,optim.weight_decay=0.01,"
    "dist.grad_allreduce_dtype=bfloat16",
    "lars": "optim.name=lars,optim.lr=0.5,optim.decay_bn_and_bias=false",
    # global-norm clipping, every finite step clipped
    "sgd-clip": "optim.lr=0.5,optim.clip_grad_norm=0.01",
}
# Optax chains as a user brings them, each with a statistic over whole arrays: a global norm
# (clipping every step: the norms are 0.05-0.3), per-array trust ratios, factored second
# moments and RMS clipping, Newton-Schulz orthogonalisation of each matrix.
CHAINS = {
    "adamw-cosine-clip": lambda: optax.chain(
        optax.clip_by_global_norm(0.02),
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 0.01, 2, STEPS), weight_decay=0.01),
    ),
    "lamb": lambda: optax.lamb(0.02, weight_decay=0.01),
    "adafactor": lambda: optax.adafactor(0.02, min_dim_size_to_factor=4),
    # at 0.02 its fifth step sat on an edge: parameters nudged by one float32 ulp after the
    # fourth took another fifth step in 7 of 40 tries (grad norm 0.152979 vs 0.153322), as
    # jaxlib 0.11's split programs did; at 0.01 a nudge after any step moves the later grad
    # norms by < 4e-7, as every other chain here (2026-11-30)
    "muon": lambda: optax.contrib.muon(0.01),
    "schedule-free-clip": lambda: optax.chain(
        optax.clip_by_global_norm(0.02), optax.contrib.schedule_free_adamw(0.02, warmup_steps=2)
    ),
}


class SmallCnn(nnx.Module):
    """Arrays split along different axes on 4 devices (kernels HWIO along I or O, the dense
    kernel along its input) and one kept whole (the 10-class bias); BatchNorm statistics. The
    convolution before BatchNorm has no bias, as in a ResNet: BatchNorm removes its gradient,
    leaving rounding noise that Adam-like optimizers scale up to whole steps of any sign."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.conv2 = nnx.Conv(8, 8, (3, 3), strides=(2, 2), rngs=rngs)
        self.head = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv1(x)))
        return self.head(nnx.relu(self.conv2(x)).mean(axis=(1, 2)))


def batches(global_rows: int, nan: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for step in range(STEPS):
        images = rng.normal(size=(global_rows, 8, 8, 3)).astype(np.float32)
        if nan and step == NAN_STEP:
            images[1, 2, 3, 0] = np.nan
        out.append({"images": images, "labels": rng.integers(0, 10, global_rows).astype(np.int32)})
    return out


class NoReduceScatter(XlaComm):
    """The path processes on CPUs take (gloo), in one process: no reduce-scatter."""

    reduce_scatter = False


def local_statistics(tx: optax.GradientTransformation, layout) -> optax.GradientTransformation:
    """``tx`` whose update each device computes on its own slices of the split arrays (under
    ``shard_map``): a statistic of a split array is then a slice's, not the array's."""

    def update(grads, state, params=None):
        grad_specs, state_specs = split_specs(grads, layout.mesh), split_specs(state, layout.mesh)
        per_device = jax.shard_map(
            lambda g, s, p: tx.update(g, s, p),
            mesh=layout.mesh,
            in_specs=(grad_specs, state_specs, grad_specs),
            out_specs=(grad_specs, state_specs),
            check_vma=False,
        )
        return per_device(grads, state, params)

    return optax.GradientTransformation(tx.init, update)


def run(case: str, kind: str, group: str) -> tuple[dict, object]:
    shard = kind.split("-")[0]
    chain = CHAINS.get(case)
    overrides = [] if chain else [o for o in CASES[case].split(",") if o]
    cfg = load_config(
        overrides=[
            f"data.global_batch_size={ROWS_PER_DEVICE * jax.device_count()}",
            "optim.schedule=constant",
            f"dist.shard={shard}",
            f"dist.shard_group={group}",
            *overrides,
        ]
    )
    rows = cfg.data.global_batch_size
    comm = (NoReduceScatter if kind.endswith("-gloo") else XlaComm)(cfg.dist.grad_allreduce_dtype)
    mesh, where = build_mesh(cfg, comm)
    layout = build_layout(cfg, mesh, comm)
    if chain:
        tx, schedule = chain(), None
        if kind.endswith("-local"):
            tx = local_statistics(tx, layout)
    else:
        tx, schedule = make_optimizer(cfg.optim, rows, STEPS)
    ema = cfg.train.ema_decay > 0
    model_def, state = create_train_state(SmallCnn(nnx.Rngs(0)), tx, mesh, ema=ema)
    state = layout.place(state)
    step, _ = build_steps(cfg, model_def, tx, mesh, comm, schedule=schedule, layout=layout)
    out: dict = {"loss": [], "grad_norm": [], "param_norm": [], "nonfinite": [], "clipped": []}
    params_per_step = [flat(state.params)]  # with an EMA: what it averages, step by step
    for batch in batches(rows, nan=not chain):
        state, metrics = step(state, {"data": place_batch(batch, mesh, where)})
        for key in out:
            out[key].append(float(metrics.get(f"train/{key}", -1)))
        if ema:
            params_per_step.append(flat(state.params))
    if ema:
        out["params_per_step"] = params_per_step
        out["ema"] = flat(state.ema_params)
        out["ema_specs"] = specs_of(state.ema_params)
    if kind.endswith("-gloo"):  # which collectives the compiled step holds
        first = {"data": place_batch(batches(rows, nan=False)[0], mesh, where)}
        out["collectives"] = collectives(step.lower(state, first).compile().as_text())
    out["params"] = flat(state.params)
    out["opt_state"] = flat(state.opt_state)  # assembled whole, as a checkpoint holds it
    out["opt_specs"] = specs_of(state.opt_state)
    out["param_specs"] = specs_of(state.params)
    out["params_replicated"] = all(x.is_fully_replicated for x in jax.tree.leaves(state.params))
    out["opt_bytes_per_device"] = bytes_held(state.opt_state)
    out["state_bytes_per_device"] = bytes_held(state)
    out["state_bytes_total"] = sum(np.asarray(x).nbytes for x in jax.tree.leaves(to_host(state)))
    out["mesh"] = dict(mesh.shape)
    return out, state


def collectives(hlo: str) -> dict[str, list[int]]:
    """The operand counts of each kind of collective in a compiled program's text."""
    kinds = "all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute"
    found: dict[str, list[int]] = {}
    for op, operands in re.findall(rf"\b({kinds})(?:-start)?\(([^)]*)\)", hlo):
        found.setdefault(op, []).append(operands.count("%"))
    return found


def specs_of(tree) -> list[str]:
    return sorted({str(x.sharding.spec) for x in jax.tree.leaves(tree)})


def flat(tree) -> list[float]:
    """Every leaf of ``tree``, assembled whole on the host, as one flat list."""
    leaves = jax.tree.leaves(to_host(tree))
    return np.concatenate([np.ravel(x).astype(np.float64) for x in leaves]).tolist()


def round_trip(saved, like, folder: Path) -> bool:
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


def main() -> None:
    jddp.initialize()
    path, specs = sys.argv[1], sys.argv[2:]
    round_trips = specs[specs.index("--round-trip") + 1 :] if "--round-trip" in specs else []
    specs = specs[: specs.index("--round-trip")] if round_trips else specs
    results, states = {}, {}
    for spec in specs:
        label, _, what = spec.partition("=")
        case, kind, *group = what.split("/")
        try:
            results[label], states[label] = run(case, kind, group[0] if group else "all")
        except ConfigError as e:  # a combination the layout refuses, in one line
            results[label] = {"refused": str(e)}
        except ValueError as e:  # a slice's statistic of another shape (-local only)
            if not kind.endswith("-local"):
                raise
            results[label] = {"error": str(e).splitlines()[0]}
    if round_trips:
        with tempfile.TemporaryDirectory() as tmp:
            results["round_trip"] = {
                f"{a}->{b}": round_trip(states[a], states[b], Path(tmp) / f"{a}-{b}")
                for a in round_trips
                for b in round_trips
                if a != b
            }
    if jax.process_index() == 0:
        Path(path).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
