"""Assemble a training run from its config: the pieces of :mod:`jddp.build`, the restored
state, the outputs (checkpoints, metrics log) and the loop's hooks.

:func:`build_run` reads the config; the loop (:mod:`jddp.run.loop`) only uses what it built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import jax
import yaml
from flax import nnx
from jax.sharding import Mesh

from jddp import config as config_lib
from jddp.build import (
    Parts,
    bn_group_size,
    build_layout,
    build_mesh,
    build_model,
    build_steps,
    build_task,
    is_custom_task,
    load_data,
    per_device_rows,
    pipeline_options,
    total_steps,
)
from jddp.checkpoint import Checkpoints
from jddp.checkpoint.best import BestCheckpoints, KeepNewestAndBest
from jddp.checkpoint.policy import SavePolicy
from jddp.checkpoint.resume import restore
from jddp.checkpoint.warm_start import warm_start
from jddp.comm import Comm
from jddp.config import Config
from jddp.data.loader import ProcessRows, TrainBatches
from jddp.data.source import Splits, is_image_source
from jddp.errors import ConfigError
from jddp.eval_lib import EvalRun, WithEma
from jddp.mesh import to_host
from jddp.metrics import Console, MetricsLog, Progress, read_metrics
from jddp.optimizer import make_optimizer
from jddp.preflight import (
    check_eval_keys,
    check_model_output,
    check_profile_steps,
    check_remat,
    check_same_init,
    check_task,
    nothing_split_warning,
    unused_outputs_warning,
)
from jddp.proc.signals import StopRequest
from jddp.proc.watchdog import StallWatchdog
from jddp.run.callbacks import Callback, Callbacks, EarlyStopping, Fanout, early_stop_keys
from jddp.run.hooks import (
    CheckpointHook,
    EvalHook,
    Profiler,
    StepReporter,
    SyncCheck,
    ThroughputMeter,
)
from jddp.run.memory import StepMemory, check_state_fits, device_budget
from jddp.run.trackers import Trackers
from jddp.shard import make_layout
from jddp.shard.base import StateLayout
from jddp.state import (
    ModelDef,
    TrainState,
    abstract_train_state,
    create_train_state,
    split_model,
    with_ema,
)
from jddp.step import TrainStep
from jddp.tasks.classification import PixelNorm
from jddp.workdir import RunFolder

__all__ = ["Parts", "Run", "build_run", "build_steps"]  # Parts, build_steps: see jddp.build


def _first_copy(x: Any) -> Any:
    """This process's first copy of a replicated array (one device, no cross-device copy); an
    array split over the devices (``dist.shard=full``) assembled whole on that device (every
    process calls this, as for a collective)."""
    if not isinstance(x, jax.Array):
        return x
    if x.is_fully_replicated:
        return x.addressable_data(0)
    return jax.device_put(to_host(x), x.addressable_data(0).devices().pop())


@dataclass(kw_only=True)
class Run:
    """Everything the loop uses, built from the config by :func:`build_run` (every part
    named: ``Run(cfg=..., comm=..., ...)``)."""

    # Where it runs: the config, the processes, the devices and this process's batch rows.
    cfg: Config
    comm: Comm
    mesh: Mesh
    process_rows: ProcessRows
    # What it trains: the data, the model and its state, from which step to which.
    splits: Splits
    batches: TrainBatches
    model_def: ModelDef
    state: TrainState
    start_step: int
    total_steps: int
    start_skipped_steps: int = 0  # skipped before this run resumed
    # The step the loop ends at: total_steps, or start_step for a rerun of a run that ended
    # early (``stopped_early``: why, from the run folder), which stays stopped.
    end_step: int | None = None
    stopped_early: str | None = None
    best: BestCheckpoints | None = None  # checkpoint.keep_best: the evals that rank them
    user_model: nnx.Module | None = None  # the module jddp.fit was given: trained in place
    # How: the steps, and the eval pass (``run.evaluate(state)``: metrics over every example).
    train_step: TrainStep
    layout: StateLayout  # dist.shard: where the state's arrays live (jddp.shard)
    step_memory: StepMemory  # the step's memory, read and checked as it first compiles
    eval_step: Any
    evaluate: EvalRun | WithEma
    # What it writes: the run folder, console lines, checkpoints, metrics.jsonl, progress.
    folder: RunFolder
    console: Console
    checkpoints: Checkpoints
    log: MetricsLog
    progress: Any
    trackers: Trackers = field(default_factory=lambda: Trackers([]))  # log.trackers, fed by log
    callbacks: Callbacks = field(default_factory=lambda: Callbacks([], None, False))  # fed by log
    # The periodic work around each step.
    meter: ThroughputMeter
    stop: StopRequest
    saves: SavePolicy  # when to save (checkpoint.every_minutes: its flag rides in every batch)
    saver: CheckpointHook  # saves when the policy says, and at the end
    reporter: StepReporter
    profiler: Profiler
    hooks: list = field(default_factory=list)
    # What stops a run that makes no progress (dist.step_timeout_s; off unless the trainer runs it).
    watchdog: StallWatchdog = field(default_factory=lambda: StallWatchdog(None, None))

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
        return self.comm.num_devices(self.mesh)

    @property
    def config_dict(self) -> dict[str, Any]:
        """The resolved config, as saved next to every checkpoint."""
        return config_lib.to_dict(self.cfg)

    @property
    def tracked_config(self) -> dict[str, Any]:
        """What the trackers record as the run's parameters: :attr:`config_dict`, and the train
        data's class names as ``data.classes`` where it names them."""
        config = self.config_dict
        classes = self.checkpoints.classes
        if classes is not None:
            config["data"] = {**config["data"], "classes": ", ".join(classes)}
        return config


