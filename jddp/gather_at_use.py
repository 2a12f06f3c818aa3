"""``dist.shard=full``: each split parameter gathered inside the call of the module that holds
it, and gathered again in that module's backward pass (FSDP's per-module all-gather with
``reshard_after_forward``), for any Flax NNX model, with no annotation.

How. Inside the step the model is merged with whole parameters, gathered as the step begins
(:mod:`jddp.fully_sharded`): what a read outside a module's own call gets (a tied embedding
read by the head, a parameter held by a module whose sub-modules hold parameters too); XLA
drops each of those gathers that no read uses. :func:`bind` then gives every *leaf holder*
(a module holding split parameters itself and none in its sub-modules: ``nnx.Linear``,
``Conv``, ``Embed``, ``LayerNorm``, ``BatchNorm``, most custom layers) a ``__call__`` that runs
the module's own inside ``jax.checkpoint`` on its *slices*:

* an optimization barrier ties the slices to the call's inputs, so each gather waits for the
  layer's input instead of all of them running as the step begins;
* inside, the slices are gathered (:func:`jddp.fully_sharded.gather`) and the module's own
  ``__call__`` runs on a copy of the module holding the whole arrays;
* the checkpoint's policy (``jddp.fully_sharded._unit_policy``) keeps only what matrix
  products and convolutions make: the backward pass gathers each parameter again where that
  module's backward pass runs and recomputes the call's cheap work (casts, normalisation),
  and the gradient goes back through the gather's transpose, a reduce-scatter;
* the module's other variables (BatchNorm statistics, RNG counters, what it sows) go
  in and out of the checkpoint and are written back, as the plain call would leave them;
  what a call changes outside variables (a plain Python attribute) or writes into its own
  parameters is not (a train step's parameters change in the update, not in the call).

XLA:CPU expands optimization barriers early and would merge each backward gather into its
forward one (keeping every gathered parameter from the forward pass to the backward pass):
:meth:`jddp.fully_sharded.FullShardLayout.compiler_options` keeps them there
(``cse_barrier_expander`` disabled for the step); XLA:GPU keeps them anyway.

What stays whole through the step: parameters read outside a leaf holder's call (above),
calls whose arguments hold modules or variables, and calls inside the model's own
transforms (``nnx.remat``, ``nnx.scan``: the model passes its state through those, so their
modules hold new values). They are correct, only gathered once for the whole step.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

# id of a whole parameter (the value the model was merged with) -> (it, its slice, split axis)
Plan = dict[int, tuple[jax.Array, jax.Array, int]]
_is_graph_node = getattr(nnx, "graphlib", getattr(nnx, "graph", None)).is_graph_node
_PLAN: contextvars.ContextVar[Plan | None] = contextvars.ContextVar("jddp_plan", default=None)
_UNIT_CLASSES: dict[tuple, type] = {}  # (class, gather, name, policy) -> its unit class


@contextlib.contextmanager
def gathering_at_use(plan: Plan) -> Iterator[None]:
    """While the step's forward pass is traced: ``plan`` maps each whole parameter the model
    is merged with (by identity) to its slice and split axis, for :func:`bind`'s calls."""
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)


def bind(model: nnx.Module, gather: Callable, name: str, policy: Callable) -> nnx.Module:
    """``model`` (merged with the whole parameters of the active plan) with each leaf holder's
    ``__call__`` gathering its parameters where it runs; ``gather(slice, axis)`` makes a whole
    array, ``name`` is the checkpoint name a gathered array gets, ``policy`` the checkpoint's
    policy (it must not save a gathered array).
    Without an active plan: ``model`` unchanged."""
    plan = _PLAN.get()
    if not plan:
        return model
    for _, module in nnx.iter_modules(model):
        if type(module) not in _UNIT_CLASSES.values() and _holds_split_leaf_params(module, plan):
            module.__class__ = _unit_class(type(module), gather, name, policy)
    return model


