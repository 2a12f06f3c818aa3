"""Pure train and eval steps: ``(state, batch) -> (state, metrics)`` under ``jax.shard_map``.

The batch is split over every device (the mesh axes :data:`jddp.mesh.DATA_AXES`); where the
parameters and optimizer state live is the layout's business (``dist.shard``,
:mod:`jddp.shard`: whole on every device, the optimizer state split, or everything split).
The step has two stages. The *grads stage*, under ``shard_map``: each device runs forward and
backward on its rows; gradients become the mean each device keeps in one place,
``layout.mean`` (an all-reduce, or a reduce-scatter). The *update stage*, on the global
arrays: the optimizer's update, which XLA partitions as the layout lays the arrays out
(``layout.update_specs``), so a statistic over a whole array (a global norm, a trust ratio, a
factored moment) is the whole array's under every layout. What the model and the batch mean is
the task's business (:mod:`jddp.tasks`): it returns per-example losses and metrics, with
optional weights; the step turns them into exact weighted means over the global batch
(:mod:`jddp.weighted`).

Why the parameters are cast to *varying* before ``grad``: inside ``shard_map`` the gradient of
a replicated (``P()``) input is already summed over devices by autodiff, so a ``pmean`` after
it would return N times the mean gradient. Casting makes autodiff return per-device
gradients, and the explicit ``pmean`` is then the one and only reduction.

A batch is ``{"data": pytree, "sys/stop": [B] (train, optional flags), "mask": [B] (eval)}``;
the task gets ``data``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jddp import weighted
from jddp.comm import Comm
from jddp.mesh import DATA_AXES
from jddp.models.batchnorm import group_batchnorms
from jddp.models.units import rematerialise_blocks
from jddp.shard.base import StateLayout, to_varying
from jddp.shard.replicated import Replicated
from jddp.state import MODEL_STATE, ModelDef, TrainState
from jddp.tasks import Task
from jddp.tasks.classification import ClassificationTask

Batch = dict[str, Any]
Metrics = dict[str, jax.Array]
MASK_KEY = "mask"
DATA_KEY = "data"
# The mean loss weight per example of a step whose loss is weighted, and whether any weight was
# negative: read by the host (jddp.run.hooks.StepReporter), never logged as they are.
LOSS_WEIGHT_KEY = "sys/loss_weight"
NEGATIVE_WEIGHT_KEY = "sys/negative_weight"


def negative_weight_key(name: str) -> str:
    """The flag of a weighted metric ``name``: whether any of its weights was negative."""
    return f"{NEGATIVE_WEIGHT_KEY}/{name}"


def negative_weight_flags(named: weighted.Named, mask: Any = None) -> dict[str, jax.Array]:
    """Per weighted metric of the task (the loss aside: :data:`NEGATIVE_WEIGHT_KEY`), 1 when a
    (real, ``mask``) row's weight was negative: refused as the loss's are, whatever the
    reduction (a weight counts what its example stands for)."""
    flags = {}
    for name, metric in named.items():
        if name != "loss" and metric.weights is not None:
            negative = metric.weights < 0
            if mask is not None:
                negative = negative & (mask > 0)
            flags[negative_weight_key(name)] = jnp.any(negative).astype(jnp.float32)
    return flags


def pop_negative_weights(values: dict[str, Any]) -> str | None:
    """Pop the flags of :func:`negative_weight_flags` from a step's or an eval's host values;
    the first metric (by name) whose weights were negative, or None."""
    prefix = negative_weight_key("")
    flagged = sorted(k for k in values if k.startswith(prefix))
    negative = [k[len(prefix) :] for k in flagged if values.pop(k) > 0]
    return negative[0] if negative else None


def batch_data(batch: Batch) -> Any:
    """The task's part of a step's batch (see the module docstring)."""
    if not isinstance(batch, dict) or DATA_KEY not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise TypeError(
            f"a step's batch is {{'data': <the task's batch>, ...}} (jddp.step), got {keys}: "
            "pass {'data': batch} (a flat {'images', 'labels'} dict is no longer taken)"
        )
    return batch[DATA_KEY]


NONFINITE_KEY = "train/nonfinite"  # 1.0 when this step's update was dropped


def _sync_model_state(comm: Comm, model_state: Any) -> Any:
    """Make the model state every device returns identical.

    Floating variables (BatchNorm statistics, running averages) are averaged: local statistics
    become the global mean, synced ones are already equal and stay so. Integer variables (RNG
    counters, step counters) advance the same way on every device; ``pmax`` only tells the
    type system so (exact, unlike a mean) when they went through per-device code.
    """

    leaves, treedef = jax.tree.flatten(model_state)
    floating = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]
    averaged = comm.average([leaves[i] for i in floating])  # one collective where fused
    synced = [x if jnp.issubdtype(x.dtype, jnp.inexact) else jax.lax.pmax(x, DATA_AXES)
              for x in leaves]  # fmt: skip
    for i, x in zip(floating, averaged, strict=True):
        synced[i] = x
    return jax.tree.unflatten(treedef, synced)


def _accumulate(local_grads: Callable, params, model_state, data, k: int):
    """``local_grads`` over ``k`` micro-batches of this device's rows: gradients and mean
    terms are means over them (sums add, extremes stay extremes: :func:`jddp.weighted.combine`),
    the model state carries from one micro-batch to the next."""
    if k == 1:
        return local_grads(params, model_state, data)

    def micro(tree: Any) -> Any:
        return jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), tree)

    def body(carry, mb):
        g_sum, stats, m_sum = carry
        g, stats, m = local_grads(params, stats, mb)
        return (jax.tree.map(jnp.add, g_sum, g), stats, weighted.combine(m_sum, m)), None

    first = jax.tree.map(lambda x: x[0], micro(data))
    shapes = jax.eval_shape(local_grads, params, model_state, first)
    zeros = jax.tree.map(lambda a: to_varying(jnp.zeros(a.shape, a.dtype)), shapes)
    # The metric terms start from each kind's identity (0 for sums, -inf for maxima, ...).
    metrics0 = {
        key: to_varying(jnp.full(a.shape, weighted.identity(weighted.reduction_of(key)), a.dtype))
        for key, a in shapes[2].items()
    }
    (grads, stats, metrics), _ = jax.lax.scan(
        body, (zeros[0], to_varying(model_state), metrics0), micro(data)
    )
    grads = jax.tree.map(lambda x: x / k, grads)
    return grads, stats, weighted.scale_means(metrics, 1 / k)


def injected_lr(opt_state: Any) -> jax.Array | None:
    """The ``learning_rate`` of an ``optax.inject_hyperparams`` optimizer anywhere in
    ``opt_state`` (a chain's states included), or None."""
    if hasattr(opt_state, "hyperparams") and "learning_rate" in opt_state.hyperparams:
        return jnp.asarray(opt_state.hyperparams["learning_rate"], jnp.float32)
    if isinstance(opt_state, (tuple, list)):
        for inner in opt_state:
            found = injected_lr(inner)
            if found is not None:
                return found
    return None


CLIPPED_KEY = "train/clipped"  # 1.0 when this step's gradient was clipped (optim.clip_grad_norm)


def ema_decay_at(step: jax.Array, decay: float, warmup: bool) -> jax.Array:
    """The EMA's decay for the update after ``step`` updates: ``decay``, or with ``warmup``
    ``min(decay, (1 + step) / (10 + step))`` (TensorFlow's ``ExponentialMovingAverage`` with
    ``num_updates``): the first updates move the average most."""
    d = jnp.asarray(decay, jnp.float32)
    if warmup:
        n = step.astype(jnp.float32)
        d = jnp.minimum(d, (1 + n) / (10 + n))
    return d


def computed_once(flag: jax.Array) -> jax.Array:
    """The boolean scalar ``flag``, computed once in the compiled step however many arrays
    select on it.

    XLA fuses a cheap scalar producer into every consumer: the non-finite check's and-chain over
    the gradient's leaves was copied into the select of each parameter, optimizer and model
    state array (the tests' ResNet-10 step: 4,001 of its 16,590 HLO instructions were that
    chain's ``and``, 5,786 the fusions' parameters). A square root is an op XLA does not
    duplicate, so the chain stays in the one fusion that ends in it; sqrt(1) > 0 and not
    sqrt(0) > 0: the same flag."""
    return jnp.sqrt(flag.astype(jnp.float32)) > 0


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of ``tree`` is finite."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def keep_checkpoint_barriers(mesh: Mesh) -> dict[str, str] | None:
    """XLA options for a step whose ``jax.checkpoint`` recomputations must stay apart from the
    forward pass: where ``mesh``'s devices are CPUs, ``cse_barrier_expander`` disabled
    (XLA:CPU expands the checkpoints' optimization barriers early, then merges each
    recomputation back into the value it recomputes, which keeps the forward pass's values
    alive after all: measured in experiments/RESULTS.md section 9). None elsewhere: XLA:GPU
    keeps the barriers. The passes ``XLA_FLAGS`` disables stay disabled (an option replaces
    the flag's list)."""
    if mesh.devices.flat[0].platform != "cpu":
        return None
    given = re.findall(r"--xla_disable_hlo_passes=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return {"xla_disable_hlo_passes": ",".join([*given, "cse_barrier_expander"])}


def _make_update_stage(
    tx: optax.GradientTransformation,
    schedule: optax.Schedule | None,
    clip_grad_norm: float | None = None,
    ema_decay: float = 0.0,
    ema_warmup: bool = True,
):
    """The optimizer stage: ``(state, grads, model_state, metrics) -> (state, metrics)``, on
    the global arrays (XLA partitions it as they are laid out)."""

    def update_stage(state: TrainState, grads, stats, terms):
        # The averaged terms divided once: exact weighted means over the global batch. A
        # weighted loss's gradient is divided by the same mean weight.
        metrics, weights = weighted.divide(terms)
        if "train/loss" in weights:
            loss_weight = weights["train/loss"]
            grads = jax.tree.map(lambda g: g / loss_weight.astype(g.dtype), grads)
            metrics[LOSS_WEIGHT_KEY] = loss_weight
        grad_norm = optax.tree.norm(grads)  # of the averaged gradient, before any clipping
        if clip_grad_norm is not None:  # as optax.clip_by_global_norm
            clip = jnp.asarray(clip_grad_norm, grad_norm.dtype)
            clipped = grad_norm >= clip
            grads = jax.tree.map(
                lambda g: jnp.where(
                    clipped, g / grad_norm.astype(g.dtype) * clip.astype(g.dtype), g
                ),
                grads,
            )
            metrics[CLIPPED_KEY] = clipped.astype(jnp.float32)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A non-finite loss or gradient drops the whole update, identically on every replica
        # (all of them see the same averaged values), so the state never holds NaNs.
        finite = computed_once(jnp.isfinite(metrics["train/loss"]) & all_finite(grads))
        params, opt_state, stats = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old),
            (params, opt_state, stats),
            (state.params, state.opt_state, state.model_state),
        )
        skipped = state.skipped_steps + (~finite).astype(jnp.int32)
        ema = state.ema_params
        if ema is not None:  # elementwise
            decay = ema_decay_at(state.step, ema_decay, ema_warmup)
            ema = jax.tree.map(
                lambda e, p: jnp.where(finite, e + (1 - decay).astype(e.dtype) * (p - e), e),
                ema,
                params,
            )
        metrics = {
            **metrics,
            NONFINITE_KEY: (~finite).astype(jnp.float32),
            "train/skipped_steps": skipped,
            "train/grad_norm": grad_norm,
            "train/param_norm": optax.tree.norm(params),
        }
        if schedule is not None:
            metrics["train/lr"] = schedule(state.step)
        elif (injected := injected_lr(opt_state)) is not None:
            metrics["train/lr"] = injected  # the new state holds the rate this update used
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            model_state=stats,
            opt_state=opt_state,
            skipped_steps=skipped,
            ema_params=ema,
        )
        return new_state, metrics

    return update_stage


