"""What every benchmark of ``experiments/`` shares: the machine and checkout a results file
records (:func:`machine_info`), where results go (:func:`save_result`), the one way to run the
trainer and read its own metrics (:func:`run_trainer`), the one ``mpirun``
(:func:`mpirun`), and the architecture figures of a ``jddp.models`` network
(:func:`model_figures`).

The scripts run as ``python experiments/<script>.py``, so this folder is on ``sys.path`` and
``import benchlib`` finds this file. jax is imported only inside :func:`model_figures`.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# Where scripts/gpu_wheels.sh records the checkout's commit, inside the folder a lent GPU
# machine is sent anyway (the tree travels there without .git).
GPU_COMMIT_FILE = Path(".whl") / "gpu_commit.txt"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
if str(REPO) not in sys.path:  # this checkout's jddp, also in a script's worker processes
    sys.path.insert(1, str(REPO))

# Distributions whose versions machine_info records (None where not installed).
VERSIONED = (
    "jax", "jaxlib", "flax", "optax", "numpy", "torch", "torchvision", "mpi4py", "mpi4jax",
    "mpich", "jax-cuda12-plugin", "jax-cuda13-plugin", "orbax-checkpoint", "grain",
)  # fmt: skip
# /proc/cpuinfo flags worth knowing when reading a CPU number (vector width, bf16, AMX).
ISA_FLAGS = frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
# Environment variables that change the memory allocator (none are set by the scripts).
ALLOCATOR_VARS = (
    "LD_PRELOAD", "MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_CONF", "TCMALLOC_RELEASE_RATE",
)  # fmt: skip


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
    one placeholder); ``(None, [], None)`` when neither is there. ``JDDP_PREFER_COMMIT_FILE=1``
    (set by ``gpu_session.sh`` there) reads the file first: the lent machine's tree once came
    with a ``.git`` from the session's start, older than the tree (2026-11-24)."""
    commit = None
    if not (os.environ.get("JDDP_PREFER_COMMIT_FILE") == "1" and (REPO / GPU_COMMIT_FILE).exists()):
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
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return path


def save_result(kind: str, machine: str, result: dict[str, Any]) -> Path:
    """Write ``result`` as ``results/<kind>-<date>-<machine>.json`` (``-runN`` if taken) and say
    where."""
    path = unused_path(RESULTS_DIR, f"{kind}-{time.strftime('%Y-%m-%d')}-{machine}")
    return write_json(path, result)


def median_p10_p90(xs: list[float]) -> dict[str, float]:
    """``{"median", "p10", "p90"}`` of ``xs`` (NaN for no values)."""
    med = statistics.median(xs) if xs else float("nan")
    return {"median": med, "p10": percentile(xs, 0.1), "p90": percentile(xs, 0.9)}


# ------------------------------------------------------------------------------ the trainer
def mpirun() -> str:
    """The ``mpirun`` next to this Python (the virtualenv's MPICH, what ``dist.backend=mpi`` is
    tested with), else the one on ``PATH``."""
    here = Path(sys.executable).parent / "mpirun"
    found = str(here) if here.exists() else shutil.which("mpirun")
    if not found:
        raise SystemExit("no mpirun next to sys.executable or on PATH: bash scripts/setup.sh")
    return found


