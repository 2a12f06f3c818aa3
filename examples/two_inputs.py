"""A model with two inputs and a dict batch, trained from the command line: scikit-learn's digits
seen by a camera (the 8x8 image) and by a second, coarse sensor (the ink along each row and
column, 16 numbers), fused into one classifier.

    python -m jddp.train --config configs/digits_two_inputs.yaml
    python -m jddp.launch --nproc 2 -- python -m jddp.train --config configs/digits_two_inputs.yaml

The config names this module's pieces: ``model.name=examples.two_inputs:model``,
``data.name=examples.two_inputs:data`` (a dict batch ``{"image": [B,8,8,1], "side": [B,16],
"label": [B]}``), ``train.loss=examples.two_inputs:loss`` and
``train.metrics=examples.two_inputs:metrics``; ``model.options``/``data.options`` set their
knobs. Run from the repository root (``examples`` is imported from there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

HELD_OUT = 360  # the last digits, as configs/digits.yaml holds out


def data(config: dict, seed: int = 0) -> tuple[dict, dict]:
    """``data.name=examples.two_inputs:data``: train and held-out dict batches. ``side``: each
    row's and column's ink, scaled to [0, 1]; ``data.options.side_noise`` adds Gaussian noise to
    it (a noisier second sensor)."""
    digits = load_digits()
    image = (digits.images / 16.0).astype(np.float32)[..., None]
    side = np.concatenate([image.sum(axis=2)[..., 0], image.sum(axis=1)[..., 0]], axis=1) / 8.0
    noise = float((config.get("options") or {}).get("side_noise", 0.0))
    side = side + noise * np.random.default_rng(seed).standard_normal(side.shape)
    batch = {"image": image, "side": side.astype(np.float32), "label": digits.target}
    train = {k: v[:-HELD_OUT] for k, v in batch.items()}
    evals = {k: v[-HELD_OUT:] for k, v in batch.items()}
    return train, evals


class TwoInputs(nnx.Module):
    """A small CNN on the 8x8 image (its 4x4 feature map flattened), an MLP on the side vector,
    concatenated into the logits."""

    def __init__(self, num_classes: int, width: int, dtype, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, width, (3, 3), dtype=dtype, rngs=rngs)
        self.conv2 = nnx.Conv(width, width, (3, 3), strides=2, dtype=dtype, rngs=rngs)
        self.side = nnx.Linear(16, width, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(17 * width, num_classes, rngs=rngs)

    def __call__(self, image: jax.Array, side: jax.Array) -> jax.Array:
        x = nnx.relu(self.conv2(nnx.relu(self.conv1(image))))
        x = x.reshape(x.shape[0], -1)  # [B, 4 * 4 * width]
        fused = jnp.concatenate([x, nnx.relu(self.side(side))], axis=-1)
        return self.head(fused.astype(jnp.float32))


def model(config: dict, dtype, rngs: nnx.Rngs) -> TwoInputs:
    """``model.name=examples.two_inputs:model``: ``model.num_classes`` outputs,
    ``model.options.width`` channels (default 16)."""
    width = int((config.get("options") or {}).get("width", 16))
    return TwoInputs(config["num_classes"], width, dtype, rngs)


def _logits(model: TwoInputs, batch: dict) -> jax.Array:
    return model(batch["image"], batch["side"])


def loss(model: TwoInputs, batch: dict) -> jax.Array:
    """``train.loss``: softmax cross-entropy per example."""
    return optax.softmax_cross_entropy_with_integer_labels(_logits(model, batch), batch["label"])


def metrics(model: TwoInputs, batch: dict) -> dict[str, jax.Array]:
    """``train.metrics``: accuracy."""
    return {"accuracy": jnp.argmax(_logits(model, batch), -1) == batch["label"]}
