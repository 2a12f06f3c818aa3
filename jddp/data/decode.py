"""Encoded image -> the uint8 crop the pipeline wants: one decoder for every image source.

Fast path (baseline and progressive colour JPEGs, nearly every photo): libjpeg-turbo through
``simplejpeg``, with DCT scaling, then OpenCV for the crop's resize. Everything else (PNG,
grayscale or CMYK JPEGs, odd files, and any file the fast path refuses) is decoded by Pillow,
as before, so every image that decoded before still decodes and a bad file raises the same
error. Both paths then resize with the same filter, so train and eval crops, JPEG or not, are
filtered alike.

Why these choices (measured in ``experiments/bench_input.py --decoders``; RESULTS.md):

* Decoding. ``simplejpeg`` and Pillow both run libjpeg-turbo's accurate integer IDCT: the
  decoded pixels are bitwise identical, ``simplejpeg`` gets there ~25% sooner (no Pillow
  image object, RGB written straight into a numpy array).
* DCT scaling. A JPEG is decoded at 1/2, 1/4 or 1/8 of its size when the crop still has at
  least ``size`` pixels each way there (Pillow's ``draft`` rule, so the decoded array is the
  one Pillow's fast path used): less work and a proper low-pass. Scales such as 3/4 are not
  used: libjpeg-turbo's non-power-of-two IDCTs are slower than decoding in full.
* Resizing. Pillow's antialiased bilinear resize took as long as the decode itself (1.9 ms for
  a 440x330 crop to 224x224, one core); OpenCV's bilinear takes 0.23 ms but does not
  antialias when shrinking. So a crop shrunk by more than 1.2x is first low-passed with a
  Gaussian of ``sigma = 0.5 * sqrt(scale**2 - 1)`` (the blur that, added to a pixel's own
  footprint, makes it as wide as the output pixel), then resized bilinearly. Against Pillow's
  output on real photos the mean absolute difference is about 0.6 of 255 (RESULTS.md).
* Crop-region decoding (decoding only the rows and columns the crop needs) is offered only
  by TurboJPEG's own API (``PyTurboJPEG``), which needs the system's libturbojpeg; jddp
  installs nothing outside pip, so it is not used.
* Not used either: Pillow-SIMD (a build against system libraries); OpenCV's own ``imdecode``
  (as fast, but it returns BGR, one more pass, and its ``IMREAD_REDUCED`` modes cover the same
  scales); DALI's CPU operators (CUDA wheels only).
"""

from __future__ import annotations

import io
import math
import os
import re
from collections.abc import Callable

import cv2
import numpy as np
import simplejpeg
from PIL import Image

from jddp.data.augment import Box
from jddp.errors import DataError, one_line

__all__ = ["decode_crop", "resize_crop"]

# The workers decode in parallel (one image per worker at a time): OpenCV's own thread pool
# would only add threads competing for the same cores.
cv2.setNumThreads(1)

BLUR_ABOVE_SCALE = 1.2  # shrinking by less than this: bilinear alone aliases too little to matter
_JPEG_MAGIC = b"\xff\xd8"
_BYTES_IO = re.compile(r"<_io\.BytesIO object at 0x[0-9a-f]+>")
# what simplejpeg decodes to RGB exactly as Pillow does
_FAST_COLORSPACES = ("YCbCr", "RGB")
# 16- and 32-bit gray, which Pillow's convert("RGB") clips at 255
_WIDE_GRAY = ("I;16", "I;16B", "I;16L", "I")


