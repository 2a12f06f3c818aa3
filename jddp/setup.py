"""Build everything a run needs from its config: mesh, data, model, state, steps, outputs.

:func:`build_run` reads the config; the loop (:mod:`jddp.loop`) only uses what it built. The
benchmarks and test workers build their steps here too, so they time the trainer's own step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jddp import config as config_lib
from jddp.checkpoint import Checkpoints
from jddp.comm import Comm
from jddp.config import Config
from jddp.data.loader import BatchLayout, TrainBatches, batch_layout
from jddp.data.registry import load_splits
from jddp.data.source import Splits
from jddp.errors import ConfigError
from jddp.hooks import (
    CheckpointHook,
    EvalHook,
    Profiler,
    StepReporter,
    StopRequest,
    SyncCheck,
    ThroughputMeter,
)
from jddp.mesh import make_mesh, select_devices, to_host
from jddp.metrics import Console, MetricsLog, Progress
from jddp.models import get_model_factory
from jddp.optimizer import make_optimizer
from jddp.preflight import check_model_output, check_profile_steps
from jddp.start import restore, warm_start
from jddp.state import ModelDef, TrainState, create_train_state
from jddp.step import PixelNorm, TrainStep, cross_entropy_loss, make_eval_step, make_train_step
from jddp.workdir import RunFolder

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclass
class Parts:
    """What a library user supplies instead of the config's built-in choices (all optional).

    ``model``: an NNX module, built identically on every process. ``optimizer``: an optax
    transformation. ``splits``: train/eval :class:`~jddp.data.source.Source` objects.
    ``loss_fn``: ``(logits_BxK, labels_B) -> loss_B``. ``metrics_fn``: ``(logits_BxK, labels_B)
    -> {name: value_B}``, logged as ``train/<name>`` means over the global batch.
    """

    model: nnx.Module | None = None
    optimizer: Any = None
    splits: Splits | None = None
    loss_fn: Any = None
    metrics_fn: Any = None


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
        zero_init_residual=cfg.model.zero_init_residual,
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


def pipeline_options(cfg: Config) -> dict[str, Any]:
    """The input pipeline's keys of ``cfg.data`` (augmentation, host workers), as
    :class:`~jddp.data.loader.TrainBatches` and ``eval_batches`` take them."""
    return {k: getattr(cfg.data, k) for k in ("augment", "workers", "worker_kind")}


def build_mesh(cfg: Config, comm: Comm) -> tuple[Mesh, BatchLayout]:
    """The mesh of ``dist.num_local_devices`` per process and this process's batch rows."""
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
    return mesh, layout


def build_steps(
    cfg: Config,
    model_def: ModelDef,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    comm: Comm,
    parts: Parts | None = None,
    schedule: optax.Schedule | None = None,
    pixel_norm: PixelNorm | None = None,
) -> tuple[TrainStep, Any]:
    """The trainer's train and eval steps for ``cfg`` (``parts`` may replace loss/metrics)."""
    parts = parts or Parts()
    compute_dtype = COMPUTE_DTYPES[cfg.train.precision]
    pixel_norm = pixel_norm or PixelNorm()
    loss_fn = parts.loss_fn or cross_entropy_loss(cfg.train.label_smoothing)
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
    return train_step, eval_step


def _first_copy(x: Any) -> Any:
    """This process's first copy of a replicated array (one device, no cross-device copy)."""
    return x.addressable_data(0) if isinstance(x, jax.Array) else x


@dataclass
class Run:
    """Everything the loop uses, built from the config by :func:`build_run`."""

    cfg: Config
    comm: Comm
    folder: RunFolder
    console: Console
    mesh: Mesh
    layout: BatchLayout
    splits: Splits
    batches: TrainBatches
    model_def: ModelDef
    state: TrainState
    start_step: int
    total_steps: int
    train_step: TrainStep
    eval_step: Any
    checkpoints: Checkpoints
    log: MetricsLog
    progress: Any
    meter: ThroughputMeter
    stop: StopRequest
    reporter: StepReporter
    profiler: Profiler
    hooks: list = field(default_factory=list)
    start_skipped_steps: int = 0  # skipped before this run resumed
    user_model: nnx.Module | None = None  # the module jddp.fit was given: trained in place

    def trained_model(self, state: TrainState) -> nnx.Module:
        """The module holding ``state``'s parameters and model state (this process's first
        copy of the replicated arrays): the user's module, updated in place, or a new one."""
        params, model_state, rest = jax.tree.map(
            _first_copy, (state.params, state.model_state, self.model_def.rest)
        )
        if self.user_model is not None:
            nnx.update(self.user_model, params, model_state)
            return self.user_model
        return nnx.merge(self.model_def.graphdef, params, model_state, rest)

    @property
    def num_devices(self) -> int:
        """Devices over all processes."""
        return len(self.mesh.local_devices) * self.comm.process_count

    @property
    def config_dict(self) -> dict[str, Any]:
        """The resolved config, as saved next to every checkpoint."""
        return config_lib.to_dict(self.cfg)

    def evaluate(self, state: TrainState) -> dict:
        """Eval metrics of ``state`` over every eval example once."""
        from jddp.evaluate import evaluate

        return evaluate(
            self.eval_step,
            state,
            self.splits.eval,
            self.cfg.data.global_batch_size,
            self.mesh,
            self.layout,
            self.comm,
            pipeline_options(self.cfg),
        )


