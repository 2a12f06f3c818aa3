"""Elastic restarts on Ray: how many workers a restarted job may take.

``python -m jddp.ray --num-workers N --min-workers M --max-restarts K``: when a worker or its
node dies, the job starts again from its newest checkpoint on the workers Ray can place now,
between M and N, largest first (so a restart after the capacity came back takes all N again).
jddp's losses do not depend on the topology, so the global batch stays
``data.global_batch_size`` and the run goes on as planned: a worker count whose devices cannot
split that batch (or its micro-batches, ``train.grad_accum_steps``) is skipped for the next
smaller one that can, never changed silently. The batch is read from the command's own
resolved config (``<command> --print-config``) when the command is ``jddp.train``; any other
command is taken to split any batch (jddp refuses one it cannot split, exit 2, in one line).
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

import yaml

PRINT_CONFIG_TIMEOUT_S = 60.0


def batch_of(command: Sequence[str]) -> tuple[int, int] | None:
    """``(data.global_batch_size, train.grad_accum_steps)`` of a ``jddp.train`` command, read
    from its ``--print-config`` (run here, without JAX); None for other commands or when the
    config cannot be read (the job's own start says why)."""
    if "jddp.train" not in command:
        return None
    try:
        out = subprocess.run(
            [*command, "--print-config"],
            capture_output=True,
            text=True,
            timeout=PRINT_CONFIG_TIMEOUT_S,
            check=False,
        )
        saved = yaml.safe_load(out.stdout) if out.returncode == 0 else None
        return int(saved["data"]["global_batch_size"]), int(saved["train"]["grad_accum_steps"])
    except (OSError, subprocess.SubprocessError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None


def splits(batch: tuple[int, int] | None, workers: int, devices_per_worker: int) -> bool:
    """Whether ``workers`` x ``devices_per_worker`` devices split ``batch`` (global batch,
    micro-batches) into equal rows per device and micro-batch."""
    if batch is None:
        return True
    global_batch, accum = batch
    devices = workers * devices_per_worker
    return global_batch % devices == 0 and (global_batch // devices) % accum == 0


def worker_counts(
    most: int, least: int, devices_per_worker: int, batch: tuple[int, int] | None
) -> list[int]:
    """The worker counts a restart tries, largest first: ``most`` down to ``least``, those
    whose devices split ``batch``."""
    return [w for w in range(most, least - 1, -1) if splits(batch, w, devices_per_worker)]
