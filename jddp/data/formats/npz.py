"""``npz``: one .npz file holding x_train, y_train, x_test, y_test."""

from __future__ import annotations

import zipfile
import zlib

import numpy as np

from jddp.data.formats.common import make_splits, require_path, to_int_labels
from jddp.data.source import Splits
from jddp.errors import DataConfigError, DataError, one_line

_NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
HINT = "point it at one .npz file holding arrays x_train, y_train, x_test, y_test"


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
    file = require_path("npz", path, HINT)
    where = repr(str(file))
    if not file.is_file():
        raise DataConfigError(f"data.path={str(path)!r} is not a file: {HINT}")
    try:
        loaded = np.load(file, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise DataError(f"npz: {where} holds a single array, not an .npz: {HINT}")
        with loaded as archive:
            missing = [k for k in _NPZ_KEYS if k not in archive.files]
            if missing:
                raise DataError(
                    f"npz: {where} has arrays {sorted(archive.files)} but lacks "
                    f"{', '.join(missing)}: {HINT}"
                )
            arrays = {k: archive[k] for k in _NPZ_KEYS}
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zlib.error, zipfile.BadZipFile) as err:
        raise DataError(f"npz: {where} cannot be read as .npz: {one_line(err)}") from err
    x_train = _npz_images(arrays["x_train"], f"{where} x_train")
    x_test = _npz_images(arrays["x_test"], f"{where} x_test")
    y_train = to_int_labels("npz", arrays["y_train"], f"{where} y_train")
    y_test = to_int_labels("npz", arrays["y_test"], f"{where} y_test")
    return make_splits(
        "npz",
        (x_train, y_train, f"{where} x_train/y_train"),
        (x_test, y_test, f"{where} x_test/y_test"),
        image_size,
        num_classes,
        None,
    )


def load(path: str | None, image_size: int | None, seed: int, num_classes: int | None) -> Splits:
    """The npz train and test splits (``seed`` is ignored)."""
    del seed
    return _npz(path, image_size, num_classes)