def build_run(cfg: Config, comm: Comm, folder: RunFolder, stop: StopRequest, parts: Parts) -> Run:
    """Build the run of ``cfg``: restore its newest good checkpoint (``checkpoint.resume``),
    write ``config.yaml``, open the metrics log, and make the loop's hooks."""
    writer = comm.process_index == 0
    console = Console(writer)
    mesh, layout = build_mesh(cfg, comm)
    splits = parts.splits or load_data(cfg)
    try:
        batches = TrainBatches(
            splits.train,
            cfg.data.global_batch_size,
            cfg.train.seed,
            mesh,
            layout,
            **pipeline_options(cfg),
        )
    except ValueError as e:  # the batch is larger than the data set
        raise ConfigError(str(e)) from None
    steps = total_steps(cfg, batches.steps_per_epoch)
    check_profile_steps(cfg.log.profile_steps, steps)

    model = parts.model or build_model(
        cfg, nnx.Rngs(cfg.train.seed), in_channels=splits.train.image_shape[-1]
    )
    if parts.optimizer is not None:
        tx, schedule = parts.optimizer, None
    else:
        tx, schedule = make_optimizer(cfg.optim, cfg.data.global_batch_size, steps)
    model_def, state = create_train_state(model, tx, mesh)
    del model
    num_outputs = check_model_output(cfg, model_def, state, splits)

    pixel_norm = PixelNorm.of(splits.train)
    ckpts = Checkpoints.of(
        folder,
        pixel_norm=pixel_norm.to_json(),
        every_steps=cfg.checkpoint.every_steps,
        keep=cfg.checkpoint.keep,
        async_save=cfg.checkpoint.async_save,
        writes=comm.writes_checkpoints,
        primary=writer,
    )
    state, start_step = restore(cfg, ckpts, state, comm, console, steps)
    if start_step == 0 and cfg.checkpoint.init_from:  # a fresh run; a resume keeps its own
        state = warm_start(cfg.checkpoint.init_from, state, tx, mesh, console, num_outputs)
    state = comm.broadcast_state(state, mesh)
    if writer:
        folder.config_yaml.write_text(config_lib.dump(cfg))
    log = MetricsLog(folder, resume_step=start_step, writer=writer)

    train_step, eval_step = build_steps(cfg, model_def, tx, mesh, comm, parts, schedule, pixel_norm)
    progress = Progress(
        cfg.log.progress, steps, start_step, writer, batches.steps_per_epoch, console
    )
    meter = ThroughputMeter(cfg.data.global_batch_size, start_step)
    reporter = StepReporter(
        cfg.log.every_steps,
        steps,
        cfg.train.on_nonfinite == "halt",
        log,
        meter,
        progress,
        ckpts,
        cfg.log.baseline_img_per_s,
        len(mesh.local_devices) * comm.process_count,
    )
    run = Run(
        cfg, comm, folder, console, mesh, layout, splits, batches, model_def, state,
        start_step, steps, train_step, eval_step, ckpts, log, progress, meter, stop, reporter,
        Profiler(cfg.log.profile_steps, folder.profile, console),
    )  # fmt: skip
    run.start_skipped_steps = int(to_host(state.skipped_steps))
    run.user_model = parts.model
    run.hooks = [
        EvalHook(cfg.train.eval_every_steps, steps, run.evaluate, log, meter, progress),
        CheckpointHook(ckpts, run.config_dict),
        SyncCheck(cfg.dist.check_sync_every, comm),
    ]
    return run
