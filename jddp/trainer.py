"""The training loop: config -> mesh -> data -> model/state -> step -> loop -> checkpoints."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jddp import config as config_lib
from jddp import distributed
from jddp.checkpoint import Checkpoints
from jddp.comm import XlaComm, config_fingerprint, make_comm
from jddp.config import Config, ConfigError
from jddp.data.loader import BatchLayout, TrainBatches, batch_layout, eval_batches
from jddp.data.sources import Splits, load_splits
from jddp.mesh import make_mesh, select_devices, to_host
from jddp.metrics import MetricsLog, is_writer, make_progress, say
from jddp.models import get_model_factory
from jddp.optimizer import make_optimizer
from jddp.state import TrainState, create_train_state
from jddp.step import cross_entropy_loss, make_eval_step, make_train_step

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def build_model(cfg: Config, rngs: nnx.Rngs, in_channels: int = 3) -> nnx.Module:
    """The model named by ``model.name``, in the compute dtype of ``train.precision``.

    Built-in ResNets get the ``model`` section's keys; a user factory ``"pkg.module:fn"`` is
    called as ``fn(config=<model section as dict>, dtype=<compute dtype>, rngs=rngs)``.
    """
    try:
        factory = get_model_factory(cfg.model.name)
    except ValueError as e:
        raise ConfigError(f"model.name: {e}") from None
    dtype = COMPUTE_DTYPES[cfg.train.precision]
    if ":" in cfg.model.name:
        return factory(config=config_lib.to_dict(cfg)["model"], dtype=dtype, rngs=rngs)
    return factory(
        num_classes=cfg.model.num_classes,
        stem=cfg.model.stem,
        width=cfg.model.width,
        sync_batchnorm=cfg.model.sync_batchnorm,
        in_channels=in_channels,
        dtype=dtype,
        rngs=rngs,
    )


def total_steps(cfg: Config, steps_per_epoch: int) -> int:
    """``train.steps``, or ``train.epochs`` converted to steps (default: one epoch)."""
    if cfg.train.steps is not None:
        return cfg.train.steps
    return max(1, math.ceil((cfg.train.epochs or 1.0) * steps_per_epoch))


def load_data(cfg: Config) -> Splits:
    """Load the data set named in ``cfg.data`` and check it against ``model.num_classes``."""
    if cfg.data.path is not None and not Path(cfg.data.path).exists():
        raise ConfigError(f"data.path={cfg.data.path!r} does not exist")
    splits = load_splits(
        cfg.data.name,
        cfg.data.path,
        cfg.data.image_size,
        seed=cfg.train.seed,
        num_classes=cfg.model.num_classes,
    )
    if splits.train.num_classes > cfg.model.num_classes:
        raise ConfigError(
            f"model.num_classes={cfg.model.num_classes} is smaller than the "
            f"{splits.train.num_classes} classes of data.name={cfg.data.name}"
        )
    return splits


def evaluate(
    eval_step,
    state: TrainState,
    splits: Splits,
    batch_size: int,
    mesh,
    layout: BatchLayout,
    comm: XlaComm,
) -> dict:
    """``eval/loss`` and ``eval/accuracy`` over every eval example exactly once."""
    totals = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
    for batch in eval_batches(splits.eval, batch_size, mesh, layout):
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


def check_same_config(comm: XlaComm, config: dict[str, Any]) -> None:
    """Refuse to start when processes were given different configs (e.g. different seeds)."""
    prints = comm.allgather_int(config_fingerprint(config))
    differ = [rank for rank, p in enumerate(prints) if p != prints[0]]
    if differ:
        raise ConfigError(
            f"the config of rank {differ[0]} differs from rank 0's: every process must be "
            "started with the same config file and overrides"
        )


def check_replicas_in_sync(comm: XlaComm, state: TrainState, step: int) -> None:
    """Fail loudly unless every device of every process holds the same parameters.

    Cheap: one float64 checksum per local device copy, compared across processes.
    """
    leaves = jax.tree.leaves(state.params)
    local = set()
    for shard_index in range(len(leaves[0].addressable_shards)):
        total = 0.0
        for leaf in leaves:
            data = leaf.addressable_shards[shard_index].data
            total += float(jnp.sum(data.astype(jnp.float32), dtype=jnp.float32))
        local.add(total)
    mine = int(np.float64(max(local)).view(np.int64)) if len(local) == 1 else -1
    everyone = comm.allgather_int(mine)
    if len(local) != 1 or len(set(everyone)) != 1:
        raise RuntimeError(
            f"replicas diverged at step {step}: parameter checksums differ between devices or "
            f"processes ({sorted(local)} here); the run is stopped (dist.check_sync_every)"
        )


@dataclass
class RunResult:
    """What a finished run reports: final step, final eval metrics, timing, checkpoint path."""

    step: int
    eval: dict[str, float]
    wall_s: float
    img_per_s: float
    checkpoint_dir: str


def train_and_evaluate(cfg: Config) -> RunResult:
    """Train ``cfg`` to its last step (resuming from ``workdir`` if allowed), evaluate, save."""
    wall_start = time.perf_counter()
    workdir = Path(cfg.workdir)
    comm = make_comm(cfg.dist.backend, cfg.dist.grad_allreduce_dtype)
    config_dict = config_lib.to_dict(cfg)
    check_same_config(comm, config_dict)
    try:
        mesh = make_mesh(select_devices(cfg.dist.num_local_devices))
        layout = batch_layout(
            mesh, cfg.data.global_batch_size, comm.process_index, comm.process_count
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    num_devices = len(mesh.local_devices) * distributed.process_count()
    per_device = cfg.data.global_batch_size // num_devices
    if per_device % cfg.train.grad_accum_steps:
        raise ConfigError(
            f"train.grad_accum_steps={cfg.train.grad_accum_steps} does not divide the "
            f"per-device batch {per_device}"
        )

    splits = load_data(cfg)
    batches = TrainBatches(splits.train, cfg.data.global_batch_size, cfg.train.seed, mesh, layout)
    steps = total_steps(cfg, batches.steps_per_epoch)

    model = build_model(cfg, nnx.Rngs(cfg.train.seed), in_channels=splits.train.image_shape[-1])
    tx, schedule = make_optimizer(cfg.optim, cfg.data.global_batch_size, steps)
    model_def, state = create_train_state(model, tx, mesh)
    del model

    # Under MPI every rank is its own orbax "primary host": rank 0 alone writes, the others
    # only read (the directory must be shared).
    ckpts = Checkpoints(
        workdir / "checkpoints",
        every_steps=cfg.checkpoint.every_steps,
        keep=cfg.checkpoint.keep,
        async_save=cfg.checkpoint.async_save,
        writes=comm.name == "xla" or comm.process_index == 0,
    )
    start_step = 0
    latest = ckpts.latest_step() if cfg.checkpoint.resume else None
    if latest is not None:
        state = ckpts.restore(latest, state)
        start_step = int(to_host(state.step))
        say(f"jddp: resumed from {ckpts.directory / str(latest)} at step {start_step}")
    state = comm.broadcast_state(state, mesh)

    if is_writer():
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.yaml").write_text(config_lib.dump(cfg))
    log = MetricsLog(workdir, resume_step=start_step)

    compute_dtype = COMPUTE_DTYPES[cfg.train.precision]
    loss_fn = cross_entropy_loss(cfg.train.label_smoothing)
    train_step = make_train_step(
        model_def,
        tx,
        mesh,
        comm,
        loss_fn=loss_fn,
        grad_accum_steps=cfg.train.grad_accum_steps,
        compute_dtype=compute_dtype,
        schedule=schedule,
    )
    eval_step = make_eval_step(model_def, mesh, loss_fn=loss_fn, compute_dtype=compute_dtype)

    def run_eval(state: TrainState) -> dict:
        return evaluate(eval_step, state, splits, cfg.data.global_batch_size, mesh, layout, comm)

    global_batch = cfg.data.global_batch_size
    progress = make_progress(cfg.log.progress, steps, start_step)
    window_start, window_steps = time.perf_counter(), 0
    timed_images, timed_s = 0, 0.0
    eval_metrics: dict[str, Any] = {}
    step = start_step
    try:
        for batch in batches.iterate(start_step, steps, cfg.data.prefetch_batches):
            state, metrics = train_step(state, batch)
            step += 1
            window_steps += 1
            if step == start_step + 1:
                # The first step includes compilation: time it apart from throughput.
                jax.block_until_ready(metrics)
                now = time.perf_counter()
                log.write(step, {"train/compile_s": now - window_start})
                window_start, window_steps = now, 0
            if step % cfg.log.every_steps == 0 or step == steps:
                row = {k: float(v) for k, v in to_host(metrics).items()}
                if window_steps:
                    dt = time.perf_counter() - window_start
                    row["train/img_per_s"] = window_steps * global_batch / dt
                    row["train/step_time_s"] = dt / window_steps
                    if cfg.log.baseline_img_per_s:
                        ideal = num_devices * cfg.log.baseline_img_per_s
                        row["train/scaling_efficiency"] = row["train/img_per_s"] / ideal
                    timed_images += window_steps * global_batch
                    timed_s += dt
                log.write(step, row)
                progress.set_postfix(
                    loss=f"{row['train/loss']:.4f}", img_s=f"{row.get('train/img_per_s', 0):.0f}"
                )
                window_start, window_steps = time.perf_counter(), 0
            progress.update(1)
            if cfg.dist.check_sync_every and step % cfg.dist.check_sync_every == 0:
                check_replicas_in_sync(comm, state, step)
            if (
                cfg.train.eval_every_steps
                and step % cfg.train.eval_every_steps == 0
                and (step < steps)
            ):
                eval_metrics = run_eval(state)
                log.write(step, eval_metrics)
                window_start = time.perf_counter()
            if ckpts.should_save(step):
                ckpts.save(step, state, config_dict)
        progress.close()
        eval_metrics = run_eval(state)
        log.write(step, eval_metrics)
        ckpts.save(step, state, config_dict)
        ckpts.close()
        comm.barrier()  # nobody leaves before rank 0's checkpoint is complete
    finally:
        progress.close()
        log.close()

    img_per_s = timed_images / timed_s if timed_s else 0.0
    wall_s = time.perf_counter() - wall_start
    result = RunResult(
        step=step,
        eval=eval_metrics,
        wall_s=wall_s,
        img_per_s=img_per_s,
        checkpoint_dir=str(ckpts.directory / str(step)),
    )
    say(
        f"jddp: done step={step} eval/accuracy={eval_metrics['eval/accuracy']:.4f} "
        f"eval/loss={eval_metrics['eval/loss']:.4f} img_per_s={img_per_s:.1f} "
        f"wall_s={wall_s:.1f} checkpoint={result.checkpoint_dir}"
    )
    return result
