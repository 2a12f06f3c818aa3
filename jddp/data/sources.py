"""Random-access labelled image sets ("sources") and the loaders that build them.

A :class:`Source` maps integer indices to a batch of normalized float32 images and
int32 labels.  :func:`load_splits` builds the train and eval sources of one data set
by name (see :data:`DATA_NAMES`).  Nothing here downloads: file-based data sets must
already be on disk, and every bad input raises :class:`DataError` with a one-line
message that names the data set or file and what was expected.

In-memory sources (:class:`ArraySource`) keep images in their compact native dtype
(uint8, or float32 for ``digits``) and convert on gather.  Their per-channel mean and
std are computed once from the train split and shared with the eval split.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jddp.errors import DataConfigError, DataError

__all__ = [
    "DATA_NAMES",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ArraySource",
    "DataError",
    "ImageFolderSource",
    "Source",
    "Splits",
    "channel_stats",
    "load_splits",
    "read_idx",
    "resize_images",
]

DATA_NAMES: tuple[str, ...] = ("synthetic", "digits", "cifar10", "mnist", "npz", "imagefolder")
"""The data set names :func:`load_splits` accepts."""

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
"""Per-channel RGB mean of ImageNet (on [0, 1] pixels), used by :class:`ImageFolderSource`."""

IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
"""Per-channel RGB std of ImageNet (on [0, 1] pixels), used by :class:`ImageFolderSource`."""

IMAGE_EXTENSIONS: tuple[str, ...] = (".png", ".jpg", ".jpeg")

SYNTHETIC_TRAIN_SIZE = 1024
SYNTHETIC_EVAL_SIZE = 256
DIGITS_EVAL_SIZE = 360

_CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR_TEST_FILE = "test_batch"
_CIFAR_ARCHIVE = "cifar-10-python.tar.gz"
_CIFAR_FOLDER = "cifar-10-batches-py"
_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
_NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")

_HINTS = {
    "cifar10": (
        f"put the CIFAR-10 python batches ({_CIFAR_ARCHIVE} from "
        "https://www.cs.toronto.edu/~kriz/cifar.html, extracted or not) there"
    ),
    "mnist": (
        "put the four MNIST IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte, "
        "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each optionally .gz) in that folder"
    ),
    "npz": "point it at one .npz file holding arrays x_train, y_train, x_test, y_test",
    "imagefolder": (
        "point it at a folder holding train/<class>/*.png|jpg|jpeg and "
        "val/<class>/... (or test/<class>/...)"
    ),
}

# IDX element type codes (third byte of the magic number) -> big-endian numpy dtype.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


@runtime_checkable
class Source(Protocol):
    """A random-access labelled image set."""

    num_classes: int
    image_shape: tuple[int, int, int]  # (H, W, C) of what get_batch returns

    def __len__(self) -> int:
        """Number of examples."""
        ...

    def get_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """images float32 [n,H,W,C] already normalized, labels int32 [n]."""
        ...

    def __repr__(self) -> str:
        """Stable description, no memory addresses (grain embeds it in its state)."""
        ...


@dataclass(frozen=True)
class Splits:
    """The train and eval sources of one data set."""

    train: Source
    eval: Source


# --------------------------------------------------------------------------- helpers


def _one_line(text: object) -> str:
    """Collapse ``text`` to a single line (exception texts may hold newlines)."""
    return " ".join(str(text).split())


def _as_index_array(indices: np.ndarray, n: int, who: str) -> np.ndarray:
    """Validate a 1-D integer index array for a source of ``n`` examples."""
    idx = np.asarray(indices)
    if idx.ndim != 1:
        raise ValueError(f"{who}.get_batch: indices must be 1-D, got shape {idx.shape}")
    if idx.size and not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"{who}.get_batch: indices must be integers, got dtype {idx.dtype}")
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IndexError(f"{who}.get_batch: index out of range for {n} examples")
    return idx.astype(np.intp, copy=False)


def _scale_shift(
    dtype: np.dtype, mean: np.ndarray, std: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel ``(scale, shift)`` so that ``x * scale + shift`` = ``(x/255 - mean)/std``."""
    pixel = 1.0 / 255.0 if dtype == np.uint8 else 1.0
    scale = (pixel / std).astype(np.float32)
    shift = (-mean / std).astype(np.float32)
    return scale, shift