def build_run(
    cfg: Config,
    comm: Comm,
    folder: RunFolder,
    stop: StopRequest,
    parts: Parts,
    watchdog: StallWatchdog | None = None,
) -> Run:
    """Build the run of ``cfg``: restore its newest good checkpoint (``checkpoint.resume``),
    write ``config.yaml``, open the metrics log, and make the loop's hooks (``watchdog``: told
    of the progress of evals and checkpoints)."""
    watchdog = watchdog or StallWatchdog(None, None)
    writer = comm.is_writer
    console = Console(writer)
    mesh, process_rows = build_mesh(cfg, comm)
    cfg = _with_bn_group_size(cfg, folder, mesh, comm, console)
    custom = is_custom_task(cfg, parts)
    splits, batches, steps = _data(cfg, parts, custom, mesh, process_rows)
    if cfg.data.image_size is None and is_image_source(splits.train):  # which size, said once
        h, w, c = splits.train.image_shape
        console.say(f"jddp: data.image_size=null: {cfg.data.name} images at {h}x{w}x{c}")
    model_def, state, tx, schedule, layout = _model_and_state(
        cfg, comm, parts=parts, splits=splits, steps=steps, mesh=mesh, console=console
    )
    task, pixel_norm, num_outputs = _checked_task(
        cfg,
        comm,
        parts=parts,
        custom=custom,
        splits=splits,
        model_def=model_def,
        state=state,
        mesh=mesh,
    )
    stop_metrics = [c.metric for c in parts.callbacks if isinstance(c, EarlyStopping)]
    check_eval_keys(cfg, stop_metrics, task=task, model_def=model_def, state=state, splits=splits)
    classes = class_names(splits.train, num_outputs)
    if warning := unused_outputs_warning(cfg, classes, num_outputs, parts.model is not None):
        console.say(warning)
    best = _best(cfg, comm, folder)
    ckpts = _checkpoints(cfg, comm, folder, task, pixel_norm, classes, best)
    state, start_step = _restored_state(
        cfg,
        comm,
        ckpts=ckpts,
        state=state,
        tx=tx,
        mesh=mesh,
        console=console,
        steps=steps,
        num_outputs=num_outputs,
        layout=layout,
    )
    if best is not None:
        best.resumed_at(start_step)
    stopped_early = _stays_stopped(cfg, comm, folder, start_step, console)
    callbacks = Callbacks(_callbacks(cfg, parts), stop, writer)
    callbacks.start(start_step, _history(folder, start_step) if writer else [])
    trackers, log = _outputs(cfg, folder, start_step, writer, callbacks)

    train_step, eval_step, step_memory = _steps(
        cfg, comm, model_def=model_def, tx=tx, mesh=mesh, task=task, schedule=schedule,
        layout=layout,
    )  # fmt: skip
    saves = SavePolicy(
        every_steps=cfg.checkpoint.every_steps,
        every_minutes=cfg.checkpoint.every_minutes,
        eval_every_steps=cfg.train.eval_every_steps,
        save_at_evals=best is not None,  # an eval's checkpoint must exist to be kept
        start_step=start_step,
    )
    progress, meter, reporter = _reporting(
        cfg,
        comm,
        mesh=mesh,
        steps=steps,
        start_step=start_step,
        batches=batches,
        console=console,
        task=task,
        log=log,
        ckpts=ckpts,
    )
    evaluate = _evaluation(cfg, comm, eval_step, splits.eval, mesh, process_rows, watchdog)
    reporter.saves = saves
    saver = CheckpointHook(
        checkpoints=ckpts,
        policy=saves,
        config=config_lib.to_dict(cfg),
        watchdog=watchdog,
    )
    if callbacks.callbacks:  # on_checkpoint once a save is complete on disk
        ckpts.on_durable = callbacks.checkpoint
    return Run(
        cfg=cfg,
        comm=comm,
        mesh=mesh,
        process_rows=process_rows,
        splits=splits,
        batches=batches,
        model_def=model_def,
        state=state,
        start_step=start_step,
        total_steps=steps,
        start_skipped_steps=int(to_host(state.skipped_steps)),
        end_step=start_step if stopped_early is not None else steps,
        stopped_early=stopped_early,
        best=best,
        user_model=parts.model,
        train_step=train_step,
        layout=layout,
        step_memory=step_memory,
        eval_step=eval_step,
        evaluate=evaluate,
        folder=folder,
        console=console,
        checkpoints=ckpts,
        log=log,
        progress=progress,
        trackers=trackers,
        callbacks=callbacks,
        meter=meter,
        stop=stop,
        saves=saves,
        saver=saver,
        reporter=reporter,
        profiler=_profiler(cfg, comm, folder, console),
        hooks=[
            EvalHook(
                every=cfg.train.eval_every_steps,
                last_step=steps,
                evaluate=evaluate,
                log=log,
                meter=meter,
                progress=progress,
                watchdog=watchdog,
                on_eval=None if best is None else best.record,
            ),
            saver,  # after the eval: a step's eval is known when it is saved (and ranked)
            SyncCheck(cfg.dist.check_sync_every, comm),
        ],
        watchdog=watchdog,
    )


