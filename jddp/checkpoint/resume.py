"""What a resumed run may change: the config keys that do not alter the training trajectory.

A checkpoint holds the resolved config it was written under. Resuming compares it with the
config of the new run: a difference in any key that changes what the steps compute (model,
data, optimizer, seed, precision, ...) is refused, naming each key and both values, unless the
user says so with ``checkpoint.allow_config_change=true`` (``--allow-config-change``).
``train.steps``/``train.epochs`` may grow (a longer run), never end before the checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from jddp import config as config_lib
from jddp.checkpoint.best import best_step
from jddp.checkpoint.find import find_checkpoint
from jddp.checkpoint.store import TMP_SUFFIX, Checkpoints, sorted_steps
from jddp.comm import Comm
from jddp.config import Config
from jddp.errors import ConfigError
from jddp.mesh import to_host
from jddp.metrics import Console
from jddp.state import TrainState
from jddp.workdir import RunFolder

# Keys a resume may change freely: where outputs go, how often things happen, and the topology
# (the trajectory is the same on every topology and backend: tests/test_multiprocess.py).
FREE_KEYS = (
    "workdir",
    "data.prefetch_batches",
    "data.workers",
    "data.worker_kind",
    "train.eval_every_steps",
    "train.on_nonfinite",
    "train.ema_decay",  # the EMA follows the parameters; it changes none of them (said)
    "train.ema_warmup",
    "train.early_stop_metric",  # when the run stops, not what its steps compute
    "train.early_stop_patience",
    "train.early_stop_mode",
    "train.early_stop_min_delta",
    "model.remat",  # recomputes the same activations: the same losses
    "fit.data",  # its type only (a tuple or a dict of the same arrays): not what changes
    "train.max_skipped_fraction",
    "train.compilation_cache_dir",
    "model.bn_group_size",  # resolved by jddp.build.bn_group_size, which refuses a change
    "dist.backend",
    "dist.num_local_devices",
    "dist.coordinator_address",
    "dist.num_processes",
    "dist.process_id",
    "dist.check_sync_every",
    "dist.shard",
    "dist.shard_group",
    "dist.init_timeout_s",
    "dist.heartbeat_timeout_s",
    "dist.step_timeout_s",
    "dist.first_step_timeout_s",
    "checkpoint.",
    "log.",
)
LENGTH_KEYS = ("train.steps", "train.epochs")


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _free(key: str) -> bool:
    return any(key == f or (f.endswith(".") and key.startswith(f)) for f in FREE_KEYS)


# Free-form sections (the user's own model and data keys): a key added or removed there is a
# change, unlike a schema key an older jddp did not write.
OPEN_SECTIONS = ("model.options", "data.options")
ABSENT = "(not set)"


def changed_keys(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, new value)`` for every trajectory-changing key that differs (keys
    the saved config lacks, from an older jddp, count as their current default: not compared;
    in ``model.options``/``data.options`` a key set on one side only differs, its absent
    value shown as ``(not set)``)."""
    before, after = _flatten(saved), _flatten(now)
    open_keys = {
        k
        for k in before.keys() | after.keys()
        if k.startswith(tuple(f"{s}." for s in OPEN_SECTIONS))
    }
    changes = [
        (key, before[key], value)
        for key, value in after.items()
        if key in before and before[key] != value and not _free(key) and key not in LENGTH_KEYS
    ]
    changes += [
        (key, before.get(key, ABSENT), after.get(key, ABSENT))
        for key in sorted(open_keys)
        if (key in before) != (key in after)
    ]
    return changes


def check_resume_config(
    saved: dict[str, Any], now: dict[str, Any], step: int, total_steps: int, where: str
) -> None:
    """Raise :class:`ConfigError` when resuming checkpoint ``where`` (at ``step``) under ``now``
    would silently change the run."""
    if total_steps < step:
        raise ConfigError(
            f"train.steps: the run would end at step {total_steps} but checkpoint {where} is at "
            f"step {step}; set train.steps >= {step}, or use another workdir"
        )
    if now.get("checkpoint", {}).get("allow_config_change"):
        return
    changes = changed_keys(saved, now)
    if changes:
        listed = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, a, b in changes)
        raise ConfigError(
            f"the config differs from checkpoint {where}'s in keys that change training "
            f"({listed}): rerun with the same values, use another workdir, "
            "checkpoint.resume=false to start over, or checkpoint.allow_config_change=true "
            "(--allow-config-change) to continue anyway"
        )


