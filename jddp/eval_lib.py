"""Evaluation: loss, top-1 and top-5 accuracy over every example of an eval source exactly once.

One eval run (:class:`EvalRun`: the eval step, the data and where they run) serves three callers:

* the trainer's periodic and final evals (:meth:`jddp.run.setup.Run.evaluate`);
* the library call ``jddp.evaluate(model_or_workdir, data=None, ...)`` (:func:`evaluate_model`);
* the CLI ``python -m jddp.evaluate`` (:mod:`jddp.evaluate`, :func:`evaluate_checkpoint`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jddp import config as config_lib
from jddp import weighted
from jddp.build import (
    Parts,
    build_mesh,
    build_model,
    build_task,
    is_custom_task,
    load_data,
    pipeline_options,
)
from jddp.checkpoint.find import find_checkpoint, reader
from jddp.checkpoint.store import sorted_steps
from jddp.comm import Comm, make_comm
from jddp.config import Config
from jddp.data.loader import PipelineOptions, ProcessRows, eval_batches, process_rows_of
from jddp.data.source import as_source, check_label_range, is_image_source
from jddp.data.trees import as_tree_source
from jddp.distributed import Job, current_job
from jddp.errors import (
    CheckpointError,
    CheckpointGone,
    ConfigError,
    DataConfigError,
    DataError,
    NonFiniteLoss,
    one_line,
)
from jddp.imports import CODE_KEYS, code_specs, refuse_untrusted
from jddp.inference import as_model, restore_into
from jddp.mesh import make_mesh, to_host
from jddp.metrics import Console, append_metrics, describe_eval, nonfinite_eval
from jddp.preflight import check_same_config, output_shape
from jddp.proc.watchdog import StallWatchdog
from jddp.proc.xla import enable_compilation_cache
from jddp.state import TrainState, create_train_state
from jddp.step import NEGATIVE_WEIGHT_KEY, make_eval_step, pop_negative_weights
from jddp.tasks import Task
from jddp.tasks.classification import PixelNorm
from jddp.workdir import RunFolder


@dataclass(kw_only=True)
class EvalRun:
    """An eval pass, ready to run on any state of its model: the eval step, the eval source,
    the global batch and where it runs. ``pipeline``: the input pipeline's options
    (its ``augment`` picks the eval transform, e.g. imagenet's centre crop; ``workers``).
    ``weight_unit``: what a weighted loss's weights count (``log.weight_unit``), reported as
    ``eval/<unit>``."""

    eval_step: Callable
    source: Any
    global_batch_size: int
    mesh: Mesh
    process_rows: ProcessRows
    comm: Comm
    pipeline: PipelineOptions | None = None
    weight_unit: str | None = None
    on_batch: Callable[[], None] | None = None  # called after each batch (the run's watchdog)

    def __call__(self, state: TrainState) -> dict:
        """``eval/loss`` and ``eval/<metric>`` for each of the task's metrics (image
        classification: ``eval/accuracy``, ``eval/top5_accuracy`` for models with more than 5
        outputs), weighted means (or the sums, maxima, minima a metric asks for) over every
        example of the source exactly once (the last batch is padded and masked), over every
        process; ``eval/count``, the examples; and
        ``eval/<weight_unit>``, the loss weights' sum, when a unit is set."""
        totals: dict[str, Any] = {}
        batches = eval_batches(
            self.source,
            self.global_batch_size,
            self.mesh,
            self.process_rows,
            pipeline=self.pipeline or PipelineOptions(),
        )
        for batch in batches:
            sums = {
                k: weighted.host_term(v) for k, v in to_host(self.eval_step(state, batch)).items()
            }
            totals = weighted.combine(totals, sums, np) if totals else sums
            if self.on_batch is not None:
                self.on_batch()
        totals = self.comm.sum_across_processes(totals)
        count = totals.pop("count", 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):  # weights summing to 0: NaN
            means, weights = weighted.divide(
                {k: weighted.host_term(v) for k, v in totals.items()}, np
            )
        if means.pop(NEGATIVE_WEIGHT_KEY, 0.0) > 0:  # as training refuses them
            raise DataError(
                "the loss returned negative weights on the eval data (weights count what each "
                "example's loss stands for, e.g. its tokens: they must be >= 0); not a result"
            )
        metric = pop_negative_weights(means)
        if metric is not None:
            raise DataError(
                f"metric {metric!r} returned negative weights on the eval data (weights count "
                "what each example stands for: they must be >= 0); not a result"
            )
        # The loss first, then the task's metrics by name (the step's sums come back sorted).
        out = {"eval/loss": float(means.pop("loss"))}
        out.update({f"eval/{k}": weighted.host_number(v) for k, v in sorted(means.items())})
        out["eval/count"] = int(count)
        if self.weight_unit is not None:
            out[f"eval/{self.weight_unit}"] = float(weights["loss"])
        return out