@dataclass(frozen=True)
class TrainStep:
    """The data-parallel train step ``(state, batch) -> (state, metrics)`` and its two stages.

    ``grads_stage(state, batch) -> (grads, model_state, metrics)``: per-device forward and
    backward under ``shard_map``, averaged over the mesh (not jitted: benchmarks lower it alone).
    ``update_stage(state, grads, model_state, metrics) -> (state, metrics)``: the optimizer.
    Calling the object runs the step the communication backend assembled from them.
    """

    grads_stage: Callable[[TrainState, Batch], tuple[Any, Any, Metrics]]
    update_stage: Callable[..., tuple[TrainState, Metrics]]
    run: Callable[[TrainState, Batch], tuple[TrainState, Metrics]]

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        return self.run(state, batch)

    def lower(self, state: TrainState, batch: Batch) -> Any:
        """The lowered program of the whole step (one jitted program on the ``xla`` backend)."""
        # run is jax.jit's on the xla backend: a Callable's type has no .lower
        return self.run.lower(state, batch)  # type: ignore[attr-defined]


def task_terms(
    task: Task, model_of: Callable[[], nnx.Module], data: Any, training: bool
) -> tuple[weighted.Named, nnx.Module]:
    """The task's loss and metrics on ``data`` as ``{name: Metric(value_B, weight_B, reduce)}``
    (the loss, a mean, under ``"loss"``), and the model the loss ran on (its state as the forward
    pass left it). ``model_of()`` builds a fresh model in the right mode: the loss gets one, the
    metrics another from the same state (their forward passes are the same computation, which
    XLA merges; the metrics' state changes are dropped)."""
    model = model_of()
    loss_B, weight_B, aux = task.loss_terms(model, data)
    named = {"loss": weighted.Metric(loss_B, weight_B)}
    named.update(task.metric_terms(model_of, data, aux, training))
    return named, model


