"""The run folder: writable check and a lock so two live runs never share one workdir."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from jddp.config import ConfigError

LOCK_NAME = ".jddp.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
    """``workdir/.jddp.lock`` holding ``host pid`` while a run uses the folder.

    A lock whose process is gone (same host, pid not alive) is stale and taken over with a
    warning; a live one is refused with a ``ConfigError`` naming the pid.
    """

    def __init__(self, workdir: str | Path):
        self.path = Path(workdir) / LOCK_NAME
        self.held = False

    def acquire(self) -> None:
        """Take the lock or raise ``ConfigError``."""
        me = f"{socket.gethostname()} {os.getpid()}"
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self.path.read_text().split() if self.path.exists() else []
                host, pid = (owner + ["?", "0"])[:2]
                alive = host != socket.gethostname() or not pid.isdigit() or _pid_alive(int(pid))
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
            self.held = True
            return
        raise ConfigError(f"cannot take the workdir lock {self.path}")

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False
