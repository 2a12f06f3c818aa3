"""Optax optimizer and learning-rate schedule from the ``optim`` config section.

LARS and LAMB scale each layer's update by a trust ratio of two norms over the whole layer;
here those norms also hold when a device holds only a slice of the layer
(``dist.shard_weight_update``, :mod:`jddp.sharded_update`): :func:`layer_sq_norms` adds the
slices' sums over the mesh axis ``data``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jddp.config import OptimConfig
from jddp.mesh import DATA_AXIS


def split_over_data(x: jax.Array) -> bool:
    """Whether ``x`` is one device's slice of an array split over the mesh axis ``data``:
    inside a ``shard_map`` step its type varies over ``data``; elsewhere never."""
    aval = jax.typeof(x)
    varying = getattr(aval, "vma", None)  # jax < 0.10
    if varying is None:
        varying = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
    return DATA_AXIS in varying


def layer_sq_norms(*trees: Any) -> list[jax.Array]:
    """``Σ|x|²`` of every leaf of ``trees`` (in order), each over its whole array: the leaves
    that are a device's slice of an array split over ``data`` (:func:`split_over_data`) add
    their slices' sums with one ``psum`` per dtype. Outside a ``shard_map`` step it is the
    plain per-leaf sum, computed as ``jnp.linalg.norm`` computes it."""
    leaves = [x for tree in trees for x in jax.tree.leaves(tree)]
    sums = [jnp.sum(jnp.real(x * jnp.conj(x))) for x in leaves]
    by_dtype: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        if split_over_data(x):
            by_dtype.setdefault(sums[i].dtype, []).append(i)
    for idx in by_dtype.values():
        total = jax.lax.psum(jnp.stack([sums[i] for i in idx]), DATA_AXIS)
        for j, i in enumerate(idx):
            sums[i] = total[j]
    return sums


def scale_by_layer_trust_ratio(
    trust_coefficient: float = 1.0, eps: float = 0.0
) -> optax.GradientTransformation:
    """``optax.scale_by_trust_ratio`` (``min_norm`` 0) with its norms over whole layers also
    when a device holds a slice of one (:func:`layer_sq_norms`): each update is scaled by
    ``trust_coefficient * ‖param‖ / (‖update‖ + eps)``, or by 1 where either norm is 0. The
    same values as optax's outside a sharded step; its state is optax's (empty)."""

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("the trust ratio needs the parameters: tx.update(g, s, params)")
        u_leaves, treedef = jax.tree.flatten(updates)
        p_leaves = treedef.flatten_up_to(params)
        sq = layer_sq_norms(u_leaves, p_leaves)
        n = len(u_leaves)

        def scale(u, p, u_sq, p_sq):
            p_norm, u_norm = jnp.sqrt(p_sq), jnp.sqrt(u_sq)
            ratio = trust_coefficient * p_norm / (u_norm + eps)
            zero_norm = jnp.logical_or(p_norm == 0.0, u_norm == 0.0)
            return u * jnp.where(zero_norm, jnp.array(1.0, dtype=p.dtype), ratio)

        scaled = [scale(u_leaves[i], p_leaves[i], sq[i], sq[n + i]) for i in range(n)]
        return jax.tree.unflatten(treedef, scaled), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def lars(
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: float,
    weight_decay_mask: Any,
    trust_coefficient: float,
    trust_ratio_mask: Any,
    momentum: float,
    nesterov: bool,
) -> optax.GradientTransformation:
    """``optax.lars`` (the same chain and state) with :func:`scale_by_layer_trust_ratio`."""
    return optax.chain(
        optax.add_decayed_weights(weight_decay, mask=weight_decay_mask),
        optax.masked(scale_by_layer_trust_ratio(trust_coefficient), mask=trust_ratio_mask),
        optax.scale_by_learning_rate(learning_rate),
        optax.trace(decay=momentum, nesterov=nesterov),
    )


def lamb(
    learning_rate: optax.ScalarOrSchedule,
    b1: float,
    b2: float,
    weight_decay: float,
    mask: Any,
) -> optax.GradientTransformation:
    """``optax.lamb`` (the same chain, defaults and state) with
    :func:`scale_by_layer_trust_ratio`."""
    return optax.chain(
        optax.scale_by_adam(b1=b1, b2=b2, eps=1e-6, eps_root=0.0),
        optax.add_decayed_weights(weight_decay=weight_decay, mask=mask),
        scale_by_layer_trust_ratio(),
        optax.scale_by_learning_rate(learning_rate),
    )


def peak_learning_rate(cfg: OptimConfig, global_batch_size: int) -> float:
    """The peak lr, after the linear scaling rule when ``lr_scaling=linear``.

    Linear scaling (Goyal et al., 2017): ``lr * global_batch_size / base_batch_size``, so a
    recipe tuned at ``base_batch_size`` keeps its per-example step size at other batch sizes.
    """
    if cfg.lr_scaling == "linear":
        return cfg.lr * global_batch_size / cfg.base_batch_size
    return cfg.lr


def make_schedule(cfg: OptimConfig, global_batch_size: int, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 over ``warmup_steps``, then constant or cosine decay to 0."""
    peak = peak_learning_rate(cfg, global_batch_size)
    warmup = min(cfg.warmup_steps, total_steps)
    if cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps=max(total_steps - warmup, 1))
    else:
        after = optax.constant_schedule(peak)
    if warmup == 0:
        return after
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup), after], boundaries=[warmup]
    )