@dataclass
class WithEma:
    """An eval pass of the parameters and of their moving average (``train.ema_decay``): the
    metrics of :class:`EvalRun` for each, the EMA's under ``eval_ema/`` (``eval_ema/loss``,
    ``eval_ema/accuracy``, ...)."""

    run: EvalRun

    def __call__(self, state: TrainState) -> dict:
        """``eval/...`` of ``state``'s parameters, then ``eval_ema/...`` of its EMA."""
        return self.run(state) | as_ema_metrics(self.run(state.replace(params=state.ema_params)))


def as_ema_metrics(metrics: dict) -> dict:
    """An eval's ``eval/...`` keys as ``eval_ema/...``: the metrics of the EMA weights."""
    return {f"eval_ema/{k.removeprefix('eval/')}": v for k, v in metrics.items()}


def build_eval_run(
    model: nnx.Module,
    source: Any,
    global_batch_size: int,
    mesh: Mesh,
    process_rows: ProcessRows,
    comm: Comm,
    *,
    task: Task,
    pipeline: PipelineOptions | None = None,
    labels_of: str | None = None,
    weight_unit: str | None = None,
) -> tuple[EvalRun, TrainState]:
    """The eval run of a module outside training, and its state replicated over ``mesh``.

    ``labels_of`` (image classification): the user's name of ``source`` (e.g. ``"data"``); its
    labels must then lie in ``[0, K)`` for the model's K outputs (``DataConfigError`` naming it
    otherwise).
    """
    model_def, state = create_train_state(model, optax.identity(), mesh)
    if labels_of is not None and hasattr(source, "labels"):
        check_label_range(source.labels, num_logits(model_def, state, source), labels_of)
    eval_step = make_eval_step(model_def, mesh, task=task)
    run = EvalRun(
        eval_step=eval_step,
        source=source,
        global_batch_size=global_batch_size,
        mesh=mesh,
        process_rows=process_rows,
        comm=comm,
        pipeline=pipeline,
        weight_unit=weight_unit,
    )
    return run, state


# ---------------------------------------------------------------------------------------------
# A model on a data source, over the job's devices (the library call)


