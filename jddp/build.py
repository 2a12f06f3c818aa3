"""Build a run's pieces from its config: mesh, data, model and steps.

What training (:mod:`jddp.run.setup`), evaluation (:mod:`jddp.eval_lib`) and inference
(:mod:`jddp.inference`) share; nothing here writes files or knows about checkpoints. The
benchmarks and test workers build their steps here too, so they time the trainer's own step.
"""

from __future__ import annotations

import inspect
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optax
from flax import nnx
from jax.sharding import Mesh

from jddp import config as config_lib
from jddp.comm import Comm
from jddp.config import Config
from jddp.data.loader import PipelineOptions, ProcessRows, process_rows_of
from jddp.data.registry import load_splits
from jddp.data.source import Splits, as_source
from jddp.data.trees import as_tree_source
from jddp.errors import ConfigError, JddpError, TaskError, UserCodeError, one_line
from jddp.imports import import_callable
from jddp.mesh import DTYPES, make_mesh, select_devices
from jddp.models import get_model_factory
from jddp.shard import make_layout
from jddp.shard.base import StateLayout
from jddp.state import ModelDef
from jddp.step import TrainStep, make_eval_step, make_train_step
from jddp.tasks import Task
from jddp.tasks.classification import ClassificationTask, PixelNorm, cross_entropy_loss
from jddp.tasks.custom import CustomTask


@dataclass
class Parts:
    """What a library user supplies instead of the config's built-in choices (all optional).

    ``model``: an NNX module, built identically on every process. ``optimizer``: an optax
    transformation. ``splits``: train/eval sources (:class:`~jddp.data.source.Source` objects
    for images, any source of batch pytrees for a custom task). ``loss``/``metrics``: a custom
    task, ``loss(model, batch) -> loss_B | (loss_B, weight_B)`` and ``metrics(model, batch) ->
    {name: value_B | (value_B, weight_B)}`` (:mod:`jddp.tasks.custom`). ``loss_fn``/``metrics_fn``:
    the classification shorthand, ``(logits_BxK, labels_B) -> loss_B`` and ``-> {name:
    value_B}``. ``lr_schedule``: the learning rate of ``optimizer`` by step, logged as
    ``train/lr``. ``callbacks``: :class:`~jddp.run.callbacks.Callback` objects.
    """

    model: nnx.Module | None = None
    optimizer: Any = None
    lr_schedule: Any = None
    callbacks: list = field(default_factory=list)
    splits: Splits | None = None
    loss: Any = None
    metrics: Any = None
    loss_fn: Any = None
    metrics_fn: Any = None

    @property
    def custom(self) -> bool:
        """Whether these parts make a custom task (``jddp.fit(loss=...)``)."""
        return self.loss is not None


def is_custom_task(cfg: Config, parts: Parts | None = None) -> bool:
    """Whether the run trains a custom task (``jddp.fit(loss=...)`` or ``train.loss``) rather
    than image classification."""
    return (parts is not None and parts.custom) or cfg.train.loss is not None


def _user_function(spec: str, key: str) -> Any:
    try:
        return import_callable(spec, "function")
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def build_task(
    cfg: Config, parts: Parts | None = None, pixel_norm: PixelNorm | None = None
) -> Task:
    """The run's task: the custom one of ``jddp.fit(loss=...)`` or ``train.loss``/
    ``train.metrics``, else image classification (``loss_fn``/``metrics_fn`` or cross-entropy
    with ``train.label_smoothing``; images normalised by ``pixel_norm``)."""
    parts = parts or Parts()
    if parts.custom:
        return CustomTask(
            parts.loss,
            parts.metrics,
            loss_name="the loss given to jddp.fit",
            metrics_name="the metrics given to jddp.fit",
        )
    if cfg.train.loss is not None:
        metrics = cfg.train.metrics
        return CustomTask(
            _user_function(cfg.train.loss, "train.loss"),
            None if metrics is None else _user_function(metrics, "train.metrics"),
            loss_name=f"train.loss={cfg.train.loss}",
            metrics_name=f"train.metrics={metrics}",
        )
    return ClassificationTask(
        loss_fn=parts.loss_fn or cross_entropy_loss(cfg.train.label_smoothing),
        metrics_fn=parts.metrics_fn,
        compute_dtype=DTYPES[cfg.train.precision],
        pixel_norm=pixel_norm or PixelNorm(),
    )