def _steps(
    cfg: Config,
    comm: Comm,
    *,
    model_def: ModelDef,
    tx: Any,
    mesh: Mesh,
    task: Any,
    schedule: Any,
    layout: StateLayout,
) -> tuple[TrainStep, Any, StepMemory]:
    """The train and eval steps, and the train step's memory check (as it first compiles)."""
    train_step, eval_step = build_steps(
        cfg, model_def, tx, mesh, comm, task=task, schedule=schedule, layout=layout
    )

    def step_for(kind: str) -> TrainStep:  # only to name what another layout would need
        other = make_layout(kind, mesh)
        return build_steps(
            cfg, model_def, tx, mesh, comm, task=task, schedule=schedule, layout=other
        )[0]

    budget = device_budget(cfg.dist.device_memory_bytes, mesh.local_devices[0])
    return train_step, eval_step, StepMemory(budget, layout, step_for)


def _evaluation(
    cfg: Config,
    comm: Comm,
    eval_step: Any,
    source: Any,
    mesh: Mesh,
    process_rows: ProcessRows,
    watchdog: StallWatchdog,
) -> EvalRun | WithEma:
    """The eval pass over every eval example (and the EMA's beside it)."""
    evaluate = EvalRun(
        eval_step=eval_step,
        source=source,
        global_batch_size=cfg.data.global_batch_size,
        mesh=mesh,
        process_rows=process_rows,
        comm=comm,
        pipeline=pipeline_options(cfg),
        weight_unit=cfg.log.weight_unit,
        on_batch=watchdog.progress,
    )
    return WithEma(evaluate) if cfg.train.ema_decay > 0 else evaluate


