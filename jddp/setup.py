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
from jddp.checkpoint import (
    Checkpoints,
    describe_mismatch,
    mismatched_weights,
    open_checkpoint,
    short_name,
    with_shapes,
)
from jddp.comm import Comm, config_fingerprint
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
from jddp.mesh import make_mesh, put_replicated, select_devices, to_host
from jddp.metrics import Console, MetricsLog, Progress
from jddp.models import get_model_factory
from jddp.optimizer import make_optimizer
from jddp.resume import check_resume_config
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


def check_same_config(comm: Comm, cfg: Config) -> None:
    """Refuse to start when processes were given different configs (e.g. different seeds)."""
    config = config_lib.to_dict(cfg)
    shared = {**config, "dist": {k: v for k, v in config["dist"].items() if k != "process_id"}}
    prints = comm.allgather_int(config_fingerprint(shared))
    differ = [rank for rank, p in enumerate(prints) if p != prints[0]]
    if differ:
        raise ConfigError(
            f"the config of rank {differ[0]} differs from rank 0's: every process must be "
            "started with the same config file and overrides"
        )


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
            splits.train, cfg.data.global_batch_size, cfg.train.seed, mesh, layout
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

    ckpts = Checkpoints.of(
        folder,
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

    train_step, eval_step = build_steps(
        cfg, model_def, tx, mesh, comm, parts, schedule, PixelNorm.of(splits.train)
    )
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


def check_profile_steps(profile_steps: str | None, steps: int) -> None:
    """``log.profile_steps='a:b'`` must end within the run (else it would silently trace
    nothing)."""
    if profile_steps and int(profile_steps.split(":")[1]) > steps:
        raise ConfigError(
            f"log.profile_steps={profile_steps!r} ends after the run's last step {steps}: "
            f"choose 'a:b' with b <= {steps}"
        )


def check_model_output(cfg: Config, model_def: ModelDef, state: TrainState, splits: Splits) -> int:
    """Refuse a model whose output is not ``[B, K]`` logits with ``K`` >= the data's classes
    (otherwise the loss fails deep inside optax, or trains on garbage); returns ``K``."""
    shape = (2, *splits.train.image_shape)

    def forward(params, model_state, images):
        model = model_def.merge(params, model_state)
        model.eval()
        return model(images)

    where = f"model.name={cfg.model.name}"
    try:
        out = jax.eval_shape(
            forward, state.params, state.model_state, jax.ShapeDtypeStruct(shape, jnp.float32)
        )
    except Exception as e:  # noqa: BLE001 - any failure here means "cannot take these images"
        error = " ".join(str(e).split())[:300]
        raise ConfigError(
            f"{where}: the model cannot be applied to images of shape {list(shape)} "
            f"({type(e).__name__}: {error})"
        ) from None
    classes = splits.train.num_classes
    if (
        not hasattr(out, "shape")
        or len(out.shape) != 2
        or out.shape[0] != 2
        or out.shape[1] < classes
    ):
        got = list(out.shape) if hasattr(out, "shape") else type(out).__name__
        raise ConfigError(
            f"{where}: the model maps images of shape {list(shape)} to {got}; expected logits "
            f"of shape [2, K] with K >= the {classes} classes of the data (model.num_classes)"
        )
    return int(out.shape[1])


def restore(
    cfg: Config,
    ckpts: Checkpoints,
    state: TrainState,
    comm: Comm,
    console: Console,
    total_steps: int,
) -> tuple[TrainState, int]:
    """The newest good checkpoint's state and step under ``checkpoint.resume``, else
    ``(state, 0)``; refuses a checkpoint whose config differs in what changes training."""
    if not cfg.checkpoint.resume:
        return state, 0
    now = config_lib.to_dict(cfg)

    def check_config(step: int, saved: dict[str, Any]) -> None:
        check_resume_config(saved, now, step, total_steps, str(ckpts.directory / str(step)))

    try:
        restored = ckpts.restore_newest_good(state, comm.agree, check_config)
    except BaseException:
        ckpts.close()  # orbax's background threads must stop before the interpreter does
        raise
    if restored is None:
        return state, 0
    state, saved_step = restored
    start_step = int(to_host(state.step))
    console.say(f"jddp: resumed from {ckpts.directory / str(saved_step)} at step {start_step}")
    return state, start_step


def head_arrays(differ: list[tuple[str, tuple, tuple]], num_outputs: int) -> list[str] | None:
    """The names of ``differ`` (``(name, saved shape, shape now)``) when they are all one
    output layer whose class dimension changed: one module's arrays, equal but for the last
    axis, which is now ``num_outputs`` (the model's logits). None otherwise."""
    if not differ:
        return None
    parents, pairs = set(), set()
    for name, saved, now in differ:
        if len(saved) != len(now) or saved[:-1] != now[:-1] or now[-1] != num_outputs:
            return None
        parents.add(name.removesuffix(".value").rsplit("[", 1)[0])
        pairs.add((saved[-1], now[-1]))
    return [name for name, *_ in differ] if len(parents) == 1 and len(pairs) == 1 else None


def warm_start(
    path: str,
    state: TrainState,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    console: Console,
    num_outputs: int,
) -> TrainState:
    """``checkpoint.init_from``: ``state`` at step 0 with another run's params and model state
    and a fresh optimizer state. Arrays the checkpoint lacks, or of other shapes, are refused
    (``ConfigError`` naming them), except an output layer whose class dimension changed: that
    one keeps its fresh initialisation (and the message says so)."""
    key = "checkpoint.init_from"
    ckpts, step = open_checkpoint(path, None, key)
    where = ckpts.directory / str(step)
    try:
        fresh = to_host({"params": state.params, "model_state": state.model_state})
        saved = ckpts.weight_shapes(step)
        missing, differ = mismatched_weights(saved, fresh)
        head = head_arrays(differ, num_outputs) or []
        if missing or (differ and not head):
            raise ConfigError(
                f"{key}: checkpoint {where} does not fit this model: "
                f"{describe_mismatch(missing, differ)} (only an output layer of another "
                "num_classes is re-initialised)"
            )
        restored = ckpts.restore_weights(step, with_shapes(fresh, saved))
    finally:
        ckpts.close()
    keep_fresh = set(head)
    weights = {}
    for top in ("params", "model_state"):
        flat, _ = jax.tree_util.tree_flatten_with_path(fresh[top])
        pick = [
            new if f".{top}{jax.tree_util.keystr(path)}" in keep_fresh else old
            for (path, new), old in zip(flat, jax.tree.leaves(restored[top]), strict=True)
        ]
        weights[top] = jax.tree.unflatten(jax.tree.structure(fresh[top]), pick)
    note = ""
    if head:
        (_, before, now), *_ = differ
        names = ", ".join(short_name(n) for n in head)
        note = f"; re-initialised {names} (class dimension {before[-1]} -> {now[-1]})"
    console.say(
        f"jddp: {key}: starting at step 0 from the params and model state of {where} "
        f"(optimizer state fresh){note}"
    )
    return state.replace(
        params=put_replicated(weights["params"], mesh),
        model_state=put_replicated(weights["model_state"], mesh),
        opt_state=put_replicated(tx.init(weights["params"]), mesh),
    )
