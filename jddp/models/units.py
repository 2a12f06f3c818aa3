"""A module's call run as a *unit*: inside ``jax.checkpoint``, recomputed in the backward pass,
its parameters gathered from their slices inside the call where the step splits them.

Two uses of one mechanism, for any Flax NNX model and without annotations:

* ``model.remat=blocks`` (:func:`rematerialise_blocks`): each *block* — a module held in a list
  of modules (``self.blocks = nnx.List([...])``: a transformer's layers, a ResNet's residual
  blocks) — keeps only its inputs from the forward pass; its activations are recomputed in
  the backward pass (:data:`REMAT_POLICY`: nothing saved).
* ``dist.shard=full`` (:func:`bind_leaf_holders`, used by :mod:`jddp.shard.full`): each *leaf
  holder* — a module holding split parameters itself and none in its sub-modules
  (``nnx.Linear``, ``Conv``, ``Embed``, ``LayerNorm``, most custom layers) — gathers its
  parameters where it runs and again where its backward pass runs (FSDP's per-module
  all-gather with ``reshard_after_forward``). A rematerialised block under ``full`` gathers
  all of its parameters as its call begins (and again in its backward pass, where it is
  recomputed): FSDP's per-block gather; the leaf holders inside it then read them whole.

How a unit runs (:func:`_run_unit`): the module's parameters that the active :class:`Plan`
names (by the identity of the whole array the model was merged with) go into the checkpoint
as their slices, each behind an optimization barrier tied to the call's inputs (so a gather
waits for the layer's input rather than running as the step begins); inside, they are
gathered, the module's own ``__call__`` runs on a copy holding whole arrays, and the
checkpoint's policy decides what the backward pass recomputes. The module's other variables
(BatchNorm statistics, RNG counters, what it sows) go in and out of the checkpoint and are
written back as the plain call would leave them; what a call changes outside variables (a
plain Python attribute) or writes into its own parameters is not.

What runs as a plain call: a call whose arguments hold modules or variables, and a call inside
the model's own transforms (``nnx.remat``, ``nnx.scan``: the model passes its state through
them, so their modules hold new values). Correct, only not a unit.

Internals this relies on (pinned by ``tests/test_compat.py``, listed in :mod:`jddp.compat`):
the unit class is made with ``type(cls)(name, (cls,), namespace, pytree=...)`` and reads
flax's ``_pytree__is_pytree`` (a class's own choice of ``pytree=False``), and
``nnx.graphlib.is_graph_node``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

_graphlib: Any = getattr(nnx, "graphlib", getattr(nnx, "graph", None))  # named by flax version
_is_graph_node = _graphlib.is_graph_node


@dataclass(frozen=True)
class Plan:
    """While a fully sharded step's forward pass is traced: ``arrays`` maps the id of each
    whole parameter the model is merged with to ``(it, its slice, split axis)``; ``gather(slice,
    axis)`` makes the whole array inside a unit."""

    arrays: dict[int, tuple[jax.Array, jax.Array, int]]
    gather: Callable[[jax.Array, int], jax.Array]


_PLAN: contextvars.ContextVar[Plan | None] = contextvars.ContextVar("jddp_plan", default=None)
_UNIT_CLASSES: dict[tuple[type, str], type] = {}  # (class, kind) -> its unit class


@contextlib.contextmanager
def gathering_at_use(plan: Plan) -> Iterator[None]:
    """Units called in this context gather the split parameters ``plan`` names."""
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)


def _dot_or_conv(prim: Any, *_: Any, **__: Any) -> bool:
    """A leaf holder's policy: save only what matrix products and convolutions make;
    recompute everything else in the module's backward pass from the call's inputs: its
    gathered parameters (a gather is neither), their casts, and the module's cheap elementwise
    work (BatchNorm's, LayerNorm's). Saving everything but the cheap operations kept values XLA
    could not fuse away: ResNet-50's fully sharded step took 2,963 MiB on 8 devices, 1,410 with
    this policy (experiments/RESULTS.md section 9)."""
    return prim.name in ("dot_general", "conv_general_dilated")


REMAT_POLICY = jax.checkpoint_policies.nothing_saveable  # a block keeps only its inputs
POLICIES = {"leaf": _dot_or_conv, "block": REMAT_POLICY}


def blocks(model: nnx.Module) -> list[nnx.Module]:
    """The modules ``model.remat=blocks`` rematerialises: those held in a list of modules
    (``nnx.List``, a list or a tuple attribute), the outermost where lists nest."""
    found: list[tuple[tuple, nnx.Module]] = []
    by_depth = sorted(nnx.iter_modules(model), key=lambda item: len(item[0]))
    for path, module in by_depth:  # outer modules first
        if not path or not isinstance(path[-1], int):
            continue
        if any(path[: len(outer)] == outer for outer, _ in found):
            continue
        found.append((tuple(path), module))
    return [module for _, module in found]


def rematerialise_blocks(model: nnx.Module) -> nnx.Module:
    """``model`` with each of its :func:`blocks` called as a unit that keeps only its inputs
    (its activations recomputed in the backward pass); raises ``ValueError`` when it holds
    none. The modules' classes change in place (a subclass each); call it on a model merged
    for one step, as the train step does."""
    found = blocks(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} holds no list of modules (its repeated blocks, e.g. "
            "self.blocks = nnx.List([...])) for model.remat=blocks to recompute"
        )
    for module in found:
        if getattr(type(module), "_jddp_unit", None) != "block":  # not twice
            _make_unit(module, "block")
    return model


def bind_leaf_holders(model: nnx.Module) -> nnx.Module:
    """``model`` (merged with the whole parameters of the active :class:`Plan`) with each leaf
    holder called as a unit that gathers its parameters where it runs; unchanged without an
    active plan. Blocks already rematerialised gather for the leaf holders inside them."""
    plan = _PLAN.get()
    if plan is None or not plan.arrays:
        return model
    inside_blocks = {
        id(inner)
        for _, module in nnx.iter_modules(model)
        if getattr(type(module), "_jddp_unit", None) == "block"
        for _, inner in nnx.iter_modules(module)
    }
    for _, module in nnx.iter_modules(model):
        if id(module) in inside_blocks or getattr(type(module), "_jddp_unit", None):
            continue
        if _holds_split_leaf_params(module, plan):
            _make_unit(module, "leaf")
    return model


def _holds_split_leaf_params(module: nnx.Module, plan: Plan) -> bool:
    """Whether ``module`` holds split parameters itself and none in its sub-modules."""
    own = [v for v in vars(module).values() if isinstance(v, nnx.Param)]
    if not any(id(v.get_value()) in plan.arrays for v in own):
        return False
    return len(jax.tree.leaves(nnx.state(module, nnx.Param))) == len(own)


def _make_unit(module: nnx.Module, kind: str) -> None:
    """Turn ``module`` into a unit of ``kind`` (``leaf`` or ``block``): its class becomes a
    subclass whose ``__call__`` runs the class's own as :func:`_run_unit` does."""
    cls = type(module)
    key = (cls, kind)
    if key not in _UNIT_CLASSES:
        own_call = cls.__call__

        def __call__(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
            return _run_unit(self, own_call, args, kwargs, kind)

        namespace = {
            "__call__": __call__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_jddp_unit": kind,
        }
        # the class's own choice of pytree=False (flax's default for a subclass is True)
        pytree = getattr(cls, "_pytree__is_pytree", None)
        metaclass: Callable[..., type] = type(cls)  # cls's, flax's (mypy calls no type(cls))
        _UNIT_CLASSES[key] = metaclass(
            cls.__name__, (cls,), namespace, **({} if pytree is None else {"pytree": pytree})
        )
    module.__class__ = _UNIT_CLASSES[key]


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray)


