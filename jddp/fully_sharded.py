"""``dist.shard=full``: parameters, gradients and optimizer state split over the devices
(ZeRO-3, PyTorch's FSDP, the ``fsdp`` axis of MaxText and levanter).

At rest each device holds 1/N of every array that splits (:meth:`ShardLayout.axis`, as
``dist.shard=optimizer`` splits the optimizer state) and the whole of the rest. In the step,
per device and per micro-batch:

1. each split parameter is all-gathered inside the call of the module that holds it
   (:mod:`jddp.gather_at_use`: one ``all_gather`` per array, :func:`gather`, in a
   ``jax.checkpoint`` per module whose policy, :func:`_unit_policy`, keeps only what matrix
   products and convolutions make), and gathered again where that
   module's backward pass runs, so the whole model is never gathered at once (FSDP's
   ``reshard_after_forward``); a parameter read outside its module's call reads a copy
   gathered as the step begins. On XLA:CPU the step is compiled with the optimization
   barriers kept (:meth:`FullShardLayout.compiler_options`: XLA:CPU would otherwise merge
   each second gather into the first);
2. the gathered parameter's gradient goes back through the gather's transpose, a
   reduce-scatter: the device receives the sum over devices of its slice's gradient, divided
   once as ``pmean`` divides (through gloo on CPUs all split parameters are gathered at once
   by one packed ``all_gather`` per dtype, :func:`gather_packed`, whose backward all-reduces
   the gradients in one buffer per dtype, then slices: gloo's reduce-scatter is unreliable,
   jax issue 40830, and its latency is paid per collective); whole arrays are all-reduced as
   in the replicated step.
   The transpose sends the parameters' dtype: ``dist.grad_allreduce_dtype=bfloat16`` is
   refused;
3. each device updates its slices with its slices of the optimizer state; nothing is gathered
   after the update.

Why per-array gathers inside ``shard_map`` rather than XLA's SPMD partitioner over sharding
annotations (MaxText, levanter): the step stays the replicated step's code with one line
changed, so it keeps that step's exact weighted means, model-state sync, NaN guard and
collective choices (gloo's reduce-scatter avoided), and it needs no per-model annotation; the
partitioner would choose its own collectives per op, which we could not keep equal to the
replicated run's losses on every topology. docs/performance.md has the measurements.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jddp.comm.base import fused
from jddp.gather_at_use import bind as bind_at_use
from jddp.gather_at_use import gathering_at_use
from jddp.layout import GradsIO, keep_checkpoint_barriers, to_varying
from jddp.mesh import DATA_AXIS
from jddp.sharded_update import ShardLayout
from jddp.state import TrainState

PyTree = Any
GATHERED = "jddp/gathered"  # the checkpoint name of a gathered parameter: never saved


def gather(x: jax.Array, axis: int) -> jax.Array:
    """Inside ``shard_map``: this device's slice ``x`` of an array split along ``axis`` over
    ``data`` -> the whole array; its transpose (the gradient's way back) gives each device the
    *sum* over devices of its slice's gradient, a reduce-scatter. A plain primitive, not a
    ``custom_vjp``: ``jax.checkpoint`` recomputes it in the backward pass (it keeps a
    ``custom_vjp``'s outputs from the forward pass). Through gloo: :func:`gather_packed`."""
    return jax.lax.all_gather(x, DATA_AXIS, axis=axis, tiled=True)


def gather_packed(slices: list[jax.Array], axes: list[int], shards: int) -> list[jax.Array]:
    """The whole arrays of several split ones at once, for gloo (XLA:CPU across processes):
    forward, one ``all_gather`` per dtype of each device's slices packed into one buffer;
    backward, the whole gradients all-reduced as one buffer per dtype (as the replicated step
    sends them, :func:`jddp.comm.base.fused`), then each device keeps its slices.

    Why not :func:`gather` per array: its transpose is a reduce-scatter, and gloo's is
    unreliable (jax issue 40830); and gloo pays each collective's latency (a few ms on one
    machine) once per array. Why a ``custom_vjp``: a ``psum``-made gather differentiates into
    a ``psum`` that XLA:CPU splits back into one all-reduce per array (a 4-layer GPT's step:
    55 gloo calls, 0.2 s of its 0.5 s, measured 2026-11-27). Every array is whole at once
    (not gathered per module, :mod:`jddp.gather_at_use`): each gloo call costs a few ms, and
    CPU processes are where memory is least scarce."""
    return _packed_gather(tuple(axes), shards)(list(slices))


def _packed_gather(axes: tuple[int, ...], shards: int) -> Callable:
    """:func:`gather_packed` for slices split along ``axes`` over ``shards`` devices."""

    def gather_all(slices: list[jax.Array]) -> list[jax.Array]:
        out: list[jax.Array | None] = [None] * len(slices)
        by_dtype: dict[Any, list[int]] = {}
        for i, x in enumerate(slices):
            by_dtype.setdefault(jnp.dtype(x.dtype), []).append(i)
        for idx in by_dtype.values():
            mine = jnp.concatenate([jnp.ravel(jnp.moveaxis(slices[i], axes[i], 0)) for i in idx])
            rows = jax.lax.all_gather(mine, DATA_AXIS)  # [shards, mine.size], device order
            offset = 0
            for i in idx:
                x, k = slices[i], axes[i]
                local = jnp.moveaxis(x, k, 0).shape  # the slice with its split axis first
                part = rows[:, offset : offset + x.size].reshape(shards, *local)
                whole = part.reshape(shards * local[0], *local[1:])  # row blocks in device order
                out[i] = jnp.moveaxis(whole, 0, k)
                offset += x.size
        return out

    @jax.custom_vjp
    def packed(slices: list[jax.Array]) -> list[jax.Array]:
        return gather_all(slices)

    def forward(slices: list[jax.Array]) -> tuple[list[jax.Array], None]:
        return gather_all(slices), None

    def backward(_: None, whole_grads: list[jax.Array]) -> tuple[list[jax.Array]]:
        sums = fused(lambda flat: jax.lax.psum(flat, DATA_AXIS), list(whole_grads))
        me = jax.lax.axis_index(DATA_AXIS)
        mine = []
        for g, k in zip(sums, axes, strict=True):
            rows = jnp.moveaxis(g, k, 0)
            rows = rows.reshape(shards, rows.shape[0] // shards, *rows.shape[1:])
            mine.append(jnp.moveaxis(jax.lax.dynamic_index_in_dim(rows, me, 0, False), 0, k))
        return (mine,)

    packed.defvjp(forward, backward)
    return packed


# Operations whose outputs the backward pass recomputes rather than keeps: the gather itself
# (``all_gather``, or gloo's ``psum``: ``jax.checkpoint`` asks about the collective's output,
# not the name given to it), and the cheap reshapes and casts that lead from a gathered
# parameter to the layer that reads it (``nnx.Linear`` casts its kernel to the compute dtype
# first: kept, that copy would hold the whole parameter from the forward pass to the backward
# pass). Activations go through those too: recomputing them from saved inputs costs next to
# nothing; a model's own psum (synced BatchNorm statistics) is recomputed, a few floats.
_RECOMPUTED = frozenset(
    {"all_gather", "psum", "convert_element_type", "reshape", "transpose", "broadcast_in_dim",
     "squeeze", "expand_dims", "copy", "copy_p", "pvary", "pcast"}
)  # fmt: skip


def _policy(prim: Any, *_: Any, **params: Any) -> bool:
    """``jax.checkpoint`` policy of the fully sharded step: save everything but a gathered
    parameter (named :data:`GATHERED`) and the outputs of :data:`_RECOMPUTED`."""
    if prim.name == "name":
        return params.get("name") != GATHERED
    return prim.name not in _RECOMPUTED


def _unit_policy(prim: Any, *_: Any, **__: Any) -> bool:
    """``jax.checkpoint`` policy of one module's call (:mod:`jddp.gather_at_use`): save only
    what matrix products and convolutions make; recompute everything else in the module's
    backward pass from the call's inputs: its gathered parameters (a gather is neither), their
    casts, and the module's cheap elementwise work (BatchNorm's, LayerNorm's). Why not
    :func:`_policy`'s "everything but the cheap ops": with XLA:CPU's optimization barriers
    kept, what it saved could not be fused away (XLA recomputes such elementwise values inside
    its fusions when nothing stands between): ResNet-50's fully sharded step took 2,963 MiB
    (``experiments/bench_memory.py``, 8 devices; 2,176 with every gather at the step's
    start), 1,410 with this policy; the 100M GPT's 852, then 763."""
    return prim.name in ("dot_general", "conv_general_dilated")


@dataclass(frozen=True)
class FullShardLayout(ShardLayout):
    """Where each array lives under ``dist.shard=full``: parameters and optimizer state split
    along :meth:`axis`, the model state and counters whole. The grads stage is
    :class:`ShardLayout`'s (the state in its layout, the gradients out as slices); what
    differs is the layout, the :class:`GradsIO` and the update stage."""

    kind = "full"

    def state_specs(self, state: TrainState) -> TrainState:
        """:class:`ShardLayout`'s (the optimizer state and the EMA split) with the parameters
        split too; the rest whole."""
        return super().state_specs(state).replace(params=self.specs(state.params))

    def grads_io(self, params: PyTree, comm: Any) -> GradsIO:
        """Split parameters gathered where used (and again in the backward pass); their
        gradients come back as this device's slice of the mean; whole ones all-reduced."""
        axes = [self.axis(x.shape) for x in jax.tree.leaves(params)]

        def grads(objective: Callable, local: PyTree) -> tuple[PyTree, Any]:
            leaves, treedef = jax.tree.flatten(local)
            # whole arrays: per-device gradients, as in the replicated step
            start = [
                x if k is not None else to_varying(x) for x, k in zip(leaves, axes, strict=True)
            ]

            def on_slices(slices: list[jax.Array]):
                split = [i for i, k in enumerate(axes) if k is not None]
                full = list(slices)
                if self.reduce_scatter:  # one all_gather per parameter, as the step begins:
                    # what reads outside a module's call get; the modules gather their own
                    plan = {}
                    for i in split:
                        full[i] = checkpoint_name(gather(slices[i], axes[i]), GATHERED)
                        plan[id(full[i])] = (full[i], slices[i], axes[i])
                    with gathering_at_use(plan):
                        return objective(jax.tree.unflatten(treedef, full))
                # through gloo: all at once, one collective per dtype
                packed = gather_packed(
                    [slices[i] for i in split], [axes[i] for i in split], self.num_shards
                )
                for i, x in zip(split, packed, strict=True):
                    full[i] = checkpoint_name(x, GATHERED)
                return objective(jax.tree.unflatten(treedef, full))

            if self.reduce_scatter:
                g, aux = jax.grad(on_slices, has_aux=True)(start)
            else:
                g, aux = jax.grad(jax.checkpoint(on_slices, policy=_policy), has_aux=True)(start)
            return jax.tree.unflatten(treedef, g), aux

        def mean(grads: PyTree, comm: Any) -> PyTree:
            leaves, treedef = jax.tree.flatten(grads)
            whole = [i for i, k in enumerate(axes) if k is None]
            # the split ones: sums over devices since the gather's transpose; divided as pmean
            n = self.num_shards
            out = [g if k is None else g / n for g, k in zip(leaves, axes, strict=True)]
            for i, m in zip(whole, comm.average_grads([leaves[i] for i in whole]), strict=True):
                out[i] = m
            return jax.tree.unflatten(treedef, out)

        def bind(model: Any) -> Any:
            return bind_at_use(model, gather, GATHERED, _unit_policy)

        return GradsIO(grads, mean, bind)

    def compiler_options(self, rematerialises: bool) -> dict[str, str] | None:
        """With per-parameter gathers: :func:`jddp.layout.keep_checkpoint_barriers`, whatever
        the model does (they hold each module's second gather apart from its first,
        :mod:`jddp.gather_at_use`; XLA:CPU would otherwise merge them, every gathered
        parameter then held from the forward pass to the backward pass). Through gloo none,
        even where the model rematerialises: the whole forward pass is one checkpoint there,
        and kept apart every gather of its backward pass would run as that pass begins."""
        return keep_checkpoint_barriers(self.mesh) if self.reduce_scatter else None

    def update_stage(self, make_update: Callable) -> Callable:
        """The optimizer stage run by every device on its slices; the parameters stay split."""
        update_slices = make_update(self.tree_norm, self.all_finite)

        def stage(state: TrainState, grads, stats, terms) -> tuple[TrainState, PyTree]:
            specs = self.state_specs(state)
            return jax.shard_map(
                update_slices,
                mesh=self.mesh,
                in_specs=(specs, self.specs(grads), P(), P()),
                out_specs=(specs, P()),
            )(state, grads, stats, terms)

        return stage
