"""What a data set is to the trainer: a random-access :class:`Source` of labelled images.

A source maps integer indices to ``(images [n,H,W,C], labels int32 [n])``. Images are uint8
pixels (0..255) or already-normalised float32; a source that hands out uint8 declares its
per-channel ``mean``/``std`` (on the [0, 1] scale) and the step normalises on the device.
:class:`ArraySource` holds arrays in memory; :func:`as_source` adapts user data (arrays,
record sources such as grain's, iterables of batches).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jddp.errors import ConfigError, DataConfigError

__all__ = ["ArraySource", "RecordSource", "Source", "Splits", "as_source", "read_batches"]


@runtime_checkable
class Source(Protocol):
    """A random-access labelled image set."""

    num_classes: int
    image_shape: tuple[int, int, int]  # (H, W, C) of what get_batch returns

    def __len__(self) -> int:
        """Number of examples."""
        ...

    def get_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """images [n,H,W,C] (uint8 pixels, normalised on the device with the source's optional
        ``mean``/``std``; or float32 already normalised) and labels int32 [n]."""
        ...

    def __repr__(self) -> str:
        """Stable description, no memory addresses (grain embeds it in its state)."""
        ...


def is_image_source(source: Any) -> bool:
    """Whether ``source`` holds labelled images (a :class:`Source`: batches ``(images,
    labels)``), rather than a custom task's batch pytrees (:mod:`jddp.data.trees`)."""
    return hasattr(source, "image_shape")


@dataclass(frozen=True)
class Splits:
    """The train and eval sources of one data set (:class:`Source` objects for images, any
    source of batch pytrees for a custom task)."""

    train: Any
    eval: Any


def as_index_array(indices: np.ndarray, n: int, who: str) -> np.ndarray:
    """Validate a 1-D integer index array for a source of ``n`` examples."""
    idx = np.asarray(indices)
    if idx.ndim != 1:
        raise ValueError(f"{who}.get_batch: indices must be 1-D, got shape {idx.shape}")
    if idx.size and not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"{who}.get_batch: indices must be integers, got dtype {idx.dtype}")
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IndexError(f"{who}.get_batch: index out of range for {n} examples")
    return idx.astype(np.intp, copy=False)


