"""A nearly free model for input benchmarks: the step reads 1/64 of the pixels and does ~nothing.

On a CPU the CPU is also the device, so a model that touched every pixel (even a full-image
mean: 100+ ms per 224 px batch of 256 here) would measure itself, not the input pipeline.
Used in-process by ``bench_input.py`` and from the CLI as
``model.name=nearly_free:factory`` with ``experiments/`` on ``PYTHONPATH``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


class PoolDense(nnx.Module):
    """Mean of every 8th row and column, then one dense layer."""

    def __init__(self, num_classes: int, rngs: nnx.Rngs, channels: int = 3):
        self.dense = nnx.Linear(channels, num_classes, rngs=rngs)

    def __call__(self, x_BxHxWxC: jax.Array) -> jax.Array:
        # XLA fuses the uint8 -> float normalisation into this strided slice, so the step
        # reads 1/64 of the pixels
        return self.dense(jnp.mean(x_BxHxWxC[:, ::8, ::8], axis=(1, 2)))


def factory(config: dict[str, Any], dtype: Any, rngs: nnx.Rngs) -> PoolDense:
    """``model.name=nearly_free:factory``: the model section's ``num_classes`` outputs."""
    del dtype
    return PoolDense(int(config.get("num_classes") or 10), rngs)
