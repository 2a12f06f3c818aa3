"""Where a run's state starts: its own newest good checkpoint (``checkpoint.resume``, under the
config policy of :mod:`jddp.checkpoint.resume`), another run's weights
(``checkpoint.init_from``), or the fresh initialisation."""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh

from jddp import config as config_lib
from jddp.checkpoint import Checkpoints
from jddp.checkpoint.resume import check_resume_config
from jddp.checkpoint.weights import (
    damage_named,
    describe_mismatch,
    mismatched_weights,
    open_checkpoint,
    short_name,
    with_shapes,
)
from jddp.comm import Comm
from jddp.config import Config
from jddp.errors import ConfigError
from jddp.mesh import put_replicated, to_host
from jddp.metrics import Console
from jddp.state import TrainState


def restore(
    cfg: Config,
    ckpts: Checkpoints,
    state: TrainState,
    comm: Comm,
    console: Console,
    total_steps: int,
) -> tuple[TrainState, int]:
    """The newest good checkpoint's state and step under ``checkpoint.resume``, else
    ``(state, 0)``; refuses a checkpoint whose config differs in what changes training."""
    if not cfg.checkpoint.resume:
        return state, 0
    now = config_lib.to_dict(cfg)

    def check_config(step: int, saved: dict[str, Any]) -> None:
        check_resume_config(saved, now, step, total_steps, str(ckpts.directory / str(step)))

    try:
        restored = ckpts.restore_newest_good(state, comm.agree, check_config)
    except BaseException:
        ckpts.close()  # orbax's background threads must stop before the interpreter does
        raise
    if restored is None:
        return state, 0
    state, saved_step = restored
    start_step = int(to_host(state.step))
    console.say(f"jddp: resumed from {ckpts.directory / str(saved_step)} at step {start_step}")
    return state, start_step


def head_arrays(
    differ: list[tuple[str, tuple, tuple]], num_outputs: int | None
) -> list[str] | None:
    """The names of ``differ`` (``(name, saved shape, shape now)``) when they are all one
    output layer whose class dimension changed: one module's arrays, equal but for the last
    axis, which is now ``num_outputs`` (the model's logits). None otherwise, and always for a
    model without class logits (``num_outputs`` None: a custom task)."""
    if not differ or num_outputs is None:
        return None
    parents, pairs = set(), set()
    for name, saved, now in differ:
        if len(saved) != len(now) or saved[:-1] != now[:-1] or now[-1] != num_outputs:
            return None
        parents.add(name.removesuffix(".value").rsplit("[", 1)[0])
        pairs.add((saved[-1], now[-1]))
    return [name for name, *_ in differ] if len(parents) == 1 and len(pairs) == 1 else None


def warm_start(
    path: str,
    state: TrainState,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    console: Console,
    num_outputs: int | None,
) -> TrainState:
    """``checkpoint.init_from``: ``state`` at step 0 with another run's params and model state
    and a fresh optimizer state. Arrays the checkpoint lacks, or of other shapes, are refused
    (``ConfigError`` naming them), except an output layer whose class dimension changed: that
    one keeps its fresh initialisation (and the message says so)."""
    key = "checkpoint.init_from"
    ckpts, step = open_checkpoint(path, None, key)
    where = ckpts.directory / str(step)
    try:
        fresh = to_host({"params": state.params, "model_state": state.model_state})

        def like_of(step: int) -> dict[str, Any]:
            return with_shapes(fresh, ckpts.weight_shapes(step))

        def use(step: int) -> str:
            return f"{key}={ckpts.directory / str(step)}"

        with damage_named(ckpts, step, like_of, key, use):
            saved = ckpts.weight_shapes(step)
            missing, differ = mismatched_weights(saved, fresh)
            head = head_arrays(differ, num_outputs) or []
            if missing or (differ and not head):
                raise ConfigError(
                    f"{key}: checkpoint {where} does not fit this model: "
                    f"{describe_mismatch(missing, differ)} (only an output layer of another "
                    "num_classes is re-initialised)"
                )
            restored = ckpts.restore_weights(step, with_shapes(fresh, saved))
    finally:
        ckpts.close()
    keep_fresh = set(head)
    weights = {}
    for top in ("params", "model_state"):
        flat, _ = jax.tree_util.tree_flatten_with_path(fresh[top])
        pick = [
            new if f".{top}{jax.tree_util.keystr(path)}" in keep_fresh else old
            for (path, new), old in zip(flat, jax.tree.leaves(restored[top]), strict=True)
        ]
        weights[top] = jax.tree.unflatten(jax.tree.structure(fresh[top]), pick)
    note = ""
    if head:
        (_, before, now), *_ = differ
        names = ", ".join(short_name(n) for n in head)
        note = f"; re-initialised {names} (class dimension {before[-1]} -> {now[-1]})"
    console.say(
        f"jddp: {key}: starting at step 0 from the params and model state of {where} "
        f"(optimizer state fresh){note}"
    )
    return state.replace(
        params=put_replicated(weights["params"], mesh),
        model_state=put_replicated(weights["model_state"], mesh),
        opt_state=put_replicated(tx.init(weights["params"]), mesh),
    )
