"""Train state: everything a step reads and writes, as one replicated pytree.

An NNX model splits three ways:

* ``params`` (``nnx.Param``): trained by the optimizer;
* ``model_state``: every other variable the forward pass may update and that must carry from
  step to step and into checkpoints — BatchNorm statistics (``nnx.BatchStat``), the counters of
  RNG streams (``nnx.RngCount``, e.g. ``nnx.Dropout``'s), and any custom ``nnx.Variable``;
* ``ModelDef.rest``: the graph plus what steps never change — RNG stream keys (``nnx.RngKey``:
  a stream advances by its counter, its key stays) and sown ``nnx.Intermediate`` values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jddp.mesh import put_replicated

# Variables carried from step to step besides the parameters.
MODEL_STATE = nnx.Not(nnx.Any(nnx.Param, nnx.RngKey, nnx.Intermediate))


@flax.struct.dataclass
class TrainState:
    """Parameters, mutable model state and optimizer state at optimizer step ``step``."""

    step: jax.Array
    params: nnx.State
    model_state: nnx.State  # BatchNorm statistics, RNG counters, custom variables
    opt_state: optax.OptState
    skipped_steps: jax.Array  # steps whose update was dropped for a non-finite loss/gradient
    # train.ema_decay: an exponential moving average of ``params`` (same tree), None when off
    ema_params: nnx.State | None = None

    if TYPE_CHECKING:  # what flax.struct.dataclass adds at run time, for type checkers

        def replace(self, **changes: Any) -> TrainState: ...


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


@flax.struct.dataclass
class ModelDef:
    """The static part of a split NNX model: its graph and the state that steps don't update."""

    graphdef: Any = flax.struct.field(pytree_node=False)
    rest: nnx.State = flax.struct.field(pytree_node=True)

    def merge(
        self,
        params: nnx.State,
        model_state: nnx.State,
        device_index: jax.Array | int | None = None,
    ) -> nnx.Module:
        """A fresh module holding ``params`` and ``model_state`` (safe inside traced code).

        With ``device_index``, that index is folded into every RNG stream key, so each device
        of a data-parallel step draws its own dropout masks (and the same ones every time the
        step is replayed, e.g. after a resume).
        """
        rest = self.rest
        if device_index is not None:
            rest = jax.tree.map(
                lambda x: jax.random.fold_in(x, device_index) if _is_key(x) else x, rest
            )
        return nnx.merge(self.graphdef, params, model_state, rest, copy=True)


def split_model(model: nnx.Module) -> tuple[ModelDef, nnx.State, nnx.State]:
    """Split ``model`` into its definition, parameters and mutable model state."""
    # flax types split's states as a variadic tuple; three filters give exactly four parts
    graphdef, params, model_state, rest = nnx.split(model, nnx.Param, MODEL_STATE, ...)  # type: ignore[misc]
    return ModelDef(graphdef, rest), params, model_state


def abstract_train_state(
    params: nnx.State,
    model_state: nnx.State,
    tx: optax.GradientTransformation,
    *,
    ema: bool = False,
) -> TrainState:
    """The train state :func:`create_train_state` would make, as shape structs: nothing is
    allocated (the optimizer state's shapes come from ``jax.eval_shape``)."""

    def shape(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    return TrainState(  # shape structs where the arrays go
        step=jax.ShapeDtypeStruct((), jnp.int32),  # type: ignore[arg-type]
        params=jax.tree.map(shape, params),
        model_state=jax.tree.map(shape, model_state),
        opt_state=jax.eval_shape(tx.init, params),
        skipped_steps=jax.ShapeDtypeStruct((), jnp.int32),  # type: ignore[arg-type]
        ema_params=jax.tree.map(shape, params) if ema else None,
    )


def with_ema(state: TrainState, ema: bool) -> TrainState:
    """``state`` with an EMA of its parameters starting at the parameters themselves (``ema``),
    or with none."""
    if not ema:
        return state.replace(ema_params=None)
    if state.ema_params is not None:
        return state
    return state.replace(ema_params=jax.tree.map(jnp.copy, state.params))


def create_train_state(
    model: nnx.Module, tx: optax.GradientTransformation, mesh: Mesh, *, ema: bool = False
) -> tuple[ModelDef, TrainState]:
    """Split ``model``, initialise the optimizer, and replicate the state on every device.
    ``ema``: keep an exponential moving average of the parameters too (``train.ema_decay``),
    starting at the initial parameters.

    Every process must build ``model`` identically (same seed): each one supplies the copies
    for its own devices.
    """
    model_def, params, model_state = split_model(model)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        model_state=model_state,
        opt_state=jax.jit(tx.init)(params),  # one compilation, not one per leaf
        skipped_steps=jnp.zeros((), jnp.int32),
    )
    return put_replicated(model_def, mesh), put_replicated(with_ema(state, ema), mesh)
