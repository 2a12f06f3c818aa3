"""Whether a checkpoint fits on its disk: what one takes, what is free, said in one phrase.

A save that runs out of space fails part-way (orbax's temporary folder, removed); across
processes it can fail on one process alone, and orbax's commit then waits for that process
until its timeout. So every save first checks that the disk has room for a checkpoint as large
as the newest one (the training state's bytes before the first), all processes agreeing.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def disk_bytes(folder: Path) -> int:
    """What the files under ``folder`` take on disk (their allocated blocks, as ``du``)."""
    total = 0
    for path in folder.rglob("*"):
        try:
            total += path.lstat().st_blocks * 512
        except OSError:  # removed meanwhile
            continue
    return total


def size_text(nbytes: float) -> str:
    """``4 KiB``, ``1.2 MiB``, ``3.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit in ("B", "KiB") else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def _need(directory: Path, intact: list[int], state_bytes: int) -> tuple[int, str]:
    """What the next checkpoint takes, about, and how that was found: the newest intact
    checkpoint's blocks on disk when there is one (the training state's bytes are about half
    of it: orbax's metadata, the manifest and the file system's blocks come on top), else at
    least the state's bytes."""
    newest = disk_bytes(directory / str(intact[-1])) if intact else 0
    if newest:
        return newest, f"about {size_text(newest)} (the size of checkpoint {intact[-1]})"
    if state_bytes:
        return state_bytes, f"more than {size_text(state_bytes)} (the training state's bytes)"
    return 0, ""


def _note(directory: Path, free: int, need: str) -> str:
    note = f": {directory} has {size_text(free)} free"
    return note + (f", a checkpoint needs {need}" if need else "")


def space_note(directory: Path, intact: list[int], state_bytes: int) -> str:
    """``: <checkpoints folder> has 4 KiB free, a checkpoint needs about 1.2 MiB (the size of
    checkpoint 2)`` ("" where the free space cannot be read)."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return ""
    return _note(directory, free, _need(directory, intact, state_bytes)[1])


def shortfall(directory: Path, intact: list[int], state_bytes: int) -> str | None:
    """:func:`space_note` when ``directory``'s disk has less room than the next checkpoint
    takes; None when it has room, or its free space cannot be read (some FUSE file systems
    report a size of 0: unknown, not full)."""
    try:
        usage = shutil.disk_usage(directory)
    except OSError:
        return None
    if usage.total == 0:
        return None
    need, said = _need(directory, intact, state_bytes)
    return _note(directory, usage.free, said) if usage.free < need else None