def channel_stats(images: np.ndarray, chunk: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std (float32 ``[C]``) of ``images`` ``[N,H,W,C]``.

    uint8 images are measured on the ``[0, 1]`` scale (divided by 255), other dtypes as
    they are.  Sums are accumulated in float64 over chunks of ``chunk`` images, so the
    memory cost stays bounded.  A channel whose std is (nearly) zero gets std 1.
    """
    if images.ndim != 4 or images.shape[0] == 0:
        raise ValueError(f"channel_stats: expected non-empty [N,H,W,C], got {images.shape}")
    channels = images.shape[-1]
    total = np.zeros(channels, np.float64)
    total_sq = np.zeros(channels, np.float64)
    for start in range(0, images.shape[0], chunk):
        block = images[start : start + chunk].reshape(-1, channels).astype(np.float64)
        total += block.sum(axis=0)
        total_sq += np.square(block).sum(axis=0)
    count = images.shape[0] * images.shape[1] * images.shape[2]
    mean = total / count
    var = np.maximum(total_sq / count - np.square(mean), 0.0)
    std = np.sqrt(var)
    if images.dtype == np.uint8:
        mean, std = mean / 255.0, std / 255.0
    std = np.where(std < 1e-6, 1.0, std)
    return mean.astype(np.float32), std.astype(np.float32)


def _bilinear_weights(n_in: int, n_out: int) -> np.ndarray:
    """``[n_out, n_in]`` resampling matrix of a triangle (bilinear) filter.

    Pixel centers are aligned (half-pixel convention) and, when shrinking, the filter
    is widened by the scale factor so it averages (antialiases) like Pillow's
    ``BILINEAR``; rows are normalized so a constant image stays constant.
    """
    scale = n_in / n_out
    support = max(scale, 1.0)
    centers = (np.arange(n_out, dtype=np.float64) + 0.5) * scale
    positions = np.arange(n_in, dtype=np.float64) + 0.5
    weights = np.maximum(0.0, 1.0 - np.abs(positions[None, :] - centers[:, None]) / support)
    weights /= weights.sum(axis=1, keepdims=True)
    return weights


def resize_images(images: np.ndarray, size: int, chunk_bytes: int = 1 << 26) -> np.ndarray:
    """Resize ``images`` ``[N,H,W,C]`` to ``[N,size,size,C]`` bilinearly, keeping the dtype.

    Matches Pillow's ``BILINEAR`` resize (antialiased when shrinking); uint8 results are
    rounded.  Work is done in chunks of about ``chunk_bytes`` of float32 output.  The
    input is returned unchanged when it already has the requested size.
    """
    if images.ndim != 4:
        raise ValueError(f"resize_images: expected [N,H,W,C], got shape {images.shape}")
    n, h, w, c = images.shape
    if (h, w) == (size, size):
        return images
    rows = _bilinear_weights(h, size).astype(np.float32)
    cols = _bilinear_weights(w, size).astype(np.float32)
    out = np.empty((n, size, size, c), images.dtype)
    per_image = max(size * max(size, w) * c * 4, 1)
    step = max(1, chunk_bytes // per_image)
    for start in range(0, n, step):
        block = images[start : start + step].astype(np.float32)
        block = np.einsum("oh,nhwc->nowc", rows, block, optimize=True)
        block = np.einsum("pw,nowc->nopc", cols, block, optimize=True)
        if images.dtype == np.uint8:
            block = np.clip(np.rint(block), 0, 255)
        out[start : start + step] = block
    return out


# --------------------------------------------------------------------------- sources


class ArraySource:
    """An in-memory :class:`Source` over images kept in their compact native dtype.

    Args:
      images: ``[N,H,W,C]`` uint8 (pixels 0..255) or float32 array.
      labels: ``[N]`` integer labels in ``[0, num_classes)``.
      num_classes: number of classes.
      mean: per-channel mean (``[C]``) on the ``[0, 1]`` scale for uint8 images.
      std: per-channel std (``[C]``), same scale as ``mean``.
      name: short stable name used in ``repr`` (e.g. ``"cifar10/train"``).

    ``get_batch`` gathers with one numpy fancy-indexing op, converts to float32
    (dividing uint8 by 255) and standardizes: ``(x - mean) / std``.
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
        self._scale, self._shift = _scale_shift(images.dtype, mean_arr, std_arr)

    def __len__(self) -> int:
        """Number of examples."""
        return int(self.images.shape[0])

    def get_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return normalized float32 images ``[n,H,W,C]`` and int32 labels ``[n]``."""
        idx = _as_index_array(indices, len(self), "ArraySource")
        images = self.images[idx].astype(np.float32)
        images *= self._scale
        images += self._shift
        return images, self.labels[idx]

    def __repr__(self) -> str:
        """Stable description (no memory addresses)."""
        return (
            f"ArraySource(name={self.name!r}, n={len(self)}, image_shape={self.image_shape}, "
            f"dtype={self.images.dtype.name}, num_classes={self.num_classes})"
        )


def _find_images(folder: Path) -> list[Path]:
    """All image files under ``folder`` (recursive), sorted by relative path."""
    files = [p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def _describe_class_diff(a: Sequence[str], b: Sequence[str], limit: int = 5) -> str:
    """Short text naming classes only in ``a`` and only in ``b``."""

    def short(items: list[str]) -> str:
        shown = ", ".join(items[:limit])
        return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")

    only_a = sorted(set(a) - set(b))
    only_b = sorted(set(b) - set(a))
    parts = []
    if only_a:
        parts.append(f"only in train: [{short(only_a)}]")
    if only_b:
        parts.append(f"only in eval: [{short(only_b)}]")
    return "; ".join(parts) if parts else "same classes, different order"


class ImageFolderSource:
    """A :class:`Source` over ``root/<split>/<class>/*.{png,jpg,jpeg}``, decoded lazily.

    Args:
      root: data set folder holding ``train/`` and ``val/`` (or ``test/``).
      image_size: output side length; ``None`` means 224.
      split: ``"train"``, ``"val"``, ``"test"``, or ``"eval"`` (``val`` if present, else
        ``test``).
      classes: if given, the class list this split must have (the train split's),
        else :class:`DataError` naming both folders.
      num_classes: if given, must be at least the number of classes.

    Classes are the sub-folder names sorted; files are found recursively and sorted.
    ``get_batch`` opens each image with Pillow, converts it to RGB, center-crops it to a
    square, resizes it (bilinear) to ``image_size`` and standardizes it with the
    ImageNet mean/std.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        image_size: int | None = None,
        split: str = "train",
        classes: Sequence[str] | None = None,
        num_classes: int | None = None,
    ) -> None:
        """Scan the split folder; no image is decoded here."""
        self.root = Path(root)
        self.image_size = 224 if image_size is None else int(image_size)
        if self.image_size <= 0:
            raise DataError(f"imagefolder: image_size={image_size} must be positive")
        self.split = _resolve_split_folder(self.root, split)
        split_dir = self.root / self.split
        self.classes: list[str] = sorted(p.name for p in split_dir.iterdir() if p.is_dir())
        if not self.classes:
            raise DataError(
                f"imagefolder: {str(split_dir)!r} has no class sub-folders: {_HINTS['imagefolder']}"
            )
        if classes is not None and list(classes) != self.classes:
            raise DataError(
                f"imagefolder: the classes of {str(split_dir)!r} ({len(self.classes)}) differ "
                f"from the train classes of {str(self.root / 'train')!r} ({len(classes)}): "
                f"{_describe_class_diff(list(classes), self.classes)}"
            )
        files: list[Path] = []
        labels: list[int] = []
        for label, cls in enumerate(self.classes):
            found = _find_images(split_dir / cls)
            files.extend(found)
            labels.extend([label] * len(found))
        if not files:
            raise DataError(
                f"imagefolder: no .png/.jpg/.jpeg files under {str(split_dir)!r}: "
                f"{_HINTS['imagefolder']}"
            )
        self.files = files
        self.labels = np.asarray(labels, np.int32)
        if num_classes is not None and num_classes < len(self.classes):
            raise DataConfigError(
                f"imagefolder: {str(split_dir)!r} has {len(self.classes)} classes (largest label "
                f"{len(self.classes) - 1}) but model.num_classes={num_classes}"
            )
        self.num_classes = len(self.classes) if num_classes is None else int(num_classes)
        self.image_shape: tuple[int, int, int] = (self.image_size, self.image_size, 3)
        self.mean = np.asarray(IMAGENET_MEAN, np.float32)
        self.std = np.asarray(IMAGENET_STD, np.float32)
        self._scale, self._shift = _scale_shift(np.dtype(np.uint8), self.mean, self.std)

    def __len__(self) -> int:
        """Number of image files in the split."""
        return len(self.files)

    def _decode(self, path: Path) -> np.ndarray:
        """Decode one file to a uint8 ``[S,S,3]`` array (RGB, center crop, resize)."""
        from PIL import Image

        size = self.image_size
        try:
            with Image.open(path) as img:
                img.draft("RGB", (size, size))  # JPEG: decode at a reduced scale >= size
                img = img.convert("RGB")
                w, h = img.size
                side = min(w, h)
                left, top = (w - side) // 2, (h - side) // 2
                img = img.resize(
                    (size, size),
                    Image.Resampling.BILINEAR,
                    box=(left, top, left + side, top + side),
                )
                return np.asarray(img, np.uint8)
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
            raise DataError(
                f"imagefolder: cannot decode image {str(path)!r}: {_one_line(err)}"
            ) from err

    def get_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Decode the indexed files; return float32 ``[n,S,S,3]`` images and int32 labels."""
        idx = _as_index_array(indices, len(self), "ImageFolderSource")
        out = np.empty((idx.shape[0], *self.image_shape), np.float32)
        for k, i in enumerate(idx):
            out[k] = self._decode(self.files[i])
        out *= self._scale
        out += self._shift
        return out, self.labels[idx]

    def __repr__(self) -> str:
        """Stable description (no memory addresses)."""
        return (
            f"ImageFolderSource(root={str(self.root)!r}, split={self.split!r}, n={len(self)}, "
            f"image_size={self.image_size}, num_classes={self.num_classes})"
        )


def _resolve_split_folder(root: Path, split: str) -> str:
    """Name of the split sub-folder of an image-folder root (``eval`` = val, else test)."""
    if not root.exists():
        raise DataConfigError(f"data.path={str(root)!r} does not exist: {_HINTS['imagefolder']}")
    if not root.is_dir():
        raise DataConfigError(f"data.path={str(root)!r} is not a folder: {_HINTS['imagefolder']}")
    if split == "eval":
        for candidate in ("val", "test"):
            if (root / candidate).is_dir():
                return candidate
        raise DataError(
            f"imagefolder: {str(root)!r} has neither val/ nor test/ for the eval split: "
            f"{_HINTS['imagefolder']}"
        )
    if split not in ("train", "val", "test"):
        raise DataError(f"imagefolder: split={split!r} must be one of train, val, test, eval")
    if not (root / split).is_dir():
        raise DataError(
            f"imagefolder: {str(root)!r} has no {split}/ folder: {_HINTS['imagefolder']}"
        )
    return split


# --------------------------------------------------------------------------- shared checks


def _check_labels(
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


def _to_int_labels(name: str, labels: np.ndarray, where: str) -> np.ndarray:
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


def _make_splits(
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
    _check_labels(name, y_train, classes, where_train, limit_name)
    _check_labels(name, y_test, classes, where_test, limit_name)
    if image_size is not None:
        x_train = resize_images(x_train, image_size)
        x_test = resize_images(x_test, image_size)
    mean, std = channel_stats(x_train)
    return Splits(
        train=ArraySource(x_train, y_train, classes, mean, std, f"{name}/train"),
        eval=ArraySource(x_test, y_test, classes, mean, std, f"{name}/eval"),
    )


def _require_path(name: str, path: str | os.PathLike[str] | None) -> Path:
    """Resolve ``data.path`` for a file-based data set; it must exist."""
    if path is None or str(path) == "":
        raise DataConfigError(f"data.path is required for data.name={name!r}: {_HINTS[name]}")
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise DataConfigError(f"data.path={str(path)!r} does not exist: {_HINTS[name]}")
    return resolved


# --------------------------------------------------------------------------- synthetic


def _synthetic(image_size: int | None, seed: int, num_classes: int | None) -> Splits:
    """Deterministic random images with labels that a linear model can learn.

    Rule: draw a fixed random projection ``W`` (``[g*g*3, K]``, standard normal) from
    ``seed``.  Each image is a random ``g x g x 3`` uint8 latent grid ``z`` (``g =
    min(4, size)``) upsampled by pixel replication to ``size x size``, plus independent
    pixel noise in ``[-16, 16]`` (clipped to 0..255).  Its label is
    ``argmax_k ((z / 255 - 0.5).ravel() @ W)[k]``.  Block means of the image recover
    ``z`` up to small noise, so the label is (nearly) a linear function of the pixels.
    """
    size = 32 if image_size is None else image_size
    classes = 10 if num_classes is None else num_classes
    grid = min(4, size)
    rng = np.random.default_rng(seed)
    projection = rng.standard_normal((grid * grid * 3, classes))
    pixel_to_cell = (np.arange(size) * grid) // size

    def make(n: int) -> tuple[np.ndarray, np.ndarray]:
        images = np.empty((n, size, size, 3), np.uint8)
        labels = np.empty(n, np.int32)
        for start in range(0, n, 128):
            m = min(128, n - start)
            latent = rng.integers(0, 256, (m, grid, grid, 3), dtype=np.uint8)
            up = latent[:, pixel_to_cell][:, :, pixel_to_cell].astype(np.int16)
            up += rng.integers(-16, 17, up.shape, dtype=np.int16)
            images[start : start + m] = np.clip(up, 0, 255)
            scores = (latent.reshape(m, -1) / 255.0 - 0.5) @ projection
            labels[start : start + m] = np.argmax(scores, axis=1)
        return images, labels

    x_train, y_train = make(SYNTHETIC_TRAIN_SIZE)
    x_test, y_test = make(SYNTHETIC_EVAL_SIZE)
    where = f"(seed={seed})"
    return _make_splits(
        "synthetic",
        (x_train, y_train, "train " + where),
        (x_test, y_test, "eval " + where),
        None,
        None,
        classes,
    )


# --------------------------------------------------------------------------- digits


def _stratified_eval_mask(labels: np.ndarray, eval_size: int) -> np.ndarray:
    """Deterministic stratified split: boolean mask of the eval examples (no RNG).

    Each class gets ``eval_size * n_c / N`` eval slots (largest remainder rounding),
    taken at evenly spaced positions among that class's examples in file order.
    """
    classes, counts = np.unique(labels, return_counts=True)
    exact = eval_size * counts / labels.shape[0]
    quota = np.floor(exact).astype(int)
    for j in np.argsort(-(exact - quota), kind="stable")[: eval_size - quota.sum()]:
        quota[j] += 1
    mask = np.zeros(labels.shape[0], bool)
    for cls, count, take in zip(classes, counts, quota, strict=True):
        members = np.flatnonzero(labels == cls)
        picks = ((np.arange(take) + 0.5) * count / max(take, 1)).astype(int)
        mask[members[picks]] = True
    return mask


def _digits(image_size: int | None, num_classes: int | None) -> Splits:
    """scikit-learn's 8x8 digits: float32 [0,1] images (8,8,1), fixed 1437/360 split."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (np.asarray(bunch.images, np.float64) / 16.0).astype(np.float32)[..., None]
    labels = np.asarray(bunch.target, np.int32)
    mask = _stratified_eval_mask(labels, DIGITS_EVAL_SIZE)
    where = "sklearn load_digits()"
    return _make_splits(
        "digits",
        (images[~mask], labels[~mask], where + " train"),
        (images[mask], labels[mask], where + " eval"),
        image_size,
        num_classes,
        10,
    )


# --------------------------------------------------------------------------- cifar10


_PICKLE_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


class _ArrayUnpickler(pickle.Unpickler):
    """An unpickler that only builds plain containers and numpy arrays (no code)."""

    def find_class(self, module: str, name: str) -> Any:
        """Allow only the numpy array reconstruction helpers."""
        if (module, name) in _PICKLE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def _parse_cifar_batch(raw: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Decode one CIFAR-10 python batch into uint8 HWC images and int32 labels."""
    try:
        batch = _ArrayUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as err:  # any unpickling failure means a bad file
        raise DataError(
            f"cifar10: {where} is not a readable CIFAR-10 python batch: {_one_line(err)}"
        ) from err
    if not isinstance(batch, dict):
        raise DataError(f"cifar10: {where} holds a {type(batch).__name__}, expected a dict")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if data is None or labels is None:
        keys = sorted(str(k) for k in batch)
        raise DataError(f"cifar10: {where} has keys {keys} but needs b'data' and b'labels'")
    data = np.asarray(data)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.dtype != np.uint8:
        raise DataError(
            f"cifar10: {where} b'data' is {data.dtype} {data.shape}, expected uint8 [N, 3072]"
        )
    labels = _to_int_labels("cifar10", np.asarray(labels), f"{where} b'labels'")
    if labels.shape[0] != data.shape[0]:
        raise DataError(f"cifar10: {where} has {data.shape[0]} images but {labels.shape[0]} labels")
    images = np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    return images, labels


def _read_cifar_tar(archive: Path) -> dict[str, bytes]:
    """Read the CIFAR-10 batch members straight out of a tarball (one pass, no extraction)."""
    wanted = {*_CIFAR_TRAIN_FILES, _CIFAR_TEST_FILE}
    found: dict[str, bytes] = {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                base = member.name.rsplit("/", 1)[-1]
                if member.isfile() and base in wanted and base not in found:
                    handle = tar.extractfile(member)
                    if handle is not None:
                        found[base] = handle.read()
    except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
        raise DataError(
            f"cifar10: {str(archive)!r} is not a readable tar archive: {_one_line(err)}"
        ) from err
    missing = [f for f in (*_CIFAR_TRAIN_FILES, _CIFAR_TEST_FILE) if f not in found]
    if missing:
        raise DataError(
            f"cifar10: archive {str(archive)!r} lacks {', '.join(missing)}: {_HINTS['cifar10']}"
        )
    return found


def _cifar10(path: str | None, image_size: int | None, num_classes: int | None) -> Splits:
    """CIFAR-10 from the python batches: a folder, its parent, or the .tar.gz itself."""
    root = _require_path("cifar10", path)
    names = (*_CIFAR_TRAIN_FILES, _CIFAR_TEST_FILE)
    if root.is_file():
        if not tarfile.is_tarfile(root):
            raise DataConfigError(
                f"data.path={str(path)!r} is a file but not a tar archive: {_HINTS['cifar10']}"
            )
        blobs = _read_cifar_tar(root)
        label = f"{str(root)!r}:"
        wheres = {n: f"{label}{n}" for n in names}
    else:
        folder = root
        if not (folder / "data_batch_1").exists() and not (folder / _CIFAR_TEST_FILE).exists():
            if (root / _CIFAR_FOLDER).is_dir():
                folder = root / _CIFAR_FOLDER
            elif (root / _CIFAR_ARCHIVE).is_file():
                return _cifar10(str(root / _CIFAR_ARCHIVE), image_size, num_classes)
            else:
                raise DataConfigError(
                    f"data.path={str(path)!r} holds neither data_batch_1..5/test_batch, "
                    f"{_CIFAR_FOLDER}/ nor {_CIFAR_ARCHIVE}: {_HINTS['cifar10']}"
                )
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise DataError(
                f"cifar10: {str(folder)!r} lacks {', '.join(missing)}: {_HINTS['cifar10']}"
            )
        blobs = {n: (folder / n).read_bytes() for n in names}
        wheres = {n: repr(str(folder / n)) for n in names}
    train_parts = [_parse_cifar_batch(blobs[n], wheres[n]) for n in _CIFAR_TRAIN_FILES]
    x_test, y_test = _parse_cifar_batch(blobs[_CIFAR_TEST_FILE], wheres[_CIFAR_TEST_FILE])
    x_train = np.concatenate([p[0] for p in train_parts])
    y_train = np.concatenate([p[1] for p in train_parts])
    for n, (_, labels) in zip(_CIFAR_TRAIN_FILES, train_parts, strict=True):
        _check_labels(
            "cifar10",
            labels,
            10 if num_classes is None else num_classes,
            wheres[n],
            "model.num_classes" if num_classes is not None else "cifar10 num_classes",
        )
    return _make_splits(
        "cifar10",
        (x_train, y_train, "data_batch_1..5"),
        (x_test, y_test, wheres[_CIFAR_TEST_FILE]),
        image_size,
        num_classes,
        10,
    )


# --------------------------------------------------------------------------- mnist / IDX


def read_idx(path: str | os.PathLike[str], item_name: str = "items") -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed, by a ``.gz`` suffix) into an array.

    The header is a big-endian magic number ``0x0000TTDD`` (``TT`` the element type:
    0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64; ``DD``
    the number of dimensions) followed by one uint32 per dimension.  The payload must
    hold exactly the product of the dimensions; otherwise :class:`DataError` names the
    file and what is wrong (``item_name`` names the first-axis items in that message,
    e.g. ``"images"``).  Multi-byte types are returned in native byte order.
    """
    path = Path(path)
    where = repr(str(path))
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as handle:
                raw = handle.read()
        else:
            raw = path.read_bytes()
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"IDX file {where} cannot be read: {_one_line(err)}") from err
    if len(raw) < 4:
        raise DataError(f"IDX file {where} holds {len(raw)} bytes, too few for an IDX header")
    zero, type_code, ndim = struct.unpack(">HBB", raw[:4])
    magic = struct.unpack(">I", raw[:4])[0]
    if zero != 0 or type_code not in _IDX_DTYPES or ndim == 0:
        raise DataError(
            f"IDX file {where} has magic number 0x{magic:08X}, not an IDX header "
            "(0x0000TTDD with TT an element type code and DD the number of dimensions)"
        )
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise DataError(
            f"IDX file {where} is truncated: its header needs {header_len} bytes for "
            f"{ndim} dims but the file holds {len(raw)}"
        )
    dims = struct.unpack(f">{ndim}I", raw[4:header_len])
    dtype = _IDX_DTYPES[type_code]
    item_bytes = int(np.prod(dims[1:], dtype=np.int64)) * dtype.itemsize
    payload = len(raw) - header_len
    expected = dims[0] * item_bytes
    if payload != expected:
        held = payload // item_bytes if item_bytes else 0
        shape = "x".join(str(d) for d in dims[1:])
        what = f"{item_name} of {shape}" if shape else item_name
        if payload < expected:
            raise DataError(
                f"IDX file {where} is truncated: its header says {dims[0]} {what} but it "
                f"holds {held}"
            )
        raise DataError(
            f"IDX file {where} has {payload - expected} extra bytes after the {dims[0]} {what} "
            "its header announces"
        )
    array = np.frombuffer(raw, dtype, offset=header_len).reshape(dims)
    return array.astype(dtype.newbyteorder("="), copy=True)


def _find_mnist_file(folder: Path, base: str) -> Path:
    """``folder/base`` or ``folder/base.gz``, whichever exists."""
    for candidate in (folder / base, folder / f"{base}.gz"):
        if candidate.is_file():
            return candidate
    raise DataError(f"mnist: {str(folder)!r} has neither {base} nor {base}.gz: {_HINTS['mnist']}")


def _read_mnist_file(path: Path, kind: str) -> np.ndarray:
    """Read an MNIST IDX file and check it is uint8 with 3 dims (images) or 1 (labels)."""
    array = read_idx(path, kind)
    ndim, magic = (3, 0x00000803) if kind == "images" else (1, 0x00000801)
    if array.dtype != np.uint8 or array.ndim != ndim:
        raise DataError(
            f"mnist: {str(path)!r} is a {array.ndim}-D {array.dtype} IDX array but an MNIST "
            f"{kind} file has magic number 0x{magic:08X} (uint8, {ndim} dims)"
        )
    return array


def _mnist(path: str | None, image_size: int | None, num_classes: int | None) -> Splits:
    """MNIST-format IDX files (plain or .gz) in one folder: uint8 images (28,28,1)."""
    folder = _require_path("mnist", path)
    if not folder.is_dir():
        raise DataConfigError(f"data.path={str(path)!r} is not a folder: {_HINTS['mnist']}")
    files = {key: _find_mnist_file(folder, base) for key, base in _MNIST_FILES.items()}
    x_train = _read_mnist_file(files["train_images"], "images")[..., None]
    y_train = _read_mnist_file(files["train_labels"], "labels").astype(np.int32)
    x_test = _read_mnist_file(files["test_images"], "images")[..., None]
    y_test = _read_mnist_file(files["test_labels"], "labels").astype(np.int32)
    for x, y, xf, yf in (
        (x_train, y_train, files["train_images"], files["train_labels"]),
        (x_test, y_test, files["test_images"], files["test_labels"]),
    ):
        if x.shape[0] != y.shape[0]:
            raise DataError(
                f"mnist: {str(xf)!r} holds {x.shape[0]} images but {str(yf)!r} holds "
                f"{y.shape[0]} labels"
            )
    return _make_splits(
        "mnist",
        (x_train, y_train, repr(str(files["train_labels"]))),
        (x_test, y_test, repr(str(files["test_labels"]))),
        image_size,
        num_classes,
        10,
    )


# --------------------------------------------------------------------------- npz


def _npz_images(array: np.ndarray, where: str) -> np.ndarray:
    """Images from an npz array: [N,H,W] or [N,H,W,C]; uint8 kept, floats to float32."""
    if array.ndim == 3:
        array = array[..., None]
    if array.ndim != 4:
        raise DataError(f"npz: {where} has shape {array.shape}, expected [N,H,W] or [N,H,W,C]")
    if array.dtype == np.uint8:
        return array
    if np.issubdtype(array.dtype, np.floating):
        return array.astype(np.float32, copy=False)
    if np.issubdtype(array.dtype, np.integer) and array.dtype != np.bool_:
        if array.size and (array.min() < 0 or array.max() > 255):
            raise DataError(
                f"npz: {where} is {array.dtype} with values outside 0..255; expected uint8 "
                "pixels or floats"
            )
        return array.astype(np.uint8)
    raise DataError(f"npz: {where} has dtype {array.dtype}, expected uint8 or float images")


def _npz(path: str | None, image_size: int | None, num_classes: int | None) -> Splits:
    """One .npz with x_train, y_train, x_test, y_test; num_classes = max label + 1."""
    file = _require_path("npz", path)
    where = repr(str(file))
    if not file.is_file():
        raise DataConfigError(f"data.path={str(path)!r} is not a file: {_HINTS['npz']}")
    try:
        loaded = np.load(file, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise DataError(f"npz: {where} holds a single array, not an .npz: {_HINTS['npz']}")
        with loaded as archive:
            missing = [k for k in _NPZ_KEYS if k not in archive.files]
            if missing:
                raise DataError(
                    f"npz: {where} has arrays {sorted(archive.files)} but lacks "
                    f"{', '.join(missing)}: {_HINTS['npz']}"
                )
            arrays = {k: archive[k] for k in _NPZ_KEYS}
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zlib.error, zipfile.BadZipFile) as err:
        raise DataError(f"npz: {where} cannot be read as .npz: {_one_line(err)}") from err
    x_train = _npz_images(arrays["x_train"], f"{where} x_train")
    x_test = _npz_images(arrays["x_test"], f"{where} x_test")
    y_train = _to_int_labels("npz", arrays["y_train"], f"{where} y_train")
    y_test = _to_int_labels("npz", arrays["y_test"], f"{where} y_test")
    return _make_splits(
        "npz",
        (x_train, y_train, f"{where} x_train/y_train"),
        (x_test, y_test, f"{where} x_test/y_test"),
        image_size,
        num_classes,
        None,
    )


# --------------------------------------------------------------------------- imagefolder


def _imagefolder(path: str | None, image_size: int | None, num_classes: int | None) -> Splits:
    """``path/train/<class>/...`` and ``path/val`` (or ``test``), decoded lazily."""
    root = _require_path("imagefolder", path)
    train = ImageFolderSource(root, image_size, "train", num_classes=num_classes)
    evaluation = ImageFolderSource(
        root, image_size, "eval", classes=train.classes, num_classes=train.num_classes
    )
    return Splits(train=train, eval=evaluation)


# --------------------------------------------------------------------------- entry point


def load_splits(
    name: str,
    path: str | None,
    image_size: int | None,
    seed: int = 0,
    num_classes: int | None = None,
) -> Splits:
    """Build the train and eval :class:`Source` of data set ``name``.

    Args:
      name: one of :data:`DATA_NAMES`.
      path: where the files are (``cifar10``, ``mnist``, ``npz``, ``imagefolder``);
        ignored by ``synthetic`` and ``digits``.
      image_size: output side length; ``None`` keeps the native size (224 for
        ``imagefolder``, 32 for ``synthetic``).  In-memory sets are resized once at
        load time (bilinear, dtype kept; non-square images become square).
      seed: only ``synthetic`` uses it; every other split is fixed.
      num_classes: override the class count; labels must be below it.

    Raises:
      DataError: with a one-line message naming the data set/file and what is expected.
    """
    if name not in DATA_NAMES:
        raise DataError(f"unknown data.name={name!r}: expected one of {', '.join(DATA_NAMES)}")
    if image_size is not None and (
        isinstance(image_size, bool)
        or not isinstance(image_size, int | np.integer)
        or image_size <= 0
    ):
        raise DataError(f"data.image_size={image_size!r} must be a positive int or None")
    if num_classes is not None and (
        isinstance(num_classes, bool)
        or not isinstance(num_classes, int | np.integer)
        or num_classes <= 0
    ):
        raise DataConfigError(f"model.num_classes={num_classes!r} must be a positive int or None")
    image_size = None if image_size is None else int(image_size)
    num_classes = None if num_classes is None else int(num_classes)
    loaders: dict[str, Callable[[], Splits]] = {
        "synthetic": lambda: _synthetic(image_size, seed, num_classes),
        "digits": lambda: _digits(image_size, num_classes),
        "cifar10": lambda: _cifar10(path, image_size, num_classes),
        "mnist": lambda: _mnist(path, image_size, num_classes),
        "npz": lambda: _npz(path, image_size, num_classes),
        "imagefolder": lambda: _imagefolder(path, image_size, num_classes),
    }
    return loaders[name]()