def _with_bn_group_size(
    cfg: Config, folder: RunFolder, mesh: Mesh, comm: Comm, console: Console
) -> Config:
    """``cfg`` with ``model.bn_group_size`` resolved (:func:`jddp.build.bn_group_size`): a
    run that resumes keeps the groups it started with, read from its saved ``config.yaml``."""
    saved = None
    checkpoints = folder.checkpoints
    resuming = cfg.checkpoint.resume and checkpoints.is_dir() and any(checkpoints.iterdir())
    if resuming and folder.config_yaml.is_file():
        saved = yaml.safe_load(folder.config_yaml.read_text())
    micro_rows = per_device_rows(cfg, mesh, comm) // cfg.train.grad_accum_steps
    rows, warning = bn_group_size(cfg, saved if isinstance(saved, dict) else None, micro_rows)
    if warning:
        console.say(warning)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, bn_group_size=rows))


def _data(
    cfg: Config, parts: Parts, custom: bool, mesh: Mesh, process_rows: ProcessRows
) -> tuple[Splits, TrainBatches, int]:
    """The data, its training batches and the run's total steps."""
    splits = parts.splits or load_data(cfg, custom)
    try:
        batches = TrainBatches(
            splits.train,
            cfg.data.global_batch_size,
            cfg.train.seed,
            mesh,
            process_rows,
            pipeline=pipeline_options(cfg),
        )
    except ValueError as e:  # the batch is larger than the data set
        raise ConfigError(str(e)) from None
    steps = total_steps(cfg, batches.steps_per_epoch)
    check_profile_steps(cfg.log.profile_steps, steps)
    return splits, batches, steps


def _model_and_state(
    cfg: Config,
    comm: Comm,
    *,
    parts: Parts,
    splits: Splits,
    steps: int,
    mesh: Mesh,
    console: Console,
) -> tuple[ModelDef, TrainState, Any, Any, Any]:
    """The model split into its definition and train state, the optimizer and its schedule
    (None for one given to jddp.fit), and the state's layout over the devices (``dist.shard``,
    built once here and kept on the run)."""
    images = is_image_source(splits.train)
    model = parts.model or build_model(
        cfg, nnx.Rngs(cfg.train.seed), in_channels=splits.train.image_shape[-1] if images else 3
    )
    if parts.optimizer is not None:  # its learning rate: as the user says, or injected
        tx, schedule = parts.optimizer, parts.lr_schedule
    else:
        tx, schedule = make_optimizer(cfg.optim, cfg.data.global_batch_size, steps)
    check_remat(cfg.model.remat, model)
    layout = build_layout(cfg, mesh, comm)
    # Before anything is placed: a state that cannot fit is one line, not an out-of-memory.
    _, params, model_state = split_model(model)
    budget = device_budget(cfg.dist.device_memory_bytes, mesh.local_devices[0])
    ema = cfg.train.ema_decay > 0
    abstract = abstract_train_state(params, model_state, tx, ema=ema)
    check_state_fits(abstract, layout, budget)
    if layout.kind != "none" and comm.name == "xla":  # each process places its slices
        check_same_init(comm, params, layout.kind)  # of its own copy (mpi: rank 0's)
    del params, model_state
    model_def, state = create_train_state(model, tx, mesh, ema=ema)
    del model
    if warning := nothing_split_warning(layout, state):
        console.say(warning)
    return model_def, state, tx, schedule, layout


