"""The library entry points: :func:`initialize` and :func:`fit` for your own model, loss, data.

Everything the CLI does (multi-device, multi-process, the MPI backend, checkpoints, resume,
preemption) goes through the same trainer; ``fit`` only swaps in the pieces you pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from jddp import config as config_lib
from jddp import distributed
from jddp.config import Config
from jddp.data.sources import ArraySource, Source, Splits
from jddp.setup import Parts
from jddp.trainer import RunResult, train_and_evaluate

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


class RecordSource:
    """A :class:`~jddp.data.sources.Source` over a random-access record source (e.g. a grain
    ``RandomAccessDataSource``): ``source[i]`` is ``(image_HxWxC, label)`` or a dict with
    ``image`` and ``label``."""

    def __init__(self, records: Any, num_classes: int, name: str = "records"):
        self.records = records
        self.num_classes = num_classes
        self.name = name
        image, _ = self._record(0)
        self.image_shape = tuple(np.asarray(image).shape)

    def _record(self, i: int) -> tuple[Any, Any]:
        rec = self.records[int(i)]
        if isinstance(rec, dict):
            return rec["image"], rec["label"]
        return rec[0], rec[1]

    def __len__(self) -> int:
        return len(self.records)

    def get_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stack the records at ``indices`` (float32 images, int32 labels)."""
        pairs = [self._record(i) for i in indices]
        images = np.stack([np.asarray(x, np.float32) for x, _ in pairs])
        return images, np.asarray([y for _, y in pairs], np.int32)

    def __repr__(self) -> str:
        return f"RecordSource(name={self.name!r}, n={len(self)}, image_shape={self.image_shape})"


def as_source(data: Any, num_classes: int | None = None, name: str = "data") -> Source:
    """Turn user data into a :class:`~jddp.data.sources.Source`.

    Accepts ``(images, labels)`` numpy arrays (uint8 images are scaled to [0, 1], nothing
    else is changed), a ``Source`` (anything with ``get_batch``), a random-access record source
    (``len`` + ``[i]``, e.g. grain's), or an iterable of ``(images, labels)`` batches, which is
    read once into memory and then sampled like arrays.
    """
    if hasattr(data, "get_batch"):
        return data
    if isinstance(data, tuple) and len(data) == 2 and hasattr(data[0], "shape"):
        images, labels = np.asarray(data[0]), np.asarray(data[1]).astype(np.int32)
    elif hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        classes = num_classes or 1 + max(
            int(data[i][1] if not isinstance(data[i], dict) else data[i]["label"])
            for i in range(len(data))
        )
        return RecordSource(data, classes, name)
    elif isinstance(data, Iterable):
        batches = [(np.asarray(x), np.asarray(y)) for x, y in data]
        images = np.concatenate([x for x, _ in batches])
        labels = np.concatenate([y for _, y in batches]).astype(np.int32)
    else:
        raise TypeError(
            f"{name}: expected (images, labels) arrays, a Source, a random-access "
            f"record source or an iterable of batches, got {type(data).__name__}"
        )
    if images.ndim == 3:
        images = images[..., None]
    if images.dtype != np.uint8:
        images = images.astype(np.float32)
    channels = images.shape[-1]
    return ArraySource(
        images,
        labels,
        num_classes or int(labels.max()) + 1,
        mean=np.zeros(channels, np.float32),
        std=np.ones(channels, np.float32),
        name=name,
    )


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

    Args:
      model: any Flax NNX module mapping images ``[B,H,W,C]`` to logits ``[B,K]`` (with or
        without BatchNorm, dropout or other mutable ``nnx.Variable`` state, all of which is
        carried between steps and checkpointed); build it identically on every process (same
        seed).
      optimizer: any optax transformation (default: the config's ``optim`` section).
      train_data, eval_data: see :func:`as_source` (default: the config's ``data`` section;
        without ``eval_data`` the train data is evaluated).
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
        train = as_source(train_data, None, "train")
        evals = as_source(eval_data, train.num_classes, "eval") if eval_data is not None else train
        splits = Splits(train=train, eval=evals)
    parts = Parts(
        model=model, optimizer=optimizer, splits=splits, loss_fn=loss_fn, metrics_fn=metrics_fn
    )
    return train_and_evaluate(cfg, parts)
