"""``mnist``: MNIST-format IDX files (plain or .gz) in one folder; :func:`read_idx`."""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from jddp.data.formats.common import make_splits, require_path
from jddp.data.source import Splits
from jddp.errors import DataConfigError, DataError, one_line

_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
HINT = (
    "put the four MNIST IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte, "
    "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each optionally .gz) in that folder"
)

# IDX element type codes (third byte of the magic number) -> big-endian numpy dtype.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


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
        raise DataError(f"IDX file {where} cannot be read: {one_line(err)}") from err
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
    raise DataError(f"mnist: {str(folder)!r} has neither {base} nor {base}.gz: {HINT}")


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
    folder = require_path("mnist", path, HINT)
    if not folder.is_dir():
        raise DataConfigError(f"data.path={str(path)!r} is not a folder: {HINT}")
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
    return make_splits(
        "mnist",
        (x_train, y_train, repr(str(files["train_labels"]))),
        (x_test, y_test, repr(str(files["test_labels"]))),
        image_size,
        num_classes,
        10,
    )


def load(path: str | None, image_size: int | None, seed: int, num_classes: int | None) -> Splits:
    """The MNIST train and t10k splits (``seed`` is ignored)."""
    del seed
    return _mnist(path, image_size, num_classes)