def _checked_task(
    cfg: Config,
    comm: Comm,
    *,
    parts: Parts,
    custom: bool,
    splits: Splits,
    model_def: ModelDef,
    state: TrainState,
    mesh: Mesh,
) -> tuple[Any, PixelNorm | None, int | None]:
    """The task, its pixel normalisation and the model's number of outputs (None for a custom
    task), checked against the model and the batches."""
    pixel_norm = PixelNorm.of(splits.train) if is_image_source(splits.train) else None
    task = build_task(cfg, parts, pixel_norm)
    if custom:  # the loss and metrics fit the batches, or one line naming them
        rows = per_device_rows(cfg, mesh, comm) // cfg.train.grad_accum_steps
        check_task(task, model_def, state, splits, rows)
        num_outputs = None
    else:
        num_outputs = check_model_output(cfg, model_def, state, splits, parts.model is not None)
    return task, pixel_norm, num_outputs


def class_names(source: Any, num_outputs: int | None) -> list[str] | None:
    """The class names a labelled image source gives (image folders, the Hub's ``ClassLabel``,
    packs), label order; None for a custom task (``num_outputs`` None) or unnamed classes."""
    classes = getattr(source, "classes", None)
    if num_outputs is None or not classes:
        return None
    return [str(c) for c in classes]


def _checkpoints(
    cfg: Config,
    comm: Comm,
    folder: RunFolder,
    task: Any,
    pixel_norm: PixelNorm | None,
    classes: list[str] | None,
    best: BestCheckpoints | None,
) -> Checkpoints:
    """The run's checkpoints, saved with what an export or an eval of them needs; rotation
    keeps the newest ``checkpoint.keep`` and, with ``best``, the best ``keep_best``."""
    return Checkpoints.of(
        folder,
        task=task.kind,
        classes=classes,
        pixel_norm=None if pixel_norm is None else pixel_norm.to_json(),
        keep=cfg.checkpoint.keep,
        async_save=cfg.checkpoint.async_save,
        writes=comm.writes_checkpoints,
        primary=comm.is_writer,
        # Every JAX process saves (under MPI each rank is its own JAX runtime, rank 0 saves).
        agree=comm.agree if jax.process_count() > 1 else None,
        preserve=None if best is None else KeepNewestAndBest(cfg.checkpoint.keep, best),
    )


def _best(cfg: Config, comm: Comm, folder: RunFolder) -> BestCheckpoints | None:
    """``checkpoint.keep_best``: the record of the run's evals that ranks its checkpoints."""
    ckpt = cfg.checkpoint
    if ckpt.keep_best == 0:
        return None
    return BestCheckpoints(
        folder.checkpoints,
        monitor=ckpt.monitor,
        mode=ckpt.mode,
        keep_best=ckpt.keep_best,
        writer=comm.is_writer,
    )


def _restored_state(
    cfg: Config,
    comm: Comm,
    *,
    ckpts: Checkpoints,
    state: TrainState,
    tx: Any,
    mesh: Mesh,
    console: Console,
    steps: int,
    num_outputs: int | None,
    layout: StateLayout,
) -> tuple[TrainState, int]:
    """The state to start from (the newest good checkpoint, a warm start, or ``state``) and its
    step, laid out as ``dist.shard`` says and the same on every process."""
    state = layout.place(state)  # before restoring: orbax reads each device's slice
    state, start_step = restore(cfg, ckpts, state, comm, console, steps)
    ema = cfg.train.ema_decay > 0
    if start_step > 0 and (state.ema_params is not None) != ema:
        console.say(
            f"jddp: the checkpoint of step {start_step} has no EMA of the parameters: the EMA "
            f"(train.ema_decay={cfg.train.ema_decay}) starts from its parameters"
            if ema
            else "jddp: train.ema_decay=0: the checkpoint's EMA of the parameters is dropped"
        )
        state = layout.place(with_ema(state, ema))
    if start_step == 0 and cfg.checkpoint.init_from:  # a fresh run; a resume keeps its own
        state = warm_start(
            cfg.checkpoint.init_from,
            state,
            tx,
            mesh,
            console,
            num_outputs,
            ema=cfg.checkpoint.init_from_ema,
        )
        state = layout.place(state)
    # the same on every process (under mpi rank 0's, copied whole: laid out again)
    return layout.place(comm.broadcast_state(state, mesh)), start_step


