"""The library entry points: :func:`initialize` and :func:`fit` for your own model, loss, data.

Everything the CLI does (multi-device, multi-process, the MPI backend, checkpoints, resume,
preemption) goes through the same trainer; ``fit`` only swaps in the pieces you pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import optax
from flax import nnx

from jddp import config as config_lib
from jddp import distributed
from jddp.build import Parts
from jddp.config import Config
from jddp.data.source import Splits, as_source
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
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for text in overrides:
        key, value = config_lib.parse_override(text)
        config_lib.set_dotted(data, key, value)
    cfg = config_lib.from_dict(data)
    if cfg.workdir is None:
        cfg.workdir = "runs/default"
    return cfg


def initialize(config: ConfigLike = None) -> None:
    """Join the job's processes (``jax.distributed`` or MPI) — call before any JAX computation,
    i.e. before building your model, when running under ``jddp.launch``, SLURM or mpirun.
    A plain single process needs no call."""
    distributed.initialize(load_config(config).dist)


def fit(
    model: nnx.Module,
    optimizer: optax.GradientTransformation | None = None,
    train_data: Any = None,
    eval_data: Any = None,
    *,
    loss_fn: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    metrics_fn: Callable[[jax.Array, jax.Array], dict[str, jax.Array]] | None = None,
    config: ConfigLike = None,
    overrides: Iterable[str] = (),
) -> RunResult:
    """Train ``model`` data-parallel over every device of every process; returns the result.

    ``model`` ends up holding the trained parameters and model state (it is updated in place,
    and is ``result.model``); ``jddp.load(result.checkpoint_dir, model=...)`` gets them back
    later.

    Args:
      model: any Flax NNX module mapping images ``[B,H,W,C]`` to logits ``[B,K]`` (with or
        without BatchNorm, dropout or other mutable ``nnx.Variable`` state, all of which is
        carried between steps and checkpointed); build it identically on every process (same
        seed).
      optimizer: any optax transformation (default: the config's ``optim`` section).
      train_data, eval_data: see :func:`as_source`: ``(images, labels)`` arrays, a list or
        iterable of such batches, a Source or a record source (default: the config's ``data``
        section; without ``eval_data`` the train data is evaluated). Labels are class indices.
      loss_fn: ``(logits_BxK, labels_B) -> loss_B`` (default: softmax cross-entropy).
      metrics_fn: ``(logits_BxK, labels_B) -> {name: value_B}``, logged as ``train/<name>``.
      config: a :class:`~jddp.config.Config`, a nested dict, a YAML path or None; ``overrides``
        are dotted ``key=value`` strings, as on the command line. ``train.steps``,
        ``data.global_batch_size``, ``workdir`` and the ``checkpoint``/``log``/``dist`` keys
        apply as in the CLI (rerunning with the same workdir resumes).
    """
    cfg = load_config(config, overrides)
    splits = None
    if train_data is not None:
        train = as_source(train_data, None, "train", label="train_data")
        evals = (
            as_source(eval_data, train.num_classes, "eval", label="eval_data")
            if eval_data is not None
            else train
        )
        splits = Splits(train=train, eval=evals)
    parts = Parts(
        model=model, optimizer=optimizer, splits=splits, loss_fn=loss_fn, metrics_fn=metrics_fn
    )
    return train_and_evaluate(cfg, parts)