def _run_unit(module: nnx.Module, own_call: Callable, args: tuple, kwargs: dict, kind: str) -> Any:
    """``own_call(module, *args, **kwargs)`` inside ``jax.checkpoint`` with ``kind``'s policy,
    the split parameters of the active plan gathered there from their slices; the plain call
    where that cannot be done (see the module docstring), or for a leaf holder with nothing
    split."""
    plan = _PLAN.get()
    # flax types split's states as a variadic tuple; two filters give exactly three parts
    graphdef, params, others = nnx.split(module, nnx.Param, ...)  # type: ignore[misc]
    param_leaves, params_def = jax.tree.flatten(params)
    arrays = plan.arrays if plan is not None else {}
    split = {i: arrays[id(x)] for i, x in enumerate(param_leaves) if id(x) in arrays}
    arg_leaves, args_def = jax.tree.flatten((args, kwargs), is_leaf=_is_graph_node)
    if (kind == "leaf" and not split) or any(_is_graph_node(x) for x in arg_leaves):
        return own_call(module, *args, **kwargs)
    other_leaves, others_def = jax.tree.flatten(others)
    inputs = [x for x in arg_leaves if _is_array(x)]
    statics: list[Any] = []  # the output's leaves that are not arrays, set when traced

    def region(param_in: list, other_in: list, array_in: list) -> tuple[list, list]:
        if split:  # the gathers wait for the layer's inputs (XLA would run them all first)
            param_in, array_in = jax.lax.optimization_barrier((param_in, array_in))
        whole = list(param_in)
        for i, (_, _, axis) in split.items():
            assert plan is not None  # split names arrays of the active plan
            whole[i] = plan.gather(param_in[i], axis)
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
        new_others, new_def = jax.tree.flatten(nnx.split(copy, nnx.Param, ...)[2])  # type: ignore[misc]
        statics[:] = [out_def, [None if _is_array(x) else x for x in out_leaves], new_def]
        return [x for x in out_leaves if _is_array(x)], new_others

    param_in = list(param_leaves)
    for i, (_, piece, _) in split.items():
        param_in[i] = piece
    out_arrays, new_others = jax.checkpoint(region, policy=POLICIES[kind])(
        param_in, other_leaves, inputs
    )
    out_def, out_leaves, new_def = statics
    nnx.update(module, jax.tree.unflatten(new_def, new_others))
    got = iter(out_arrays)
    return jax.tree.unflatten(out_def, [next(got) if x is None else x for x in out_leaves])
