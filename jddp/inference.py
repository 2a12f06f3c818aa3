"""A trained model in hand: :func:`load` one from a run, :func:`predict` logits with it.

Both work in one process on one device, without a mesh or ``jax.distributed``: the checkpoint's
saved config says how to build the model (or a template module says it), and only the
parameters and model state are read (the optimizer state is not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jddp import config as config_lib
from jddp.build import build_model
from jddp.checkpoint import Checkpoints
from jddp.checkpoint.find import damage_named, open_checkpoint
from jddp.checkpoint.matching import describe_mismatch, mismatched_weights
from jddp.data.pipeline import eval_rows
from jddp.data.source import ArraySource, is_image_source, pixel_images
from jddp.data.trees import as_tree_source, example_spec
from jddp.errors import ConfigError
from jddp.imports import refuse_untrusted
from jddp.state import split_model
from jddp.tasks.classification import PixelNorm

PathLike = str | Path


def restore_into(
    model: nnx.Module,
    ckpts: Checkpoints,
    step: int,
    key: str,
    use: Callable[[int], str] = lambda step: f"step={step}",
    ema: bool = False,
) -> nnx.Module:
    """Set ``model``'s parameters and model state to checkpoint ``step``'s (in place); ``ema``:
    its parameters' moving average (``train.ema_decay``) as the parameters. A damaged
    checkpoint is a ``CheckpointError`` naming ``key``, the checkpoint and the newest intact
    one (``use(step)``: how the caller picks that one)."""
    _, params, model_state = split_model(model)
    weights = {"params": params, "model_state": model_state}
    with damage_named(ckpts, step, lambda _: weights, key, use):
        missing, differ = mismatched_weights(ckpts.weight_shapes(step, ema), weights)
        if missing or differ:
            raise ConfigError(
                f"{key}: checkpoint {ckpts.directory / str(step)} does not fit this model: "
                f"{describe_mismatch(missing, differ)}"
            )
        restored = jax.tree.map(jnp.asarray, ckpts.restore_weights(step, weights, ema))
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


def load(
    path: PathLike,
    step: int | str | None = None,
    *,
    model: nnx.Module | None = None,
    ema: bool = False,
    trust_code: bool = False,
):
    """The trained model of a run, in eval mode, on the default device.

    ``path``: a workdir (its newest checkpoint, or ``step``; ``step="best"``: its best by
    ``checkpoint.monitor``, a run with ``checkpoint.keep_best``) or one checkpoint folder
    (``workdir/checkpoints/<step>``). The model is built as the checkpoint's config says
    (``model.name``, ``model.num_classes``, ...); for a model passed to :func:`jddp.fit` that the
    config cannot build, pass a freshly built ``model`` of the same architecture as a template:
    its arrays are replaced in place and it is returned. ``ema``: the parameters' exponential
    moving average (a run with ``train.ema_decay``) in place of the parameters. ``trust_code``:
    import the ``pkg.module:factory`` the checkpoint's config names for its model (its code
    runs: the run folder's author wrote it); without it such a config is a
    :class:`ConfigError` (not needed with ``model=``, nor for a built-in model). Raises
    :class:`ConfigError` when there is no such checkpoint, it holds no EMA (``ema``), or the
    model does not fit it (naming the arrays).
    """
    return load_run(path, step, model=model, ema=ema, trust_code=trust_code).model


@dataclass
class LoadedRun:
    """A run's trained model (eval mode) and how training fed it: the pixel normalisation
    (None for checkpoints that predate its recording, and for custom tasks), ``data.augment``
    (which picks the eval transform, e.g. imagenet's centre crop), the task kind
    (``"classification"`` or ``"custom"``, :mod:`jddp.tasks`) and the class names of its train
    data (output ``k`` is ``classes[k]``; None where the data named none)."""

    model: nnx.Module
    pixel_norm: PixelNorm | None = None
    augment: str = "none"
    task: str = "classification"
    classes: list[str] | None = None


def load_run(
    path: PathLike,
    step: int | str | None = None,
    *,
    model: nnx.Module | None = None,
    key: str = "path",
    use: Callable[[int], str] = lambda step: f"step={step}",
    ema: bool = False,
    trust_code: bool = False,
) -> LoadedRun:
    """:func:`load` and how the run fed its model (:class:`LoadedRun`). Errors name ``key`` (a
    CLI's ``--workdir``) and, for a damaged checkpoint, how to pick the intact one
    (``use(step)``)."""
    ckpts, step = open_checkpoint(path, step, key=key)

    def like_of(step: int) -> dict[str, Any]:  # the weights of the model checkpoint step fits
        built = model if model is not None else _model_of(ckpts, step, trust_code)
        _, params, model_state = split_model(built)
        return {"params": params, "model_state": model_state}

    try:
        with damage_named(ckpts, step, like_of, key, use):
            saved_norm = ckpts.saved_pixel_norm(step)
            task = ckpts.saved_task(step)
            classes = ckpts.saved_classes(step)
            saved = ckpts.saved_config(step)
            loaded = _restored_model(ckpts, step, model, key, ema, trust_code)
    finally:
        ckpts.close()
    loaded.eval()
    norm = None if saved_norm is None else PixelNorm.from_json(saved_norm)
    augment = str((saved.get("data") or {}).get("augment", "none"))
    return LoadedRun(loaded, norm, augment, task, classes)


def class_names(path: PathLike, step: int | str | None = None) -> list[str] | None:
    """The class names of a run's train data in label order, so that output ``k`` of
    :func:`predict`'s logits is ``class_names(run)[k]``: the image folder's class folders, the
    Hub's ``ClassLabel`` names, a pack's classes. None where the data named none (arrays, a
    custom task) or the checkpoint predates their recording. ``path`` and ``step`` as for
    :func:`load`; nothing but the checkpoint's manifest is read."""
    ckpts, step = open_checkpoint(path, step, key="path")
    try:
        return ckpts.saved_classes(step)
    finally:
        ckpts.close()


def _model_of(ckpts: Checkpoints, step: int, trust_code: bool = False) -> nnx.Module:
    """A fresh model as checkpoint ``step``'s config names it (a ``ConfigError`` saying what to
    do for a model that was given to ``jddp.fit``, or naming a factory imported only with
    ``trust_code``)."""
    saved = ckpts.saved_config(step)
    fit = config_lib.from_dict({"fit": saved.get("fit") or {}, "model": saved.get("model") or {}})
    fit.workdir = str(ckpts.directory.parent)
    config_lib.refuse_fit_run(fit, "jddp.load/predict/export without model=")
    cfg = model_config(saved)
    where = f"the config of checkpoint {ckpts.directory / str(step)}"
    refuse_untrusted(where, [("model.name", cfg.model.name)], trust_code)
    channels = _in_channels(ckpts.weight_shapes(step))
    return build_model(cfg, nnx.Rngs(0), in_channels=channels)


def _restored_model(
    ckpts: Checkpoints,
    step: int,
    model: nnx.Module | None,
    key: str = "path",
    ema: bool = False,
    trust_code: bool = False,
) -> nnx.Module:
    """``model`` (or the model checkpoint ``step``'s config names) with the step's weights."""
    if model is not None:
        return restore_into(model, ckpts, step, key=key, ema=ema)
    model = _model_of(ckpts, step, trust_code)
    try:
        return restore_into(model, ckpts, step, key=key, ema=ema)
    except ConfigError as e:
        name = model_config(ckpts.saved_config(step)).model.name
        raise ConfigError(
            f"{e}; the config names model.name={name}: for a model that was "
            "passed to jddp.fit, pass a freshly built one as jddp.load(..., model=...)"
        ) from None


def as_model(
    model_or_workdir: nnx.Module | PathLike,
    step: int | str | None = None,
    ema: bool = False,
    trust_code: bool = False,
) -> LoadedRun:
    """``model_or_workdir`` itself if it is a module (no known normalisation, eval transform or
    task), else :func:`load_run` of it (``ema``: its parameters' moving average;
    ``trust_code``: its config's model factory may be imported)."""
    if isinstance(model_or_workdir, nnx.Module):
        if ema:
            raise TypeError("ema=True reads a run's checkpoint: pass a workdir, not a module")
        return LoadedRun(model_or_workdir, task="unknown")
    return load_run(model_or_workdir, step, ema=ema, trust_code=trust_code)


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


def default_forward(model: nnx.Module, inputs: Any) -> Any:
    """How :func:`predict` calls a model on a batch of a custom task's inputs: ``model(x)`` for
    an array, ``model(*x)`` for a tuple, ``model(**x)`` for a dict."""
    if isinstance(inputs, tuple):
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def _is_images(inputs: Any) -> bool:
    """Inputs :func:`predict` feeds as images: an image source, or one array ``[N, H, W(, C)]``."""
    if hasattr(inputs, "get_batch"):
        return is_image_source(inputs)
    return hasattr(inputs, "shape") and np.ndim(inputs) in (3, 4)


def predict(
    model_or_workdir: nnx.Module | PathLike,
    images: Any,
    batch_size: int = 256,
    *,
    mean: Any = None,
    std: Any = None,
    step: int | str | None = None,
    forward: Callable[[nnx.Module, Any], Any] | None = None,
    ema: bool = False,
    trust_code: bool = False,
) -> Any:
    """The model's outputs for ``images`` (or any task's inputs), in input order. ``ema``: a
    run's parameters' moving average (``train.ema_decay``) in place of its parameters.
    ``trust_code``: a run's model may be built by the ``pkg.module:factory`` its config names
    (as :func:`load`).

    **Image classification** (a run trained on images, or a module given one image array or an
    image source): logits ``[N, K]`` (``logits.argmax(-1)``: the labels). ``images``:
    ``[N, H, W, C]`` (or ``[N, H, W]``) float images, normalised as in training, or integer
    pixels 0..255 (any integer dtype), scaled to [0, 1] and standardised per channel like the
    train step does: with ``mean``/``std`` (on the [0, 1] scale; both or neither) when given,
    else, for a run, with the normalisation it trained with (recorded in its checkpoints), else
    scaled only; or a data source (:func:`jddp.as_source`), whose own normalisation is used.
    Images of another channel count than that normalisation, or integers outside 0..255, are a
    ``DataConfigError``. For a run trained with ``data.augment=imagenet``, each image is first
    centre-cropped as its eval does.

    **Any other task** (a run trained with a custom loss, or inputs that are not one image
    array): ``images`` is a batch pytree of the model's inputs with a leading example axis (an
    array, a tuple, a dict; or a list or source of examples, as ``jddp.fit`` takes data), fed
    as it is; ``forward(model, batch)`` computes the outputs (default :func:`default_forward`:
    ``model(x)``, ``model(*x)`` or ``model(**x)``); the result has the outputs' structure, every
    leaf ``[N, ...]``.

    Runs in eval mode on the default device, ``batch_size`` examples at a time (the last batch
    is padded, so one program serves every batch); no inputs give outputs with a leading 0.
    The model passed is not changed.
    """
    run = as_model(model_or_workdir, step, ema, trust_code)
    custom = run.task == "custom" or (run.task == "unknown" and not _is_images(images))
    if custom or forward is not None:
        source = as_tree_source(images, "inputs", label="inputs", allow_empty=True)
        return _predict(
            run.model,
            source.get_batch,
            len(source),
            example_spec(source),
            batch_size,
            forward or default_forward,
        )
    if hasattr(images, "get_batch"):
        source = images
        norm = PixelNorm.of(source)
    else:
        array = pixel_images(images, "images")
        norm = pixel_norm_of(mean, std, run.pixel_norm)
        source = ArraySource(
            array,
            np.zeros(len(array), np.int32),
            1,
            mean=np.zeros(array.shape[-1], np.float32),
            std=np.ones(array.shape[-1], np.float32),
            name="images",
        )
    norm.check_channels((len(source), *source.image_shape), "images")

    def rows(indices: np.ndarray) -> np.ndarray:
        # The eval transform of the run (imagenet: the centre crop its evaluate takes).
        return np.asarray(eval_rows(source, indices, run.augment)[0])

    def classify(model: nnx.Module, images_BxHxWxC: Any) -> Any:
        return model(norm(images_BxHxWxC, jnp.float32))

    one_image = jax.ShapeDtypeStruct(tuple(source.image_shape), np.uint8)
    return _predict(run.model, rows, len(source), one_image, batch_size, classify)


def _predict(
    model: nnx.Module,
    get_batch: Callable[[np.ndarray], Any],
    n: int,
    example: Any,
    batch_size: int,
    forward: Callable,
) -> Any:
    """``forward(model, batch)`` over examples ``0..n-1`` (``get_batch(indices)``; one is shaped
    like ``example``) in order, in eval mode, in batches of ``batch_size`` (the last one padded),
    concatenated leaf by leaf."""
    graphdef, state = nnx.split(model)

    def apply(state, batch):
        module = nnx.merge(graphdef, state)
        module.eval()
        return forward(module, batch)

    if n == 0:  # no inputs: the outputs' structure with a leading 0
        one = jax.tree.map(lambda s: jax.ShapeDtypeStruct((1, *s.shape), s.dtype), example)
        shapes = jax.eval_shape(apply, state, one)
        return jax.tree.map(lambda s: np.zeros((0, *s.shape[1:]), s.dtype), shapes)
    apply = jax.jit(apply)
    size = max(1, min(batch_size, n))
    out = []
    for start in range(0, n, size):
        idx = np.arange(start, start + size)
        real = idx < n
        outputs = apply(state, get_batch(np.where(real, idx, 0)))
        out.append(jax.tree.map(lambda y, real=real: np.asarray(y)[real], outputs))
    return jax.tree.map(lambda *ys: np.concatenate(ys), *out)
