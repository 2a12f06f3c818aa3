"""Build a run's pieces from its config: mesh, data, model and steps.

What training (:mod:`jddp.run.setup`), evaluation (:mod:`jddp.evaluation`) and inference
(:mod:`jddp.inference`) share; nothing here writes files or knows about checkpoints. The
benchmarks and test workers build their steps here too, so they time the trainer's own step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import optax
from flax import nnx
from jax.sharding import Mesh

from jddp import config as config_lib
from jddp.comm import Comm
from jddp.config import Config
from jddp.data.loader import BatchLayout, batch_layout
from jddp.data.registry import load_splits
from jddp.data.source import Splits
from jddp.errors import ConfigError
from jddp.mesh import DTYPES, make_mesh, select_devices
from jddp.models import get_model_factory
from jddp.state import ModelDef
from jddp.step import PixelNorm, TrainStep, cross_entropy_loss, make_eval_step, make_train_step


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
    dtype = DTYPES[cfg.train.precision]
    if ":" in cfg.model.name:  # the user's code runs as written (it may not be traceable)
        return factory(config=config_lib.to_dict(cfg)["model"], dtype=dtype, rngs=rngs)

    def make(rngs: nnx.Rngs) -> nnx.Module:
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

    # Initialised in one compiled program: eagerly, each parameter shape compiled its own
    # random-normal program (a ResNet-18: ~40 compilations, 3.7 s of a 14 s start even with a
    # warm compilation cache; jitted: 1.4 s).
    return nnx.jit(make)(rngs)


def total_steps(cfg: Config, steps_per_epoch: int) -> int:
    """``train.steps``, or ``train.epochs`` converted to steps (default: one epoch)."""
    if cfg.train.steps is not None:
        return cfg.train.steps
    steps = max(1, math.ceil((cfg.train.epochs or 1.0) * steps_per_epoch))
    if steps > config_lib.MAX_INT:  # the step counter is int32 on the devices
        raise ConfigError(
            f"train.epochs={cfg.train.epochs:g} is {steps} steps of {steps_per_epoch} per epoch; "
            f"at most {config_lib.MAX_INT} steps fit: choose fewer epochs"
        )
    return steps


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
    comm.meet(mesh)
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
    compute_dtype = DTYPES[cfg.train.precision]
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