def _holds_split_leaf_params(module: nnx.Module, plan: Plan) -> bool:
    """Whether ``module`` holds split parameters itself and none in its sub-modules."""
    own = [v for v in vars(module).values() if isinstance(v, nnx.Param)]
    if not any(id(v.get_value()) in plan for v in own):
        return False
    return len(jax.tree.leaves(nnx.state(module, nnx.Param))) == len(own)


def _unit_class(cls: type, gather: Callable, name: str, policy: Callable) -> type:
    """A subclass of ``cls`` whose ``__call__`` runs ``cls``'s on gathered slices."""
    key = (cls, gather, name, policy)
    if key in _UNIT_CLASSES:
        return _UNIT_CLASSES[key]
    own_call = cls.__call__

    def __call__(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
        return _call_on_slices(self, own_call, args, kwargs, gather, name, policy)

    namespace = {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
    }
    # the class's own choice of pytree=False (flax's default for a subclass is True)
    pytree = getattr(cls, "_pytree__is_pytree", None)
    unit = type(cls)(
        cls.__name__, (cls,), namespace, **({} if pytree is None else {"pytree": pytree})
    )
    _UNIT_CLASSES[key] = unit
    return unit


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray)


def _call_on_slices(
    module: nnx.Module,
    own_call: Callable,
    args: tuple,
    kwargs: dict,
    gather: Callable,
    name: str,
    policy: Callable,
) -> Any:
    """``own_call(module, *args, **kwargs)`` inside ``jax.checkpoint``, its split parameters
    gathered there from their slices; the plain call where that cannot be done."""
    plan = _PLAN.get()
    graphdef, params, others = nnx.split(module, nnx.Param, ...)
    param_leaves, params_def = jax.tree.flatten(params)
    split = {i: plan[id(x)] for i, x in enumerate(param_leaves) if plan and id(x) in plan}
    arg_leaves, args_def = jax.tree.flatten((args, kwargs), is_leaf=_is_graph_node)
    if not split or any(_is_graph_node(x) for x in arg_leaves):
        return own_call(module, *args, **kwargs)
    other_leaves, others_def = jax.tree.flatten(others)
    arrays = [x for x in arg_leaves if _is_array(x)]
    statics: list[Any] = []  # the output's leaves that are not arrays, set when traced

    def region(param_in: list, other_in: list, array_in: list) -> tuple[list, list]:
        # the gathers wait for the layer's inputs (XLA would otherwise run them all first)
        param_in, array_in = jax.lax.optimization_barrier((param_in, array_in))
        whole = list(param_in)
        for i, (_, _, axis) in split.items():
            whole[i] = checkpoint_name(gather(param_in[i], axis), name)
        copy = nnx.merge(
            graphdef,
            jax.tree.unflatten(params_def, whole),
            jax.tree.unflatten(others_def, other_in),
        )
        given = iter(array_in)
        call_args, call_kwargs = jax.tree.unflatten(
            args_def, [next(given) if _is_array(x) else x for x in arg_leaves]
        )
        out = own_call(copy, *call_args, **call_kwargs)
        out_leaves, out_def = jax.tree.flatten(out)
        # the module's other variables after the call, with any it added (``sow``, lazy ones)
        new_others, new_def = jax.tree.flatten(nnx.split(copy, nnx.Param, ...)[2])
        statics[:] = [out_def, [None if _is_array(x) else x for x in out_leaves], new_def]
        return [x for x in out_leaves if _is_array(x)], new_others

    param_in = list(param_leaves)
    for i, (_, piece, _) in split.items():
        param_in[i] = piece
    out_arrays, new_others = jax.checkpoint(region, policy=policy)(param_in, other_leaves, arrays)
    out_def, out_leaves, new_def = statics
    nnx.update(module, jax.tree.unflatten(new_def, new_others))
    got = iter(out_arrays)
    return jax.tree.unflatten(out_def, [next(got) if x is None else x for x in out_leaves])