def decayed_params_mask(params: Any) -> Any:
    """``True`` for the parameters that weight decay (and LARS's trust ratio) applies to when
    ``optim.decay_bn_and_bias=false``: the kernels of convolutions and dense layers (two or more
    dimensions); ``False`` for every 1-D parameter, i.e. BatchNorm scales and biases and all
    biases, as the NVIDIA and MLPerf ResNet-50 recipes exclude them."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


def make_optimizer(
    cfg: OptimConfig, global_batch_size: int, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax transformation for ``cfg`` and its schedule (for logging the lr).

    ``sgd``: L2 weight decay added to the gradient, then momentum SGD (the classic ResNet
    recipe). ``adamw``: Adam with decoupled weight decay. ``lars``: ``optax.lars`` (You et al.
    2017, "Large Batch Training of Convolutional Networks": per-layer trust ratio, momentum),
    ``lamb``: ``optax.lamb`` (You et al. 2019), both with trust ratios over whole layers also
    when each device updates a slice (:func:`lars`, :func:`lamb`). Weight decay applies to
    every parameter, biases and BatchNorm scales included, unless ``decay_bn_and_bias=false``:
    then only to :func:`decayed_params_mask`'s, and LARS leaves the others' step unadapted too
    (MLPerf).
    """
    schedule = make_schedule(cfg, global_batch_size, total_steps)
    mask = None if cfg.decay_bn_and_bias else decayed_params_mask
    if cfg.name == "sgd":
        tx = optax.chain(
            optax.add_decayed_weights(cfg.weight_decay, mask=mask),
            optax.sgd(schedule, momentum=cfg.momentum or None, nesterov=cfg.nesterov),
        )
    elif cfg.name == "lars":
        tx = lars(
            schedule,
            weight_decay=cfg.weight_decay,
            weight_decay_mask=mask or True,
            trust_coefficient=cfg.trust_coefficient,
            trust_ratio_mask=mask or True,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
        )
    elif cfg.name == "lamb":
        tx = lamb(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=mask)
    else:
        tx = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=mask)
    return tx, schedule


def describe_optax(tx: optax.GradientTransformation, params: Any) -> str:
    """An optax optimizer, named as well as it can be from outside: the types of its state
    (``ScaleByAdamState+EmptyState``) and the first update it makes of a unit gradient at unit
    parameters (its learning rate, for most), computed on one element per array. The same
    optimizer gives the same text; another transformation or learning rate, another one."""
    probe = jax.tree.map(lambda x: jnp.ones((1,) * jnp.ndim(x), jnp.result_type(x)), params)
    try:
        state = tx.init(probe)
        updates, _ = tx.update(probe, state, probe)
        first = next((float(jnp.ravel(u)[0]) for u in jax.tree.leaves(updates)), None)
    except Exception:  # noqa: BLE001 - a transformation that needs real shapes: name it only
        state, first = jax.eval_shape(tx.init, params), None
    nodes = jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "_fields"))
    types = "+".join(type(n).__name__ for n in nodes if hasattr(n, "_fields")) or "stateless"
    update = "" if first is None else f", a unit gradient's first update {first:.6g}"
    return f"optax {types}{update}"
