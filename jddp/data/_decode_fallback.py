"""TEMPORARY stand-in for jddp.data.decode.decode_crop until it lands on main: the image
folder's Pillow path, on bytes or a path (removed when the real decoder is merged)."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable

import numpy as np

from jddp.data.augment import Box
from jddp.data.source import one_line
from jddp.errors import DataError


def decode_crop(
    data: bytes | os.PathLike, box_of: Callable[[int, int], Box], size: int, where: str
) -> np.ndarray:
    """uint8 ``[size, size, 3]``: the crop ``box_of(height, width)`` of the image resized."""
    from PIL import Image

    try:
        source = io.BytesIO(data) if isinstance(data, bytes | bytearray) else data
        with Image.open(source) as img:
            width, height = img.size
            left, top, right, bottom = box_of(height, width)
            want = (
                math.ceil(width * size / (right - left)),
                math.ceil(height * size / (bottom - top)),
            )
            img.draft("RGB", want)
            sx, sy = img.size[0] / width, img.size[1] / height
            img = img.convert("RGB")
            img = img.resize(
                (size, size),
                Image.Resampling.BILINEAR,
                box=(left * sx, top * sy, right * sx, bottom * sy),
            )
            return np.asarray(img, np.uint8)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise DataError(f"{where}: {one_line(err)}") from err
