"""A trained model in hand: :func:`load` one from a run, :func:`predict` logits with it.

Both work in one process on one device, without a mesh or ``jax.distributed``: the checkpoint's
saved config says how to build the model (or a template module says it), and only the
parameters and model state are read (the optimizer state is not).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jddp import config as config_lib
from jddp.build import build_model
from jddp.checkpoint import Checkpoints
from jddp.checkpoint.weights import (
    damage_named,
    describe_mismatch,
    mismatched_weights,
    open_checkpoint,
)
from jddp.data.pipeline import eval_rows
from jddp.data.source import ArraySource, pixel_images
from jddp.errors import ConfigError
from jddp.state import split_model
from jddp.step import PixelNorm

PathLike = str | Path


def restore_into(
    model: nnx.Module,
    ckpts: Checkpoints,
    step: int,
    key: str,
    use: Callable[[int], str] = lambda step: f"step={step}",
) -> nnx.Module:
    """Set ``model``'s parameters and model state to checkpoint ``step``'s (in place). A
    damaged checkpoint is a ``CheckpointError`` naming ``key``, the checkpoint and the newest
    intact one (``use(step)``: how the caller picks that one)."""
    _, params, model_state = split_model(model)
    weights = {"params": params, "model_state": model_state}
    with damage_named(ckpts, step, lambda _: weights, key, use):
        missing, differ = mismatched_weights(ckpts.weight_shapes(step), weights)
        if missing or differ:
            raise ConfigError(
                f"{key}: checkpoint {ckpts.directory / str(step)} does not fit this model: "
                f"{describe_mismatch(missing, differ)}"
            )
        restored = jax.tree.map(jnp.asarray, ckpts.restore_weights(step, weights))
    nnx.update(model, restored["params"], restored["model_state"])
    return model


def _in_channels(shapes: dict[str, tuple[int, ...]]) -> int:
    """Input channels of a built-in ResNet, from its first convolution's kernel [h, w, C, out]."""
    kernel = shapes.get(".params['conv1']['kernel'].value")
    return kernel[2] if kernel and len(kernel) == 4 else 3


def model_config(saved: dict[str, Any]) -> config_lib.Config:
    """The parts of a checkpoint's saved config that say how to build its model."""
    train = saved.get("train", {})
    precision = {"precision": train["precision"]} if "precision" in train else {}
    return config_lib.from_dict({"model": saved.get("model", {}), "train": precision})


def load(path: PathLike, step: int | None = None, *, model: nnx.Module | None = None):
    """The trained model of a run, in eval mode, on the default device.

    ``path``: a workdir (its newest checkpoint, or ``step``) or one checkpoint folder
    (``workdir/checkpoints/<step>``). The model is built as the checkpoint's config says
    (``model.name``, ``model.num_classes``, ...); for a model passed to :func:`jddp.fit` that the
    config cannot build, pass a freshly built ``model`` of the same architecture as a template:
    its arrays are replaced in place and it is returned. Raises :class:`ConfigError` when there
    is no such checkpoint or the model does not fit it (naming the arrays).
    """
    return load_run(path, step, model=model)[0]


def load_run(
    path: PathLike, step: int | None = None, *, model: nnx.Module | None = None
) -> tuple[nnx.Module, PixelNorm | None, str]:
    """:func:`load`, the pixel normalisation the run trained with (None for checkpoints that
    predate its recording) and its ``data.augment`` (which picks the eval transform, e.g.
    imagenet's centre crop)."""
    ckpts, step = open_checkpoint(path, step, key="path")

    def like_of(step: int) -> dict[str, Any]:  # the weights of the model checkpoint step fits
        _, params, model_state = split_model(model if model is not None else _model_of(ckpts, step))
        return {"params": params, "model_state": model_state}

    try:
        with damage_named(ckpts, step, like_of, "path", lambda step: f"step={step}"):
            saved_norm = ckpts.saved_pixel_norm(step)
            saved = ckpts.saved_config(step)
            loaded = _restored_model(ckpts, step, model)
    finally:
        ckpts.close()
    loaded.eval()
    norm = None if saved_norm is None else PixelNorm.from_json(saved_norm)
    return loaded, norm, str((saved.get("data") or {}).get("augment", "none"))


def _model_of(ckpts: Checkpoints, step: int) -> nnx.Module:
    """A fresh model as checkpoint ``step``'s config names it."""
    cfg = model_config(ckpts.saved_config(step))
    channels = _in_channels(ckpts.weight_shapes(step))
    return build_model(cfg, nnx.Rngs(0), in_channels=channels)


