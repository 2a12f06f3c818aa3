"""Optax optimizer and learning-rate schedule from the ``optim`` config section.

Any layout of the train state (``dist.shard``) takes these and any other optax transformation
as they are: the update runs on the global arrays, which XLA partitions (:mod:`jddp.step`), so
LARS's and LAMB's trust ratios and the global norms see whole arrays under every layout.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jddp.config import OptimConfig


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
    ``lamb``: ``optax.lamb`` (You et al. 2019). Weight decay applies to
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
        tx = optax.lars(
            schedule,
            weight_decay=cfg.weight_decay,
            weight_decay_mask=mask or True,
            trust_coefficient=cfg.trust_coefficient,
            trust_ratio_mask=mask or True,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
        )
    elif cfg.name == "lamb":
        tx = optax.lamb(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=mask)
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