def _local_grads_fn(
    model_def: ModelDef,
    comm: Comm,
    task: Task,
    layout: StateLayout,
    shapes: Any,
    remat: bool,
    bn_group_size: int | None,
) -> Callable:
    """``(params, model_state, data) -> (grads, new model state, weighted means)`` of one
    micro-batch on one device (inside the step's ``shard_map``); ``layout`` says how the
    device's parameters (whole or its slices; ``shapes``: their full shapes) reach the model;
    ``remat``: the model's blocks recompute their activations in the backward pass;
    ``bn_group_size``: its BatchNorms normalise groups of that many rows."""

    def local_grads(params, model_state, data):
        device = comm.device_index()

        def objective(p):
            def model_of() -> nnx.Module:
                model = group_batchnorms(model_def.merge(p, model_state, device), bn_group_size)
                if remat:  # first: a rematerialised block gathers for the modules inside it
                    rematerialise_blocks(model)
                model = layout.bind(model)
                model.train()
                return model

            named, model = task_terms(task, model_of, data, training=True)
            terms = weighted.means({f"train/{k}": v for k, v in named.items()})
            weight_B = named["loss"].weights
            if weight_B is not None:
                terms[NEGATIVE_WEIGHT_KEY] = jnp.any(weight_B < 0).astype(jnp.float32)
            terms.update(negative_weight_flags(named))
            return terms["train/loss"], (nnx.state(model, MODEL_STATE), terms)

        grads, (new_stats, terms) = layout.gradients(objective, params, shapes, comm)
        return grads, new_stats, terms

    return local_grads


