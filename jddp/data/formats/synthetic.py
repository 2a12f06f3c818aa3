"""``synthetic``: deterministic random uint8 images whose labels a linear model can learn."""

from __future__ import annotations

import numpy as np

from jddp.data.formats.common import make_splits
from jddp.data.source import Splits

SYNTHETIC_TRAIN_SIZE = 1024
SYNTHETIC_EVAL_SIZE = 256


def _synthetic(image_size: int | None, seed: int, num_classes: int | None) -> Splits:
    """Deterministic random images with labels that a linear model can learn.

    Rule: draw a fixed random projection ``W`` (``[g*g*3, K]``, standard normal) from
    ``seed``.  Each image is a random ``g x g x 3`` uint8 latent grid ``z`` (``g =
    min(4, size)``) upsampled by pixel replication to ``size x size``, plus independent
    pixel noise in ``[-16, 16]`` (clipped to 0..255).  Its label is
    ``argmax_k ((z / 255 - 0.5).ravel() @ W)[k]``.  Block means of the image recover
    ``z`` up to small noise, so the label is (nearly) a linear function of the pixels.
    """
    size = 32 if image_size is None else image_size
    classes = 10 if num_classes is None else num_classes
    grid = min(4, size)
    rng = np.random.default_rng(seed)
    projection = rng.standard_normal((grid * grid * 3, classes))
    pixel_to_cell = (np.arange(size) * grid) // size

    def make(n: int) -> tuple[np.ndarray, np.ndarray]:
        images = np.empty((n, size, size, 3), np.uint8)
        labels = np.empty(n, np.int32)
        for start in range(0, n, 128):
            m = min(128, n - start)
            latent = rng.integers(0, 256, (m, grid, grid, 3), dtype=np.uint8)
            up = latent[:, pixel_to_cell][:, :, pixel_to_cell].astype(np.int16)
            up += rng.integers(-16, 17, up.shape, dtype=np.int16)
            images[start : start + m] = np.clip(up, 0, 255)
            scores = (latent.reshape(m, -1) / 255.0 - 0.5) @ projection
            labels[start : start + m] = np.argmax(scores, axis=1)
        return images, labels

    x_train, y_train = make(SYNTHETIC_TRAIN_SIZE)
    x_test, y_test = make(SYNTHETIC_EVAL_SIZE)
    where = f"(seed={seed})"
    return make_splits(
        "synthetic",
        (x_train, y_train, "train " + where),
        (x_test, y_test, "eval " + where),
        None,
        None,
        classes,
    )


def load(path: str | None, image_size: int | None, seed: int, num_classes: int | None) -> Splits:
    """The synthetic splits (``path`` is ignored; ``seed`` draws the images)."""
    del path
    return _synthetic(image_size, seed, num_classes)