def evaluate_model(
    model_or_workdir: Any,
    data: Any = None,
    *,
    batch_size: int = 256,
    step: int | str | None = None,
    loss: Callable | None = None,
    metrics: Callable | None = None,
    loss_fn: Callable | None = None,
    overrides: Iterable[str] = (),
    ema: bool = False,
    trust_code: bool = False,
) -> dict:
    """Eval metrics (as :class:`EvalRun` returns them) of a model on ``data``.

    ``model_or_workdir``: an NNX module or a run (workdir or checkpoint folder, see
    :func:`jddp.load`; ``step`` picks a checkpoint). ``data``: what ``jddp.fit`` takes as data;
    default, for a run, its configured eval split (``overrides`` may change ``data.*``). Every
    example counts once; the batches are spread over every device of every process (under
    ``jax.distributed`` every process must call it with the same arguments).

    The task: ``loss``/``metrics`` as given to ``jddp.fit`` (any task; a run trained with
    ``train.loss``/``train.metrics`` brings its own), else image classification with
    ``loss_fn`` ``(logits_BxK, labels_B) -> loss_B`` (default: the run's cross-entropy).
    ``ema``: a run's parameters' moving average (``train.ema_decay``) in place of them.
    ``trust_code``: a run's config may name the code that builds its model, data or task
    (``pkg.module:factory``), imported only then (see :func:`jddp.load`); what is given here
    (``data``, ``loss``) replaces it and needs no consent.
    """
    overrides = list(overrides)
    run = as_model(model_or_workdir, step, ema, trust_code)
    cfg = None
    parts = Parts(loss=loss, metrics=metrics, loss_fn=loss_fn)
    if run.model is not model_or_workdir:  # a run: its config (optional when data is given)
        try:
            cfg = run_config(Path(model_or_workdir), overrides, imports=())
        except ConfigError:
            if data is None:
                raise
        if cfg is not None:  # what of it is imported: the data unless given, the task's code
            keys: tuple[str, ...] = ("data.name",) if data is None else ()
            keys += () if parts.custom else ("train.loss", "train.metrics")
            assert cfg.workdir is not None  # run_config sets it: the run's folder
            where = str(RunFolder(cfg.workdir).config_yaml)
            refuse_untrusted(where, code_specs(cfg, keys, overrides), trust_code)
    custom = parts.custom or (cfg is not None and is_custom_task(cfg))
    if run.task == "custom" and not custom:
        raise ConfigError(
            f"{model_or_workdir}: this run trained a custom task; pass its loss= (and metrics=) "
            "as given to jddp.fit"
        )
    source = _eval_source(data, cfg, custom)
    comm = make_comm(current_job(config_lib.DistConfig()), "xla")
    mesh = make_mesh()
    devices = comm.num_devices(mesh)
    global_batch = -(-batch_size // devices) * devices
    process_rows = process_rows_of(mesh, global_batch, comm.process_index, comm.process_count)
    run_cfg = cfg or config_lib.from_dict({})
    task, pipeline, labels_of = _eval_task(run, data, cfg, run_cfg, parts, custom, source)
    evaluate, state = build_eval_run(
        run.model,
        source,
        global_batch,
        mesh,
        process_rows,
        comm,
        task=task,
        pipeline=pipeline,
        labels_of=labels_of,
        weight_unit=run_cfg.log.weight_unit,
    )
    return evaluate(state)


def _eval_source(data: Any, cfg: Config | None, custom: bool) -> Any:
    """The examples to evaluate: ``data``, else the run's configured eval split."""
    if data is not None:
        source = (
            as_tree_source(data, "eval", label="data")
            if custom
            else as_source(data, None, "eval", label="data", check_labels=False)
        )
    elif cfg is not None:
        source = load_data(cfg, custom).eval
    else:
        raise TypeError("evaluate: pass data= to evaluate a model (a run has its eval split)")
    if not len(source):
        raise DataConfigError(f"data: no examples to evaluate ({source!r})")
    return source


def _eval_task(
    run: Any,
    data: Any,
    cfg: Config | None,
    run_cfg: Config,
    parts: Parts,
    custom: bool,
    source: Any,
) -> tuple[Task, PipelineOptions | None, str | None]:
    """The task to evaluate with, the pipeline options of the eval batches and where the
    labels come from (``"data"``: checked against the model's outputs)."""
    if custom:
        return build_task(run_cfg, parts), None, None
    # Raw arrays or records of a run are fed as the run was trained (its recorded
    # normalisation); a Source (or the run's own eval split) brings its own.
    pixel_norm = (
        run.pixel_norm
        if run.pixel_norm is not None and data is not None and not hasattr(data, "get_batch")
        else PixelNorm.of(source)
    )
    pixel_norm.check_channels((len(source), *source.image_shape), "data")
    if cfg is not None and data is None:
        pipeline = pipeline_options(cfg)
    else:  # user data of a run get its eval transform (imagenet: the centre crop)
        pipeline = PipelineOptions(augment=run.augment)
    task = build_task(run_cfg, parts, pixel_norm)
    return task, pipeline, "data" if data is not None else None


def num_logits(model_def: Any, state: TrainState, source: Any) -> int:
    """How many classes the model scores (its output's last axis) for ``source``'s images;
    the source's own class count where the model's output is not ``[B, K]`` logits."""
    try:
        shape = output_shape(model_def, state, (2, *source.image_shape)).shape
    except Exception:  # noqa: BLE001 - the eval itself reports a model that cannot run
        return source.num_classes
    return int(shape[-1]) if len(shape) == 2 else source.num_classes


def run_config(
    path: Path,
    overrides: Iterable[str] = (),
    *,
    trust_code: bool = False,
    imports: Iterable[str] = CODE_KEYS,
) -> Config:
    """The resolved config of the run at ``path`` (a workdir, or a checkpoint folder inside
    one), with ``overrides``; its ``workdir`` is the run's folder. Someone else may have written
    it: unless ``trust_code``, a ``ConfigError`` when one of the keys the caller will
    ``imports`` names code (``pkg.module:factory``) that no override replaced."""
    root = path
    for candidate in (path, path.parent, path.parent.parent):
        if RunFolder(candidate).config_yaml.is_file():
            root = candidate
            break
    else:
        raise ConfigError(f"--workdir: no run in {path} (it has no config.yaml)")
    saved = RunFolder(root).config_yaml
    cfg = config_lib.load(saved, list(overrides))
    cfg.workdir = str(root)
    refuse_untrusted(str(saved), code_specs(cfg, imports, overrides), trust_code)
    return cfg


# ---------------------------------------------------------------------------------------------
# A checkpoint of a run on its eval split, over the job's devices and processes (the CLI)


# How often ``python -m jddp.evaluate`` (no --step) picks the newest checkpoint again when a
# live run's keep-N rotation deleted the one it picked before it was read.
ROTATION_RETRIES = 3


def evaluate_checkpoint(
    cfg: Config, path: str, step: int | str | None, job: Job, ema: bool = False
) -> dict:
    """Evaluate checkpoint ``step`` (default: the newest) of the run at ``path`` on ``cfg``'s
    eval split over the job's devices and processes; process 0 prints the result, then
    appends it to metrics.jsonl (a file it cannot write is one warning line: the result
    stands). ``ema``: the parameters' moving average (``train.ema_decay``), logged as
    ``eval_ema/...``."""
    enable_compilation_cache(cfg.train.compilation_cache_dir)  # the run's eval step, compiled
    comm = make_comm(job, cfg.dist.backend, cfg.dist.grad_allreduce_dtype, cfg.dist.fuse_allreduce)
    check_same_config(comm, cfg)
    mesh, process_rows = build_mesh(cfg, comm)
    splits = load_data(cfg, is_custom_task(cfg))
    images = is_image_source(splits.train)
    channels = splits.train.image_shape[-1] if images else 3
    model = build_model(cfg, nnx.Rngs(cfg.train.seed), in_channels=channels)
    directory, step = restore_run_checkpoint(model, path, step, comm, ema)
    evaluate, state = build_eval_run(
        model,
        splits.eval,
        cfg.data.global_batch_size,
        mesh,
        process_rows,
        comm,
        task=build_task(cfg, pixel_norm=PixelNorm.of(splits.train) if images else None),
        pipeline=pipeline_options(cfg),
        weight_unit=cfg.log.weight_unit,
    )
    del model
    # A rank hung while alive (SIGSTOP, a dead mount) ends the eval in one line, exit 124, as it
    # ends a run: the first batch compiles (dist.first_step_timeout_s), then each batch counts.
    watchdog = StallWatchdog(
        cfg.dist.step_timeout_s,
        cfg.dist.first_step_timeout_s,
        comm.process_index,
        after="stopping (exit 124); nothing was written",
    )
    watchdog.waiting("eval", step)
    evaluate.on_batch = lambda: watchdog.progress(step_done=True)
    with watchdog:
        metrics = evaluate(state)
    nonfinite = nonfinite_eval(metrics)
    if nonfinite:  # not a result: say so (exit 1) instead of logging eval/loss=nan
        raise NonFiniteLoss(
            f"checkpoint {directory / str(step)} on {cfg.data.name}: {nonfinite} over "
            f"{metrics['eval/count']} eval examples (NaN/Inf in the eval data or the weights, or "
            "a max/min metric over no rows); nothing was appended to metrics.jsonl"
        )
    weights = " (the EMA of its parameters)" if ema else ""
    description = describe_eval(metrics, cfg.log.weight_unit)
    if ema:  # logged beside the run's own eval_ema/ lines
        metrics = as_ema_metrics(metrics)
    Console(comm.is_writer).say(
        f"jddp: evaluated checkpoint {directory / str(step)}{weights} on {cfg.data.name} "
        f"({len(splits.eval)} eval examples): {description}\n"
        f"jddp: eval step={step} "
        + " ".join(
            f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
        )
    )
    if comm.is_writer:
        assert cfg.workdir is not None  # every config load sets it (run_config: the run's)
        folder = RunFolder(cfg.workdir)
        try:
            data_key = "eval_ema/data" if ema else "eval/data"
            append_metrics(folder, step, {**metrics, data_key: cfg.data.name})
        except OSError as e:  # a read-only run folder: the result above is what was asked for
            print(
                f"jddp: warning: {folder.metrics_jsonl}: cannot append the result "
                f"({e.strerror or one_line(e)}); it is printed above only",
                file=sys.stderr,
                flush=True,
            )
    return metrics


def restore_run_checkpoint(
    model: nnx.Module, path: str, step: int | str | None, comm: Comm, ema: bool = False
) -> tuple[Path, int]:
    """Set ``model``'s weights to checkpoint ``step`` (default: the newest) of the run at
    ``path`` (``ema``: its parameters' moving average); its checkpoints folder and step. Every
    process reads the step process 0 picked.

    A live run's ``checkpoint.keep`` rotation may delete the picked checkpoint before it is
    read: with no ``step`` asked for (or ``"best"``), the newest (best) one then present is
    read instead (up to :data:`ROTATION_RETRIES` times); a ``step`` asked for that vanished is a
    ``ConfigError``
    naming it and the checkpoints now present. A damaged checkpoint is a ``CheckpointError``
    naming it and the newest intact one.
    """
    for _ in range(ROTATION_RETRIES):
        directory, picked = find_checkpoint(path, step, "--workdir", "--step")
        picked = comm.allgather_int(picked)[0]
        ckpts = reader(directory)
        try:
            restore_into(
                model, ckpts, picked, key="--workdir", use=lambda s: f"--step {s}", ema=ema
            )
            gone = None
        except CheckpointGone as e:
            gone = e
        finally:
            ckpts.close()
        if comm.agree(gone is None):
            return directory, picked
        if step not in (None, "best"):  # (a best one is rotated only for a better one)
            now = [p.name for p in sorted_steps(directory)]
            raise ConfigError(
                f"--step: {gone or f'checkpoint {directory / str(step)} vanished'}; the "
                f"checkpoints now: {', '.join(now) or 'none'}"
            )
    raise CheckpointError(
        f"--workdir: the newest checkpoint in {directory} was deleted before it could be read "
        f"{ROTATION_RETRIES} times in a row (a running trainer rotates its checkpoints): "
        "evaluate again, or pass --step of a kept one"
    )
