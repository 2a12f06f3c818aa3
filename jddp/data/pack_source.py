"""What ``python -m jddp.pack`` reads: the format of ``SRC`` and its splits as lists of items.

An item is ``(thing, label)``: a file path or a shard format's example
(:class:`~jddp.data.formats.shards.ShardExample`) for encoded images, a pixel array for
CIFAR-10, MNIST and npz. The listing's digest identifies the source, so a rerun with another
source is another pack.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from jddp.data.formats.imagefolder import IMAGENET_MEAN, IMAGENET_STD, ImageFolderSource
from jddp.data.formats.shards import ShardExample
from jddp.errors import ConfigError

FORMATS = ("imagefolder", "cifar10", "mnist", "npz", "parquet", "webdataset")

SHARD_FORMATS = ("parquet", "webdataset")  # SRC may be a glob or brace pattern of shards

CLASS_NAMES = {
    "cifar10": [
        "airplane",
        "automobile",
        "bird",
        "cat",
        "deer",
        "dog",
        "frog",
        "horse",
        "ship",
        "truck",
    ],  # fmt: skip
    "mnist": [str(d) for d in range(10)],
}


def _tar_format(src: Path) -> str:
    """A tar file's format by what it holds: CIFAR-10's python batches, else a WebDataset shard
    (a single shard was taken for CIFAR-10 by its name alone)."""
    import tarfile

    try:
        with tarfile.open(src, "r:*") as tar:
            for _, member in zip(range(64), tar, strict=False):
                if "data_batch_" in member.name or "cifar-10-batches" in member.name:
                    return "cifar10"
    except (tarfile.TarError, OSError, EOFError) as err:
        raise ConfigError(f"pack: SRC {str(src)!r} is not a readable tar file ({err})") from None
    return "webdataset"


def detect_format(src: Path) -> str:
    """The ``data.name`` whose ``data.path`` reading ``src`` matches (else :class:`ConfigError`)."""
    text = str(src)
    if any(c in text for c in "*?[{") and not src.exists():  # a pattern of shards
        if text.endswith(".parquet"):
            return "parquet"
        if text.endswith(".tar"):
            return "webdataset"
    if src.is_file() and src.suffix == ".parquet":
        return "parquet"
    if not src.exists():
        raise ConfigError(f"pack: SRC {str(src)!r} does not exist")
    if src.is_file():
        if src.suffix == ".npz":
            return "npz"
        if src.name.endswith((".tar.gz", ".tgz", ".tar")):
            return _tar_format(src)
    else:
        if (src / "train").is_dir():
            return "imagefolder"
        cifar = ("data_batch_1", "cifar-10-batches-py", "cifar-10-python.tar.gz")
        if any((src / name).exists() for name in cifar):
            return "cifar10"
        if any(src.glob("train-images-idx3-ubyte*")):
            return "mnist"
        if any(src.rglob("*.parquet")):
            return "parquet"
        if any(src.glob("*.tar")):
            return "webdataset"
    raise ConfigError(
        f"pack: cannot tell the format of SRC {str(src)!r} (an image folder with train/, "
        "CIFAR-10 batches or .tar.gz, MNIST IDX files, an .npz, Parquet or WebDataset .tar "
        "shards): give --format " + "|".join(FORMATS)
    )


def read_source(fmt: str, src: Path) -> dict[str, Any]:
    """The splits of ``src`` as lists of items, plus what the manifest says about them."""
    if fmt == "imagefolder":
        train = ImageFolderSource(src, None, "train")
        evaluation = ImageFolderSource(src, None, "eval", classes=train.classes)
        splits = {
            name: {
                "from": s.split,
                "items": [(str(f), int(y)) for f, y in zip(s.files, s.labels, strict=True)],
            }
            for name, s in (("train", train), ("eval", evaluation))
        }
        return {
            "kind": "encoded",
            "splits": splits,
            "classes": train.classes,
            "num_classes": len(train.classes),
            "mean": list(IMAGENET_MEAN),
            "std": list(IMAGENET_STD),
        }
    from jddp.data.registry import load_splits

    if fmt in SHARD_FORMATS:  # encoded images read by index: the pack keeps their bytes
        loaded = load_splits(fmt, str(src), None)
        parts = [("train", loaded.train)]
        if loaded.eval is not loaded.train:
            parts.append(("eval", loaded.eval))
        splits = {
            name: {
                "from": s.split,
                "items": [(ShardExample(s, i), int(y)) for i, y in enumerate(s.labels)],
            }
            for name, s in parts
        }
        if "eval" not in splits:
            splits["eval"] = {"from": "train", "items": splits["train"]["items"]}
        return {
            "kind": "encoded",
            "splits": splits,
            "classes": loaded.train.classes,
            "num_classes": loaded.train.num_classes,
            "mean": list(IMAGENET_MEAN),
            "std": list(IMAGENET_STD),
        }

    loaded = load_splits(fmt, str(src), None)
    train, evaluation = loaded.train, loaded.eval
    splits = {
        name: {"from": name, "items": list(zip(s.images, s.labels.tolist(), strict=True))}
        for name, s in (("train", train), ("eval", evaluation))
    }
    return {
        "kind": "raw",
        "splits": splits,
        "classes": CLASS_NAMES.get(fmt),
        "num_classes": train.num_classes,
        "mean": train.mean.tolist(),
        "std": train.std.tolist(),
        "image_shape": list(train.image_shape),
        "dtype": train.images.dtype.name,
    }


def item_bytes(kind: str, item: tuple[Any, int]) -> int:
    """Bytes ``item`` takes in the source (to size the shards)."""
    if isinstance(item[0], ShardExample):
        return item[0].nbytes()
    return os.path.getsize(item[0]) if kind == "encoded" else int(item[0].nbytes)


def fingerprint(kind: str, splits: dict[str, Any]) -> str:
    """A digest of the source's listing: the files (name, size, label) or the arrays' bytes."""
    digest = hashlib.sha256()
    for name, split in splits.items():
        digest.update(f"{name}:{len(split['items'])}\n".encode())
        for thing, label in split["items"]:
            if isinstance(thing, ShardExample):
                digest.update(f"{thing}\t{thing.nbytes()}\t{label}\n".encode())
            elif kind == "encoded":
                digest.update(f"{thing}\t{os.path.getsize(thing)}\t{label}\n".encode())
            else:
                digest.update(thing.tobytes())
                digest.update(f"\t{label}\n".encode())
    return digest.hexdigest()
