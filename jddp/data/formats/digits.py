"""``digits``: scikit-learn's 8x8 handwritten digits, float32 [0, 1], fixed 1437/360 split."""

from __future__ import annotations

import numpy as np

from jddp.data.formats.common import make_splits
from jddp.data.source import Splits

DIGITS_EVAL_SIZE = 360


def _stratified_eval_mask(labels: np.ndarray, eval_size: int) -> np.ndarray:
    """Deterministic stratified split: boolean mask of the eval examples (no RNG).

    Each class gets ``eval_size * n_c / N`` eval slots (largest remainder rounding),
    taken at evenly spaced positions among that class's examples in file order.
    """
    classes, counts = np.unique(labels, return_counts=True)
    exact = eval_size * counts / labels.shape[0]
    quota = np.floor(exact).astype(int)
    for j in np.argsort(-(exact - quota), kind="stable")[: eval_size - quota.sum()]:
        quota[j] += 1
    mask = np.zeros(labels.shape[0], bool)
    for cls, count, take in zip(classes, counts, quota, strict=True):
        members = np.flatnonzero(labels == cls)
        picks = ((np.arange(take) + 0.5) * count / max(take, 1)).astype(int)
        mask[members[picks]] = True
    return mask


def _digits(image_size: int | None, num_classes: int | None) -> Splits:
    """scikit-learn's 8x8 digits: float32 [0,1] images (8,8,1), fixed 1437/360 split."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (np.asarray(bunch.images, np.float64) / 16.0).astype(np.float32)[..., None]
    labels = np.asarray(bunch.target, np.int32)
    mask = _stratified_eval_mask(labels, DIGITS_EVAL_SIZE)
    where = "sklearn load_digits()"
    return make_splits(
        "digits",
        (images[~mask], labels[~mask], where + " train"),
        (images[mask], labels[mask], where + " eval"),
        image_size,
        num_classes,
        10,
    )


def load(path: str | None, image_size: int | None, seed: int, num_classes: int | None) -> Splits:
    """The digits splits (``path`` and ``seed`` are ignored: the split is fixed)."""
    del path, seed
    return _digits(image_size, num_classes)
