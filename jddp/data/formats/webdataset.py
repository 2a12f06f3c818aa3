"""``webdataset``: WebDataset tar shards (``key.jpg`` + ``key.cls``/``key.json``), read by index.

A shard is a plain tar; the members of one example share a key (the member's path up to the
first dot of its file name) and differ by extension. Each shard is indexed once (one pass over
its tar headers: the offset and size of every example's image, its label read on the way) and
the index is cached beside the shard as ``<shard>.jddp-index.npz`` (or under the run's
``data-index/`` when the shard folder is read-only), checked against the shard's size and
modification time. Example ``i`` is then one ``pread`` of its image's bytes: random access, so
batch *k* is the same images on any topology and after a resume.

Splits: ``data.path`` may name both (shards named ``*train*`` and ``*val*``/``*test*``, as
timm's ``imagenet-train-{000000..001281}.tar`` and ``imagenet-val-*``), or the eval shards are
``data.eval_path``. Labels: the ``.cls`` member (a decimal integer), else the ``label`` field of
the ``.json`` member; ``data.label_key=EXT`` names another integer member, ``json:FIELD``
another JSON field; ``data.image_key=EXT`` picks the image among several.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

from jddp.data.formats.shards import (
    EncodedImageSource,
    check_labels_in_range,
    split_files,
)
from jddp.data.formats.tar import tar_members
from jddp.data.source import Splits
from jddp.errors import DataConfigError, DataError, one_line

IMAGE_EXTENSIONS: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")
LABEL_EXTENSIONS: tuple[str, ...] = ("cls", "cls.txt", "label", "txt")
INDEX_SUFFIX = ".jddp-index.npz"
INDEX_VERSION = 2  # 2: label offsets and the content fingerprint (verified at every load)
HINT = (
    "point it at WebDataset tar shards, e.g. data.path='shards/train-{000000..000146}.tar' "
    "(brace ranges and globs), members key.jpg|png|webp + key.cls|json"
)


def split_key(name: str) -> tuple[str, str]:
    """WebDataset's ``(key, extension)`` of a member: the path up to the first dot of the file
    name, and the rest (lower case): ``a/b/n01.x.jpg`` -> ``("a/b/n01", "x.jpg")``."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower() if dot else ""


# ------------------------------------------------------------------------ one shard's index
def _read_label(f: Any, shard: Path, key: str, ext: str, field: str | None, at: int, n: int) -> int:
    f.seek(at)
    text = f.read(n)
    where = f"webdataset: shard {str(shard)!r} member {key + '.' + ext!r}"
    try:
        if field is not None:
            value = json.loads(text)
            if not isinstance(value, dict) or field not in value:
                raise DataError(f"{where} has no {field!r} field")
            value = value[field]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise DataError(f"{where}: its {field!r} is {value!r}, not an integer label")
        else:
            value = float(text.decode("utf-8").strip())
        if value != int(value):
            raise ValueError(f"{value} is not a whole number")
        return int(value)
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{where} is not an integer label: {one_line(err)}") from err


def build_index(shard: Path, image_key: str | None, label_key: str | None) -> dict[str, np.ndarray]:
    """Index ``shard``: per example (in archive order of its first member) its key, the offset
    and size of its image and its label. An example without an image or a label member is a
    :class:`DataError` naming the shard and the key."""
    names, offsets, sizes = tar_members(shard)
    images = (image_key.lower(),) if image_key else IMAGE_EXTENSIONS
    label_ext, field = None, None
    if label_key and label_key.startswith("json:"):
        label_ext, field = "json", label_key.split(":", 1)[1]
    elif label_key:
        label_ext = label_key.lower()
    members: dict[str, dict[str, int]] = {}
    for m, name in enumerate(names):
        key, ext = split_key(name)
        members.setdefault(key, {})[ext] = m
    keys = list(members)
    image_at = np.empty(len(keys), np.int64)
    image_size = np.empty(len(keys), np.int64)
    labels = np.empty(len(keys), np.int64)
    label_at = np.empty(len(keys), np.int64)
    label_size = np.empty(len(keys), np.int64)
    where = f"webdataset: shard {str(shard)!r}"
    with open(shard, "rb") as f:
        for i, key in enumerate(keys):
            found = members[key]
            image = next((found[e] for e in images if e in found), None)
            if image is None:
                raise DataError(
                    f"{where}: example {key!r} has no {'/'.join('.' + e for e in images)} member "
                    f"(it has {', '.join('.' + e for e in found) or 'none'})"
                )
            image_at[i], image_size[i] = offsets[image], sizes[image]
            if label_ext is not None:
                ext = label_ext
            else:
                ext = next((e for e in (*LABEL_EXTENSIONS, "json") if e in found), None)
                field = "label" if ext == "json" else None
            if ext is None or ext not in found:
                wanted = (
                    f".{label_ext}"
                    if label_ext
                    else "/".join("." + e for e in (*LABEL_EXTENSIONS, "json"))
                )
                raise DataError(
                    f"{where}: example {key!r} has no label member {wanted} (it has "
                    f"{', '.join('.' + e for e in found)}): set data.label_key"
                )
            m = found[ext]
            label_at[i], label_size[i] = offsets[m], sizes[m]
            labels[i] = _read_label(f, shard, key, ext, field, int(offsets[m]), int(sizes[m]))
    index = {
        "keys": np.asarray(keys, dtype=np.str_),
        "image_at": image_at,
        "image_size": image_size,
        "labels": labels,
        "label_at": label_at,
        "label_size": label_size,
    }
    index["fingerprint"] = content_fingerprint(shard, index)
    return index


