"""Train state: everything a step reads and writes, as one replicated pytree."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jddp.mesh import put_replicated


@flax.struct.dataclass
class TrainState:
    """Parameters, BatchNorm statistics and optimizer state at optimizer step ``step``."""

    step: jax.Array
    params: nnx.State
    batch_stats: nnx.State
    opt_state: optax.OptState
    skipped_steps: jax.Array  # steps whose update was dropped for a non-finite loss/gradient


@flax.struct.dataclass
class ModelDef:
    """The static part of a split NNX model: its graph and any state that steps don't update."""

    graphdef: Any = flax.struct.field(pytree_node=False)
    rest: nnx.State = flax.struct.field(pytree_node=True)

    def merge(self, params: nnx.State, batch_stats: nnx.State) -> nnx.Module:
        """A fresh module holding ``params`` and ``batch_stats`` (safe inside traced code)."""
        return nnx.merge(self.graphdef, params, batch_stats, self.rest, copy=True)


def split_model(model: nnx.Module) -> tuple[ModelDef, nnx.State, nnx.State]:
    """Split ``model`` into its definition, parameters and BatchNorm statistics."""
    graphdef, params, batch_stats, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
    return ModelDef(graphdef, rest), params, batch_stats


def create_train_state(
    model: nnx.Module, tx: optax.GradientTransformation, mesh: Mesh
) -> tuple[ModelDef, TrainState]:
    """Split ``model``, initialise the optimizer, and replicate the state on every device.

    Every process must build ``model`` identically (same seed): each one supplies the copies
    for its own devices.
    """
    model_def, params, batch_stats = split_model(model)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        batch_stats=batch_stats,
        opt_state=tx.init(params),
        skipped_steps=jnp.zeros((), jnp.int32),
    )
    return put_replicated(model_def, mesh), put_replicated(state, mesh)
