"""Helpers shared by the benchmark scripts of ``experiments/`` (``bench.py``,
``bench_overhead.py``, ``bench_allreduce.py``, ``bench_precision.py``).

What every results file needs the same way: where results go (:data:`RESULTS_DIR`), the record
of the machine and checkout a run was made on (:func:`machine_info`), a quiet subprocess call
(:func:`sh`), an installed distribution's version (:func:`version`), an interpolated
percentile (:func:`percentile`) and a results file name that is not taken yet
(:func:`unused_path`).

Standard library only, at import and at call time: ``bench.py``'s driver imports nothing else.
The scripts run as ``python experiments/<script>.py``, so this folder is on ``sys.path`` and
``import benchlib`` finds this file.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# Where scripts/gpu_wheels.sh records the checkout's commit, inside the folder a lent GPU
# machine is sent anyway (the tree travels there without .git).
GPU_COMMIT_FILE = Path(".whl") / "gpu_commit.txt"
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Distributions whose versions machine_info records (None where not installed).
VERSIONED = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "numpy",
    "torch",
    "torchvision",
    "mpi4py",
    "mpi4jax",
    "mpich",
    "jax-cuda12-plugin",
    "jax-cuda13-plugin",
    "orbax-checkpoint",
    "grain",
)
# /proc/cpuinfo flags worth knowing when reading a CPU number (vector width, bf16, AMX).
ISA_FLAGS = frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
# Environment variables that change the memory allocator (none are set by the scripts).
ALLOCATOR_VARS = (
    "LD_PRELOAD",
    "MALLOC_ARENA_MAX",
    "MALLOC_MMAP_MAX_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_CONF",
    "TCMALLOC_RELEASE_RATE",
)


def sh(*cmd: str) -> str | None:
    """``cmd``'s stdout, stripped; None when it cannot start, fails or runs over 30 s."""
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None."""
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``xs`` by linear interpolation; NaN for no values."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def unused_path(folder: Path, stem: str, suffix: str = ".json") -> Path:
    """``folder/<stem><suffix>``, or ``<stem>-run2``, ``-run3``, ... when that exists."""
    path = folder / f"{stem}{suffix}"
    n = 2
    while path.exists():
        path = folder / f"{stem}-run{n}{suffix}"
        n += 1
    return path


def _cpuinfo() -> tuple[str | None, float | None, set[str]]:
    """Model name, clock (MHz) and flags of the first CPU in /proc/cpuinfo (None/empty: unknown)."""
    model, mhz, flags = None, None, set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, mhz, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "cpu MHz" and mhz is None:
            try:
                mhz = float(value)
            except ValueError:
                pass
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, mhz, flags


def _mem_gib() -> float | None:
    try:
        return int(Path("/proc/meminfo").read_text().split()[1]) / 1024**2  # MemTotal, kB
    except (OSError, ValueError, IndexError):
        return None


def checkout() -> tuple[str | None, list[str], str | None]:
    """Commit (short), dirty paths and where they came from: ``git``, or, in a copy of the tree
    without ``.git`` (as on a lent GPU machine), the file :data:`GPU_COMMIT_FILE` that
    ``scripts/gpu_wheels.sh`` writes (``<commit> clean|dirty``; dirty paths are then unknown,
    one placeholder); ``(None, [], None)`` when neither is there."""
    commit = sh("git", "-C", str(REPO), "rev-parse", "--short", "HEAD")
    if commit:
        dirty = (sh("git", "-C", str(REPO), "status", "--porcelain") or "").splitlines()
        return commit, dirty, "git"
    try:
        fields = (REPO / GPU_COMMIT_FILE).read_text().split()
    except OSError:
        return None, [], None
    if not fields:
        return None, [], None
    dirty = [] if fields[1:2] == ["clean"] else [f"(unknown: {GPU_COMMIT_FILE} says dirty)"]
    return fields[0], dirty, str(GPU_COMMIT_FILE)


def machine_info(name: str | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """This machine and checkout, as the results files record them.

    ``name``: the machine's name in file names (default: the short host name). ``extra``: a
    script's own fields, added last (they win over a common field of the same name)."""
    cpu_model, mhz, flags = _cpuinfo()
    host = socket.gethostname().split(".")[0]
    commit, dirty, commit_source = checkout()
    info: dict[str, Any] = {
        "name": name or host or "cpu",
        "hostname": host,
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_model": cpu_model,
        "cpu_mhz": mhz,
        "cpu_count": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "isa": sorted(flags & ISA_FLAGS),
        "mem_gib": _mem_gib(),
        "gpus": (sh("nvidia-smi", "-L") or "").splitlines(),
        "gpu_driver": (
            sh("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader") or ""
        ).split("\n")[0]
        or None,
        "python": platform.python_version(),
        "versions": {d: version(d) for d in VERSIONED},
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "allocator_env": {k: os.environ.get(k) for k in ALLOCATOR_VARS},
        "git_commit": commit,
        "git_dirty": bool(dirty),
        "git_dirty_paths": dirty,
        "git_commit_source": commit_source,
    }
    info.update(extra or {})
    return info


def write_json(path: Path, result: dict[str, Any]) -> Path:
    """Write ``result`` to ``path`` (folders made as needed) as the results files are written,
    and say where."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return path


def save_result(kind: str, machine: str, result: dict[str, Any]) -> Path:
    """Write ``result`` as ``results/<kind>-<date>-<machine>.json`` (``-runN`` if taken) and say
    where."""
    import time

    path = unused_path(RESULTS_DIR, f"{kind}-{time.strftime('%Y-%m-%d')}-{machine}")
    return write_json(path, result)