def _restored_model(ckpts: Checkpoints, step: int, model: nnx.Module | None) -> nnx.Module:
    """``model`` (or the model checkpoint ``step``'s config names) with the step's weights."""
    if model is not None:
        return restore_into(model, ckpts, step, key="path")
    model = _model_of(ckpts, step)
    try:
        return restore_into(model, ckpts, step, key="path")
    except ConfigError as e:
        name = model_config(ckpts.saved_config(step)).model.name
        raise ConfigError(
            f"{e}; the config names model.name={name}: for a model that was "
            "passed to jddp.fit, pass a freshly built one as jddp.load(..., model=...)"
        ) from None


def as_model(
    model_or_workdir: nnx.Module | PathLike, step: int | None = None
) -> tuple[nnx.Module, PixelNorm | None, str]:
    """``model_or_workdir`` itself if it is a module (no known normalisation, no eval
    transform), else :func:`load_run` of it."""
    if isinstance(model_or_workdir, nnx.Module):
        return model_or_workdir, None, "none"
    return load_run(model_or_workdir, step)


def pixel_norm_of(mean: Any, std: Any, default: PixelNorm | None) -> PixelNorm:
    """The normalisation of ``mean``/``std`` given by the caller, else ``default`` (a run's),
    else scaling only; one given without the other is a ``ConfigError`` naming both."""
    if (mean is None) != (std is None):
        given, missing = ("mean", "std") if std is None else ("std", "mean")
        raise ConfigError(
            f"mean/std: {given} was given without {missing}; pass both (per-channel, on the "
            "[0, 1] scale) or neither"
        )
    if mean is not None:
        return PixelNorm(
            tuple(float(m) for m in np.ravel(mean)), tuple(float(s) for s in np.ravel(std))
        )
    return default or PixelNorm()


def predict(
    model_or_workdir: nnx.Module | PathLike,
    images: Any,
    batch_size: int = 256,
    *,
    mean: Any = None,
    std: Any = None,
    step: int | None = None,
) -> np.ndarray:
    """Logits ``[N, K]`` of ``images`` in input order (``logits.argmax(-1)``: the labels).

    ``images``: ``[N, H, W, C]`` (or ``[N, H, W]``) float images, normalised as in training,
    or integer pixels 0..255 (any integer dtype), scaled to [0, 1] and standardised per channel
    like the train step does: with ``mean``/``std`` (on the [0, 1] scale; both or neither) when
    given, else, for a run, with the normalisation it trained with (recorded in its
    checkpoints), else scaled only; or a data source (:func:`jddp.as_source`), whose own
    normalisation is used. Images of another channel count than that normalisation, or
    integers outside 0..255, are a ``DataConfigError``. For a run trained with
    ``data.augment=imagenet``, each image is first centre-cropped as its eval does. Runs in eval
    mode on the default device, ``batch_size`` images at a time (the last batch is padded, so
    one program serves every batch); no images give ``[0, K]``. The model passed is not changed.
    """
    model, run_norm, augment = as_model(model_or_workdir, step)
    if hasattr(images, "get_batch"):
        source = images
        norm = PixelNorm.of(source)
    else:
        array = pixel_images(images, "images")
        norm = pixel_norm_of(mean, std, run_norm)
        source = ArraySource(
            array,
            np.zeros(len(array), np.int32),
            1,
            mean=np.zeros(array.shape[-1], np.float32),
            std=np.ones(array.shape[-1], np.float32),
            name="images",
        )
    norm.check_channels((len(source), *source.image_shape), "images")
    n = len(source)
    graphdef, state = nnx.split(model)

    def forward(state, images_BxHxWxC):
        module = nnx.merge(graphdef, state)
        module.eval()
        return module(norm(images_BxHxWxC, jnp.float32))

    if n == 0:  # no images: [0, K], K from the model's output for one image
        one = jax.ShapeDtypeStruct((1, *source.image_shape), np.uint8)
        return np.zeros((0, *jax.eval_shape(forward, state, one).shape[1:]), np.float32)
    forward = jax.jit(forward)
    size = max(1, min(batch_size, n))
    out = []
    for start in range(0, n, size):
        idx = np.arange(start, start + size)
        real = idx < n
        # The eval transform of the run (imagenet: the centre crop its evaluate takes).
        batch = np.asarray(eval_rows(source, np.where(real, idx, 0), augment)[0])
        out.append(np.asarray(forward(state, batch))[real])
    return np.concatenate(out)