def content_fingerprint(shard: Path, index: dict[str, np.ndarray]) -> np.ndarray:
    """A hash of what an index takes from ``shard`` besides offsets: each label member's bytes
    and each image member's tar header (its name, size and times), read at the indexed
    offsets (two small reads per example). A shard rewritten with the same size and
    modification time (``rsync -t``, ``cp -p``) but other labels or members no longer matches."""
    digest = hashlib.blake2b(digest_size=16)
    with open(shard, "rb") as f:
        rows = zip(index["label_at"], index["label_size"], index["image_at"], strict=True)
        for at, n, image in rows:
            f.seek(int(at))
            digest.update(f.read(int(n)))
            f.seek(int(image) - 512)  # the member's header block, just before its data
            digest.update(f.read(512))
    return np.asarray(digest.hexdigest())


INDEX_KEYS = ("keys", "image_at", "image_size", "labels", "label_at", "label_size", "fingerprint")


def _index_paths(shard: Path, index_dir: Path | None) -> list[Path]:
    """Where ``shard``'s index may be: beside it, then under ``index_dir`` (a name unique to
    the shard's absolute path)."""
    paths = [shard.with_name(shard.name + INDEX_SUFFIX)]
    if index_dir is not None:
        digest = hashlib.sha1(str(shard.resolve()).encode()).hexdigest()[:16]
        paths.append(index_dir / f"{shard.name}.{digest}{INDEX_SUFFIX}")
    return paths


def _stamp(shard: Path, image_key: str | None, label_key: str | None) -> np.ndarray:
    stat = shard.stat()
    text = f"{INDEX_VERSION}|{stat.st_size}|{stat.st_mtime_ns}|{image_key}|{label_key}"
    return np.asarray(text)


def shard_index(
    shard: Path, image_key: str | None, label_key: str | None, index_dir: Path | None
) -> tuple[dict[str, np.ndarray], bool]:
    """``shard``'s index (:func:`build_index`) from its cache if that matches the shard's size,
    modification time and the keys and its content (:func:`content_fingerprint`), else built
    and cached (written atomically: processes that
    build it at once each write a whole file). Returns it and whether it was built."""
    stamp = _stamp(shard, image_key, label_key)
    paths = _index_paths(shard, index_dir)
    for path in paths:
        try:
            with np.load(path) as cached:
                if str(cached["stamp"]) == str(stamp):
                    index = {k: cached[k] for k in INDEX_KEYS}
                    # size and time can lie (a copy that keeps them): the content decides
                    if str(content_fingerprint(shard, index)) == str(index["fingerprint"]):
                        return index, False
        except (OSError, KeyError, ValueError, EOFError):
            continue
    index = build_index(shard, image_key, label_key)
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                np.savez(f, stamp=stamp, **index)
            os.replace(tmp, path)
            break
        except OSError:  # a read-only shard folder: the next place
            continue
    return index, True


