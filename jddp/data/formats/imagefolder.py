"""``imagefolder``: ``root/<split>/<class>/*.{png,jpg,jpeg}``, decoded lazily."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from jddp.data.augment import Box, square_box
from jddp.data.decode import decode_crop
from jddp.data.formats.common import require_path
from jddp.data.source import Splits, as_index_array
from jddp.errors import DataConfigError, DataError

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
"""Per-channel RGB mean of ImageNet (on [0, 1] pixels), used by :class:`ImageFolderSource`."""

IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
"""Per-channel RGB std of ImageNet (on [0, 1] pixels), used by :class:`ImageFolderSource`."""

IMAGE_EXTENSIONS: tuple[str, ...] = (".png", ".jpg", ".jpeg")
HINT = (
    "point it at a folder holding train/<class>/*.png|jpg|jpeg and "
    "val/<class>/... (or test/<class>/...)"
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
    ``get_batch`` decodes each image (:mod:`jddp.data.decode`: libjpeg-turbo, Pillow for
    what it does not read), center-crops it to a square and resizes it to ``image_size``:
    uint8 pixels, normalised on the device with the ImageNet ``mean``/``std``. ``get_crops``
    takes other crops (augmentation).
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
            raise DataError(f"imagefolder: {str(split_dir)!r} has no class sub-folders: {HINT}")
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
                f"imagefolder: no .png/.jpg/.jpeg files under {str(split_dir)!r}: {HINT}"
            )
        seen = set(labels)
        empty = [cls for label, cls in enumerate(self.classes) if label not in seen]
        if empty:  # a class the model would never see: a copy that went wrong, most likely
            raise DataError(
                f"imagefolder: {len(empty)} class folder(s) of {str(split_dir)!r} hold no "
                f".png/.jpg/.jpeg file, e.g. {str(split_dir / empty[0])!r}: fill or remove them"
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

    def __len__(self) -> int:
        """Number of image files in the split."""
        return len(self.files)

    def _decode(self, path: Path, box_of: Callable[[int, int], Box]) -> np.ndarray:
        """Decode one file to uint8 ``[S,S,3]``: the crop ``box_of(height, width)`` resized
        (:func:`jddp.data.decode.decode_crop`: libjpeg-turbo with DCT scaling for colour
        JPEGs, Pillow for everything else, one resize filter for both)."""
        return decode_crop(
            path, box_of, self.image_size, f"imagefolder: cannot decode image {str(path)!r}"
        )

    def get_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Decode the indexed files (centre square); uint8 ``[n,S,S,3]`` and int32 labels."""
        return self.get_crops(indices, lambda k, height, width: square_box(height, width))

    def get_crops(
        self, indices: np.ndarray, boxes: Callable[[int, int, int], Box]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Decode the indexed files; row ``k`` is the crop ``boxes(k, height, width)``."""
        idx = as_index_array(indices, len(self), "ImageFolderSource")
        out = np.empty((idx.shape[0], *self.image_shape), np.uint8)
        for k, i in enumerate(idx):
            out[k] = self._decode(self.files[i], functools.partial(boxes, k))
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
        raise DataConfigError(f"data.path={str(root)!r} does not exist: {HINT}")
    if not root.is_dir():
        raise DataConfigError(f"data.path={str(root)!r} is not a folder: {HINT}")
    if split == "eval":
        for candidate in ("val", "test"):
            if (root / candidate).is_dir():
                return candidate
        raise DataError(
            f"imagefolder: {str(root)!r} has neither val/ nor test/ for the eval split: {HINT}"
        )
    if split not in ("train", "val", "test"):
        raise DataError(f"imagefolder: split={split!r} must be one of train, val, test, eval")
    if not (root / split).is_dir():
        raise DataError(f"imagefolder: {str(root)!r} has no {split}/ folder: {HINT}")
    return split


def _imagefolder(path: str | None, image_size: int | None, num_classes: int | None) -> Splits:
    """``path/train/<class>/...`` and ``path/val`` (or ``test``), decoded lazily."""
    root = require_path("imagefolder", path, HINT)
    train = ImageFolderSource(root, image_size, "train", num_classes=num_classes)
    evaluation = ImageFolderSource(
        root, image_size, "eval", classes=train.classes, num_classes=train.num_classes
    )
    return Splits(train=train, eval=evaluation)


def load(path: str | None, image_size: int | None, seed: int, num_classes: int | None) -> Splits:
    """The train and val (or test) splits (``seed`` is ignored)."""
    del seed
    return _imagefolder(path, image_size, num_classes)