def _user_model(factory: Any, name: str, config: dict, dtype: Any, rngs: nnx.Rngs) -> nnx.Module:
    """``factory(config=..., dtype=..., rngs=...)`` of ``model.name``, or one line naming it:
    a callable that cannot take those keywords (a model class itself, say), or a factory that
    returns something other than an NNX module."""
    try:
        if inspect.isclass(factory):  # its metaclass may hide __init__ behind (*args, **kw)
            inspect.signature(factory.__init__).bind(None, config=config, dtype=dtype, rngs=rngs)
        else:
            inspect.signature(factory).bind(config=config, dtype=dtype, rngs=rngs)
    except TypeError:
        raise ConfigError(
            f"model.name: {name} is called as fn(config=<model section dict>, dtype=<compute "
            f"dtype>, rngs=nnx.Rngs), but its signature is {_signature(factory)}; point "
            "model.name at a factory function that builds the model from those (examples/"
            "lm_stdlib.py:gpt is one)"
        ) from None
    except ValueError:  # no signature to read (a builtin): call it and see
        pass
    model = call_user(factory, f"model.name={name}", config=config, dtype=dtype, rngs=rngs)
    if not isinstance(model, nnx.Module):
        raise ConfigError(
            f"model.name: {name} returned {type(model).__name__}, not a flax.nnx.Module "
            "(did it forget to return the model?)"
        )
    return model


def call_user(fn: Callable, name: str, **kwargs: Any) -> Any:
    """``fn(**kwargs)``, the user's factory called ``name`` in errors: what it raises (but
    jddp's own errors) becomes one line naming it, the exception and the line that raised it
    (:class:`UserCodeError`, the exception chained)."""
    try:
        return fn(**kwargs)
    except JddpError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code: name it
        frames = traceback.extract_tb(e.__traceback__)
        at = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
        raise UserCodeError(f"{name} raised {type(e).__name__}: {one_line(e)}{at}") from e