def apply_resume_from(folder: RunFolder, cfg: Config, console: Console) -> None:
    """``checkpoint.resume_from`` (process 0, the workdir locked, before the run is built):
    make the checkpoint it names the newest good one of the workdir, which the run then
    resumes from as always. One of this workdir's: its newer checkpoints are moved to
    ``previous/<UTC time>/`` with a copy of ``metrics.jsonl``; another run's: this workdir's
    earlier run is moved there (as ``checkpoint.resume=false`` does) and the checkpoint is
    copied in. Applied once: a rerun with the same value continues from the newest. A step,
    ``best`` or path that names no checkpoint is a ``ConfigError`` naming the key."""
    value, key = cfg.checkpoint.resume_from, "checkpoint.resume_from"
    if value is None:
        return
    done = folder.resumed_from()
    if done is not None and done[0] == str(value):
        console.say(
            f"jddp: {key}={value} was applied by an earlier run of this workdir (it resumed "
            f"from step {done[1]}): continuing from the newest checkpoint (remove "
            f"{folder.resumed_from_marker} to apply it again)"
        )
        return
    own = folder.checkpoints
    steps = [int(p.name) for p in sorted_steps(own)]
    listed = ", ".join(map(str, steps)) or "none"
    if isinstance(value, int) or value.strip().isdigit():
        directory, step = own, int(value)
        if step not in steps:
            raise ConfigError(f"{key}: no checkpoint of step {step} in {own} (there are: {listed})")
    elif value.strip().lower() == "best":
        if not steps:
            raise ConfigError(f"{key}: best: no checkpoint in {own}")
        directory = own
        step = best_step(own, steps, key, cfg.checkpoint.monitor, cfg.checkpoint.mode)
    else:
        directory, step = find_checkpoint(value, None, key)
    where = own / str(step)
    if directory.resolve() == own.resolve():
        newer = [s for s in steps if s > step]
        moved = folder.set_aside_checkpoints(newer) if newer else None
        console.say(
            f"jddp: {key}={value}: resuming from {where}"
            + (
                f"; the newer checkpoints ({', '.join(map(str, newer))}) went to {moved}"
                if moved
                else ""
            )
        )
    else:
        moved = folder.set_aside_previous_run()
        copy_checkpoint(directory / str(step), where)
        console.say(
            f"jddp: {key}={value}: starting from {where}, a copy of checkpoint "
            f"{directory / str(step)}"
            + (f"; this workdir's earlier run went to {moved}" if moved else "")
        )
    folder.mark_resumed_from(str(value), step)


def copy_checkpoint(source: Path, target: Path) -> None:
    """Copy checkpoint folder ``source`` to ``target`` under orbax's temporary name first (a
    copy cut short is such a folder, which the next run writing here removes), then rename."""
    tmp = target.with_name(f"{target.name}{TMP_SUFFIX}-copy")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, tmp)
    tmp.rename(target)


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
    layouts: dict[int, dict[str, str]] = {}

    emas: dict[int, Any] = {}

    def check_config(step: int, saved: dict[str, Any]) -> None:
        check_resume_config(saved, now, step, total_steps, str(ckpts.directory / str(step)))
        layouts[step] = saved_layout(saved)
        emas[step] = (saved.get("train") or {}).get("ema_decay")

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
    now_layout = {"shard": cfg.dist.shard, "shard_group": str(cfg.dist.shard_group)}
    before = layouts.get(saved_step, now_layout)
    for key, value in now_layout.items():  # allowed: checkpoints hold the same logical arrays
        if before[key] != value:
            console.say(
                f"jddp: dist.{key}={value} now, {before[key]} when the checkpoint was written: "
                "the same arrays, laid out anew"
            )
    decay, before = cfg.train.ema_decay, emas.get(saved_step)
    if decay > 0 and isinstance(before, int | float) and before > 0 and before != decay:
        console.say(  # (turned on or off: said where the EMA is added or dropped)
            f"jddp: train.ema_decay={decay} now, {before} when the checkpoint was written: "
            "the EMA goes on from the checkpoint's with the new decay"
        )
    return state, start_step


def saved_layout(saved: dict[str, Any]) -> dict[str, str]:
    """The ``dist.shard`` and ``dist.shard_group`` a saved config used (the older spelling
    read too; an older jddp's group: all)."""
    dist = dict(saved.get("dist") or {})
    config_lib.translate_old_keys({"dist": dist})
    return {
        "shard": str(dist.get("shard", "none")),
        "shard_group": str(dist.get("shard_group", "all")),
    }
