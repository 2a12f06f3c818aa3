"""``packed``: a folder written by ``python -m jddp.pack`` (ArrayRecord shards + ``pack.json``).

Example ``i`` of a split is one record, read by index (random access), so batch *k* is the
same pixels whatever reads it. Image packs hold the encoded files and decode them like
``imagefolder`` (the same decoder, so a pack without ``--max-side`` gives the image folder's
pixels bit for bit); array packs (``cifar10``, ``mnist``, ``npz``) hold the raw pixels and give
the in-memory source's batches.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jddp.data.augment import Box, square_box
from jddp.data.decode import decode_crop
from jddp.data.formats.common import require_path
from jddp.data.image_ops import resize_images
from jddp.data.pack_format import (
    MANIFEST,
    READER_OPTIONS,
    VERSION,
    Record,
    parse_record,
)
from jddp.data.source import ArraySource, Splits, as_index_array
from jddp.errors import DataConfigError, DataError, one_line

HINT = "point it at a folder written by python -m jddp.pack SRC OUT"


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of the pack in ``root``; :class:`DataConfigError` if there is none or it is
    not one this jddp reads."""
    file = root / MANIFEST
    if not root.is_dir():
        raise DataConfigError(f"data.path={str(root)!r} is not a folder: {HINT}")
    if not file.is_file():
        partial = any(root.glob("*.array_record*"))
        what = "an unfinished pack (no pack.json yet): rerun the same python -m jddp.pack"
        raise DataConfigError(
            f"data.path={str(root)!r} holds {what if partial else f'no {MANIFEST}: {HINT}'}"
        )
    try:
        manifest = json.loads(file.read_text())
        version = manifest["version"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(
            f"packed: {str(file)!r} is not a readable pack manifest: {one_line(err)}"
        ) from err
    if version != VERSION:
        raise DataError(
            f"packed: {str(file)!r} is pack format version {version}; this jddp reads version "
            f"{VERSION}: re-pack with this jddp"
        )
    return manifest


class PackedSource:
    """A :class:`~jddp.data.source.Source` over one split of a pack.

    Args:
      root: the pack folder (holding ``pack.json``).
      manifest: its parsed manifest.
      split: ``"train"`` or ``"eval"``.
      image_size: output side; ``None``: 224 for image packs, the stored size for array packs.
      num_classes: if given, at least the pack's number of classes.

    Opening checks every shard against the manifest (present, its size, its record count, the
    pack id of its first record); every read checks each record's CRC-32 and pack id. Readers
    are opened lazily in each process (the source pickles into worker processes) and shared
    by its threads.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        manifest: dict[str, Any],
        split: str,
        image_size: int | None = None,
        num_classes: int | None = None,
    ) -> None:
        """Check the shards of ``split`` against the manifest; nothing is decoded here."""
        self.root = Path(root)
        self.split = split
        self.pack_id = bytes.fromhex(manifest["pack_id"])
        self.encoded = manifest["kind"] == "encoded"
        info = manifest["splits"][split]
        self.shards = [self.root / s["file"] for s in info["shards"]]
        self._counts = [int(s["records"]) for s in info["shards"]]
        self._bytes = [int(s["bytes"]) for s in info["shards"]]
        self._starts = np.cumsum([0, *self._counts])
        stored_classes = int(manifest["num_classes"])
        if num_classes is not None and num_classes < stored_classes:
            raise DataConfigError(
                f"packed: {str(self.root)!r} has {stored_classes} classes (largest label "
                f"{stored_classes - 1}) but model.num_classes={num_classes}"
            )
        self.num_classes = stored_classes if num_classes is None else int(num_classes)
        self.classes: list[str] | None = manifest.get("classes")
        self.mean = np.asarray(manifest["mean"], np.float32)
        self.std = np.asarray(manifest["std"], np.float32)
        if self.encoded:
            self.image_size = 224 if image_size is None else int(image_size)
            self.image_shape: tuple[int, int, int] = (self.image_size, self.image_size, 3)
            self._stored_shape: tuple[int, ...] = ()
        else:
            height, width, channels = (int(d) for d in manifest["image_shape"])
            self._stored_shape = (height, width, channels)
            self._dtype = np.dtype(manifest["dtype"])
            # like the in-memory formats: data.image_size resizes (square), None keeps the size
            self.image_size = height if image_size is None else int(image_size)
            self.image_shape = (
                self._stored_shape
                if image_size is None
                else (self.image_size, self.image_size, channels)
            )
        self._lock = threading.Lock()
        self._readers: dict[int, Any] = {}
        self._pid = os.getpid()
        for shard in range(len(self.shards)):
            self._check_shard(shard)

    def __len__(self) -> int:
        """Number of examples in the split."""
        return int(self._starts[-1])

    # ---------------------------------------------------------------- shards and records
    def _where(self, shard: int, record: int | None = None) -> str:
        at = "" if record is None else f" record {record}"
        return f"packed: shard {str(self.shards[shard])!r}{at}"

    def _reader(self, shard: int) -> Any:
        """The open reader of ``shard`` in this process (opened on first use)."""
        if self._pid != os.getpid():  # a forked copy: the parent's readers are not ours
            self._readers, self._pid = {}, os.getpid()
        reader = self._readers.get(shard)
        if reader is None:
            with self._lock:
                reader = self._readers.get(shard)
                if reader is None:
                    reader = self._open(shard)
                    self._readers[shard] = reader
        return reader

    def _open(self, shard: int) -> Any:
        from array_record.python.array_record_module import ArrayRecordReader

        path = self.shards[shard]
        want = self._counts[shard]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise DataError(
                f"{self._where(shard)} is missing (the manifest lists it with {want} records): "
                "restore it or re-pack the data set"
            ) from None
        if size != self._bytes[shard]:
            raise DataError(
                f"{self._where(shard)} is {size} bytes but the manifest says "
                f"{self._bytes[shard]}: truncated or replaced; restore it or re-pack"
            )
        try:
            reader = ArrayRecordReader(str(path), READER_OPTIONS)
            found = reader.num_records()
        except Exception as err:  # noqa: BLE001 - any reader failure is a damaged shard
            raise DataError(f"{self._where(shard)} cannot be opened: {one_line(err)}") from err
        if found != want:
            raise DataError(
                f"{self._where(shard)} holds {found} records but the manifest says {want}: "
                "truncated or replaced; restore it or re-pack"
            )
        return reader

    def _check_shard(self, shard: int) -> None:
        """Open ``shard`` and parse its first record (size, count and pack id checked)."""
        if self._counts[shard]:
            self._records(shard, [0])

    def _records(self, shard: int, records: list[int]) -> list[Record]:
        """Parse ``records`` (indices within ``shard``)."""
        reader = self._reader(shard)
        try:
            blobs = reader.read(records)
        except Exception as err:  # noqa: BLE001 - a read failure is a damaged shard
            span = records[0] if len(records) == 1 else f"among {records[:8]}"
            raise DataError(
                f"{self._where(shard, span)} cannot be read: {one_line(err)}"  # type: ignore[arg-type]
            ) from err
        return [
            parse_record(blob, self.pack_id, self._where(shard, r))
            for r, blob in zip(records, blobs, strict=True)
        ]

    def records(self, indices: np.ndarray) -> list[tuple[Record, str]]:
        """The records at example ``indices`` (in that order), each with its ``where`` text."""
        idx = as_index_array(indices, len(self), "PackedSource") % max(len(self), 1)
        shard_of = np.searchsorted(self._starts, idx, side="right") - 1
        out: list[tuple[Record, str] | None] = [None] * len(idx)
        for shard in np.unique(shard_of):
            rows = np.flatnonzero(shard_of == shard)
            local = [int(i - self._starts[shard]) for i in idx[rows]]
            for row, r, rec in zip(rows, local, self._records(int(shard), local), strict=True):
                out[row] = (rec, self._where(int(shard), r))
        return out  # type: ignore[return-value]

    # ---------------------------------------------------------------- the Source protocol
    def get_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """uint8 ``[n,S,S,3]`` centre squares (image packs) or the stored arrays, int32 labels."""
        if not self.encoded:
            batch, rows = self._array_batch(indices)
            return batch.get_batch(rows)
        return self.get_crops(indices, lambda k, height, width: square_box(height, width))

    def get_crops(
        self, indices: np.ndarray, boxes: Callable[[int, int, int], Box]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`get_batch`, row ``k`` the crop ``boxes(k, height, width)`` resized."""
        if not self.encoded:
            batch, rows = self._array_batch(indices)
            return batch.get_crops(rows, boxes)
        found = self.records(indices)
        out = np.empty((len(found), *self.image_shape), np.uint8)
        for k, (rec, where) in enumerate(found):
            out[k] = decode_crop(rec.payload, functools.partial(boxes, k), self.image_size, where)
        return out, np.asarray([rec.label for rec, _ in found], np.int32)

    def _array_batch(self, indices: np.ndarray) -> tuple[ArraySource, np.ndarray]:
        """The stored arrays at ``indices`` as an in-memory source (so batches, crops and
        normalisation are the in-memory formats' own code) and its row indices."""
        found = self.records(indices)
        images = np.empty((len(found), *self._stored_shape), self._dtype)
        for k, (rec, where) in enumerate(found):
            if rec.payload.shape != self._stored_shape or rec.payload.dtype != self._dtype:
                raise DataError(
                    f"{where}: holds a {rec.payload.dtype} {rec.payload.shape} image, the pack "
                    f"{self._dtype} {self._stored_shape}: damaged shard"
                )
            images[k] = rec.payload
        if self.image_shape != self._stored_shape:
            images = resize_images(images, self.image_size)  # as make_splits does at load
        labels = np.asarray([rec.label for rec, _ in found], np.int32)
        name = f"packed/{self.split}"
        source = ArraySource(images, labels, self.num_classes, self.mean, self.std, name)
        return source, np.arange(len(found))

    def __repr__(self) -> str:
        """Stable description (no memory addresses)."""
        return (
            f"PackedSource(root={str(self.root)!r}, split={self.split!r}, n={len(self)}, "
            f"pack_id={self.pack_id.hex()!r}, image_shape={self.image_shape}, "
            f"num_classes={self.num_classes})"
        )

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without open readers or the lock (worker processes open their own)."""
        return {**self.__dict__, "_readers": {}, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pid = os.getpid()


def load(path: str | None, image_size: int | None, seed: int, num_classes: int | None) -> Splits:
    """The train and eval splits of the pack in ``path`` (``seed`` is ignored)."""
    del seed
    root = require_path("packed", path, HINT)
    manifest = read_manifest(root)
    train = PackedSource(root, manifest, "train", image_size, num_classes)
    evaluation = PackedSource(root, manifest, "eval", image_size, train.num_classes)
    return Splits(train=train, eval=evaluation)