def trainer_command(
    workdir: Path,
    overrides: list[str],
    nproc: int = 1,
    devices: int = 1,
    backend: str = "xla",
    wrap: tuple[str, ...] = (),
    launcher: str = "jddp.launch",
) -> list[str]:
    """``python -m jddp.train <overrides> workdir=...``, as one process, under ``python -m
    jddp.launch --nproc P --devices-per-proc D`` (``backend="xla"``, P or D > 1), under
    ``srun -N1 -n P --cpus-per-task=C`` (``launcher="srun"``, one device per task, C: this
    machine's cores over P) or under ``mpirun -np P`` with ``dist.backend=mpi``. ``wrap``: a
    command each rank is started through (e.g. ``bench.py``'s CPU pinning)."""
    train = [*wrap, sys.executable, "-m", "jddp.train", *overrides, f"workdir={workdir}"]
    if backend == "mpi":
        return [mpirun(), "-np", str(nproc), *train, "dist.backend=mpi"]
    if launcher == "srun":
        if devices != 1:
            raise ValueError("srun runs one device per task (devices=1)")
        cores = max(1, len(os.sched_getaffinity(0)) // nproc)
        return ["srun", "-N1", "-n", str(nproc), f"--cpus-per-task={cores}", *train]
    if nproc > 1 or devices > 1:
        launch = [sys.executable, "-m", "jddp.launch", "--nproc", str(nproc)]
        return [*launch, "--devices-per-proc", str(devices), "--", *train]
    return train


def run_trainer(
    workdir: Path,
    overrides: list[str],
    *,
    nproc: int = 1,
    devices: int = 1,
    backend: str = "xla",
    wrap: tuple[str, ...] = (),
    launcher: str = "jddp.launch",
    env: dict[str, str] | None = None,
    skip_steps: int = 0,
    check: bool = True,
    timeout: float | None = None,
    tree: Path = REPO,
) -> dict[str, Any]:
    """Run the trainer (:func:`trainer_command`) to the end and read what it logged itself in
    ``workdir/metrics.jsonl``: ``train/compile_s`` (the first step, compilation included) and,
    for every logging window ending after step ``skip_steps``, ``train/step_time_s``,
    ``train/img_per_s`` (a custom task's ``train/examples_per_s``) and
    ``perf/input_wait_fraction`` (and all of those windows' keys: ``timed_rows``); also every
    step's ``train/loss`` and the last eval line. Output goes to ``workdir/train.log``. A failed
    run raises SystemExit, or with ``check=False`` returns ``{"error": ...}``. ``tree``: the
    checkout whose jddp runs (the working directory: ``python -m`` puts it first on
    ``sys.path``, before PYTHONPATH)."""
    env = dict(os.environ if env is None else env)
    if backend == "mpi" and devices > 1:  # jddp.launch sets this itself for its ranks
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    cmd = trainer_command(workdir, overrides, nproc, devices, backend, wrap, launcher)
    workdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, env=env, cwd=tree, timeout=timeout
        )
        rc, stdout, stderr = out.returncode, out.stdout, out.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = "timeout", str(e.stdout or ""), str(e.stderr or "")
    wall = time.perf_counter() - start
    (workdir / "train.log").write_text(
        f"$ XLA_FLAGS={env.get('XLA_FLAGS', '')!r} {' '.join(cmd)}\n{stdout}\n{stderr}"
    )
    metrics = workdir / "metrics.jsonl"
    if rc != 0 or not metrics.exists():
        message = f"{' '.join(cmd)} failed ({rc}):\n{stderr[-2000:]}"
        if check:
            raise SystemExit(message)
        return {"command": cmd, "error": message[-3000:], "wall_s": wall}
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    timed = [r for r in rows if "train/step_time_s" in r and r["step"] > skip_steps]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    return {
        "command": cmd,
        "wall_s": wall,
        "compile_s": next((r["train/compile_s"] for r in rows if "train/compile_s" in r), None),
        "steps": [r["step"] for r in timed],
        "step_s": [r["train/step_time_s"] for r in timed],
        "img_per_s": [r.get("train/img_per_s", r.get("train/examples_per_s")) for r in timed],
        "timed_rows": timed,  # every key of those windows (a task's own rates, say)
        "input_wait_fraction": [r.get("perf/input_wait_fraction") for r in timed],
        "losses": {r["step"]: r["train/loss"] for r in rows if "train/loss" in r},
        "eval": evals[-1] if evals else None,
        "stdout_tail": stdout[-1500:],
    }


