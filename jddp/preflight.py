"""Checks before the first step, so a mistake costs seconds and one clear line, not a crash
deep inside a compiled step: the same config on every process, the same initial parameters
where each process places its slices of them, a model output that fits the data (image
classification), a task whose loss and metrics fit the batches (any task), a profile range
inside the run, eval keys that the run's evals hold (early stopping, the best checkpoints),
blocks for ``model.remat``; and the warnings a run says once (outputs no label reaches, a
split layout that splits nothing)."""

from __future__ import annotations

import difflib
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jddp import config as config_lib
from jddp.comm import Comm, config_fingerprint
from jddp.config import Config
from jddp.data.source import Splits
from jddp.data.trees import example_spec
from jddp.errors import ConfigError, JddpError, TaskError
from jddp.models.units import blocks
from jddp.state import ModelDef, TrainState
from jddp.step import task_terms
from jddp.tasks import Task


def check_same_config(comm: Comm, cfg: Config) -> None:
    """Refuse to start when processes were given different configs (e.g. different seeds)."""
    config = config_lib.to_dict(cfg)
    shared = {**config, "dist": {k: v for k, v in config["dist"].items() if k != "process_id"}}
    prints = comm.allgather_int(config_fingerprint(shared))
    differ = [rank for rank, p in enumerate(prints) if p != prints[0]]
    if differ:
        raise ConfigError(
            f"the config of rank {differ[0]} differs from rank 0's: every process must be "
            "started with the same config file and overrides"
        )


def check_profile_steps(profile_steps: str | None, steps: int) -> None:
    """``log.profile_steps='a:b'`` must end within the run (else it would silently trace
    nothing)."""
    if profile_steps and int(profile_steps.split(":")[1]) > steps:
        raise ConfigError(
            f"log.profile_steps={profile_steps!r} ends after the run's last step {steps}: "
            f"choose 'a:b' with b <= {steps}"
        )


def output_shape(model_def: ModelDef, state: TrainState, image_shape: tuple[int, ...]) -> Any:
    """What the model (in eval mode) returns for float32 images of ``image_shape``, as shapes
    (nothing is computed)."""

    def forward(params, model_state, images):
        model = model_def.merge(params, model_state)
        model.eval()
        return model(images)

    return jax.eval_shape(
        forward, state.params, state.model_state, jax.ShapeDtypeStruct(image_shape, jnp.float32)
    )


def check_model_output(
    cfg: Config, model_def: ModelDef, state: TrainState, splits: Splits, user_model: bool = False
) -> int:
    """Refuse a model whose output is not ``[B, K]`` logits with ``K`` >= the data's classes
    (otherwise the loss fails deep inside optax, or trains on garbage); returns ``K``.
    ``user_model``: the model was given to :func:`jddp.fit` (errors name it, not model.name)."""
    shape = (2, *splits.train.image_shape)
    # A module given to jddp.fit is not the config's model.name: name what the user passed.
    where = "the model given to jddp.fit" if user_model else f"model.name={cfg.model.name}"
    try:
        out = output_shape(model_def, state, shape)
    except Exception as e:  # noqa: BLE001 - any failure here means "cannot take these images"
        error = " ".join(str(e).split())[:300]
        raise ConfigError(
            f"{where}: the model cannot be applied to images of shape {list(shape)} "
            f"({type(e).__name__}: {error})"
        ) from None
    classes = splits.train.num_classes
    if (
        not hasattr(out, "shape")
        or len(out.shape) != 2
        or out.shape[0] != 2
        or out.shape[1] < classes
    ):
        got = list(out.shape) if hasattr(out, "shape") else type(out).__name__
        raise ConfigError(
            f"{where}: the model maps images of shape {list(shape)} to {got}; expected logits "
            f"of shape [2, K] with K >= the {classes} classes of the data (model.num_classes)"
        )
    return int(out.shape[1])


def check_task(
    task: Task, model_def: ModelDef, state: TrainState, splits: Splits, rows: int
) -> None:
    """Trace the task's loss and metrics on batches of ``rows`` examples shaped like each split
    (train mode on the train split, eval mode on the eval split; nothing is computed): what
    they return is checked there (:mod:`jddp.tasks.custom`), and code that fails on the batch
    (a missing key, a shape mismatch) is a :class:`TaskError` naming the function, before
    anything compiles."""
    for split, source, training in (("train", splits.train, True), ("eval", splits.eval, False)):
        data = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct((rows, *s.shape), s.dtype), example_spec(source)
        )

        def terms(params, model_state, data, training=training):
            def model_of():
                model = model_def.merge(params, model_state)
                if training:
                    model.train()
                else:
                    model.eval()
                return model

            return task_terms(task, model_of, data, training)[0]

        try:
            jax.eval_shape(terms, state.params, state.model_state, data)
        except JddpError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: name it and the batch
            shapes = jax.tree.map(lambda s: f"{s.dtype}{list(s.shape)}", data)
            error = " ".join(str(e).split())[:300]
            raise TaskError(
                f"{getattr(task, 'loss_name', 'the loss')} (or its metrics) failed on a {split} "
                f"batch of {rows} examples {shapes} ({type(e).__name__}: {error})"
            ) from None


