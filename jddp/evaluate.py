"""Evaluation: loss, top-1 and top-5 accuracy over every example of an eval source exactly once.

Three ways in:

* the trainer's evals call :func:`evaluate` with its eval step and state;
* ``python -m jddp.evaluate --workdir W [--step N] [key=value ...]`` evaluates a checkpoint of a
  run on the configured eval split (overrides may change ``data.*``), on any number of devices
  and processes (under ``python -m jddp.launch``, SLURM or mpirun, as train), prints the
  result and appends it to ``W/metrics.jsonl``;
* the library call ``jddp.evaluate(model_or_workdir, data=None, ...)`` (this module is
  callable: :func:`evaluate_model` runs).

Exit codes of the CLI are those of train: 0, 2 for bad input (no checkpoint in the workdir, a
``--step`` that does not exist, a bad override), 1 for any other failure.
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from jax.sharding import Mesh

from jddp.cli import OneLineParser, Session, run
from jddp.comm import Comm
from jddp.data.loader import BatchLayout, eval_batches
from jddp.mesh import to_host
from jddp.metrics import describe_eval
from jddp.state import TrainState

USAGE = "python -m jddp.evaluate --workdir W [--step N] [key.sub=value ...]"


def evaluate(
    eval_step: Callable,
    state: TrainState,
    source,
    global_batch_size: int,
    mesh: Mesh,
    layout: BatchLayout,
    comm: Comm,
    pipeline: dict[str, Any] | None = None,
) -> dict:
    """``eval/loss``, ``eval/accuracy``, ``eval/top5_accuracy`` (models with more than 5
    outputs) and ``eval/count`` over every example of ``source`` exactly once (the last batch
    is padded and masked), summed over every process. ``pipeline``: the input pipeline's
    options (``augment`` picks the eval transform, e.g. imagenet's centre crop; ``workers``)."""
    totals: dict[str, float] = {}
    for batch in eval_batches(source, global_batch_size, mesh, layout, **(pipeline or {})):
        sums = to_host(eval_step(state, batch))
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    totals = comm.sum_across_processes(totals)
    count = max(totals.get("count", 0.0), 1.0)
    out = {
        "eval/loss": totals.get("loss_sum", 0.0) / count,
        "eval/accuracy": totals.get("correct", 0.0) / count,
    }
    if "correct_top5" in totals:
        out["eval/top5_accuracy"] = totals["correct_top5"] / count
    out["eval/count"] = int(totals.get("count", 0.0))
    return out


# ---------------------------------------------------------------------------------------------
# A model on a data source, over the job's devices (the library call and the CLI)


def evaluate_model(
    model_or_workdir: Any,
    data: Any = None,
    *,
    batch_size: int = 256,
    step: int | None = None,
    loss_fn: Callable | None = None,
    overrides: Iterable[str] = (),
) -> dict:
    """Eval metrics (as :func:`evaluate` returns them) of a model on ``data``.

    ``model_or_workdir``: an NNX module or a run (workdir or checkpoint folder, see
    :func:`jddp.load`; ``step`` picks a checkpoint). ``data``: what :func:`jddp.as_source`
    takes; default, for a run, its configured eval split (``overrides`` may change
    ``data.*``). Every example counts once; the batches are spread over every device of every
    process (under ``jax.distributed`` every process must call it with the same arguments).
    ``loss_fn``: ``(logits_BxK, labels_B) -> loss_B`` (default: the run's cross-entropy).
    """
    import jax.numpy as jnp
    import optax

    from jddp import config as config_lib
    from jddp.comm import make_comm
    from jddp.data.loader import batch_layout
    from jddp.data.source import as_source, check_label_range
    from jddp.distributed import current_job
    from jddp.errors import ConfigError
    from jddp.inference import as_model
    from jddp.mesh import make_mesh
    from jddp.setup import COMPUTE_DTYPES, load_data, pipeline_options
    from jddp.state import create_train_state
    from jddp.step import PixelNorm, cross_entropy_loss, make_eval_step

    model, run_norm = as_model(model_or_workdir, step)
    cfg = None
    if model is not model_or_workdir:  # a run: its config (optional when data is given)
        try:
            cfg = run_config(Path(model_or_workdir), overrides)
        except ConfigError:
            if data is None:
                raise
    if data is not None:
        source = as_source(data, None, "eval", label="data")
    elif cfg is not None:
        source = load_data(cfg).eval
    else:
        raise TypeError("evaluate: pass data= to evaluate a model (a run has its eval split)")
    smoothing = cfg.train.label_smoothing if cfg is not None else 0.0
    dtype = COMPUTE_DTYPES[cfg.train.precision] if cfg is not None else jnp.float32
    comm = make_comm(current_job(config_lib.DistConfig()), "xla")
    mesh = make_mesh()
    devices = mesh.devices.size
    global_batch = -(-batch_size // devices) * devices
    layout = batch_layout(mesh, global_batch, comm.process_index, comm.process_count)
    model_def, state = create_train_state(model, optax.identity(), mesh)
    if data is not None and hasattr(source, "labels"):  # the user's labels vs the model's K
        check_label_range(source.labels, num_logits(model_def, state, source), "data")
    eval_step = make_eval_step(
        model_def,
        mesh,
        loss_fn=loss_fn or cross_entropy_loss(smoothing),
        compute_dtype=dtype,
        # Raw arrays or records of a run are fed as the run was trained (its recorded
        # normalisation); a Source (or the run's own eval split) brings its own.
        pixel_norm=(
            run_norm
            if run_norm is not None and data is not None and not hasattr(data, "get_batch")
            else PixelNorm.of(source)
        ),
    )
    pipeline = pipeline_options(cfg) if cfg is not None and data is None else None
    return evaluate(eval_step, state, source, global_batch, mesh, layout, comm, pipeline)


def num_logits(model_def: Any, state: TrainState, source: Any) -> int:
    """How many classes the model scores (its output's last axis) for ``source``'s images;
    the source's own class count where the model's output is not ``[B, K]`` logits."""
    from jddp.preflight import output_shape

    try:
        shape = output_shape(model_def, state, (2, *source.image_shape)).shape
    except Exception:  # noqa: BLE001 - the eval itself reports a model that cannot run
        return source.num_classes
    return int(shape[-1]) if len(shape) == 2 else source.num_classes


def run_config(path: Path, overrides: Iterable[str] = ()):
    """The resolved config of the run at ``path`` (a workdir, or a checkpoint folder inside
    one), with ``overrides``; its ``workdir`` is the run's folder."""
    from jddp import config as config_lib
    from jddp.errors import ConfigError
    from jddp.workdir import RunFolder

    root = path
    for candidate in (path, path.parent, path.parent.parent):
        if RunFolder(candidate).config_yaml.is_file():
            root = candidate
            break
    else:
        raise ConfigError(f"--workdir: no run in {path} (it has no config.yaml)")
    cfg = config_lib.load(RunFolder(root).config_yaml, list(overrides))
    cfg.workdir = str(root)
    return cfg


# ---------------------------------------------------------------------------------------------
# The CLI


def evaluate_checkpoint(cfg, directory: Path, step: int, job) -> dict:
    """Evaluate checkpoint ``step`` in ``directory`` on ``cfg``'s eval split over the job's
    devices and processes; process 0 prints the result and appends it to metrics.jsonl."""
    import optax
    from flax import nnx

    from jddp.comm import make_comm
    from jddp.inference import restore_into
    from jddp.metrics import Console, append_metrics
    from jddp.preflight import check_same_config
    from jddp.setup import COMPUTE_DTYPES, build_mesh, build_model, load_data, pipeline_options
    from jddp.state import create_train_state
    from jddp.step import PixelNorm, cross_entropy_loss, make_eval_step
    from jddp.weights import reader
    from jddp.workdir import RunFolder

    comm = make_comm(job, cfg.dist.backend, cfg.dist.grad_allreduce_dtype)
    check_same_config(comm, cfg)
    mesh, layout = build_mesh(cfg, comm)
    splits = load_data(cfg)
    model = build_model(cfg, nnx.Rngs(cfg.train.seed), in_channels=splits.train.image_shape[-1])
    ckpts = reader(directory)
    try:
        restore_into(model, ckpts, step, key="--workdir")
    finally:
        ckpts.close()
    model_def, state = create_train_state(model, optax.identity(), mesh)
    del model
    eval_step = make_eval_step(
        model_def,
        mesh,
        loss_fn=cross_entropy_loss(cfg.train.label_smoothing),
        compute_dtype=COMPUTE_DTYPES[cfg.train.precision],
        pixel_norm=PixelNorm.of(splits.train),
    )
    metrics = evaluate(
        eval_step,
        state,
        splits.eval,
        cfg.data.global_batch_size,
        mesh,
        layout,
        comm,
        pipeline_options(cfg),
    )
    if comm.process_index == 0:
        append_metrics(RunFolder(cfg.workdir), step, {**metrics, "eval/data": cfg.data.name})
    Console(comm.process_index == 0).say(
        f"jddp: evaluated checkpoint {directory / str(step)} on {cfg.data.name} "
        f"({len(splits.eval)} eval examples): {describe_eval(metrics)}\n"
        f"jddp: eval step={step} "
        + " ".join(
            f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
        )
    )
    return metrics


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``--workdir``, ``--step`` and the ``key=value`` overrides."""
    parser = OneLineParser(
        prog="python -m jddp.evaluate",
        usage=USAGE,
        description="Evaluate a checkpoint of a run on its eval split (every example once): "
        "loss, top-1 and top-5 accuracy, printed and appended to WORKDIR/metrics.jsonl.",
    )
    parser.add_argument("--workdir", required=True, help="the run's folder")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. data.*")
    return parser.parse_intermixed_args(argv)  # overrides before and after the flags


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    from jddp.weights import find_checkpoint

    argv = sys.argv[1:] if argv is None else argv

    def body(session: Session) -> int:
        args = parse_args(argv)
        cfg = run_config(Path(args.workdir), args.overrides)
        directory, step = find_checkpoint(args.workdir, args.step, "--workdir", "--step")
        evaluate_checkpoint(cfg, directory, step, session.start_jax(cfg.dist))
        return 0

    return run(body)


class _CallableModule(types.ModuleType):
    """``jddp.evaluate`` is this module (``python -m jddp.evaluate``) and the library call."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return evaluate_model(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