# ----------------------------------------------------------------------- the architecture
def model_figures(
    model: str, stem: str, width: int, num_classes: int, image_size: int
) -> dict[str, Any]:
    """Parameter shapes and count and the forward multiply-accumulates of one example, read from
    the ``jddp.models`` network itself: the model is built abstractly (``nnx.eval_shape``) and
    its forward pass traced (``jax.make_jaxpr``); every convolution counts output elements x
    kernel elements per output feature (padding taps included, as torchvision, thop and fvcore
    count), every matmul output elements x contracted size; BatchNorm, activations, pooling and
    residual adds are left out (well under 1% for a ResNet)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a trace needs no accelerator
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jddp.models import get_model_factory

    factory = get_model_factory(model)
    abstract = nnx.eval_shape(
        lambda: factory(num_classes=num_classes, stem=stem, width=width, rngs=nnx.Rngs(0))
    )
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)

    def forward(params, rest, x):
        net = nnx.merge(graphdef, params, rest)
        net.eval()
        return net(x)

    image = jax.ShapeDtypeStruct((1, image_size, image_size, 3), jnp.float32)
    shapes = [tuple(leaf.shape) for leaf in jax.tree.leaves(params)]
    return {
        "params": sum(math.prod(s) for s in shapes),
        "param_shapes": shapes,
        "forward_macs": forward_macs(forward, params, rest, image),
    }


def forward_macs(forward: Any, *args: Any) -> int:
    """Multiply-accumulates of ``forward(*args)`` (arguments may be shapes), from its traced
    program: every convolution counts output elements x kernel elements per output feature
    (padding taps included, as torchvision, thop and fvcore count), every matmul (``einsum``
    included) output elements x contracted size; elementwise work is left out."""
    import jax

    macs = 0

    def walk(jaxpr) -> None:
        nonlocal macs
        for eqn in jaxpr.eqns:
            out = eqn.outvars[0].aval
            if eqn.primitive.name == "conv_general_dilated":
                kernel = eqn.invars[1].aval
                out_dim = eqn.params["dimension_numbers"].rhs_spec[0]
                macs += math.prod(out.shape) * math.prod(kernel.shape) // kernel.shape[out_dim]
            elif eqn.primitive.name == "dot_general":
                (contracted, _), _ = eqn.params["dimension_numbers"]
                lhs = eqn.invars[0].aval.shape
                macs += math.prod(out.shape) * math.prod(lhs[d] for d in contracted)
            for value in eqn.params.values():  # nested calls (jit, custom_jvp, ...)
                inner = getattr(value, "jaxpr", None)
                if inner is not None:
                    walk(getattr(inner, "jaxpr", inner))

    walk(jax.make_jaxpr(forward)(*args).jaxpr)
    return macs


def assumed_peak(machine: dict[str, Any], platform: str = "cpu") -> tuple[float | None, str]:
    """The FP32 vector peak FLOP/s assumed for a CPU (cores x clock x FLOP/cycle of its widest
    FMA units) and how it was reckoned; None on other platforms (give a peak there)."""
    if platform != "cpu" or not machine.get("cpu_mhz"):
        return None, "none given (--peak-tflops): achieved FLOP/s only"
    cores, ghz = machine["cpu_count"], machine["cpu_mhz"] / 1e3
    per_cycle = 64 if "avx512f" in machine["isa"] else 32
    peak = cores * ghz * 1e9 * per_cycle
    return peak, (
        f"assumed FP32 vector peak: {cores} cores x {ghz:.2f} GHz x {per_cycle} FLOP/cycle "
        f"= {peak / 1e9:.1f} GFLOP/s; MFU for float32 only"
    )


def train_step_flops(figures: dict[str, Any], global_batch: int) -> float:
    """Model FLOPs of one training step: 3 (forward + backward counted as 2 x forward) x 2
    (multiply and add) x forward MACs x global batch."""
    return 3 * 2 * figures["forward_macs"] * global_batch
