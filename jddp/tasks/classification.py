"""The built-in task: images to logits, softmax cross-entropy, accuracy and top-5.

Batches are ``{"images": [B,H,W,C], "labels": [B]}``: integer images (uint8 pixels, a quarter of
the float bytes to the device) are normalised on the device by :class:`PixelNorm`, float images
are taken as already normalised. The loss is ``loss_fn(logits, labels)`` (cross-entropy by
default; the ``jddp.fit(loss_fn=...)`` shorthand), the metrics accuracy, top-5 accuracy (eval,
models with more than 5 outputs) and ``metrics_fn(logits, labels)``'s, all from the logits of
the loss's own forward pass (one forward pass a step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jddp.errors import DataConfigError
from jddp.tasks.custom import named_metrics
from jddp.weighted import Metric, Named

LossFn = Callable[[jax.Array, jax.Array], jax.Array]
MetricsFn = Callable[[jax.Array, jax.Array], dict[str, jax.Array]]


def cross_entropy_loss(label_smoothing: float = 0.0) -> LossFn:
    """Per-example softmax cross-entropy ``(logits_BxK, labels_B) -> loss_B``.

    With ``label_smoothing > 0`` the one-hot targets are smoothed towards uniform.
    """

    def loss_fn(logits_BxK: jax.Array, labels_B: jax.Array) -> jax.Array:
        logits_BxK = logits_BxK.astype(jnp.promote_types(logits_BxK.dtype, jnp.float32))
        if label_smoothing == 0.0:
            return optax.softmax_cross_entropy_with_integer_labels(logits_BxK, labels_B)
        targets = optax.smooth_labels(
            jax.nn.one_hot(labels_B, logits_BxK.shape[-1]), label_smoothing
        )
        return optax.softmax_cross_entropy(logits_BxK, targets)

    return loss_fn


@dataclass(frozen=True)
class PixelNorm:
    """How a batch's images become the model's input, on the device inside the jitted step.

    Integer images (uint8 pixels 0..255, what sources hand out, so a quarter of the float bytes
    cross to the device) are scaled to [0, 1] and standardised per channel with ``mean``/``std``
    (on the [0, 1] scale; None: scaling only). Floating images are taken as already normalised.
    Either way the result is cast to the compute dtype.
    """

    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    @classmethod
    def of(cls, source: Any) -> PixelNorm:
        """The normalisation a source declares through its ``mean``/``std`` attributes."""
        return cls._of(getattr(source, "mean", None), getattr(source, "std", None))

    @classmethod
    def _of(cls, mean: Any, std: Any) -> PixelNorm:
        if mean is None or std is None:
            return cls()
        return cls(tuple(float(m) for m in mean), tuple(float(s) for s in std))

    def to_json(self) -> dict[str, list[float] | None]:
        """``{"mean": [...] | None, "std": [...] | None}``: how checkpoints record it."""
        return {
            "mean": None if self.mean is None else list(self.mean),
            "std": None if self.std is None else list(self.std),
        }

    @classmethod
    def from_json(cls, saved: dict[str, Any]) -> PixelNorm:
        """The inverse of :meth:`to_json`."""
        return cls._of(saved.get("mean"), saved.get("std"))

    def check_channels(self, shape: Sequence[int], who: str) -> None:
        """Refuse images ``shape`` ``[N, H, W, C]`` whose C differs from the normalisation's
        channels: its per-channel mean/std would silently broadcast 1-channel images to 3
        (``DataConfigError`` naming ``who``, the expected and the given shape)."""
        channels = len(self.mean) if self.mean is not None else None
        if channels is not None and channels != 1 and shape[-1] != channels:
            raise DataConfigError(
                f"{who}: expected images [N, H, W, {channels}] (the pixel mean/std have "
                f"{channels} channels), got shape {list(shape)}"
            )

    def __call__(self, images: jax.Array, dtype: Any) -> jax.Array:
        if not jnp.issubdtype(images.dtype, jnp.integer):
            return images.astype(dtype)
        x = images.astype(jnp.float32)
        if self.mean is None:
            return (x * (1.0 / 255.0)).astype(dtype)
        std = jnp.asarray(self.std, jnp.float32)
        scale = 1.0 / (255.0 * std)
        shift = -jnp.asarray(self.mean, jnp.float32) / std
        return (x * scale + shift).astype(dtype)


@dataclass(frozen=True)
class ClassificationTask:
    """Image classification (see the module docstring); ``compute_dtype`` is what the images
    are cast to after normalisation."""

    loss_fn: LossFn = field(default_factory=cross_entropy_loss)
    metrics_fn: MetricsFn | None = None
    compute_dtype: Any = jnp.float32
    pixel_norm: PixelNorm = field(default_factory=PixelNorm)
    kind: str = "classification"
    example_unit: str = "img"

    def loss_terms(self, model: Any, data: dict[str, jax.Array]) -> tuple[Any, None, jax.Array]:
        """Per-example losses (unweighted) and, as ``aux``, the logits."""
        logits_BxK = model(self.pixel_norm(data["images"], self.compute_dtype))
        return self.loss_fn(logits_BxK, data["labels"]), None, logits_BxK

    def metric_terms(
        self, fresh_model: Any, data: dict[str, jax.Array], logits_BxK: jax.Array, training: bool
    ) -> Named:
        """Accuracy, top-5 (eval; more than 5 outputs) and ``metrics_fn``'s, from the loss's
        logits."""
        labels_B = data["labels"]
        out: Named = {"accuracy": Metric(jnp.argmax(logits_BxK, -1) == labels_B)}
        if not training and logits_BxK.shape[-1] > 5:
            top5_Bx5 = jax.lax.top_k(logits_BxK, 5)[1]
            out["top5_accuracy"] = Metric(jnp.any(top5_Bx5 == labels_B[:, None], axis=-1))
        if self.metrics_fn is not None:
            mine = self.metrics_fn(logits_BxK, labels_B)
            out.update(named_metrics(mine, labels_B.shape[0], "metrics_fn"))
        return out
