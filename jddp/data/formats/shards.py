"""What the shard formats share (``parquet``, ``webdataset``): finding the shard files of each
split from a path, a glob or a brace pattern, and the labelled-image source over encoded images
read by example index.

A shard format reads example ``i`` of a split by index (random access), never as a stream, so
jddp's guarantee holds for it as for every format: global batch *k* is the same examples on any
topology and after a resume.
"""

from __future__ import annotations

import functools
import glob
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from jddp.data.augment import Box, square_box
from jddp.data.decode import decode_crop
from jddp.data.formats.imagefolder import IMAGENET_MEAN, IMAGENET_STD
from jddp.data.source import as_index_array
from jddp.errors import DataConfigError, DataError

EVAL_SPLIT_NAMES: tuple[str, ...] = ("validation", "valid", "val", "test")
"""Split names of eval shards, in order of preference (the Hugging Face Hub writes
``validation-*``; timm's WebDataset ImageNet ``imagenet-val-*``)."""

_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_CHOICE = re.compile(r"\{([^{}]*,[^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """``shards-{000000..000146}.tar`` -> 147 names (zero padding kept), ``{a,b}`` -> two;
    several groups multiply, left to right as the shell expands them. Without braces:
    ``[pattern]``."""
    found = [m for m in (_RANGE.search(pattern), _CHOICE.search(pattern)) if m]
    if not found:
        return [pattern]
    match = min(found, key=lambda m: m.start())
    head, tail = pattern[: match.start()], pattern[match.end() :]
    if match.re is _RANGE:
        first, last = match.group(1), match.group(2)
        width = len(first) if first.startswith("0") or len(first) == len(last) else 0
        lo, hi = int(first), int(last)
        step = 1 if hi >= lo else -1
        parts = [f"{i:0{width}d}" for i in range(lo, hi + step, step)]
    else:
        parts = match.group(1).split(",")
    return [name for part in parts for name in expand_braces(head + part + tail)]


def find_files(pattern: str, suffixes: tuple[str, ...], key: str, hint: str) -> list[Path]:
    """The files ``pattern`` names: a folder (its files ending in ``suffixes``, recursively),
    one file, a glob or a brace pattern (every file it expands to must exist). Sorted by path;
    none is a :class:`DataConfigError` naming ``key``."""
    expanded = os.path.expanduser(pattern)
    root = Path(expanded)
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(suffixes))
        if not files:
            raise DataConfigError(
                f"{key}={pattern!r} is a folder without {'/'.join(suffixes)} files: {hint}"
            )
        return files
    files = []
    for name in expand_braces(expanded):
        if glob.has_magic(name):
            files.extend(Path(p) for p in glob.glob(name, recursive=True) if Path(p).is_file())
        elif Path(name).is_file():
            files.append(Path(name))
        elif "{" in pattern:  # a brace range names each shard: one missing is a lost shard
            raise DataConfigError(f"{key}={pattern!r} names {name!r}, which does not exist")
    if not files:
        raise DataConfigError(f"{key}={pattern!r} matches no file: {hint}")
    return sorted(set(files))


def split_of(path: Path) -> str | None:
    """``"train"``, ``"eval"`` or None from a shard's name as the Hub and timm write them:
    ``train-00000-of-00004.parquet``, ``data/validation-...``, ``imagenet-val-000000.tar``,
    ``train/0000.parquet`` (the split as a folder name)."""
    named = split_name(path)
    return None if named is None else "train" if named == "train" else "eval"


def split_name(path: Path) -> str | None:
    """The split a shard's name gives: ``train``, one of :data:`EVAL_SPLIT_NAMES`, or None."""
    words = [
        w for part in (path.name, path.parent.name) for w in re.split(r"[^a-z]+", part.lower())
    ]
    if "train" in words:
        return "train"
    return next((name for name in EVAL_SPLIT_NAMES if name in words), None)


def split_files(
    name: str, path: str | None, eval_path: str | None, suffixes: tuple[str, ...], hint: str
) -> tuple[list[Path], list[Path] | None]:
    """The train and eval shards: ``data.eval_path`` names the eval ones if given, else the
    shards of ``data.path`` are split by their names (:func:`split_of`); None for eval when
    no shard is named as a split (one unnamed set: the caller evaluates the train shards).
    Train shards without eval shards are refused, as an image folder without ``val/`` is."""
    if path is None or str(path) == "":
        raise DataConfigError(f"data.path is required for data.name={name!r}: {hint}")
    files = find_files(str(path), suffixes, "data.path", hint)
    if eval_path:  # those, and data.path's train split (all of it when nothing is named so)
        evals = find_files(str(eval_path), suffixes, "data.eval_path", hint)
        rest = [f for f in files if f not in set(evals)]
        named_train = [f for f in rest if split_of(f) == "train"]
        return named_train or rest, evals
    by_split: dict[str | None, list[Path]] = {}
    for file in files:
        by_split.setdefault(split_of(file), []).append(file)
    if "train" not in by_split and "eval" not in by_split:
        return files, None  # one unnamed set: trained on and evaluated
    if "train" not in by_split:
        raise DataConfigError(
            f"data.path={path!r}: no shard is named as a train split (train-*, */train/*; found "
            f"{files[0].name!r}...): name them so, or give the eval shards as data.eval_path"
        )
    if "eval" not in by_split and None not in by_split:  # as an image folder without val/
        raise DataConfigError(
            f"data.path={path!r}: only train shards (train-*): no eval split "
            f"({', '.join(f'{n}-*' for n in EVAL_SPLIT_NAMES)}) to evaluate on; give the eval "
            "shards as data.eval_path (python -m jddp.pack: a SRC pattern that takes them "
            "too, e.g. 'dir/{train,val}-*')"
        )
    unnamed = by_split.get(None, [])
    if unnamed:
        raise DataConfigError(
            f"data.path={path!r}: {str(unnamed[0])!r} is neither a train nor an eval shard by its "
            f"name (train-*, {'|'.join(EVAL_SPLIT_NAMES)}-*): narrow data.path to the shards"
        )
    return by_split["train"], _preferred_eval(by_split.get("eval"))


def _preferred_eval(files: list[Path] | None) -> list[Path] | None:
    """The shards of the first split of :data:`EVAL_SPLIT_NAMES` present (a Hub data set with
    validation and test evaluates on validation, not on both merged)."""
    if not files:
        return files
    for name in EVAL_SPLIT_NAMES:
        chosen = [f for f in files if split_name(f) == name]
        if chosen:
            return chosen
    return files


def decode_rows(
    payloads: Sequence[tuple[bytes, str]], boxes: Callable[[int, int, int], Box], size: int
) -> np.ndarray:
    """Decode encoded images to uint8 ``[n,size,size,3]``: row ``k`` the crop
    ``boxes(k, height, width)`` of ``payloads[k] = (bytes, where)`` resized (the decoder of
    every encoded format: :func:`jddp.data.decode.decode_crop`)."""
    out = np.empty((len(payloads), size, size, 3), np.uint8)
    for k, (data, where) in enumerate(payloads):
        out[k] = decode_crop(data, functools.partial(boxes, k), size, where)
    return out


class EncodedImageSource:
    """A :class:`~jddp.data.source.Source` of encoded images read by example index: a
    subclass gives :meth:`payloads`; decoding, crops and the labels are here. Pixels are the
    image folder's for the same files (the same decoder), normalised with ImageNet's mean/std.

    Subclasses set ``labels`` (int32 ``[N]``), ``num_classes`` and ``image_size``.
    """

    labels: np.ndarray
    num_classes: int
    image_size: int
    classes: list[str] | None = None
    mean = np.asarray(IMAGENET_MEAN, np.float32)
    std = np.asarray(IMAGENET_STD, np.float32)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(S, S, 3)``: what :meth:`get_batch` returns per example."""
        return (self.image_size, self.image_size, 3)

    def __len__(self) -> int:
        """Number of examples in the split."""
        return int(self.labels.shape[0])

    def payloads(self, indices: np.ndarray) -> list[tuple[bytes, str]]:
        """The encoded bytes of examples ``indices`` (valid, non-negative), each with the text
        naming it in errors (shard and row or member)."""
        raise NotImplementedError

    def where(self, i: int) -> str:
        """The shard and row or member of example ``i`` (in error lines)."""
        raise NotImplementedError

    def stored_bytes(self, i: int) -> int:
        """About how many bytes example ``i``'s image takes in its shard."""
        raise NotImplementedError

    def get_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Decode the indexed images (centre square): uint8 ``[n,S,S,3]`` and int32 labels."""
        return self.get_crops(indices, lambda k, height, width: square_box(height, width))

    def get_crops(
        self, indices: np.ndarray, boxes: Callable[[int, int, int], Box]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Decode the indexed images; row ``k`` is the crop ``boxes(k, height, width)``."""
        idx = as_index_array(indices, len(self), type(self).__name__) % max(len(self), 1)
        return decode_rows(self.payloads(idx), boxes, self.image_size), self.labels[idx]


class ShardExample:
    """Example ``index`` of an :class:`EncodedImageSource`, as ``python -m jddp.pack`` lists a
    shard format's images (beside an image folder's paths): its bytes, size and name."""

    def __init__(self, source: EncodedImageSource, index: int) -> None:
        self.source = source
        self.index = int(index)

    def read(self) -> bytes:
        """The encoded image's bytes."""
        return self.source.payloads(np.asarray([self.index]))[0][0]

    def nbytes(self) -> int:
        """Its size in bytes (about, for Parquet: the row group's bytes per row)."""
        return self.source.stored_bytes(self.index)

    def __str__(self) -> str:
        """Where it is: the shard and the row or member."""
        return self.source.where(self.index)


def check_labels_in_range(
    name: str, labels: np.ndarray, num_classes: int | None, where: Callable[[int], str]
) -> int:
    """The class count (``num_classes``, else the largest label + 1); a negative label, or one
    not below ``num_classes``, is a :class:`DataError` naming ``where(i)`` of the first one."""
    classes = int(labels.max(initial=-1)) + 1 if num_classes is None else int(num_classes)
    bad = np.flatnonzero((labels < 0) | (labels >= classes))
    if bad.size:
        i = int(bad[0])
        limit = f"model.num_classes={num_classes}" if num_classes is not None else "labels"
        raise DataError(
            f"{name}: {where(i)} holds label {int(labels[i])}, outside [0, {classes}) "
            f"({limit}; {bad.size} such labels)"
        )
    return max(classes, 1)
