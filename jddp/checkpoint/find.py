"""Finding and opening a run's checkpoints from a path (a workdir, its ``checkpoints`` folder or
one checkpoint), for reading outside training: ``jddp.load``, ``jddp.evaluate``, export and
``checkpoint.init_from``; a damaged one named with the newest intact one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from jddp.checkpoint.best import best_step
from jddp.checkpoint.store import Checkpoints, sorted_steps
from jddp.errors import CheckpointDamaged, CheckpointError, ConfigError
from jddp.workdir import RunFolder

Step = int | str | None  # a step, "best" (jddp.checkpoint.best), or None: the newest


def find_checkpoint(
    path: str | Path, step: Step, key: str, step_key: str | None = None
) -> tuple[Path, int]:
    """The checkpoints folder and the step that ``path`` names: a workdir (its newest
    checkpoint, ``step``, or with ``step="best"`` its best by the record of its evals:
    ``checkpoint.keep_best``), its ``checkpoints`` folder, or one checkpoint folder
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
    elif step == "best":
        step = best_step(directory, steps, step_key)
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


def open_checkpoint(path: str | Path, step: Step, key: str) -> tuple[Checkpoints, int]:
    """:func:`find_checkpoint`, opened for reading (close it after use)."""
    directory, step = find_checkpoint(path, step, key)
    return reader(directory), step


def reader(directory: Path) -> Checkpoints:
    """The checkpoints in ``directory``, for reading only."""
    return Checkpoints(
        directory,
        keep=1,
        async_save=False,
        writes=False,
        primary=False,
        damaged_directory=RunFolder(directory.parent).damaged_checkpoints,
    )
