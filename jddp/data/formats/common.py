"""Checks and builders shared by the file-format loaders (labels, paths, in-memory splits)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from jddp.data.image_ops import channel_stats, resize_images
from jddp.data.source import ArraySource, Splits
from jddp.errors import DataConfigError, DataError


def check_labels(
    name: str, labels: np.ndarray, num_classes: int, where: str, source_of_limit: str
) -> None:
    """Raise :class:`DataError` if ``labels`` fall outside ``[0, num_classes)``."""
    if labels.size == 0:
        return
    low, high = int(labels.min()), int(labels.max())
    if low < 0:
        raise DataError(f"{name}: {where} holds negative label {low}: labels must be >= 0")
    if high >= num_classes:
        error = DataConfigError if source_of_limit == "model.num_classes" else DataError
        raise error(
            f"{name}: {where} holds label {high} but {source_of_limit}={num_classes}: "
            f"labels must be in [0, {num_classes})"
        )


def to_int_labels(name: str, labels: np.ndarray, where: str) -> np.ndarray:
    """Convert labels to int32 ``[N]`` (squeezing ``[N,1]``), or raise :class:`DataError`."""
    labels = np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1:
        raise DataError(f"{name}: {where} must be 1-D labels [N], got shape {labels.shape}")
    if np.issubdtype(labels.dtype, np.floating):
        if not np.all(np.isfinite(labels)) or np.any(labels != np.round(labels)):
            raise DataError(f"{name}: {where} holds non-integer labels (dtype {labels.dtype})")
    elif not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{name}: {where} must hold integer labels, got dtype {labels.dtype}")
    if labels.size and (labels.min() < np.iinfo(np.int32).min or labels.max() > 2**31 - 1):
        raise DataError(f"{name}: {where} holds labels that do not fit int32")
    return labels.astype(np.int32)


def make_splits(
    name: str,
    train: tuple[np.ndarray, np.ndarray, str],
    test: tuple[np.ndarray, np.ndarray, str],
    image_size: int | None,
    num_classes: int | None,
    default_num_classes: int | None,
) -> Splits:
    """Check, resize and normalize two in-memory splits; share the train stats.

    ``train``/``test`` are ``(images, labels, where)`` with ``where`` naming the file(s).
    ``default_num_classes`` None means "max label + 1".
    """
    x_train, y_train, where_train = train
    x_test, y_test, where_test = test
    for x, y, where in ((x_train, y_train, where_train), (x_test, y_test, where_test)):
        if x.shape[0] == 0:
            raise DataError(f"{name}: {where} holds no examples")
        if x.shape[0] != y.shape[0]:
            raise DataError(f"{name}: {where} has {x.shape[0]} images but {y.shape[0]} labels")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(
            f"{name}: train images {where_train} are {x_train.shape[1:]} but eval images "
            f"{where_test} are {x_test.shape[1:]}: both splits need the same (H, W, C)"
        )
    if x_train.dtype != x_test.dtype:
        raise DataError(
            f"{name}: train images {where_train} are {x_train.dtype} but eval images "
            f"{where_test} are {x_test.dtype}: both splits need the same dtype"
        )
    if num_classes is not None:
        limit_name, classes = "model.num_classes", int(num_classes)
    elif default_num_classes is not None:
        limit_name, classes = f"{name} num_classes", int(default_num_classes)
    else:
        highest = max(int(y_train.max()), int(y_test.max()))
        limit_name, classes = f"{name} num_classes", highest + 1
    check_labels(name, y_train, classes, where_train, limit_name)
    check_labels(name, y_test, classes, where_test, limit_name)
    if image_size is not None:
        x_train = resize_images(x_train, image_size)
        x_test = resize_images(x_test, image_size)
    mean, std = channel_stats(x_train)
    return Splits(
        train=ArraySource(x_train, y_train, classes, mean, std, f"{name}/train"),
        eval=ArraySource(x_test, y_test, classes, mean, std, f"{name}/eval"),
    )


def require_path(name: str, path: str | os.PathLike[str] | None, hint: str) -> Path:
    """Resolve ``data.path`` for a file-based data set; it must exist."""
    if path is None or str(path) == "":
        raise DataConfigError(f"data.path is required for data.name={name!r}: {hint}")
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise DataConfigError(f"data.path={str(path)!r} does not exist: {hint}")
    return resolved