# ------------------------------------------------------------------------ the source
class WebDatasetSource(EncodedImageSource):
    """A :class:`~jddp.data.source.Source` over the examples of WebDataset tar ``shards``.

    Args:
      shards: the tar files of the split, in order (example ``i`` counts across them).
      image_size: output side; ``None`` means 224.
      num_classes: if given, the labels must be below it; else the largest label + 1.
      image_key / label_key: ``data.image_key`` / ``data.label_key`` (see the module).
      index_dir: where indexes go when a shard's folder is read-only.
    """

    def __init__(
        self,
        shards: list[Path],
        image_size: int | None = None,
        num_classes: int | None = None,
        image_key: str | None = None,
        label_key: str | None = None,
        index_dir: Path | None = None,
        split: str = "train",
    ) -> None:
        """Index (or read the cached indexes of) every shard; nothing is decoded here."""
        self.shards = list(shards)
        self.split = split
        self.image_size = 224 if image_size is None else int(image_size)
        indexes = [shard_index(s, image_key, label_key, index_dir)[0] for s in self.shards]
        counts = [len(ix["labels"]) for ix in indexes]
        empty = [s for s, n in zip(self.shards, counts, strict=True) if n == 0]
        if empty:
            raise DataError(f"webdataset: shard {str(empty[0])!r} holds no example")
        self._starts = np.cumsum([0, *counts])
        self._shard_of = np.repeat(np.arange(len(self.shards)), counts)
        self._keys = np.concatenate([ix["keys"] for ix in indexes])
        self._image_at = np.concatenate([ix["image_at"] for ix in indexes])
        self._image_size = np.concatenate([ix["image_size"] for ix in indexes])
        labels = np.concatenate([ix["labels"] for ix in indexes])
        self.num_classes = check_labels_in_range("webdataset", labels, num_classes, self.where)
        self.labels = labels.astype(np.int32)
        self._lock = threading.Lock()
        self._files: dict[int, int] = {}
        self._pid = os.getpid()

    def stored_bytes(self, i: int) -> int:
        """The size of example ``i``'s image member."""
        return int(self._image_size[i])

    def where(self, i: int) -> str:
        """``shard '...' member 'key.jpg'`` of example ``i``."""
        shard = int(self._shard_of[i])
        return f"shard {str(self.shards[shard])!r} example {str(self._keys[i])!r}"

    def _fd(self, shard: int) -> int:
        """This process's open descriptor of ``shard`` (opened on first use, shared by threads;
        ``os.pread`` needs no seek, so threads never race on a file position)."""
        if self._pid != os.getpid():  # a forked copy: the parent's descriptors are not ours
            self._files, self._pid = {}, os.getpid()
        fd = self._files.get(shard)
        if fd is None:
            with self._lock:
                fd = self._files.get(shard)
                if fd is None:
                    try:
                        fd = os.open(self.shards[shard], os.O_RDONLY)
                    except OSError as err:
                        raise DataError(
                            f"webdataset: shard {str(self.shards[shard])!r} cannot be opened: "
                            f"{one_line(err)}"
                        ) from err
                    self._files[shard] = fd
        return fd

    def payloads(self, indices: np.ndarray) -> list[tuple[bytes, str]]:
        """One ``pread`` per example of its image member's bytes."""
        out = []
        for i in indices:
            shard, size = int(self._shard_of[i]), int(self._image_size[i])
            data = os.pread(self._fd(shard), size, int(self._image_at[i]))
            where = f"webdataset: {self.where(int(i))}"
            if len(data) != size:
                raise DataError(
                    f"{where}: read {len(data)} of {size} bytes: the shard was truncated "
                    "after it was indexed"
                )
            out.append((data, f"{where}: cannot decode image"))
        return out

    def __repr__(self) -> str:
        """Stable description (no memory addresses)."""
        return (
            f"WebDatasetSource(shards={len(self.shards)}, first={str(self.shards[0])!r}, "
            f"split={self.split!r}, n={len(self)}, image_size={self.image_size}, "
            f"num_classes={self.num_classes})"
        )

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without open descriptors or the lock (worker processes open their own)."""
        return {**self.__dict__, "_files": {}, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pid = os.getpid()


def load(
    path: str | None,
    image_size: int | None,
    seed: int,
    num_classes: int | None,
    *,
    eval_path: str | None = None,
    image_key: str | None = None,
    label_key: str | None = None,
    index_dir: str | None = None,
) -> Splits:
    """The train and eval splits of the shards ``path`` (and ``eval_path``); ``seed`` unused."""
    del seed
    train_files, eval_files = split_files("webdataset", path, eval_path, (".tar",), HINT)
    where = None if index_dir is None else Path(index_dir)
    keys = {"image_key": image_key, "label_key": label_key, "index_dir": where}
    train = WebDatasetSource(train_files, image_size, num_classes, split="train", **keys)
    if eval_files is None:
        return Splits(train=train, eval=train)
    if set(eval_files) & set(train_files):
        raise DataConfigError("data.eval_path names shards that data.path trains on")
    evaluation = WebDatasetSource(eval_files, image_size, train.num_classes, split="eval", **keys)
    return Splits(train=train, eval=evaluation)
