"""Pure train and eval steps: ``(state, batch) -> (state, metrics)`` under ``jax.shard_map``.

Parameters and optimizer state are replicated (``P()``); the batch is split over the mesh axis
``data``. Each device runs forward and backward on its slice; gradients are averaged in one
place, ``comm.average_grads`` inside :func:`make_train_step`'s ``grads_stage``.

Why the parameters are cast to *varying* before ``grad``: inside ``shard_map`` the gradient of
a replicated (``P()``) input is already summed over devices by autodiff, so a ``pmean`` after
it would return N times the mean gradient. Casting makes autodiff return per-device
gradients, and the explicit ``pmean`` is then the one and only reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jddp.comm import Comm
from jddp.errors import DataConfigError
from jddp.mesh import DATA_AXIS
from jddp.run.stop import STOP_KEY
from jddp.state import MODEL_STATE, ModelDef, TrainState

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
LossFn = Callable[[jax.Array, jax.Array], jax.Array]


def cross_entropy_loss(label_smoothing: float = 0.0) -> LossFn:
    """Per-example softmax cross-entropy ``(logits_BxK, labels_B) -> loss_B``.

    With ``label_smoothing > 0`` the one-hot targets are smoothed towards uniform.
    """

    def loss_fn(logits_BxK: jax.Array, labels_B: jax.Array) -> jax.Array:
        logits_BxK = logits_BxK.astype(jnp.promote_types(logits_BxK.dtype, jnp.float32))
        if label_smoothing == 0.0:
            return optax.softmax_cross_entropy_with_integer_labels(logits_BxK, labels_B)
        targets = optax.smooth_labels(
            jax.nn.one_hot(labels_B, logits_BxK.shape[-1]), label_smoothing
        )
        return optax.softmax_cross_entropy(logits_BxK, targets)

    return loss_fn


@dataclass(frozen=True)
class PixelNorm:
    """How a batch's images become the model's input, on the device inside the jitted step.

    Integer images (uint8 pixels 0..255, what sources hand out, so a quarter of the float bytes
    cross to the device) are scaled to [0, 1] and standardised per channel with ``mean``/``std``
    (on the [0, 1] scale; None: scaling only). Floating images are taken as already normalised.
    Either way the result is cast to the compute dtype.
    """

    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    @classmethod
    def of(cls, source: Any) -> PixelNorm:
        """The normalisation a source declares through its ``mean``/``std`` attributes."""
        return cls._of(getattr(source, "mean", None), getattr(source, "std", None))

    @classmethod
    def _of(cls, mean: Any, std: Any) -> PixelNorm:
        if mean is None or std is None:
            return cls()
        return cls(tuple(float(m) for m in mean), tuple(float(s) for s in std))

    def to_json(self) -> dict[str, list[float] | None]:
        """``{"mean": [...] | None, "std": [...] | None}``: how checkpoints record it."""
        return {
            "mean": None if self.mean is None else list(self.mean),
            "std": None if self.std is None else list(self.std),
        }

    @classmethod
    def from_json(cls, saved: dict[str, Any]) -> PixelNorm:
        """The inverse of :meth:`to_json`."""
        return cls._of(saved.get("mean"), saved.get("std"))

    def check_channels(self, shape: Sequence[int], who: str) -> None:
        """Refuse images ``shape`` ``[N, H, W, C]`` whose C differs from the normalisation's
        channels: its per-channel mean/std would silently broadcast 1-channel images to 3
        (``DataConfigError`` naming ``who``, the expected and the given shape)."""
        channels = len(self.mean) if self.mean is not None else None
        if channels is not None and channels != 1 and shape[-1] != channels:
            raise DataConfigError(
                f"{who}: expected images [N, H, W, {channels}] (the pixel mean/std have "
                f"{channels} channels), got shape {list(shape)}"
            )

    def __call__(self, images: jax.Array, dtype: Any) -> jax.Array:
        if not jnp.issubdtype(images.dtype, jnp.integer):
            return images.astype(dtype)
        x = images.astype(jnp.float32)
        if self.mean is None:
            return (x * (1.0 / 255.0)).astype(dtype)
        std = jnp.asarray(self.std, jnp.float32)
        scale = 1.0 / (255.0 * std)
        shift = -jnp.asarray(self.mean, jnp.float32) / std
        return (x * scale + shift).astype(dtype)


NONFINITE_KEY = "train/nonfinite"  # 1.0 when this step's update was dropped


def _all_finite(tree: Any) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _to_varying(tree: Any) -> Any:
    return jax.lax.pcast(tree, DATA_AXIS, to="varying")


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
    synced = [x if jnp.issubdtype(x.dtype, jnp.inexact) else jax.lax.pmax(x, DATA_AXIS)
              for x in leaves]  # fmt: skip
    for i, x in zip(floating, averaged, strict=True):
        synced[i] = x
    return jax.tree.unflatten(treedef, synced)


def _accumulate(local_grads: Callable, params, model_state, images, labels, k: int):
    """``local_grads`` over ``k`` micro-batches of this device's rows: gradients and metrics
    are means over them, the model state carries from one micro-batch to the next."""
    if k == 1:
        return local_grads(params, model_state, images, labels)

    def micro(x: jax.Array) -> jax.Array:
        return x.reshape(k, -1, *x.shape[1:])

    def body(carry, mb):
        g_sum, stats, m_sum = carry
        g, stats, m = local_grads(params, stats, *mb)
        return (jax.tree.map(jnp.add, g_sum, g), stats, jax.tree.map(jnp.add, m_sum, m)), None

    shapes = jax.eval_shape(local_grads, params, model_state, micro(images)[0], micro(labels)[0])
    zeros = jax.tree.map(lambda a: _to_varying(jnp.zeros(a.shape, a.dtype)), shapes)
    (grads, stats, metrics), _ = jax.lax.scan(
        body, (zeros[0], _to_varying(model_state), zeros[2]), (micro(images), micro(labels))
    )
    grads, metrics = jax.tree.map(lambda x: x / k, (grads, metrics))
    return grads, stats, metrics


def _make_update_stage(tx: optax.GradientTransformation, schedule: optax.Schedule | None):
    """The optimizer stage: ``(state, grads, model_state, metrics) -> (state, metrics)``."""

    def update_stage(state: TrainState, grads, stats, metrics):
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A non-finite loss or gradient drops the whole update, identically on every replica
        # (all of them see the same averaged values), so the state never holds NaNs.
        finite = jnp.isfinite(metrics["train/loss"]) & _all_finite(grads)
        params, opt_state, stats = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old),
            (params, opt_state, stats),
            (state.params, state.opt_state, state.model_state),
        )
        skipped = state.skipped_steps + (~finite).astype(jnp.int32)
        metrics = {
            **metrics,
            NONFINITE_KEY: (~finite).astype(jnp.float32),
            "train/skipped_steps": skipped,
            "train/grad_norm": optax.tree.norm(grads),  # of the averaged gradient
            "train/param_norm": optax.tree.norm(params),
        }
        if schedule is not None:
            metrics["train/lr"] = schedule(state.step)
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            model_state=stats,
            opt_state=opt_state,
            skipped_steps=skipped,
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
        return self.run.lower(state, batch)


def make_train_step(
    model_def: ModelDef,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    comm: Comm,
    *,
    loss_fn: LossFn | None = None,
    metrics_fn: Callable[[jax.Array, jax.Array], dict[str, jax.Array]] | None = None,
    grad_accum_steps: int = 1,
    compute_dtype: Any = jnp.float32,
    schedule: optax.Schedule | None = None,
    pixel_norm: PixelNorm = PixelNorm(),
) -> TrainStep:
    """Build the data-parallel train step ``(state, batch) -> (state, metrics)``.

    ``batch`` holds ``images`` [B,H,W,C] (uint8 pixels, normalised on the device by
    ``pixel_norm``, or float) and ``labels`` [B] sharded over ``data``; B is the global batch.
    Each device splits its slice into ``grad_accum_steps`` micro-batches, sums
    their gradients, and the averaged gradient is applied once. Returned metrics are means
    over the whole global batch: ``train/loss``, ``train/accuracy``, ``train/nonfinite`` (1
    when the update was dropped because the loss or a gradient was not finite),
    ``train/skipped_steps``, ``train/grad_norm`` (of the averaged gradient), ``train/param_norm``
    (after the update) (and ``train/lr``). An optional ``batch["sys/stop"]`` (one flag per
    row, each process filling its rows) comes back as ``metrics["sys/stop"] > 0`` when any
    process asked to stop, so all processes agree on the step. The model's mutable state
    (BatchNorm statistics, RNG counters, custom variables) carries through the micro-batches
    and comes back synced over devices; each device draws its own random numbers. The state
    argument is donated. Returns a :class:`TrainStep`: call it, or reach its stages.
    """
    loss_fn = loss_fn or cross_entropy_loss()

    def local_grads(params, model_state, images, labels):
        def objective(p):
            model = model_def.merge(p, model_state, comm.device_index())
            model.train()
            logits = model(pixel_norm(images, compute_dtype))
            loss_B = loss_fn(logits, labels)
            extra = {"accuracy": (jnp.argmax(logits, -1) == labels).astype(jnp.float32)}
            if metrics_fn is not None:
                extra.update(metrics_fn(logits, labels))
            extra = {f"train/{k}": v.astype(jnp.float32).mean() for k, v in extra.items()}
            return loss_B.mean(), (nnx.state(model, MODEL_STATE), extra)

        (loss, (new_stats, extra)), grads = jax.value_and_grad(objective, has_aux=True)(
            _to_varying(params)
        )
        return grads, new_stats, {"train/loss": loss, **extra}

    def per_device(state: TrainState, images, labels):
        grads, stats, metrics = _accumulate(
            local_grads, state.params, state.model_state, images, labels, grad_accum_steps
        )
        # The one place where gradients are averaged across devices (and processes).
        grads = comm.average_grads(grads)
        stats = _sync_model_state(comm, stats)
        return grads, stats, metrics

    def per_device_batch(state: TrainState, batch: Batch):
        grads, stats, metrics = per_device(state, batch["images"], batch["labels"])
        if STOP_KEY in batch:  # any process asking to stop: the mean over devices is > 0
            metrics[STOP_KEY] = jnp.max(batch[STOP_KEY]).astype(jnp.float32)
        return grads, stats, comm.average(metrics)

    grads_stage = jax.shard_map(
        per_device_batch, mesh=mesh, in_specs=(P(), P(DATA_AXIS)), out_specs=P()
    )

    update_stage = _make_update_stage(tx, schedule)
    return TrainStep(grads_stage, update_stage, comm.compose(grads_stage, update_stage))


def make_eval_step(
    model_def: ModelDef,
    mesh: Mesh,
    *,
    loss_fn: LossFn | None = None,
    compute_dtype: Any = jnp.float32,
    pixel_norm: PixelNorm = PixelNorm(),
) -> Callable[[TrainState, Batch], Metrics]:
    """Build the eval step ``(state, batch) -> sums``.

    ``batch`` carries ``mask`` [B] (1 for real examples, 0 for padding), so a padded last batch
    counts each real example exactly once. Returns global *sums* ``loss_sum``, ``correct``,
    ``count`` and, when the model has more than 5 outputs, ``correct_top5`` (the label is among
    the 5 largest logits); the caller divides after the last batch.
    """
    loss_fn = loss_fn or cross_entropy_loss()

    def per_device(state: TrainState, batch: Batch) -> Metrics:
        model = model_def.merge(state.params, state.model_state)
        model.eval()
        logits = model(pixel_norm(batch["images"], compute_dtype))
        mask = batch["mask"].astype(jnp.float32)
        loss = loss_fn(logits, batch["labels"])
        correct = (jnp.argmax(logits, -1) == batch["labels"]).astype(jnp.float32)
        sums = {
            "loss_sum": (loss * mask).sum(),
            "correct": (correct * mask).sum(),
            "count": mask.sum(),
        }
        if logits.shape[-1] > 5:
            top5_Bx5 = jax.lax.top_k(logits, 5)[1]
            in_top5 = jnp.any(top5_Bx5 == batch["labels"][:, None], axis=-1)
            sums["correct_top5"] = (in_top5.astype(jnp.float32) * mask).sum()
        return jax.lax.psum(sums, DATA_AXIS)

    return jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(DATA_AXIS)), out_specs=P())
    )
