"""``checkpoint.init_from``: a new run starts from another run's weights (its checkpoint) or a
torchvision/timm ResNet's tensors (:mod:`jddp.checkpoint.pretrained`), with a fresh optimizer
state. Weights are matched by name and shape; an output layer of another class count keeps its
fresh initialisation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optax
from jax.sharding import Mesh

from jddp.checkpoint.find import damage_named, open_checkpoint
from jddp.checkpoint.manifest import weight_leaves
from jddp.checkpoint.matching import (
    HEAD_ONLY,
    describe_mismatch,
    head_note,
    head_to_keep,
    map_weights,
    mismatched_weights,
    with_shapes,
)
from jddp.checkpoint.pretrained import is_pretrained_file, pretrained_weights
from jddp.errors import ConfigError
from jddp.mesh import put_replicated, to_host
from jddp.metrics import Console
from jddp.state import TrainState


def warm_start(
    path: str,
    state: TrainState,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    console: Console,
    num_outputs: int | None,
    ema: bool = False,
) -> TrainState:
    """``checkpoint.init_from``: ``state`` at step 0 with another run's params and model state
    (or a torchvision/timm ResNet's tensors: ``FILE.safetensors``/``.pth``,
    :mod:`jddp.checkpoint.pretrained`) and a fresh optimizer state. Arrays the source lacks, or
    of other shapes, are refused (``ConfigError`` naming them), except an output layer whose
    class dimension changed: that one keeps its fresh initialisation (and the message says
    so). ``ema`` (``checkpoint.init_from_ema``): another run's EMA of its parameters instead of
    its parameters. An EMA this run keeps starts at the weights started from."""
    key = "checkpoint.init_from"
    fresh = to_host({"params": state.params, "model_state": state.model_state})
    if is_pretrained_file(path):
        if ema:
            raise ConfigError(
                f"checkpoint.init_from_ema: {path} is a file of tensors, not a run with an EMA"
            )
        weights, differ, head = pretrained_weights(path, fresh, num_outputs, key)
        source = f"the tensors of {path}"
    else:
        weights, differ, head, where = _run_weights(path, fresh, num_outputs, key, ema)
        what = "the EMA of the params" if ema else "the params"
        source = f"{what} and model state of {where}"
    console.say(
        f"jddp: {key}: starting at step 0 from {source} (optimizer state fresh)"
        f"{head_note(differ, head)}"
    )
    params = put_replicated(weights["params"], mesh)
    return state.replace(
        params=params,
        model_state=put_replicated(weights["model_state"], mesh),
        opt_state=put_replicated(tx.init(weights["params"]), mesh),
        ema_params=None if state.ema_params is None else put_replicated(weights["params"], mesh),
    )


def _run_weights(
    path: str, fresh: dict[str, Any], num_outputs: int | None, key: str, ema: bool = False
) -> tuple[dict[str, Any], list[tuple[str, tuple, tuple]], list[str], Path]:
    """The weights of another run's checkpoint at ``path`` in the structure of ``fresh``, with
    a re-initialised head kept fresh: ``(weights, differ, head, checkpoint folder)``."""
    ckpts, step = open_checkpoint(path, None, key)
    where = ckpts.directory / str(step)
    try:

        def like_of(step: int) -> dict[str, Any]:
            return with_shapes(fresh, ckpts.weight_shapes(step))

        def use(step: int) -> str:
            return f"{key}={ckpts.directory / str(step)}"

        with damage_named(ckpts, step, like_of, key, use):
            saved = ckpts.weight_shapes(step, ema)
            missing, differ = mismatched_weights(saved, fresh)
            head = head_to_keep(missing, differ, num_outputs)
            if head is None:
                raise ConfigError(
                    f"{key}: checkpoint {where} does not fit this model: "
                    f"{describe_mismatch(missing, differ)} {HEAD_ONLY}"
                )
            like = with_shapes(fresh, saved)
            restored = dict(weight_leaves(ckpts.restore_weights(step, like, ema)))
    finally:
        ckpts.close()
    keep_fresh = set(head)
    weights = map_weights(lambda name, x: x if name in keep_fresh else restored[name], fresh)
    return weights, differ, head, where
