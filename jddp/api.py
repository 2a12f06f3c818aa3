"""The library entry points: :func:`initialize` and :func:`fit` for your own model, loss, data.

Everything the CLI does (multi-device, multi-process, the MPI backend, checkpoints, resume,
preemption) goes through the same trainer; ``fit`` only swaps in the pieces you pass.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import optax
from flax import nnx

from jddp import config as config_lib
from jddp import distributed
from jddp.build import Parts, user_splits
from jddp.compat.collector import collecting_less_often
from jddp.compat.excepthook import exiting_on_uncaught_jddp_error
from jddp.config import Config, FitConfig
from jddp.data.source import as_source  # noqa: F401 - jddp.as_source
from jddp.errors import ConfigError
from jddp.optimizer import describe_optax
from jddp.run.callbacks import Callback, EarlyStopping  # noqa: F401 - jddp.Callback, ...
from jddp.run.trainer import RunResult, train_and_evaluate

ConfigLike = Config | dict[str, Any] | str | Path | None


def load_config(config: ConfigLike = None, overrides: Iterable[str] = ()) -> Config:
    """A validated :class:`~jddp.config.Config` from a Config, a nested dict, a YAML path or
    None (the defaults), with dotted ``key=value`` overrides applied."""
    if isinstance(config, Config):
        base = config_lib.to_dict(config)
    elif isinstance(config, dict):
        base = config
    elif config is not None:
        return config_lib.load(config, list(overrides))
    else:
        base = {}
    data = copy.deepcopy(base)  # overrides must not write into the caller's dicts
    config_lib.apply_overrides(data, overrides, once=False)  # here the last one wins
    return config_lib.with_default_workdir(config_lib.from_dict(data))


def initialize(config: ConfigLike = None) -> None:
    """Join the job's processes (``jax.distributed`` or MPI) — call before any JAX computation,
    i.e. before building your model, when running under ``jddp.launch``, SLURM or mpirun.
    A plain single process needs no call."""
    distributed.initialize(load_config(config).dist)


def python_name(obj: Any) -> str | None:
    """``module:qualified.name`` of a class or function (None for None)."""
    if obj is None:
        return None
    obj = getattr(obj, "func", obj)  # a functools.partial: what it calls
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{getattr(obj, '__module__', None) or type(obj).__module__}:{name}"


def fit(
    model: nnx.Module,
    optimizer: optax.GradientTransformation | None = None,
    train_data: Any = None,
    eval_data: Any = None,
    *,
    loss: Callable[[nnx.Module, Any], Any] | None = None,
    metrics: Callable[[nnx.Module, Any], dict[str, Any]] | None = None,
    loss_fn: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    metrics_fn: Callable[[jax.Array, jax.Array], dict[str, jax.Array]] | None = None,
    config: ConfigLike = None,
    overrides: Iterable[str] = (),
    lr_schedule: optax.Schedule | None = None,
    callbacks: Iterable[Callback] = (),
) -> RunResult:
    """Train ``model`` data-parallel over every device of every process; returns the result.

    ``model`` ends up holding the trained parameters and model state (it is updated in place,
    and is ``result.model``); ``jddp.load(result.checkpoint_dir, model=...)`` gets them back
    later.

    **Any task** (``loss`` given): ``loss(model, batch)`` gets the model (train mode) and this
    device's slice of a batch pytree and returns per-example losses ``[B]``, or ``(loss_B,
    weight_B)``; the objective, and the logged ``train/loss``, is ``Σ w·loss / Σ w`` over the
    global batch (w = 1 by default: a language model's weights are its tokens per sequence),
    the same on every topology. ``metrics(model, batch)`` returns ``{name: value_B}`` or
    ``{name: (value_B, weight_B)}``, logged as ``train/<name>`` and ``eval/<name>``;
    ``eval/loss`` is the weighted mean loss over every eval example exactly once. Data: a
    pytree of arrays with a leading example axis (a dict, a tuple, nested), a list or
    random-access source (``len`` + ``[i]``, e.g. a grain ``MapDataset``) of examples without
    it, an iterator of batches, or an object with ``get_batch(indices)``
    (:mod:`jddp.data.trees`).

    **Image classification** (no ``loss``): ``model`` maps images ``[B,H,W,C]`` to logits
    ``[B,K]``; data as :func:`as_source` takes it (``(images, labels)`` arrays, a list or
    iterable of such batches, a Source or a record source; labels are class indices);
    ``loss_fn(logits_BxK, labels_B) -> loss_B`` (default: softmax cross-entropy) and
    ``metrics_fn(logits_BxK, labels_B) -> {name: value_B}``; accuracy and top-5 are logged.

    Either way: the model may hold BatchNorm, dropout or other mutable ``nnx.Variable`` state,
    all of which is carried between steps and checkpointed; build it identically on every
    process (same seed). ``optimizer``: any optax transformation (default: the config's
    ``optim`` section); its learning rate is logged as ``train/lr`` when it can be read: pass
    the schedule you built it with as ``lr_schedule`` (step -> lr), or build it with
    ``optax.inject_hyperparams`` (its ``learning_rate``); otherwise no ``train/lr`` is logged
    rather than a guess. ``callbacks``: :class:`~jddp.run.callbacks.Callback` objects whose
    ``on_start``/``on_log``/``on_eval``/``on_checkpoint``/``on_end`` run on process 0 outside
    the step; ``on_log``/``on_eval`` returning True stops the run on every process within two
    steps (the flag rides in the next batch, read one step late), saved and evaluated as a
    finished run (:class:`~jddp.run.callbacks.EarlyStopping` is one; ``train.early_stop_metric``
    builds it). Without ``train_data`` the config's ``data`` section is read; without
    ``eval_data`` the train data is evaluated. ``config``: a :class:`~jddp.config.Config`, a
    nested dict, a YAML path or None; ``overrides`` are dotted ``key=value`` strings, as on the
    command line. ``train.steps``, ``data.global_batch_size``, ``workdir`` and the
    ``checkpoint``/``log``/``dist`` keys apply as in the CLI (rerunning with the same workdir
    resumes).

    A stop signal (SIGTERM, SIGUSR1, SIGHUP, Ctrl-C) saves a checkpoint and raises
    :class:`~jddp.errors.Preempted`; left uncaught, the script exits 75 after the one line
    ``jddp: preempted at step N ...``, as the CLI does, with no traceback. So does every other
    :class:`~jddp.errors.JddpError` ``fit`` raises: left uncaught, it ends the script with one
    line, ``jddp: error: <the message>``, and its exit code (2 for a
    :class:`~jddp.errors.ConfigError`: a bad config key or value, an unsupported combination;
    1 for the others), as the CLI does
    (:func:`~jddp.compat.excepthook.exit_code_on_uncaught_jddp_error`); caught, it is the
    exception as raised.

    What ``fit`` changes in your process (:mod:`jddp.compat` lists why, and what lets each go).
    Put back when it returns or raises: Python's garbage collector thresholds (its youngest
    generation is collected every 50,000 allocations while ``fit`` runs; tracing's garbage), the
    handlers of the stop signals and the signal wakeup fd, and ``sys.excepthook``, except when a
    ``JddpError`` (a ``Preempted`` too) leaves ``fit``: then the hook stays chained to yours, so
    that the exception, uncaught, ends the script with its line and exit code (it acts on
    nothing else; catch the exception and it never runs). Left for the rest of the process:
    JAX's persistent compilation cache (``jax_compilation_cache_dir`` is
    ``train.compilation_cache_dir`` unless you set one; programs compiling in 0.5 s or more are
    kept unless JAX's own variables say); jddp's replacements of private functions of JAX (a CPU
    program's cache key without device ids, cache entries written whole) and orbax (replicas'
    shares of CPU arrays cut with NumPy); filters on the ``absl`` and ``asyncio`` loggers and a
    ``sys.unraisablehook`` that drop orbax's reports of failures jddp reports itself
    (:mod:`jddp.checkpoint.orbax_quiet`); with an MLflow tracker, MLflow's HTTP retry and
    timeout variables in ``os.environ`` where you set none.
    """
    # The hook stays after a JddpError: left uncaught, it is one line and its exit code.
    with exiting_on_uncaught_jddp_error():
        return _fit(
            model,
            optimizer,
            train_data,
            eval_data,
            Parts(
                model=model,
                optimizer=optimizer,
                loss=loss,
                metrics=metrics,
                loss_fn=loss_fn,
                metrics_fn=metrics_fn,
                lr_schedule=lr_schedule,
                callbacks=list(callbacks),
            ),
            load_config(config, overrides),
        )


def _fit(
    model: nnx.Module,
    optimizer: optax.GradientTransformation | None,
    train_data: Any,
    eval_data: Any,
    parts: Parts,
    cfg: Config,
) -> RunResult:
    """:func:`fit`'s work, its arguments gathered in ``parts`` and ``cfg``."""
    loss, metrics, loss_fn, metrics_fn = parts.loss, parts.metrics, parts.loss_fn, parts.metrics_fn
    if loss is None and metrics is not None:
        raise TypeError(
            "fit: metrics= (metrics(model, batch)) belongs to a custom task: pass loss= too, or "
            "metrics_fn=(logits, labels) for image classification"
        )
    if loss is not None and (loss_fn is not None or metrics_fn is not None):
        raise TypeError(
            "fit: loss= (any task) and loss_fn=/metrics_fn= (the classification shorthand) "
            "exclude each other; pass one form"
        )
    if cfg.train.precision != "float32":  # nothing would apply it: said, not recorded
        raise ConfigError(
            f"train.precision={cfg.train.precision}: a model given to jddp.fit computes in the "
            "dtype it was built with; build it in bfloat16 (flax layers' dtype=jnp.bfloat16, "
            "param_dtype stays float32) and leave train.precision at float32 (it sets the "
            "dtype of the built-in models and of model.name factories)"
        )
    cfg.fit = FitConfig(  # config.yaml says what came from Python (jddp.config.refuse_fit_run)
        model=python_name(type(model)),
        optimizer=None
        if optimizer is None
        else describe_optax(optimizer, nnx.state(model, nnx.Param)),
        loss=python_name(loss or loss_fn),
        metrics=python_name(metrics or metrics_fn),
        data=None if train_data is None else python_name(type(train_data)),
    )
    if train_data is not None:
        parts.splits = user_splits(train_data, eval_data, parts.custom)
    distributed.join_if_launched(cfg.dist)  # or refused: the script built its model first
    with collecting_less_often():  # put back as they were when fit returns
        return train_and_evaluate(cfg, parts)