def _shape_of(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def make_train_step(
    model_def: ModelDef,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    comm: Comm,
    *,
    task: Task | None = None,
    grad_accum_steps: int = 1,
    schedule: optax.Schedule | None = None,
    layout: StateLayout | None = None,
    clip_grad_norm: float | None = None,
    ema_decay: float = 0.0,
    ema_warmup: bool = True,
    remat: str = "none",
    bn_group_size: int | None = None,
) -> TrainStep:
    """Build the data-parallel train step ``(state, batch) -> (state, metrics)``.

    ``batch["data"]`` is the task's batch pytree, every leaf sharded over every device along its
    leading axis (B, the global batch); ``task`` (:mod:`jddp.tasks`) computes per-example losses
    and metrics from it (default: :class:`~jddp.tasks.classification.ClassificationTask`,
    cross-entropy over ``images`` [B,H,W,C] and ``labels`` [B]). Each device splits its slice
    into ``grad_accum_steps`` micro-batches, sums their gradients, and the averaged gradient is
    applied once. Returned metrics are weighted means over the whole global batch (``Σ w·x / Σ
    w``, w = 1 unless the task gives weights; a metric's sum, max or min where the task says so,
    :class:`jddp.weighted.Metric`): ``train/loss``, ``train/<metric>`` for each of the task's
    metrics, ``train/nonfinite`` (1 when the update was dropped because the loss or a gradient
    was not finite), ``train/skipped_steps``, ``train/grad_norm`` (of the averaged gradient),
    ``train/param_norm`` (after the update) (and ``train/lr``); with a weighted loss also
    ``sys/loss_weight`` (the mean weight per example) and ``sys/negative_weight`` (> 0 when a
    weight was negative). Every other key of ``batch`` is a per-row flag (one per row, each
    process filling its rows: ``sys/stop`` and the like, :mod:`jddp.proc.signals`) and comes
    back as ``metrics[key] > 0`` when any process raised it, so all processes agree on the step.
    The model's mutable state (BatchNorm statistics, RNG counters, custom variables) carries
    through the micro-batches and comes back synced over devices; each device draws its own
    random numbers. The state argument is donated. Returns a :class:`TrainStep`: call it, or
    reach its stages.

    ``layout`` (``dist.shard``, :mod:`jddp.shard`; default: everything whole on every device)
    says where the state lives (laid out by ``layout.place``) and how gradients become
    updates: all-reduced and applied whole (``none``); reduce-scattered, each device updating
    its slices with its slices of the optimizer state, the parameters all-gathered after
    (``optimizer``); or each parameter gathered where its module runs, its gradient
    reduce-scattered, and every array updated and kept as slices (``full``); the same steps
    with any optax ``tx``. ``clip_grad_norm``: the averaged gradient is scaled to at most this
    global L2 norm before ``tx`` sees it (``optim.clip_grad_norm``; ``train/clipped`` is 1
    where it was). ``ema_decay``, ``ema_warmup``: how the state's ``ema_params`` (when it has
    them, :func:`jddp.state.create_train_state`) follow the parameters (:func:`ema_decay_at`;
    a dropped update leaves them too). ``remat="blocks"`` (``model.remat``): each block of the
    model (a module held in a list of modules, :func:`jddp.models.units.blocks`) recomputes
    its activations in the backward pass; a model with none raises ``ValueError`` as the step
    is traced. ``bn_group_size`` (``model.bn_group_size``): each per-device BatchNorm of the
    model normalises groups of that many rows in training (:mod:`jddp.models.batchnorm`), the
    same groups on any device count; None: each device's micro-batch.
    """
    task = task or ClassificationTask()
    layout = layout or Replicated(mesh)
    rematerialises = remat != "none"

    def grads_stage(state: TrainState, batch: Batch) -> tuple[Any, Any, Metrics]:
        shapes = jax.tree.map(_shape_of, state.params)
        local_grads = _local_grads_fn(
            model_def, comm, task, layout, shapes, rematerialises, bn_group_size
        )

        def per_device(params, model_state, batch: Batch):
            grads, stats, metrics = _accumulate(
                local_grads, params, model_state, batch_data(batch), grad_accum_steps
            )
            # The one place where gradients become the mean each device keeps (whole arrays
            # or its slices), across devices and processes.
            grads = layout.mean(grads, shapes, comm)
            stats = _sync_model_state(comm, stats)
            # Each flag's max over the device's rows: any process's shows in the mean. Sorted:
            # a set's order follows the process's string hashes, and with it the program's
            # text, hence its compilation cache key (each process and restart missed).
            for key in sorted(batch.keys() - {DATA_KEY}):
                metrics[key] = jnp.max(batch[key]).astype(jnp.float32)
            return grads, stats, comm.reduce_terms(metrics)

        specs = layout.state_specs(state)
        return jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(specs.params, specs.model_state, P(DATA_AXES)),
            out_specs=(layout.grad_specs(state.params), P(), P()),
        )(state.params, state.model_state, batch)

    update = _make_update_stage(tx, schedule, clip_grad_norm, ema_decay, ema_warmup)

    def update_stage(state: TrainState, grads, stats, terms) -> tuple[TrainState, Metrics]:
        # XLA partitions the update as the arrays are laid out: each device computes its
        # slices, and a statistic over a whole array adds the slices' parts
        state = layout.constrain(state, layout.update_specs(state))
        new, metrics = update(state, grads, stats, terms)
        # computed as the slices (XLA had gathered both operands of the NaN guard's select:
        # each parameter gathered twice), then laid out as at rest
        new = layout.constrain(new, layout.update_specs(new))
        return layout.at_rest(new, comm), metrics

    barriers = layout.keeps_barriers(comm, rematerialises)
    run = comm.compose(
        grads_stage, update_stage, keep_checkpoint_barriers(mesh) if barriers else None
    )
    return TrainStep(grads_stage, update_stage, run)


