"""The one list of data set names: name -> format module, imported only when it is loaded.

``python -m jddp.train --help`` and config validation read :data:`DATA_NAMES` without
importing any format module (some pull in scikit-learn or Pillow).
"""

from __future__ import annotations

import importlib

import numpy as np

from jddp.data.source import Splits
from jddp.errors import DataConfigError, DataError

__all__ = ["DATA_NAMES", "FORMATS", "load_splits"]

FORMATS: dict[str, str] = {
    "synthetic": "jddp.data.formats.synthetic",
    "digits": "jddp.data.formats.digits",
    "cifar10": "jddp.data.formats.cifar10",
    "mnist": "jddp.data.formats.mnist",
    "npz": "jddp.data.formats.npz",
    "imagefolder": "jddp.data.formats.imagefolder",
    "packed": "jddp.data.formats.packed",
    "parquet": "jddp.data.formats.parquet",
    "webdataset": "jddp.data.formats.webdataset",
}
"""Data set name -> module exposing ``load(path, image_size, seed, num_classes) -> Splits``
(the shard formats also take the keyword options of :data:`SHARD_FORMATS`)."""

SHARD_FORMATS: dict[str, tuple[str, ...]] = {
    "parquet": ("eval_path", "image_key", "label_key", "custom"),
    "webdataset": ("eval_path", "image_key", "label_key", "index_dir"),
}
"""The shard formats and the options each takes (``data.eval_path``, ``data.image_key``,
``data.label_key``; ``custom``: a custom task's batches; ``index_dir``: where an index goes
when the shard folder is read-only)."""

DATA_NAMES: tuple[str, ...] = tuple(FORMATS)
"""The data set names :func:`load_splits` accepts (and ``data.name`` allows)."""


def _positive_int_or_none(value: object) -> bool:
    return value is None or (
        not isinstance(value, bool) and isinstance(value, int | np.integer) and value > 0
    )


def load_splits(
    name: str,
    path: str | None,
    image_size: int | None,
    seed: int = 0,
    num_classes: int | None = None,
    **options: object,
) -> Splits:
    """Build the train and eval :class:`~jddp.data.source.Source` of data set ``name``.

    Args:
      name: one of :data:`DATA_NAMES`.
      path: where the files are (``cifar10``, ``mnist``, ``npz``, ``imagefolder``, ``packed``);
        ignored by ``synthetic`` and ``digits``.
      image_size: output side length; ``None`` keeps the native size (224 for
        ``imagefolder``, 32 for ``synthetic``).  In-memory sets are resized once at
        load time (bilinear, dtype kept; non-square images become square).
      seed: only ``synthetic`` uses it; every other split is fixed.
      num_classes: override the class count; labels must be below it.
      options: the shard formats' options (:data:`SHARD_FORMATS`); a value set for a format
        that does not take it is a :class:`DataConfigError` naming the key.

    Raises:
      DataError: with a one-line message naming the data set/file and what is expected.
    """
    if name not in FORMATS:
        raise DataError(f"unknown data.name={name!r}: expected one of {', '.join(DATA_NAMES)}")
    if not _positive_int_or_none(image_size):
        raise DataError(f"data.image_size={image_size!r} must be a positive int or None")
    if not _positive_int_or_none(num_classes):
        raise DataConfigError(f"model.num_classes={num_classes!r} must be a positive int or None")
    image_size = None if image_size is None else int(image_size)
    num_classes = None if num_classes is None else int(num_classes)
    given = {k: v for k, v in options.items() if v not in (None, False)}
    taken = SHARD_FORMATS.get(name, ())
    unused = [k for k in given if k not in taken and k not in ("index_dir", "custom")]
    if unused:
        raise DataConfigError(
            f"data.{unused[0]} applies to data.name={'|'.join(SHARD_FORMATS)}, not {name}"
        )
    module = importlib.import_module(FORMATS[name])
    return module.load(
        path, image_size, seed, num_classes, **{k: v for k, v in given.items() if k in taken}
    )