def _signature(fn: Any) -> str:
    try:
        if inspect.isclass(fn):
            return str(inspect.signature(fn.__init__)).replace("(self, ", "(", 1)
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "unknown"


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
        return _user_model(factory, cfg.model.name, config_lib.to_dict(cfg)["model"], dtype, rngs)

    def make(rngs: nnx.Rngs) -> nnx.Module:
        return factory(
            num_classes=cfg.model.num_classes,
            stem=cfg.model.stem,
            width=cfg.model.width,
            sync_batchnorm=cfg.model.sync_batchnorm,
            zero_init_residual=cfg.model.zero_init_residual,
            bn_momentum=cfg.model.bn_momentum,
            bn_epsilon=cfg.model.bn_epsilon,
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


def load_data(cfg: Config, custom: bool = False) -> Splits:
    """Load the data set named in ``cfg.data``: a built-in one, checked against
    ``model.num_classes``, or what a ``pkg.module:factory`` returns (as a custom task's data
    when ``custom``, else as labelled images)."""
    if ":" in cfg.data.name:
        return _factory_data(cfg, custom)
    splits = load_splits(
        cfg.data.name,
        cfg.data.path,
        cfg.data.image_size,
        seed=cfg.train.seed,
        num_classes=cfg.model.num_classes,
        eval_path=cfg.data.eval_path,
        image_key=cfg.data.image_key,
        label_key=cfg.data.label_key,
        custom=custom,
        index_dir=str(Path(cfg.workdir) / "data-index") if cfg.workdir else None,
    )
    if custom:
        return splits
    if splits.train.num_classes > cfg.model.num_classes:
        raise ConfigError(
            f"model.num_classes={cfg.model.num_classes} is smaller than the "
            f"{splits.train.num_classes} classes of data.name={cfg.data.name}"
        )
    return splits


def _factory_data(cfg: Config, custom: bool) -> Splits:
    """``data.name=pkg.module:factory`` called as ``fn(config=<data section>,
    seed=train.seed)``; it returns ``(train, eval)`` (eval may be None: the train data is
    evaluated), ``{"train": ..., "eval": ...}`` or a :class:`Splits`."""
    key = f"data.name={cfg.data.name}"
    try:
        factory = import_callable(cfg.data.name, "data factory")
    except ValueError as e:
        raise ConfigError(f"data.name: {e}") from None
    out = call_user(factory, key, config=config_lib.to_dict(cfg)["data"], seed=cfg.train.seed)
    if isinstance(out, Splits):
        return out
    if isinstance(out, dict) and "train" in out:
        train, evals = out["train"], out.get("eval")
    elif isinstance(out, tuple) and len(out) == 2:
        train, evals = out
    else:
        raise TaskError(
            f"{key} returned a {type(out).__name__}; expected (train, eval) or "
            '{"train": ..., "eval": ...} (eval may be None), each in a form jddp.fit takes'
        )
    return user_splits(train, evals, custom, who=f"{key} ")


def user_splits(train: Any, evals: Any, custom: bool, who: str = "") -> Splits:
    """Train and eval sources of user data (``evals`` None: the train data is evaluated):
    batch pytrees for a custom task (:func:`~jddp.data.trees.as_tree_source`), labelled images
    otherwise (:func:`~jddp.data.source.as_source`). Errors name ``{who}train_data`` etc."""
    if custom:
        train_source = as_tree_source(train, "train", label=f"{who}train_data")
        eval_source = (
            train_source
            if evals is None
            else as_tree_source(evals, "eval", label=f"{who}eval_data")
        )
        return Splits(train=train_source, eval=eval_source)
    train_source = as_source(train, None, "train", label=f"{who}train_data")
    eval_source = (
        train_source
        if evals is None
        else as_source(evals, train_source.num_classes, "eval", label=f"{who}eval_data")
    )
    return Splits(train=train_source, eval=eval_source)


def pipeline_options(cfg: Config) -> PipelineOptions:
    """The input pipeline's options of ``cfg.data`` (augmentation, host workers), as
    :class:`~jddp.data.loader.TrainBatches` and ``eval_batches`` take them."""
    return PipelineOptions(cfg.data.augment, cfg.data.workers, cfg.data.worker_kind)


def per_device_rows(cfg: Config, mesh: Mesh, comm: Comm) -> int:
    """Rows of every global batch each device holds (before micro-batching)."""
    return cfg.data.global_batch_size // comm.num_devices(mesh)


def shard_group(cfg: Config, num_devices: int, local_devices: int) -> int:
    """The devices a split state is split over (``dist.shard_group``): ``all`` of them, a
    ``process``'s, or a count that divides them and either divides a process's devices or
    holds whole processes (a group must not straddle processes unevenly). Unused with
    ``dist.shard=none``: the state is whole on every device."""
    group = cfg.dist.shard_group
    if group == "all" or cfg.dist.shard == "none":
        return num_devices
    key = f"dist.shard_group={group}"
    size = local_devices if group == "process" else int(group)
    if num_devices % size:
        raise ConfigError(
            f"{key}: a group of {size} devices does not divide the {num_devices} devices; "
            f"choose a divisor of {num_devices}, process ({local_devices}), or all"
        )
    if local_devices % size and size % local_devices:
        raise ConfigError(
            f"{key}: a group of {size} devices neither lies within a process ({local_devices} "
            f"devices) nor holds whole processes; choose a divisor or a multiple of "
            f"{local_devices}, process, or all"
        )
    return size


def build_mesh(cfg: Config, comm: Comm) -> tuple[Mesh, ProcessRows]:
    """The mesh of ``dist.num_local_devices`` per process, in groups of ``dist.shard_group``
    (under ``dist.backend=mpi`` the mesh holds this process's devices: its group), and this
    process's batch rows."""
    try:
        devices = select_devices(cfg.dist.num_local_devices)
        local = sum(d.process_index == devices[0].process_index for d in devices)
        group = shard_group(cfg, comm.process_count * local, local)
        if comm.name == "mpi" and cfg.dist.shard != "none" and group > local:
            raise ConfigError(
                f"dist.shard_group={cfg.dist.shard_group}: under dist.backend=mpi a group lies "
                f"within a process ({local} devices): processes share no collective but MPI's "
                "gradient mean; set dist.shard_group=process"
            )
        mesh = make_mesh(devices, min(group, len(devices)))
        process_rows = process_rows_of(
            mesh, cfg.data.global_batch_size, comm.process_index, comm.process_count
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    per_device = per_device_rows(cfg, mesh, comm)
    if per_device % cfg.train.grad_accum_steps:
        raise ConfigError(
            f"train.grad_accum_steps={cfg.train.grad_accum_steps} does not divide the "
            f"per-device batch {per_device}"
        )
    comm.meet(mesh)
    return mesh, process_rows


def bn_group_size(
    cfg: Config, saved: dict[str, Any] | None, micro_rows: int
) -> tuple[int | None, str | None]:
    """The rows each BatchNorm normalises together (``model.bn_group_size``) and a warning to
    say, if any: the key's value; else, resuming (``saved``: the run folder's saved config),
    the value the run started with; else ``micro_rows``, each device's micro-batch now. None
    with ``model.sync_batchnorm`` (statistics over the global batch). Raises
    :class:`ConfigError` for a value that does not divide ``micro_rows`` or that differs from
    the one the run started with. An inherited value that no longer divides (the run resumed
    on more devices than it started on) gives way to ``micro_rows``, said in the warning."""
    if cfg.model.sync_batchnorm:
        return None, None
    given = cfg.model.bn_group_size
    started = ((saved or {}).get("model") or {}).get("bn_group_size")
    if given is not None:
        if started is not None and started != given:
            raise ConfigError(
                f"model.bn_group_size={given}, but the run started with {started}: BatchNorm "
                "would normalise other groups of rows (other losses); leave the key unset to "
                "keep the run's, or use another workdir"
            )
        if micro_rows % given:
            raise ConfigError(
                f"model.bn_group_size={given} does not divide the {micro_rows} rows each device "
                "holds per micro-batch (data.global_batch_size / devices / "
                "train.grad_accum_steps); choose a divisor, or leave it unset"
            )
        return given, None
    if started is None:
        return micro_rows, None
    if micro_rows % started:
        return micro_rows, (
            f"jddp: warning: model.bn_group_size={started} (each device's micro-batch when this "
            f"run started) does not divide the {micro_rows} rows a device holds now: BatchNorm "
            f"normalises groups of {micro_rows} from here on, and the losses differ from the "
            "run's on its first topology (set model.sync_batchnorm=true for statistics that do "
            "not depend on the device count)"
        )
    return started, None


def build_layout(cfg: Config, mesh: Mesh, comm: Comm) -> StateLayout:
    """The layout of the train state over ``mesh`` that ``dist.shard`` names
    (:mod:`jddp.shard`), split within the mesh's groups (:func:`build_mesh`)."""
    kind = cfg.dist.shard
    if kind == "full" and cfg.dist.grad_allreduce_dtype != "float32":
        raise ConfigError(
            f"dist.grad_allreduce_dtype={cfg.dist.grad_allreduce_dtype} with dist.shard=full: "
            "there the gradients are reduce-scattered as the gathers' transpose, in the "
            "parameters' dtype; set dist.grad_allreduce_dtype=float32, or dist.shard=optimizer"
        )
    return make_layout(kind, mesh)


def build_steps(
    cfg: Config,
    model_def: ModelDef,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    comm: Comm,
    *,
    parts: Parts | None = None,
    schedule: optax.Schedule | None = None,
    pixel_norm: PixelNorm | None = None,
    task: Task | None = None,
    layout: StateLayout | None = None,
) -> tuple[TrainStep, Any]:
    """The trainer's train and eval steps for ``cfg`` and its task (default
    :func:`build_task` of ``cfg``, ``parts`` and ``pixel_norm``). The train step takes the
    state as ``layout`` (default :func:`build_layout` of ``cfg``) ``place`` lays it out."""
    task = task or build_task(cfg, parts, pixel_norm)
    layout = layout or build_layout(cfg, mesh, comm)
    train_step = make_train_step(
        model_def,
        tx,
        mesh,
        comm,
        task=task,
        grad_accum_steps=cfg.train.grad_accum_steps,
        schedule=schedule,
        layout=layout,
        clip_grad_norm=cfg.optim.clip_grad_norm,
        ema_decay=cfg.train.ema_decay,
        ema_warmup=cfg.train.ema_warmup,
        remat=cfg.model.remat,
        bn_group_size=None if cfg.model.sync_batchnorm else cfg.model.bn_group_size,
    )
    return train_step, make_eval_step(model_def, mesh, task=task)
