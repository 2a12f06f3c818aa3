"""The training loop: config -> mesh -> data -> model/state -> step -> loop -> checkpoints."""

from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jddp import config as config_lib
from jddp.checkpoint import Checkpoints
from jddp.comm import XlaComm, config_fingerprint, make_comm
from jddp.config import Config
from jddp.data.loader import BatchLayout, TrainBatches, batch_layout, eval_batches, place_batch
from jddp.data.registry import load_splits
from jddp.data.source import Splits
from jddp.errors import ConfigError, NonFiniteLoss, Preempted, ReplicasDiverged
from jddp.mesh import make_mesh, select_devices, to_host
from jddp.metrics import InputWait, MetricsLog, is_writer, make_progress, say
from jddp.models import get_model_factory
from jddp.optimizer import make_optimizer
from jddp.state import TrainState, create_train_state
from jddp.step import (
    NONFINITE_KEY,
    STOP_KEY,
    PixelNorm,
    cross_entropy_loss,
    make_eval_step,
    make_train_step,
)
from jddp.workdir import WorkdirLock, prepare

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
    pipeline: dict[str, Any] | None = None,
) -> dict:
    """``eval/loss`` and ``eval/accuracy`` over every eval example exactly once."""
    totals = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
    for batch in eval_batches(splits.eval, batch_size, mesh, layout, **(pipeline or {})):
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
    shared = {**config, "dist": {k: v for k, v in config["dist"].items() if k != "process_id"}}
    prints = comm.allgather_int(config_fingerprint(shared))
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
        raise ReplicasDiverged(
            f"replicas diverged at step {step}: parameter checksums differ between devices or "
            f"processes ({sorted(local)} here); the run is stopped (dist.check_sync_every)"
        )


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Records SIGTERM/SIGUSR1 (SLURM's warning before a time-out) while installed."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class RunResult:
    """What a finished run reports: final step, final eval metrics, timing, checkpoint path.

    ``input_wait_fraction``: the share of the timed train wall time (the first step, which
    compiles, and eval excluded) that process 0's loop spent blocked waiting for the next batch
    from the input pipeline.
    """

    step: int
    eval: dict[str, float]
    wall_s: float
    img_per_s: float
    checkpoint_dir: str
    input_wait_fraction: float = 0.0


def _agree(comm: XlaComm, ok: bool) -> bool:
    """True on every process iff ``ok`` on every process."""
    return all(v == 1 for v in comm.allgather_int(int(ok)))


@dataclass
class Parts:
    """What a library user supplies instead of the config's built-in choices (all optional).

    ``model``: an NNX module, built identically on every process. ``optimizer``: an optax
    transformation. ``splits``: train/eval :class:`~jddp.data.sources.Source` objects.
    ``loss_fn``:
    ``(logits_BxK, labels_B) -> loss_B``. ``metrics_fn``: ``(logits_BxK, labels_B) -> {name:
    value_B}``, logged as ``train/<name>`` means over the global batch.
    """

    model: nnx.Module | None = None
    optimizer: Any = None
    splits: Splits | None = None
    loss_fn: Any = None
    metrics_fn: Any = None


def train_and_evaluate(cfg: Config, parts: Parts | None = None) -> RunResult:
    """Train ``cfg`` to its last step (resuming from ``workdir`` if allowed), evaluate, save.

    ``parts`` replaces the model, optimizer, data or loss that ``cfg`` names. Raises
    :class:`Preempted` after saving when SIGTERM/SIGUSR1 arrives, :class:`NonFiniteLoss` for a
    non-finite step under ``train.on_nonfinite=halt``, ``ConfigError`` for bad input.
    """
    comm = make_comm(cfg.dist.backend, cfg.dist.grad_allreduce_dtype)
    check_same_config(comm, config_lib.to_dict(cfg))
    lock = WorkdirLock(cfg.workdir)
    problem: ConfigError | None = None
    if is_writer():
        try:
            prepare(cfg.workdir)
            lock.acquire()
        except ConfigError as e:
            problem = e
    if not _agree(comm, problem is None):
        raise problem or ConfigError(f"process 0 could not use workdir={cfg.workdir!r}")
    try:
        with StopRequest() as stop:
            return _train(cfg, comm, stop, parts or Parts())
    finally:
        lock.release()


def _train(cfg: Config, comm: XlaComm, stop: StopRequest, parts: Parts) -> RunResult:
    wall_start = time.perf_counter()
    workdir = Path(cfg.workdir)
    config_dict = config_lib.to_dict(cfg)
    try:
        mesh = make_mesh(select_devices(cfg.dist.num_local_devices))
        layout = batch_layout(
            mesh, cfg.data.global_batch_size, comm.process_index, comm.process_count
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    num_devices = len(mesh.local_devices) * comm.process_count
    per_device = cfg.data.global_batch_size // num_devices
    if per_device % cfg.train.grad_accum_steps:
        raise ConfigError(
            f"train.grad_accum_steps={cfg.train.grad_accum_steps} does not divide the "
            f"per-device batch {per_device}"
        )

    splits = parts.splits or load_data(cfg)
    pipeline = {k: getattr(cfg.data, k) for k in ("augment", "workers", "worker_kind")}
    try:
        batches = TrainBatches(
            splits.train, cfg.data.global_batch_size, cfg.train.seed, mesh, layout, **pipeline
        )
    except ValueError as e:  # the batch is larger than the data set
        raise ConfigError(str(e)) from None
    steps = total_steps(cfg, batches.steps_per_epoch)

    model = parts.model or build_model(
        cfg, nnx.Rngs(cfg.train.seed), in_channels=splits.train.image_shape[-1]
    )
    if parts.optimizer is not None:
        tx, schedule = parts.optimizer, None
    else:
        tx, schedule = make_optimizer(cfg.optim, cfg.data.global_batch_size, steps)
    model_def, state = create_train_state(model, tx, mesh)
    del model

    ckpts = Checkpoints(
        workdir / "checkpoints",
        every_steps=cfg.checkpoint.every_steps,
        keep=cfg.checkpoint.keep,
        async_save=cfg.checkpoint.async_save,
        writes=comm.writes_checkpoints,
    )
    start_step = 0
    if cfg.checkpoint.resume:
        try:
            restored = ckpts.restore_newest_good(state, agree=lambda ok: _agree(comm, ok))
        except BaseException:
            ckpts.close()  # orbax's background threads must stop before the interpreter does
            raise
        if restored is not None:
            state, saved_step = restored
            start_step = int(to_host(state.step))
            say(f"jddp: resumed from {ckpts.directory / str(saved_step)} at step {start_step}")
    state = comm.broadcast_state(state, mesh)

    if is_writer():
        (workdir / "config.yaml").write_text(config_lib.dump(cfg))
    log = MetricsLog(workdir, resume_step=start_step)

    compute_dtype = COMPUTE_DTYPES[cfg.train.precision]
    loss_fn = parts.loss_fn or cross_entropy_loss(cfg.train.label_smoothing)
    pixel_norm = PixelNorm.of(splits.train)
    train_step = make_train_step(
        model_def,
        tx,
        mesh,
        comm,
        loss_fn=loss_fn,
        metrics_fn=parts.metrics_fn,
        grad_accum_steps=cfg.train.grad_accum_steps,
        compute_dtype=compute_dtype,
        schedule=schedule,
        pixel_norm=pixel_norm,
    )
    eval_step = make_eval_step(
        model_def, mesh, loss_fn=loss_fn, compute_dtype=compute_dtype, pixel_norm=pixel_norm
    )

    def run_eval(state: TrainState) -> dict:
        return evaluate(
            eval_step, state, splits, cfg.data.global_batch_size, mesh, layout, comm, pipeline
        )

    global_batch = cfg.data.global_batch_size
    progress = make_progress(cfg.log.progress, steps, start_step)
    # Throughput windows are counted in finished steps: "last" is the step whose end "start"
    # marks (the first step, which includes compilation, is timed apart).
    timer = {"start": time.perf_counter(), "last": start_step + 1, "images": 0, "seconds": 0.0}
    input_wait = InputWait()  # its windows are the throughput windows

    def restart_window(last: int | None = None) -> None:
        timer["start"] = time.perf_counter()
        if last is not None:
            timer["last"] = last
        input_wait.restart()

    def stop_flags() -> dict[str, jax.Array]:
        flag = np.full(layout.rows.stop - layout.rows.start, stop.signal_name is not None)
        return place_batch({STOP_KEY: flag.astype(np.float32)}, mesh, layout)

    def after_step(step: int, metrics: dict[str, jax.Array]) -> bool:
        """Log ``step``'s metrics (read one step late, so the device never waits for the
        host); returns whether some process asked to stop."""
        host = {k: float(v) for k, v in to_host(metrics).items()}
        stop_requested = host.pop(STOP_KEY, 0.0) > 0
        if host[NONFINITE_KEY] and cfg.train.on_nonfinite == "halt":
            kept = ckpts.all_steps()
            raise NonFiniteLoss(
                f"non-finite loss or gradient at step {step} (train.on_nonfinite=halt); the "
                f"update was not applied; last checkpoint: "
                f"{ckpts.directory / str(kept[-1]) if kept else 'none'}"
            )
        if step % cfg.log.every_steps == 0 or step == steps or host[NONFINITE_KEY]:
            done = step - timer["last"]
            if done > 0:
                dt = time.perf_counter() - timer["start"]
                host["train/img_per_s"] = done * global_batch / dt
                host["train/step_time_s"] = dt / done
                if cfg.log.baseline_img_per_s:
                    ideal = num_devices * cfg.log.baseline_img_per_s
                    host["train/scaling_efficiency"] = host["train/img_per_s"] / ideal
                timer["images"] += done * global_batch
                timer["seconds"] += dt
                host[InputWait.KEY] = input_wait.end_window(dt)
            log.write(step, host)
            progress.set_postfix(
                loss=f"{host['train/loss']:.4f}", img_s=f"{host.get('train/img_per_s', 0):.0f}"
            )
            restart_window(step)
        return stop_requested

    try:
        eval_metrics: dict[str, Any] = {}
        step = start_step
        profile = (
            tuple(int(x) for x in cfg.log.profile_steps.split(":"))
            if cfg.log.profile_steps
            else None
        )
        pending: tuple[int, dict] | None = None
        stopped = False
        for batch in input_wait.timed(
            batches.iterate(start_step, steps, cfg.data.prefetch_batches)
        ):
            if profile and step == profile[0]:
                jax.profiler.start_trace(str(workdir / "profile"))
            state, metrics = train_step(state, {**batch, **stop_flags()})
            step += 1
            if profile and step == profile[1]:
                jax.block_until_ready(metrics)
                jax.profiler.stop_trace()
                say(f"jddp: profile of steps {profile[0]}..{profile[1] - 1} in {workdir}/profile")
            if step == start_step + 1:
                # The first step includes compilation: time it apart from throughput.
                jax.block_until_ready(metrics)
                log.write(step, {"train/compile_s": time.perf_counter() - timer["start"]})
                restart_window()
            if pending is not None and after_step(*pending):
                stopped = True  # every process saw the same flag at the same step
                break
            pending = (step, metrics)
            progress.update(1)
            if (
                cfg.train.eval_every_steps
                and step % cfg.train.eval_every_steps == 0
                and step < steps
            ):
                eval_metrics = run_eval(state)
                log.write(step, eval_metrics)
                restart_window(step)
            if ckpts.should_save(step):
                ckpts.save(step, state, config_dict)
        if pending is not None and not stopped:
            stopped = after_step(*pending)
        progress.close()
        if stopped:
            ckpts.save(step, state, config_dict)
            ckpts.close()
            comm.barrier()
            log.close()
            say(
                f"jddp: preempted at step {step} ({stop.signal_name or 'signal on another process'}"
                f"); checkpoint {ckpts.directory / str(step)} saved; rerun the same command to "
                "continue"
            )
            raise Preempted(step)
        eval_metrics = run_eval(state)
        log.write(step, eval_metrics)
        ckpts.save(step, state, config_dict)
        ckpts.close()
        comm.barrier()  # nobody leaves before rank 0's checkpoint is complete
        log.close()

    except NonFiniteLoss:
        ckpts.close()  # every process raised at the same step: finish the saves in flight
        raise
    except BaseException:
        if comm.process_count == 1:  # with peers gone, waiting on them could hang
            ckpts.close()
        raise

    img_per_s = timer["images"] / timer["seconds"] if timer["seconds"] else 0.0
    wall_s = time.perf_counter() - wall_start
    result = RunResult(
        step=step,
        eval=eval_metrics,
        wall_s=wall_s,
        img_per_s=img_per_s,
        checkpoint_dir=str(ckpts.directory / str(step)),
        input_wait_fraction=input_wait.mean_fraction,
    )
    say(
        "jddp: summary\n"
        f"  steps          {start_step} -> {step} of {steps}\n"
        f"  eval           loss {eval_metrics['eval/loss']:.4f}, accuracy "
        f"{eval_metrics['eval/accuracy']:.4f} over {eval_metrics['eval/count']} examples\n"
        f"  throughput     {img_per_s:.1f} img/s on {num_devices} devices "
        f"({comm.process_count} processes)\n"
        f"  input wait     {100 * result.input_wait_fraction:.2f}% of the timed step wall time "
        f"({InputWait.KEY}, mean over the run)\n"
        f"  wall time      {wall_s:.1f} s\n"
        f"  checkpoint     {result.checkpoint_dir}\n"
        f"  metrics        {workdir / 'metrics.jsonl'} (plots: python -m jddp.plot {workdir})"
    )
    say(
        f"jddp: done step={step} eval/accuracy={eval_metrics['eval/accuracy']:.4f} "
        f"eval/loss={eval_metrics['eval/loss']:.4f} img_per_s={img_per_s:.1f} "
        f"wall_s={wall_s:.1f} checkpoint={result.checkpoint_dir}"
    )
    return result
