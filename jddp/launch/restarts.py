"""``python -m jddp.launch --max-restarts K``: a group whose rank died starts again by itself.

When a rank dies (kill -9, the OOM killer, a stall ended by the watchdog, a dead peer) the
launcher stops the group as always; with restarts left it waits ``--restart-delay`` seconds and
starts the same command again, which resumes from the newest checkpoint (a rerun of jddp's
commands resumes; every step is logged once, and the losses are the uninterrupted run's
bitwise on the same topology). Each restart is one line on stderr and a ``restart`` row in the
run's ``metrics.jsonl`` when the command names its ``workdir=``.

Not restarted: a preemption (every rank exited 75: the scheduler's business, as without the
flag), a stop signal to the launcher, bad input (exit 2: the same command would fail the same
way) and Ctrl-C (130).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from jddp.errors import PREEMPTED

NOT_RESTARTED = {0, 2, PREEMPTED, 130}  # done, bad input, preempted, interrupted


def workdir_of(command: Sequence[str]) -> Path | None:
    """The ``workdir=...`` override of a jddp command, if it has one."""
    for arg in command:
        if arg.startswith("workdir="):
            return Path(arg.split("=", 1)[1]).expanduser()
    return None


def newest_checkpoint(workdir: Path | None) -> int | None:
    """The newest complete checkpoint step in ``workdir/checkpoints`` (orbax's step folders;
    one still being written has a temporary name), or None."""
    if workdir is None or not (workdir / "checkpoints").is_dir():
        return None
    names = [p.name for p in (workdir / "checkpoints").iterdir()]
    steps = [int(name) for name in names if re.fullmatch(r"\d+", name)]
    return max(steps, default=None)


def should_restart(code: int, signal_received: int | None) -> bool:
    """Whether the launcher's exit ``code`` is a failure a restart can get past."""
    return signal_received is None and code not in NOT_RESTARTED


def restart_line(count: int, limit: int, cause: str, step: int | None) -> str:
    """``restart 1/3: rank 1 was killed by signal SIGKILL; resuming from step 40``."""
    where = f"resuming from step {step}" if step is not None else "starting again from step 0"
    return f"restart {count}/{limit}: {cause}; {where}"


def record_restart(workdir: Path | None, count: int, cause: str, step: int | None) -> None:
    """A ``restart`` row in ``workdir/metrics.jsonl`` at the step the run resumes from (kept
    by the resumed run, which keeps every line up to its checkpoint)."""
    if workdir is None or not (workdir / "metrics.jsonl").exists():
        return
    row = {"step": step or 0, "restart": count, "restart/cause": cause}
    with (workdir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