def scale_shift(
    dtype: np.dtype, mean: np.ndarray, std: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel ``(scale, shift)`` so that ``x * scale + shift`` = ``(x/255 - mean)/std``."""
    pixel = 1.0 / 255.0 if dtype == np.uint8 else 1.0
    scale = (pixel / std).astype(np.float32)
    shift = (-mean / std).astype(np.float32)
    return scale, shift


class ArraySource:
    """An in-memory :class:`Source` over images kept in their compact native dtype.

    Args:
      images: ``[N,H,W,C]`` uint8 (pixels 0..255) or float32 array.
      labels: ``[N]`` integer labels in ``[0, num_classes)``.
      num_classes: number of classes.
      mean: per-channel mean (``[C]``) on the ``[0, 1]`` scale for uint8 images.
      std: per-channel std (``[C]``), same scale as ``mean``.
      name: short stable name used in ``repr`` (e.g. ``"cifar10/train"``).

    ``get_batch`` gathers with one numpy fancy-indexing op. uint8 rows are handed out as
    they are stored (the step normalises them on the device with ``mean``/``std``: a quarter
    of the float bytes cross to the device); float32 rows are standardised on the host,
    ``(x - mean) / std``, since the step passes float images through.
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        num_classes: int,
        mean: Sequence[float] | np.ndarray,
        std: Sequence[float] | np.ndarray,
        name: str,
    ) -> None:
        """Validate shapes and precompute the per-channel affine normalization."""
        images = np.asarray(images)
        labels = np.asarray(labels)
        if images.ndim != 4:
            raise ValueError(f"ArraySource {name!r}: images must be [N,H,W,C], got {images.shape}")
        if images.dtype != np.uint8 and images.dtype != np.float32:
            raise ValueError(
                f"ArraySource {name!r}: images must be uint8 or float32, got {images.dtype}"
            )
        if labels.shape != (images.shape[0],):
            raise ValueError(
                f"ArraySource {name!r}: labels shape {labels.shape} does not match "
                f"{images.shape[0]} images"
            )
        channels = images.shape[-1]
        mean_arr = np.asarray(mean, np.float32).reshape(-1)
        std_arr = np.asarray(std, np.float32).reshape(-1)
        if mean_arr.shape != (channels,) or std_arr.shape != (channels,):
            raise ValueError(
                f"ArraySource {name!r}: mean/std need {channels} values, "
                f"got {mean_arr.shape[0]} and {std_arr.shape[0]}"
            )
        if np.any(std_arr <= 0):
            raise ValueError(f"ArraySource {name!r}: std must be positive, got {std_arr}")
        self.images = images
        self.labels = labels.astype(np.int32, copy=False)
        self.num_classes = int(num_classes)
        self.image_shape: tuple[int, int, int] = tuple(int(d) for d in images.shape[1:])
        self.mean = mean_arr
        self.std = std_arr
        self.name = str(name)
        self._scale, self._shift = scale_shift(images.dtype, mean_arr, std_arr)

    def __len__(self) -> int:
        """Number of examples."""
        return int(self.images.shape[0])

    def get_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """uint8 images ``[n,H,W,C]`` as stored (float32 ones normalised) and int32 labels."""
        idx = as_index_array(indices, len(self), "ArraySource")
        images = self.images[idx]
        if images.dtype != np.uint8:
            images *= self._scale
            images += self._shift
        return images, self.labels[idx]

    def get_crops(
        self, indices: np.ndarray, boxes: Callable[[int, int, int], tuple[int, int, int, int]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`get_batch`, but row ``k`` is the crop ``boxes(k, H, W)`` (left, top,
        right, bottom) resized bilinearly back to ``[H, W]``."""
        from jddp.data.image_ops import crop_resize

        images, labels = self.get_batch(indices)
        h, w = self.image_shape[:2]
        out = np.empty_like(images)
        for k in range(images.shape[0]):
            out[k] = crop_resize(images[k], boxes(k, h, w), (h, w))
        return out, labels

    def __repr__(self) -> str:
        """Stable description (no memory addresses)."""
        return (
            f"ArraySource(name={self.name!r}, n={len(self)}, image_shape={self.image_shape}, "
            f"dtype={self.images.dtype.name}, num_classes={self.num_classes})"
        )


class RecordSource:
    """A :class:`Source` over a random-access record source (e.g. a grain
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


# An iterable of batches is read whole into memory (batch k is sampled from all of it, the same on
# every topology and after a resume), so one that never ends would grow until the machine runs
# out: past this many bytes the read stops and the data is refused in one line.
ITERATOR_LIMIT_BYTES = 2 * 1024**3


def _nbytes(batch: Any) -> int:
    """Bytes held by the arrays of ``batch`` (a pytree of dicts, lists, tuples, arrays)."""
    if isinstance(batch, dict):
        return sum(_nbytes(v) for v in batch.values())
    if isinstance(batch, list | tuple):
        return sum(_nbytes(v) for v in batch)
    return int(getattr(batch, "nbytes", 0))


def _never_ends(data: Any) -> bool:
    """An iterator that says it never ends: ``itertools.cycle`` (how ``cycle(loader)`` is
    written) or an ``itertools.repeat`` without ``times``."""
    if isinstance(data, itertools.cycle):
        return True
    if isinstance(data, itertools.repeat):
        try:
            operator.length_hint(data)
        except TypeError:  # "len() of unsized object": repeat() without times
            return True
    return False


def read_batches(data: Iterable[Any], who: str, convert: Callable[[int, Any], Any]) -> list[Any]:
    """Every batch of ``data``, ``convert(i, batch)`` each, read into memory at once. An iterator
    that never ends is refused in one line (``DataConfigError`` naming ``who``): an
    ``itertools.cycle`` at once, any other after :data:`ITERATOR_LIMIT_BYTES` without an end."""
    limit = ITERATOR_LIMIT_BYTES
    limit_text = f"{limit / 1024**3:g} GiB" if limit >= 1024**3 else f"{limit / 1024**2:g} MiB"
    advice = (
        "jddp reads an iterator of batches once, whole, into memory, and draws every step's batch "
        "from all of it itself (train.steps sets how long it trains); pass one pass over the "
        "data (the loader itself), a list or arrays, or a random-access source (len + [i])"
    )
    if _never_ends(data):
        raise DataConfigError(f"{who}: itertools.{type(data).__name__} never ends; {advice}")
    batches, size = [], 0
    for i, batch in enumerate(data):
        batches.append(convert(i, batch))
        size += _nbytes(batches[-1])
        if size > limit:
            raise DataConfigError(
                f"{who}: the iterator gave more than {limit_text} ({i + 1} batches) without "
                f"ending (endless? a generator with while True, itertools.cycle); {advice}"
            )
    return batches


def _image_batch(i: int, batch: Any) -> tuple[np.ndarray, np.ndarray]:
    """One ``(images, labels)`` batch of an iterable as arrays."""
    images, labels = batch
    return np.asarray(images), np.asarray(labels)


def _is_batch_list(data: Any) -> bool:
    """A list/tuple of ``(images, labels)`` batches (labels ``[n]``), not of records."""
    if not isinstance(data, list | tuple) or not data:
        return False
    first = data[0]
    return isinstance(first, list | tuple) and len(first) == 2 and np.ndim(first[1]) == 1


def class_labels(labels: Any, who: str) -> np.ndarray:
    """``labels`` as int32 class indices ``[N]`` (``[N, 1]`` is taken as ``[N]``); float labels
    with a fractional part are an error (``ConfigError`` naming ``who``), not silently
    truncated, and so are other shapes (one-hot ``[N, K]``: the hint says what to pass)."""
    labels = np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1:
        one_hot = " (one-hot? pass labels.argmax(-1))" if labels.ndim == 2 else ""
        raise ConfigError(
            f"{who}: labels must be class indices of shape [N], got shape "
            f"{list(labels.shape)}{one_hot}; for other targets give a loss "
            "to jddp.fit (loss=..., a custom task)"
        )
    if labels.dtype.kind == "f":
        bad = labels[~np.isfinite(labels) | (labels != np.round(labels))]
        if bad.size:
            raise ConfigError(
                f"{who}: labels must be integer class indices, got float labels such as "
                f"{bad.flat[0]!r} ({bad.size} of {labels.size} are not whole numbers)"
            )
    return labels.astype(np.int32)


def pixel_images(images: Any, who: str) -> np.ndarray:
    """User images as a source holds them: ``[N, H, W, C]`` (``[N, H, W]`` gains C=1), uint8
    pixels 0..255 or float32 taken as already normalised.

    Integer images of any dtype are pixels, like uint8 ones: values in 0..255 become uint8 (the
    step scales and standardises them); other values, a boolean or non-numeric dtype, or another
    rank are a ``DataConfigError`` naming ``who`` (an int64 array is never read as normalised
    floats).
    """
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4:
        raise DataConfigError(
            f"{who}: expected images [N, H, W, C] or [N, H, W], got shape {list(images.shape)}"
        )
    if images.dtype == np.uint8:
        return images
    if np.issubdtype(images.dtype, np.integer):
        if images.size and (images.min() < 0 or images.max() > 255):
            raise DataConfigError(
                f"{who}: integer images are pixels 0..255, got {images.dtype} values in "
                f"[{images.min()}, {images.max()}]; pass uint8 pixels or normalised floats"
            )
        return images.astype(np.uint8)
    if np.issubdtype(images.dtype, np.floating):
        return images.astype(np.float32, copy=False)
    raise DataConfigError(
        f"{who}: images must be integer pixels 0..255 or floats, got dtype {images.dtype}"
    )


def check_label_range(labels: np.ndarray, num_classes: int, who: str) -> None:
    """Refuse labels outside ``[0, num_classes)`` (``DataConfigError`` naming ``who``, how many
    and the first one): the loss would be NaN, or silently wrong, for them."""
    labels = np.asarray(labels)
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if bad.size:
        first = int(bad[0])
        raise DataConfigError(
            f"{who}: {bad.size} of {labels.size} labels are outside [0, {num_classes}) (the "
            f"first at index {first}: {int(labels[first])}); labels are class indices "
            f"0..{num_classes - 1}"
        )


def as_source(
    data: Any,
    num_classes: int | None = None,
    name: str = "data",
    *,
    label: str | None = None,
    check_labels: bool = True,
) -> Source:
    """Turn user data into a :class:`Source`.

    Accepts ``(images, labels)`` numpy arrays (uint8 images are scaled to [0, 1], nothing
    else is changed), a ``Source`` (anything with ``get_batch``), a random-access record source
    (``len`` + ``[i]``, e.g. grain's), or an iterable (a list, a tuple, a generator) of
    ``(images, labels)`` batches, which is read once into memory and then sampled like arrays
    (an endless one is refused: :func:`read_batches`).
    Labels are class indices; float labels must be whole numbers. Errors name ``label``
    (default ``name``), e.g. ``train_data``. ``check_labels=False`` leaves the range of array
    labels to the caller (``jddp.evaluate`` checks them against the model's outputs).
    """
    who = label or name
    if hasattr(data, "get_batch"):
        return data
    pytree_inputs = (
        isinstance(data, tuple)
        and len(data) == 2
        and isinstance(data[0], dict | list | tuple)
        and hasattr(data[1], "shape")
    )
    if isinstance(data, dict) or pytree_inputs:
        what = (
            "a dict of arrays"
            if isinstance(data, dict)
            else (f"({type(data[0]).__name__} of arrays, labels)")
        )
        raise TypeError(
            f"{who}: {what} is a custom task's batch: give its loss (jddp.fit(loss=...), "
            "or train.loss=pkg.module:function on the command line); image classification "
            "takes (images, labels), images one array"
        )
    if isinstance(data, list | tuple) and not data:
        raise DataConfigError(f"{who}: no examples (an empty {type(data).__name__})")
    if isinstance(data, tuple) and len(data) == 2 and hasattr(data[0], "shape"):
        images, labels = np.asarray(data[0]), class_labels(data[1], who)
    elif hasattr(data, "__len__") and hasattr(data, "__getitem__") and not _is_batch_list(data):
        classes = num_classes or 1 + max(
            int(data[i][1] if not isinstance(data[i], dict) else data[i]["label"])
            for i in range(len(data))
        )
        return RecordSource(data, classes, name)
    elif isinstance(data, Iterable):
        batches = read_batches(data, who, _image_batch)
        images = np.concatenate([x for x, _ in batches])
        labels = class_labels(np.concatenate([y for _, y in batches]), who)
    else:
        raise TypeError(
            f"{who}: expected (images, labels) arrays, a Source, a random-access "
            f"record source or an iterable of batches, got {type(data).__name__}"
        )
    images = pixel_images(images, who)
    if not len(images):
        raise DataConfigError(f"{who}: no examples (0 images of shape {list(images.shape)})")
    channels = images.shape[-1]
    classes = num_classes or int(labels.max(initial=0)) + 1
    if check_labels:
        check_label_range(labels, classes, who)
    return ArraySource(
        images,
        labels,
        classes,
        mean=np.zeros(channels, np.float32),
        std=np.ones(channels, np.float32),
        name=name,
    )