def eval_metric_names(
    task: Task,
    model_def: ModelDef,
    state: TrainState,
    source: Any,
    augment: str,
    weight_unit: str | None = None,
    ema: bool = False,
) -> list[str] | None:
    """The keys of this run's eval lines (``eval/loss``, ``eval/<metric>`` of the task's
    metrics, ``eval/count``, ``eval/<weight_unit>``; ``eval_ema/...`` too with ``ema``), from
    the task's eval terms traced on the shapes of two eval examples (nothing computed, the
    eval step not run). None for an eval split without examples."""
    from jddp.data.pipeline import eval_batch

    if len(source) == 0:
        return None
    example = eval_batch(source, np.arange(min(2, len(source))), augment)
    data = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), example)

    def terms(params, model_state, data):
        def model_of():
            model = model_def.merge(params, model_state)
            model.eval()
            return model

        return {k: 0 for k in task_terms(task, model_of, data, False)[0]}

    named = jax.eval_shape(terms, state.params, state.model_state, data)
    names = ["eval/loss", *(f"eval/{k}" for k in sorted(named) if k != "loss"), "eval/count"]
    if weight_unit is not None:
        names.append(f"eval/{weight_unit}")
    if ema:
        names += [f"eval_ema/{n.removeprefix('eval/')}" for n in names]
    return names


def check_eval_key(key: str, value: str, names: list[str]) -> None:
    """``ConfigError`` naming ``key`` when ``value`` is not one of the eval keys ``names``
    (:func:`eval_metric_names`), with the closest as a hint."""
    if value in names:
        return
    close = difflib.get_close_matches(value, names, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(
        f"{key}: {value!r} is not an eval metric of this run (its eval lines hold "
        f"{', '.join(names)}){hint}"
    )


def check_same_init(comm: Comm, params: Any, kind: str) -> None:
    """Refuse (one line) parameters that differ between processes: under a split layout each
    process places its slices of its own copy, so a model built differently per process (a
    per-process seed, host randomness) would train a mix of them."""
    if comm.process_count == 1:
        return
    digest = hashlib.blake2b(digest_size=7)
    for leaf in jax.tree.leaves(params):
        digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    mine = int.from_bytes(digest.digest(), "little")
    everyone = comm.allgather_int(mine)
    if len(set(everyone)) > 1:
        differ = [p for p, d in enumerate(everyone) if d != everyone[0]]
        raise ConfigError(
            f"dist.shard={kind}: the model's initial parameters differ between processes "
            f"(process 0's are not those of process {', '.join(map(str, differ))}): build it "
            "identically on every process (the same seed, no per-process randomness), as each "
            "process places its slices of its own copy"
        )


def check_eval_keys(
    cfg: Config,
    early_stop_metrics: list[str],
    *,
    task: Any,
    model_def: ModelDef,
    state: TrainState,
    splits: Splits,
) -> None:
    """Before anything trains: early stopping's metric (``train.early_stop_metric``, an
    :class:`EarlyStopping` given to jddp.fit) and the best checkpoints' ``checkpoint.monitor``
    must be keys of the run's eval lines, and there must be evals before the end for them to
    decide on (one line naming the key). ``early_stop_metrics``: those of the
    :class:`~jddp.run.callbacks.EarlyStopping` callbacks given to jddp.fit."""
    wanted = [("train.early_stop_metric", cfg.train.early_stop_metric)]
    wanted += [("EarlyStopping(metric=...)", metric) for metric in early_stop_metrics]
    if cfg.checkpoint.keep_best > 0:
        wanted.append(("checkpoint.monitor", cfg.checkpoint.monitor))
    wanted = [(key, value) for key, value in wanted if value is not None]
    if not wanted:
        return
    key, value = wanted[0]
    if cfg.train.eval_every_steps == 0:
        raise ConfigError(
            f"{key}={value} needs evals during the run: set train.eval_every_steps > 0 (with "
            "train.eval_every_steps=0 the only eval is the final one: it could never stop)"
        )
    names = eval_metric_names(
        task,
        model_def,
        state,
        splits.eval,
        cfg.data.augment,
        cfg.log.weight_unit,
        ema=cfg.train.ema_decay > 0,
    )
    for key, value in wanted if names is not None else ():
        check_eval_key(key, value, names)


def check_remat(remat: str, model: Any) -> None:
    """``model.remat=blocks`` needs blocks to recompute (:func:`jddp.models.units.blocks`):
    refused in one line for a model that holds no list of modules, not silently ignored."""
    if remat != "none" and not blocks(model):
        raise ConfigError(
            f"model.remat={remat}: {type(model).__name__} holds no list of modules (its "
            "repeated blocks, e.g. self.blocks = nnx.List([...])) whose activations could be "
            "recomputed; hold its blocks in a list, or set model.remat=none"
        )


def unused_outputs_warning(
    cfg: Config, classes: list[str] | None, num_outputs: int | None, given_model: bool
) -> str | None:
    """The warning for a classifier with more outputs than the train data names classes
    (fine-tuning into a larger head is allowed; a forgotten ``model.num_classes`` is said)."""
    if classes is None or num_outputs is None or num_outputs <= len(classes):
        return None
    outputs = (
        f"the model's {num_outputs} outputs"
        if given_model
        else f"model.num_classes={cfg.model.num_classes}"
    )
    return (
        f"jddp: warning: {outputs} but the train data names {len(classes)} classes "
        f"({_short(classes)}): {num_outputs - len(classes)} outputs will never be a label"
        + ("" if given_model else f"; set model.num_classes={len(classes)}")
    )


def nothing_split_warning(layout: Any, state: TrainState) -> str | None:
    """The warning for a split layout under which no array of the state splits (no axis the
    group's device count divides): every device then holds all of it."""
    if layout.kind == "none" or layout.split_share(state) > 0:
        return None
    return (
        f"jddp: warning: dist.shard={layout.kind}: no array of the train state has an axis "
        f"{layout.group_size} devices divide: every device holds all of it (0.0% split)"
    )


def _short(names: list[str], shown: int = 5) -> str:
    more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