def make_eval_step(
    model_def: ModelDef,
    mesh: Mesh,
    *,
    task: Task | None = None,
) -> Callable[[TrainState, Batch], Metrics]:
    """Build the eval step ``(state, batch) -> sums``.

    ``batch`` carries ``mask`` [B] (1 for real examples, 0 for padding), so a padded last batch
    counts each real example exactly once. Returns global *sums* over the batch
    (:func:`jddp.weighted.masked_sums`): ``loss`` and ``loss~w`` (``Σ m·w·loss``, ``Σ m·w``), the
    same pair for each of the task's mean metrics (the classification task: ``accuracy``, and
    ``top5_accuracy`` when the model has more than 5 outputs), ``name~sum``, ``name~max``,
    ``name~min`` for its other metrics, ``count`` (``Σ m``), and with a weighted loss
    ``sys/negative_weight~max`` (1 when a real row's weight was negative); the caller combines
    them over batches (:func:`jddp.weighted.combine`) and divides after the last
    (:func:`jddp.weighted.divide`).
    The model runs in eval mode. Without ``task``: image classification's, cross-entropy.
    """
    task = task or ClassificationTask()

    def per_device(state: TrainState, batch: Batch) -> Metrics:
        def model_of() -> nnx.Module:
            model = model_def.merge(state.params, state.model_state)
            model.eval()
            return model

        named, _ = task_terms(task, model_of, batch_data(batch), training=False)
        mask = batch[MASK_KEY].astype(jnp.float32)
        sums = weighted.masked_sums(named, mask)
        sums["count"] = mask.sum()
        loss_weight = named["loss"].weights
        if loss_weight is not None:  # 1 where a real row's weight is negative (refused)
            negative = jnp.any((mask > 0) & (loss_weight < 0)).astype(jnp.float32)
            sums[weighted.term_key(NEGATIVE_WEIGHT_KEY, "max")] = negative
        for key, flag in negative_weight_flags(named, mask).items():  # the metrics' alike
            sums[weighted.term_key(key, "max")] = flag
        groups = weighted.split(sums)
        for kind, group in groups.items():  # sums add over devices, extremes stay extremes
            groups[kind] = weighted.COLLECTIVE.get(kind, jax.lax.psum)(group, DATA_AXES)
        return weighted.merge(groups)

    per_batch = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(DATA_AXES)), out_specs=P())
    # The optimizer state (and the EMA: evaluated as the params of a state of its own) stays
    # out: unused here, and split over devices under dist.shard
    # optimizer or full (P() would gather it). Split parameters (full) are gathered whole
    # for the eval by the P() in_spec: an eval holds no gradients or optimizer state.
    return jax.jit(
        lambda state, batch: per_batch(state.replace(opt_state=None, ema_params=None), batch)
    )
