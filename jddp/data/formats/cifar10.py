"""``cifar10``: the CIFAR-10 python batches (a folder, its parent, or the .tar.gz)."""

from __future__ import annotations

import io
import pickle
import tarfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from jddp.data.formats.common import check_labels, make_splits, require_path, to_int_labels
from jddp.data.source import Splits
from jddp.errors import DataConfigError, DataError, one_line

_CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR_TEST_FILE = "test_batch"
_CIFAR_ARCHIVE = "cifar-10-python.tar.gz"
_CIFAR_FOLDER = "cifar-10-batches-py"
HINT = (
    f"put the CIFAR-10 python batches ({_CIFAR_ARCHIVE} from "
    "https://www.cs.toronto.edu/~kriz/cifar.html, extracted or not) there"
)

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
            f"cifar10: {where} is not a readable CIFAR-10 python batch: {one_line(err)}"
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
    labels = to_int_labels("cifar10", np.asarray(labels), f"{where} b'labels'")
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
            f"cifar10: {str(archive)!r} is not a readable tar archive: {one_line(err)}"
        ) from err
    missing = [f for f in (*_CIFAR_TRAIN_FILES, _CIFAR_TEST_FILE) if f not in found]
    if missing:
        raise DataError(f"cifar10: archive {str(archive)!r} lacks {', '.join(missing)}: {HINT}")
    return found


def _cifar10(path: str | None, image_size: int | None, num_classes: int | None) -> Splits:
    """CIFAR-10 from the python batches: a folder, its parent, or the .tar.gz itself."""
    root = require_path("cifar10", path, HINT)
    names = (*_CIFAR_TRAIN_FILES, _CIFAR_TEST_FILE)
    if root.is_file():
        if not tarfile.is_tarfile(root):
            raise DataConfigError(
                f"data.path={str(path)!r} is a file but not a tar archive: {HINT}"
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
                    f"{_CIFAR_FOLDER}/ nor {_CIFAR_ARCHIVE}: {HINT}"
                )
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise DataError(f"cifar10: {str(folder)!r} lacks {', '.join(missing)}: {HINT}")
        blobs = {n: (folder / n).read_bytes() for n in names}
        wheres = {n: repr(str(folder / n)) for n in names}
    train_parts = [_parse_cifar_batch(blobs[n], wheres[n]) for n in _CIFAR_TRAIN_FILES]
    x_test, y_test = _parse_cifar_batch(blobs[_CIFAR_TEST_FILE], wheres[_CIFAR_TEST_FILE])
    x_train = np.concatenate([p[0] for p in train_parts])
    y_train = np.concatenate([p[1] for p in train_parts])
    for n, (_, labels) in zip(_CIFAR_TRAIN_FILES, train_parts, strict=True):
        check_labels(
            "cifar10",
            labels,
            10 if num_classes is None else num_classes,
            wheres[n],
            "model.num_classes" if num_classes is not None else "cifar10 num_classes",
        )
    return make_splits(
        "cifar10",
        (x_train, y_train, "data_batch_1..5"),
        (x_test, y_test, wheres[_CIFAR_TEST_FILE]),
        image_size,
        num_classes,
        10,
    )


def load(path: str | None, image_size: int | None, seed: int, num_classes: int | None) -> Splits:
    """The CIFAR-10 train (data_batch_1..5) and test splits (``seed`` is ignored)."""
    del seed
    return _cifar10(path, image_size, num_classes)