def _stays_stopped(
    cfg: Config, comm: Comm, folder: RunFolder, start_step: int, console: Console
) -> str | None:
    """Why the run resumed at ``start_step`` ended early, when it did so at that step under
    the same ``train.early_stop_*`` keys: a rerun then stays stopped (it trained on to the
    next eval and replaced the final checkpoint and eval). Process 0 reads the run folder and
    decides for everyone; None otherwise."""
    record = folder.stopped_run() if comm.is_writer else None
    keys = early_stop_keys(cfg.train)
    applies = record is not None and record[0] == start_step > 0 and record[2] == keys
    if not comm.allgather_int(int(applies))[0]:
        return None
    if record is None:  # another process: process 0 says why
        return "stopped early"
    step, reason, _ = record
    console.say(
        f"jddp: this run stopped early at step {step} ({reason}); it stays stopped (change "
        f"train.early_stop_*, or remove {folder.stopped_marker}, to train on)"
    )
    return reason


def _callbacks(cfg: Config, parts: Parts) -> list[Callback]:
    """The callbacks given to jddp.fit, and early stopping when ``train.early_stop_metric``."""
    callbacks = list(parts.callbacks)
    train = cfg.train
    if train.early_stop_metric is not None:
        callbacks.append(
            EarlyStopping(
                train.early_stop_metric,
                train.early_stop_patience,
                train.early_stop_mode,
                train.early_stop_min_delta,
            )
        )
    return callbacks


def _history(folder: RunFolder, start_step: int) -> list[dict[str, Any]]:
    """The ``metrics.jsonl`` lines a resumed run keeps (up to ``start_step``)."""
    if start_step == 0:
        return []
    rows = read_metrics(folder.root) if folder.metrics_jsonl.exists() else []
    return [row for row in rows if 0 < row.get("step", 0) <= start_step]


def _outputs(
    cfg: Config, folder: RunFolder, start_step: int, writer: bool, callbacks: Callbacks
) -> tuple[Trackers, MetricsLog]:
    """Write ``config.yaml`` (the writer only) and open the trackers and the metrics log, which
    feeds them and the callbacks."""
    if writer:
        folder.config_yaml.write_text(config_lib.dump(cfg))
    trackers = Trackers.of(
        cfg.log.trackers, folder, start_step, cfg.log.experiment, writer
    )  # started by the trainer, with the loop
    log = MetricsLog(
        folder, resume_step=start_step, writer=writer, sink=Fanout(trackers, callbacks)
    )
    return trackers, log


def _reporting(
    cfg: Config,
    comm: Comm,
    *,
    mesh: Mesh,
    steps: int,
    start_step: int,
    batches: TrainBatches,
    console: Console,
    task: Any,
    log: MetricsLog,
    ckpts: Checkpoints,
) -> tuple[Any, ThroughputMeter, StepReporter]:
    """The progress bar, the throughput meter and the per-step reporter."""
    writer = comm.is_writer
    progress = Progress(
        mode=cfg.log.progress,
        total=steps,
        initial=start_step,
        writer=writer,
        steps_per_epoch=batches.steps_per_epoch,
        console=console,
        unit=task.example_unit,
        weight_unit=cfg.log.weight_unit,
    )
    meter = ThroughputMeter(
        cfg.data.global_batch_size, start_step, task.example_unit, cfg.log.weight_unit
    )
    reporter = StepReporter(
        every=cfg.log.every_steps,
        last_step=steps,
        halt_on_nonfinite=cfg.train.on_nonfinite == "halt",
        log=log,
        meter=meter,
        progress=progress,
        checkpoints=ckpts,
        baseline_img_per_s=cfg.log.baseline_img_per_s,
        num_devices=comm.num_devices(mesh),
    )
    return progress, meter, reporter


def _profiler(cfg: Config, comm: Comm, folder: RunFolder, console: Console) -> Profiler:
    """One trace per process: jax.profiler names its files after the host only, so the
    processes of one machine would write the same files."""
    directory = (
        folder.profile / f"process_{comm.process_index}"
        if comm.process_count > 1
        else folder.profile
    )
    return Profiler(cfg.log.profile_steps, directory, console)
