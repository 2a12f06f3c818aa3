"""The run folder: the one owner of every path in a workdir, its writable check, and a lock so
two live runs never share one workdir."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from jddp.errors import ConfigError, WorkdirLost

LOCK_NAME = ".jddp.lock"
PREEMPTED_NAME = ".jddp.preempted"
STOPPED_NAME = ".jddp.stopped"
RESUMED_FROM_NAME = ".jddp.resumed_from"


class RunFolder:
    """Every path of a run folder (``workdir``); no other module spells them."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @property
    def config_yaml(self) -> Path:
        """The resolved config of the run."""
        return self.root / "config.yaml"

    @property
    def metrics_jsonl(self) -> Path:
        """One JSON object per logged step."""
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files (``tensorboard --logdir WORKDIR``)."""
        return self.root / "tensorboard"

    @property
    def trackers_json(self) -> Path:
        """The tracked runs (MLflow, W&B) of this run: ids and last steps sent, so a rerun
        continues them (:mod:`jddp.run.trackers`)."""
        return self.root / "trackers.json"

    @property
    def checkpoints(self) -> Path:
        """Orbax checkpoints, one folder per step (absolute: orbax wants it)."""
        return (self.root / "checkpoints").absolute()

    @property
    def damaged_checkpoints(self) -> Path:
        """Where checkpoints that fail verification are moved (nothing written is deleted)."""
        return (self.root / "checkpoints-damaged").absolute()

    @property
    def profile(self) -> Path:
        """``log.profile_steps`` traces."""
        return self.root / "profile"

    @property
    def lock_file(self) -> Path:
        """Held while a run uses the folder."""
        return self.root / LOCK_NAME

    @property
    def preempted_marker(self) -> Path:
        """Present while the folder's run was preempted and has not finished since: holds the
        step and the config it stopped with (so a rerun continues it, see
        :meth:`preempted_run`)."""
        return self.root / PREEMPTED_NAME

    def mark_preempted(self, step: int, config: dict) -> None:
        """Record that the run stopped at ``step`` on a stop signal (written atomically)."""
        _write_marker(self.preempted_marker, {"step": step, "config": config})

    def preempted_run(self) -> tuple[int, dict] | None:
        """``(step, config)`` of the folder's preempted, unfinished run, or None."""
        try:
            record = _read_marker(self.preempted_marker)
            return int(record["step"]), dict(record["config"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def clear_preempted(self) -> None:
        """The run finished: a later rerun under ``checkpoint.resume=false`` starts over."""
        self.preempted_marker.unlink(missing_ok=True)

    @property
    def stopped_marker(self) -> Path:
        """Present while the folder's run ended early (a callback's stop, early stopping):
        its step, why, and the early-stopping keys it ran under (so a rerun stays stopped,
        see :meth:`stopped_run`)."""
        return self.root / STOPPED_NAME

    def mark_stopped(self, step: int, reason: str, keys: dict) -> None:
        """Record that the run ended early at ``step`` (written atomically)."""
        _write_marker(self.stopped_marker, {"step": step, "reason": reason, "keys": keys})

    def stopped_run(self) -> tuple[int, str, dict] | None:
        """``(step, reason, keys)`` of the folder's run that ended early, or None."""
        try:
            record = _read_marker(self.stopped_marker)
            return int(record["step"]), str(record["reason"]), dict(record["keys"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def clear_stopped(self) -> None:
        """The run trained on past an early stop (or ended at its last step)."""
        self.stopped_marker.unlink(missing_ok=True)

    @property
    def resumed_from_marker(self) -> Path:
        """Present once ``checkpoint.resume_from`` was applied: its value and the step it
        resumed from (a rerun with the same value continues from the newest checkpoint)."""
        return self.root / RESUMED_FROM_NAME

    def mark_resumed_from(self, value: str, step: int) -> None:
        """Record that ``checkpoint.resume_from=value`` resumed from ``step`` (atomically)."""
        _write_marker(self.resumed_from_marker, {"resume_from": value, "step": step})

    def resumed_from(self) -> tuple[str, int] | None:
        """``(value, step)`` of the ``checkpoint.resume_from`` applied here, or None."""
        try:
            record = _read_marker(self.resumed_from_marker)
            return str(record["resume_from"]), int(record["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _new_previous(self) -> Path:
        """A new, empty ``previous/<UTC time>[-n]/`` folder."""
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        target = self.previous_runs / stamp
        suffix = 1
        while target.exists():
            suffix += 1
            target = self.previous_runs / f"{stamp}-{suffix}"
        target.mkdir(parents=True)
        return target

    def set_aside_checkpoints(self, steps: list[int]) -> Path:
        """Move checkpoints ``steps`` to ``previous/<UTC time>/checkpoints/`` with a copy of
        ``metrics.jsonl`` (a run resuming from an older checkpoint drops the lines after
        it); returns where they went. Nothing is deleted."""
        target = self._new_previous()
        (target / "checkpoints").mkdir()
        for step in steps:
            (self.checkpoints / str(step)).rename(target / "checkpoints" / str(step))
        if self.metrics_jsonl.exists():
            shutil.copy2(self.metrics_jsonl, target / self.metrics_jsonl.name)
        return target

    @property
    def previous_runs(self) -> Path:
        """Where ``checkpoint.resume=false`` moves an earlier run's outputs."""
        return self.root / "previous"

    def prepare(self) -> Path:
        """Create the folder and its checkpoints folder if needed; ``ConfigError`` naming the
        one that cannot be written (a save into it would fail only after training)."""
        prepare(self.root)
        checkpoints = self.checkpoints
        if checkpoints.exists() and not checkpoints.is_dir():
            raise ConfigError(
                f"workdir={str(self.root)!r}: its checkpoints folder {checkpoints} is not a "
                "folder (a file is there); move it away, or use another workdir"
            )
        # (One that does not exist yet is made in the workdir, writable as just checked.)
        problem = unwritable(checkpoints) if checkpoints.exists() else None
        if problem is not None:
            raise ConfigError(
                f"workdir={str(self.root)!r}: its checkpoints folder {checkpoints} is not "
                f"writable ({problem}); make it writable, or use another workdir"
            )
        return self.root

    def set_aside_previous_run(self) -> Path | None:
        """Move an earlier run's outputs (checkpoints, metrics, TensorBoard files, tracked runs,
        config, profile) to ``previous/<UTC time>/``, so a fresh run's folder holds only its own and
        nothing written is lost; returns where they went (None if there was nothing)."""
        outputs = [
            self.config_yaml,
            self.metrics_jsonl,
            self.tensorboard,
            self.trackers_json,
            self.checkpoints,
            self.damaged_checkpoints,
            self.profile,
            self.preempted_marker,
            self.stopped_marker,
            self.resumed_from_marker,
        ]
        present = [p for p in outputs if p.exists()]
        if not present:
            return None
        target = self._new_previous()
        for path in present:
            path.rename(target / path.name)
        return target


def _proc_stat(pid: int) -> list[str]:
    """Fields 3.. of /proc/<pid>/stat (state, ppid, ...), or [] where unavailable."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' where /proc is unavailable)."""
    fields = _proc_stat(pid)
    return fields[19] if len(fields) > 19 else ""  # field 22 of proc(5)


def _pid_alive(pid: int, started: str) -> bool:
    """Whether ``pid`` is alive and is still the process that wrote the lock (pids are reused:
    a live pid with another start time, or our own pid, is not the owner)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _proc_stat(pid)
    if fields and fields[0] in ("Z", "X"):  # killed, not yet reaped: dead
        return False
    return not started or not fields or _start_time(pid) == started


def unwritable(folder: Path) -> str | None:
    """Why a file cannot be written in ``folder``, as the OS says it (``Read-only file
    system``, ``Permission denied``, ``No such file or directory``, ...); None when one can.
    Tried, not read from the permission bits: root ignores those, a read-only mount binds it
    too."""
    probe = folder / f".jddp-write-test-{socket.gethostname()}-{os.getpid()}"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return e.strerror or str(e)
    return None


def prepare(workdir: str | Path) -> Path:
    """Create ``workdir`` if needed; ``ConfigError`` naming it when it cannot be written."""
    path = Path(workdir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".jddp-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"workdir={str(path)!r} is not writable: {e.strerror or e}") from None
    return path


class WorkdirLock:
    """A run folder's lock file holding ``host pid start-time`` while a run uses the folder.

    A lock whose process is gone (same host, pid not alive) is stale and taken over with a
    warning; a live one is refused with a ``ConfigError`` naming the pid.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.held = False
        self.owner = ""  # what this process wrote into the lock file

    def acquire(self) -> None:
        """Take the lock or raise ``ConfigError``."""
        me = f"{socket.gethostname()} {os.getpid()} {_start_time(os.getpid())}"
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self.path.read_text().split() if self.path.exists() else []
                host, pid, started = (owner + ["?", "0", ""][len(owner) :])[:3]
                alive = host != socket.gethostname() or (
                    pid.isdigit() and _pid_alive(int(pid), started)
                )
                if alive:
                    raise ConfigError(
                        f"workdir {str(self.path.parent)!r} is in use by a live run "
                        f"(pid {pid} on {host}, lock {self.path}); wait for it or use another "
                        "workdir"
                    ) from None
                print(
                    f"jddp: warning: taking over stale lock {self.path} of dead pid {pid}",
                    file=sys.stderr,
                )
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(me + "\n")
            self.held, self.owner = True, me + "\n"
            return
        raise ConfigError(f"cannot take the workdir lock {self.path}")

    def verify(self) -> None:
        """Raise :class:`WorkdirLost` when the lock this process holds was removed or now
        belongs to another run (a cleanup script, a user, a second run that then started):
        two runs in one folder would delete each other's checkpoints."""
        if not self.held:
            return
        try:
            now = self.path.read_text()
        except FileNotFoundError:
            now = None
        except OSError:
            return  # unreadable for a moment (a network file system): check again later
        if now == self.owner:
            return
        self.held = False  # not ours any more: never delete it
        owner = now.split() if now else []
        what = (
            f"was taken by another run (pid {owner[1]} on {owner[0]})"
            if len(owner) >= 2
            else "was removed"
        )
        raise WorkdirLost(
            f"the workdir lock {self.path} {what} while this run trained: this run stops so "
            "that two runs never write one workdir (nothing was deleted; its checkpoints so far "
            "stay); rerun when the folder is free, or use another workdir"
        )

    def release(self) -> None:
        """Remove the lock if this process holds it (and it still holds what we wrote)."""
        if self.held:
            try:
                ours = self.path.read_text() == self.owner
            except OSError:
                ours = False
            if ours:
                self.path.unlink(missing_ok=True)
            self.held = False


def _write_marker(path: Path, record: dict) -> None:
    """A marker file's JSON ``record``, written atomically (a temporary file renamed)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def _read_marker(path: Path) -> Any:
    """A marker file's JSON record (OSError when absent, ValueError when not JSON)."""
    return json.loads(path.read_text())
