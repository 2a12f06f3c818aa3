"""A run's weights outside training: find a run's checkpoint from a path, compare a model's
arrays with a checkpoint's (or a pretrained file's) by name and shape, keep an output layer of
another class count fresh, read only params and model state.
(``jddp.load``, ``jddp.evaluate``, ``checkpoint.init_from``, ``jddp.load_pretrained``.)"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax

from jddp.checkpoint import Checkpoints, weight_leaves
from jddp.errors import CheckpointDamaged, CheckpointError, ConfigError
from jddp.workdir import RunFolder


def short_name(name: str) -> str:
    """A manifest name as users read it: ``params['out']['kernel']``."""
    return name.removeprefix(".").removesuffix(".value")


def mismatched_weights(
    saved: dict[str, tuple[int, ...]], weights: dict[str, Any]
) -> tuple[list[str], list[tuple[str, tuple, tuple]]]:
    """Arrays of ``weights`` the checkpoint lacks, and ``(name, saved, now)`` for every array
    whose shape differs (names as in the checkpoint's manifest)."""
    missing, differ = [], []
    for name, leaf in weight_leaves(weights):
        shape = tuple(leaf.shape)
        if name not in saved:
            missing.append(name)
        elif saved[name] != shape:
            differ.append((name, saved[name], shape))
    return missing, differ


def describe_mismatch(
    missing: list[str],
    differ: list[tuple[str, tuple, tuple]],
    unexpected: Sequence[str] = (),
    source: str = "the checkpoint",
) -> str:
    """One line naming (up to 5 of) each kind of mismatch: arrays ``missing`` from ``source``,
    arrays of ``source`` the model does not have (``unexpected``), and other shapes."""
    parts = []
    if missing:
        names = ", ".join(short_name(n) for n in missing[:5])
        parts.append(f"{len(missing)} arrays are not in {source} ({names})")
    if unexpected:
        names = ", ".join(short_name(n) for n in unexpected[:5])
        parts.append(f"{len(unexpected)} arrays of {source} are not in the model ({names})")
    if differ:
        names = ", ".join(
            f"{short_name(n)} {list(a)} there vs {list(b)} now" for n, a, b in differ[:5]
        )
        parts.append(f"{len(differ)} arrays have other shapes ({names})")
    return "; ".join(parts)


# Said when weights are refused for their shapes: the one difference init_from forgives.
HEAD_ONLY = "(only an output layer of another num_classes is re-initialised)"


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


def head_to_keep(
    missing: list[str], differ: list[tuple[str, tuple, tuple]], num_outputs: int | None
) -> list[str] | None:
    """What a warm start keeps freshly initialised: ``[]`` when the saved weights fit the
    model, the output layer's names when only its class dimension differs
    (:func:`head_arrays`), None when they do not fit (arrays missing, other shapes)."""
    if missing:
        return None
    return head_arrays(differ, num_outputs) if differ else []


def head_note(differ: list[tuple[str, tuple, tuple]], head: list[str]) -> str:
    """``"; re-initialised <names> (class dimension A -> B)"`` for a kept-fresh ``head``, else
    ``""`` (the end of a warm start's line)."""
    if not head:
        return ""
    (_, before, now), *_ = differ
    names = ", ".join(short_name(n) for n in head)
    return f"; re-initialised {names} (class dimension {before[-1]} -> {now[-1]})"


def map_weights(fn: Callable[[str, Any], Any], weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` (``{"params": ..., "model_state": ...}``) with every leaf replaced by
    ``fn(name, leaf)``, names as :func:`jddp.checkpoint.weight_leaves` spells them."""
    out = {}
    for top in ("params", "model_state"):
        flat, treedef = jax.tree_util.tree_flatten_with_path(weights[top])
        leaves = [fn(f".{top}{jax.tree_util.keystr(p)}", x) for p, x in flat]
        out[top] = jax.tree_util.tree_unflatten(treedef, leaves)
    return out


def with_shapes(weights: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """``weights`` as shape/dtype structs, with the shape of each array named in ``shapes``."""
    return map_weights(
        lambda name, x: jax.ShapeDtypeStruct(shapes.get(name, x.shape), x.dtype), weights
    )


def find_checkpoint(
    path: str | Path, step: int | None, key: str, step_key: str | None = None
) -> tuple[Path, int]:
    """The checkpoints folder and the step that ``path`` names: a workdir (its newest
    checkpoint, or ``step``), its ``checkpoints`` folder, or one checkpoint folder
    ``.../checkpoints/<step>``. Reads only the file system. ``ConfigError`` naming ``key`` (or
    ``step_key`` for a step that does not exist) when there is none."""
    step_key = step_key or key
    p = Path(path).absolute()
    if p.name.isdigit() and (p / "state").is_dir():
        directory, named = p.parent, int(p.name)
        if step is not None and step != named:
            raise ConfigError(f"{step_key}: {path} is the checkpoint of step {named}, not {step}")
        step = named
    elif RunFolder(p).checkpoints.is_dir() or RunFolder(p).config_yaml.is_file():
        directory = RunFolder(p).checkpoints
    elif p.is_dir() and any(c.name.isdigit() for c in p.iterdir()):
        directory = p
    else:
        raise ConfigError(f"{key}: {path} is neither a run's workdir nor a checkpoint folder")
    steps = [int(c.name) for c in sorted_steps(directory)]
    if not steps:
        raise ConfigError(f"{key}: no checkpoint in {directory}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError(
            f"{step_key}: no checkpoint of step {step} in {directory} (there are: "
            f"{', '.join(map(str, steps))})"
        )
    return directory, step


@contextmanager
def damage_named(
    ckpts: Checkpoints,
    step: int,
    like_of: Callable[[int], dict[str, Any]],
    key: str,
    use: Callable[[int], str],
) -> Iterator[None]:
    """Reads of checkpoint ``step`` inside this block: a damaged checkpoint becomes one
    :class:`CheckpointError` line naming ``key``, the checkpoint, the cause, and the newest
    other checkpoint whose weights read intact (``like_of(step)``: the ``like`` of
    :meth:`Checkpoints.restore_weights` for a step) with how to use it (``use(step)``, e.g.
    ``"--step 4"``)."""
    try:
        yield
    except CheckpointDamaged as e:
        intact = ckpts.newest_intact(like_of, but=step)
        if intact is not None:
            advice = f"checkpoint {ckpts.directory / str(intact)} is intact: use {use(intact)}"
        else:
            advice = f"no other checkpoint in {ckpts.directory} is intact"
        raise CheckpointError(f"{key}: {e}; {advice}") from None


def sorted_steps(directory: Path) -> list[Path]:
    """The step folders in checkpoints folder ``directory``, oldest first (none if it is
    missing)."""
    if not directory.is_dir():
        return []
    return sorted(
        (c for c in directory.iterdir() if c.name.isdigit() and c.is_dir()),
        key=lambda c: int(c.name),
    )


def open_checkpoint(path: str | Path, step: int | None, key: str) -> tuple[Checkpoints, int]:
    """:func:`find_checkpoint`, opened for reading (close it after use)."""
    directory, step = find_checkpoint(path, step, key)
    return reader(directory), step


def reader(directory: Path) -> Checkpoints:
    """The checkpoints in ``directory``, for reading only."""
    return Checkpoints(
        directory,
        every_steps=0,
        keep=1,
        async_save=False,
        writes=False,
        primary=False,
        damaged_directory=directory.parent / "checkpoints-damaged",
    )
