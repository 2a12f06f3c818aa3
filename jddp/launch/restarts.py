"""``python -m jddp.launch --max-restarts K``: a group whose rank died starts again by itself.

When a rank dies (kill -9, the OOM killer, a stall ended by the watchdog, a dead peer) the
launcher stops the group as always; with restarts left it waits ``--restart-delay`` seconds and
starts the same command again, which resumes from the newest checkpoint (a rerun of jddp's
commands resumes; every step is logged once, and the losses are the uninterrupted run's
bitwise on the same topology). Each restart is one line on stderr and a ``restart`` row in the
run's ``metrics.jsonl``: the run's workdir is read from the command (:func:`workdir_of`: its
config file and overrides, as ``jddp.train`` resolves them).

Not restarted: a preemption (every rank exited 75: the scheduler's business, as without the
flag), a stop signal to the launcher, bad input (exit 2: the same command would fail the same
way) and Ctrl-C (130); nor a crash loop: the same exit code again, at the same step (within
:data:`SAME_STEP`: process 0 logs a step one step late) with no checkpoint written since the last
restart — a deterministic failure, on which restarts would only be burnt (:class:`Restarts`);
nor a run whose workdir was deleted while it ran (a restart would begin a new run at step 0).
When the restarts run out, the last failure is named once more with the exit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from jddp.errors import PREEMPTED

NOT_RESTARTED = {0, 2, PREEMPTED, 130}  # done, bad input, preempted, interrupted
SAME_STEP = 2  # logged steps this close are "the same step" (lines are read one step late)


def workdir_of(command: Sequence[str]) -> Path | None:
    """The workdir of a jddp command, as the command resolves it: ``python -m jddp.train``'s
    ``--config FILE`` and overrides, read with jddp's own config loader (no JAX, nothing of the
    config imported), ``workdir`` defaulting to ``runs/<config name>``; another command's
    ``workdir=...`` override. None when there is none, or the config cannot be read (the
    command says why itself, exit 2)."""
    command = list(command)
    if "jddp.train" in command:
        return _train_workdir(command[command.index("jddp.train") + 1 :])
    for arg in command:
        if arg.startswith("workdir="):
            return Path(arg.split("=", 1)[1]).expanduser()
    return None


def _train_workdir(args: list[str]) -> Path | None:
    """The workdir of ``python -m jddp.train ARGS``."""
    if "-h" in args or "--help" in args:
        return None
    from jddp import config as config_lib
    from jddp.errors import JddpError
    from jddp.train import parse_args

    try:
        parsed = parse_args(args)
        return Path(config_lib.load(parsed.config, list(parsed.overrides)).workdir)
    except (JddpError, OSError, SystemExit):
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


def last_logged_step(workdir: Path | None) -> int | None:
    """The newest step with a train line in ``workdir/metrics.jsonl`` (process 0's), or None."""
    if workdir is None or not (workdir / "metrics.jsonl").exists():
        return None
    last = None
    with (workdir / "metrics.jsonl").open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a torn last line
            if isinstance(row, dict) and "train/loss" in row:
                last = max(last or 0, int(row.get("step", 0)))
    return last


class Restarts:
    """A launcher's restart budget (``--max-restarts``) and its crash-loop check, shared by
    ``jddp.launch`` and ``jddp.ray``."""

    def __init__(self, limit: int, workdir: Path | None):
        self.limit, self.workdir = limit, workdir
        self.count = 0
        self._previous: tuple[int, int | None, int | None] | None = None  # code, step, ckpt
        self._workdir_seen = False  # the workdir existed while the job ran (see: watch)

    def watch(self) -> None:
        """Called by a launcher as it supervises the job: note that the workdir exists, so that
        its deletion is told from a run that never made one (a stat at most)."""
        if not self._workdir_seen and self.workdir is not None and self.limit:
            self._workdir_seen = self.workdir.is_dir()

    def refusal(
        self, code: int, signal_received: int | None, cause: str, may_loop: bool = True
    ) -> str | None:
        """None to restart after a failure (``code``, said as ``cause``); else why not: ""
        when there is nothing to add (no restarts asked for, or nothing to restart), else the
        line that says it (restarts used up, a crash loop). The crash-loop check needs the
        command's workdir (its steps and checkpoints: :func:`workdir_of`) and ``may_loop``
        (False for a lost machine or Ray actor: no bug of the run's)."""
        if self.limit == 0 or not should_restart(code, signal_received):
            return ""
        step, checkpoint = last_logged_step(self.workdir), newest_checkpoint(self.workdir)
        if self._workdir_seen and self.workdir is not None and not self.workdir.is_dir():
            return (  # a restart would begin a new run at step 0 where the old one was
                f"{cause}; the run's workdir {self.workdir} was deleted while it ran: not "
                "restarting"
            )
        if self.count >= self.limit:
            return f"no restart left (--max-restarts {self.limit}); the last failure: {cause}"
        previous, self._previous = self._previous, (code, step, checkpoint)
        if not may_loop or self.workdir is None:
            previous = None
        if previous is not None and previous[0] == code and previous[2] == checkpoint:
            before = previous[1]
            same = (
                step == before
                if step is None or before is None
                else abs(step - before) <= SAME_STEP
            )
            if same:
                where = "before its first step" if step is None else f"after step {step}"
                return (
                    f"{cause} again {where}, with no checkpoint since the last restart: not "
                    "restarting (a failure that repeats at the same step is deterministic: fix "
                    "it, then rerun the same command, which resumes)"
                )
        self.count += 1
        return None

    def restarting(self, cause: str) -> str:
        """The restart's line (``restart 1/3: CAUSE; resuming from step 40``), its ``restart``
        row written to the run's ``metrics.jsonl``."""
        step = newest_checkpoint(self.workdir)
        record_restart(self.workdir, self.count, cause, step)
        return restart_line(self.count, self.limit, cause, step)
