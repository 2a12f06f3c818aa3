"""A rank killed by the kernel's out-of-memory killer, told from any other SIGKILL.

The OOM killer ends a process with SIGKILL, as ``kill -9`` does: the launcher saw "killed by
signal SIGKILL" and nothing more. The kernel counts its kills in the memory cgroup of the
process killed, and in every cgroup above it: the launcher reads the count of its own cgroup
(its ranks start in it) when it starts the ranks and again after a rank's SIGKILL
(:func:`oom_kills`); when it grew, the launcher says so, with the bytes the run's step needs per
device when its ``metrics.jsonl`` has them (``mem/step_bytes_per_device``) and what would need
less (:func:`oom_cause`).
"""

from __future__ import annotations

import json
from pathlib import Path

from jddp.launch.restarts import workdir_of

CGROUP_ROOT = Path("/sys/fs/cgroup")
STEP_KEY = "mem/step_bytes_per_device"  # (jddp.run.memory's, read here without JAX)


def oom_kills(root: Path = CGROUP_ROOT, cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """How many processes the OOM killer has killed in this process's memory cgroup (and the
    cgroups under it): ``oom_kill`` of ``memory.oom_control`` (cgroup v1, the hierarchy with
    the ``memory`` controller) or of ``memory.events`` (cgroup v2: the ``0::`` line), the
    cgroup read from ``cgroup`` (``/proc/self/cgroup``) under ``root``; None where there is
    none to read (no memory cgroup, another operating system)."""
    try:
        lines = cgroup.read_text().splitlines()
    except OSError:
        return None
    files = []
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        where = path.strip().lstrip("/")
        if "memory" in controllers.split(","):  # v1 first: a hybrid's v2 has no memory
            files.insert(0, root / "memory" / where / "memory.oom_control")
        elif number == "0" and not controllers:
            files += [root / where / "memory.events", root / "unified" / where / "memory.events"]
    for file in files:
        try:
            text = file.read_text()
        except OSError:
            continue
        for row in text.splitlines():
            key, _, value = row.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def step_bytes(workdir: Path | None) -> int | None:
    """The newest ``mem/step_bytes_per_device`` in ``workdir/metrics.jsonl``, if any."""
    if workdir is None:
        return None
    found = None
    try:
        with (workdir / "metrics.jsonl").open(encoding="utf-8", errors="replace") as f:
            for line in f:
                if STEP_KEY in line:
                    try:
                        value = json.loads(line).get(STEP_KEY)
                    except (ValueError, AttributeError):
                        continue
                    found = value if isinstance(value, int) else found
    except OSError:
        return None
    return found


def _size(nbytes: int) -> str:
    """``nbytes`` in MiB, one decimal (GiB from 10 GiB on), as the run's own memory line."""
    if nbytes >= 10 * 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


def oom_cause(rank: int, command: list[str]) -> str:
    """The launcher's words for rank ``rank`` killed by the OOM killer: the step's bytes per
    device from the run's ``metrics.jsonl`` (its workdir read from ``command``, as restarts
    read it), and what would need less."""
    need = step_bytes(workdir_of(command))
    needs = f"; the step needs {_size(need)} per device ({STEP_KEY})" if need else ""
    return (
        f"rank {rank} was killed by the kernel's out-of-memory killer (SIGKILL){needs}; what "
        "needs less memory: dist.shard=full, model.remat=blocks, a smaller per-device batch "
        "(data.global_batch_size, train.grad_accum_steps)"
    )