def draft_factor(box: Box, size: int) -> int:
    """The DCT scale denominator (1, 2, 4 or 8) for decoding ``box`` to ``size``: the largest
    that leaves the crop at least ``size`` pixels each way (Pillow's ``draft`` rule)."""
    left, top, right, bottom = box
    room = min((right - left) // size, (bottom - top) // size)
    for factor in (8, 4, 2):
        if room >= factor:
            return factor
    return 1


def resize_crop(
    image: np.ndarray, box: tuple[float, float, float, float], size: int | tuple[int, int]
) -> np.ndarray:
    """The ``box`` (left, top, right, bottom; may be fractional) of ``image`` ``[H,W(,C)]``
    uint8 resized to ``size`` (a side, or ``(height, width)``): a Gaussian low-pass when
    shrinking by more than 1.2x, then OpenCV's bilinear resize."""
    out_h, out_w = (size, size) if isinstance(size, int) else size
    left, top, right, bottom = box
    height, width = image.shape[:2]
    top_px, bottom_px = min(round(top), height - 1), min(max(round(bottom), round(top) + 1), height)
    left_px, right_px = min(round(left), width - 1), min(max(round(right), round(left) + 1), width)
    crop = image[top_px:bottom_px, left_px:right_px]
    scale = max(crop.shape[0] / out_h, crop.shape[1] / out_w)
    if scale > BLUR_ABOVE_SCALE:
        sigma = 0.5 * math.sqrt(scale * scale - 1.0)
        taps = 2 * math.ceil(2.0 * sigma) + 1  # +-2 sigma: OpenCV's default +-3 costs 20% more
        crop = cv2.GaussianBlur(crop, (taps, taps), sigma)
    return cv2.resize(crop, (out_w, out_h), interpolation=cv2.INTER_LINEAR)


def _fast_decode(data: bytes, box_of: Callable[[int, int], Box], size: int) -> np.ndarray | None:
    """libjpeg-turbo decode of a colour JPEG, DCT-scaled for the crop; None if not for it."""
    if not data.startswith(_JPEG_MAGIC):
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        if colorspace not in _FAST_COLORSPACES:
            return None
        if Image.MAX_IMAGE_PIXELS and height * width > 2 * Image.MAX_IMAGE_PIXELS:
            return None  # Pillow refuses it as a decompression bomb: the same error here
        box = box_of(height, width)
        factor = draft_factor(box, size)
        image = simplejpeg.decode_jpeg(
            data, "RGB", min_height=-(-height // factor), min_width=-(-width // factor)
        )
    except ValueError:  # anything libjpeg-turbo refuses goes to Pillow, which says why
        return None
    scale_y, scale_x = image.shape[0] / height, image.shape[1] / width
    left, top, right, bottom = box
    return resize_crop(
        image, (left * scale_x, top * scale_y, right * scale_x, bottom * scale_y), size
    )


def _pillow_decode(
    data: bytes, path: os.PathLike[str] | str | None, box_of: Callable[[int, int], Box], size: int
) -> np.ndarray:
    """Pillow decode (any format it reads; JPEGs DCT-scaled by ``draft``), then the same resize.

    Opens ``path`` when there is one, so a bad file gets exactly Pillow's error for it.
    """
    with Image.open(path if path is not None else io.BytesIO(data)) as img:
        width, height = img.size
        box = box_of(height, width)
        factor = draft_factor(box, size)
        if factor > 1:
            img.draft("RGB", (-(-width // factor), -(-height // factor)))
        scale_x, scale_y = img.size[0] / width, img.size[1] / height
        if img.mode in _WIDE_GRAY:  # 16-bit (or 32-bit) gray: scaled to 8 bits, not clipped
            wide = np.asarray(img).astype(np.int64)
            bits = 16 if img.mode.startswith("I;16") or wide.max(initial=0) < 1 << 16 else 32
            gray = np.clip(wide >> (bits - 8), 0, 255).astype(np.uint8)
            image = np.repeat(gray[..., None], 3, axis=-1)
        else:
            image = np.asarray(img.convert("RGB"), np.uint8)
    left, top, right, bottom = box
    return resize_crop(
        image, (left * scale_x, top * scale_y, right * scale_x, bottom * scale_y), size
    )


def decode_crop(
    data: bytes | os.PathLike[str] | str,
    box_of: Callable[[int, int], Box],
    size: int,
    where: str,
) -> np.ndarray:
    """Decode an encoded image to uint8 ``[size,size,3]``: the crop ``box_of(height, width)``
    (in full-image pixels) resized to ``size`` x ``size``.

    ``data`` is the file's bytes or its path. Raises :class:`~jddp.errors.DataError`
    ``"{where}: <cause>"`` for anything that cannot be read or decoded.
    """
    path = None if isinstance(data, bytes | bytearray | memoryview) else data
    try:
        if path is not None:
            with open(path, "rb") as f:
                data = f.read()
        data = bytes(data)
        image = _fast_decode(data, box_of, size)
        return image if image is not None else _pillow_decode(data, path, box_of, size)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, cv2.error) as err:
        # Pillow names a BytesIO by its memory address: say "the data" instead
        raise DataError(f"{where}: {_BYTES_IO.sub('the data', one_line(err))}") from err
