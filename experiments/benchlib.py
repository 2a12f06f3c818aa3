"""What every benchmark of ``experiments/`` shares: the machine and checkout a results file
records (:func:`machine_info`), its options and where it goes (:func:`output_args`,
:func:`save_result`), Markdown tables (:func:`md_table`), the one way to run the trainer and read
its own metrics (:func:`run_trainer`), the one ``mpirun``, and model FLOPs (:func:`model_figures`).
Scripts run as ``python experiments/<script>.py``: this folder is on ``sys.path``.
"""

from __future__ import annotations

import argparse
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


def load1() -> float:
    """The 1-minute load average (the VM is shared: every results file records it)."""
    return os.getloadavg()[0]


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
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        first = []
    cpu = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first)}
    mhz = cpu.get("cpu MHz", "")
    mhz = float(mhz) if mhz.replace(".", "", 1).isdigit() else None
    return cpu.get("model name"), mhz, set(cpu.get("flags", "").split())


def _mem_gib() -> float | None:
    try:
        return int(Path("/proc/meminfo").read_text().split()[1]) / 1024**2  # MemTotal, kB
    except (OSError, ValueError, IndexError):
        return None


def checkout() -> tuple[str | None, list[str], str | None]:
    """Commit (short), dirty paths and their source: ``git``, or, in a tree without ``.git`` (a
    lent GPU machine), :data:`GPU_COMMIT_FILE` (``<commit> clean|dirty``); ``(None, [], None)``
    when neither. ``JDDP_PREFER_COMMIT_FILE=1`` (``gpu_session.sh``) reads the file first: that
    tree once came with a stale ``.git`` (2026-11-24)."""
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
    """This machine and checkout as the results files record them; ``name``: the machine's name
    in file names (default: the short host name); ``extra``: a script's own fields, added last."""
    cpu_model, mhz, flags = _cpuinfo()
    host = socket.gethostname().split(".")[0]
    commit, dirty, commit_source = checkout()
    driver = sh("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
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
        "gpu_driver": (driver or "").split("\n")[0] or None,
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
    """Write ``result`` to ``path`` (folders made as needed) and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return path


def output_args(ap: argparse.ArgumentParser, machine: str | None = None) -> None:
    """The options every script shares: ``--machine`` (its name in the results file's name) and
    ``--out`` (the JSON path instead of ``results/...``)."""
    ap.add_argument("--machine", default=machine, help="name in the results file (default: host)")
    ap.add_argument(
        "--out", help="JSON path (default: experiments/results/<kind>-<date>-<machine>)"
    )


def save_result(kind: str, machine: str, result: dict[str, Any], out: str | None = None) -> Path:
    """Write ``result`` to ``out``, else to ``results/<kind>-<date>-<machine>.json`` (no ``kind``:
    ``<date>-<machine>``; ``-runN`` if taken), and say where."""
    if out:
        return write_json(Path(out), result)
    stem = "-".join(x for x in (kind, time.strftime("%Y-%m-%d"), machine) if x)
    return write_json(unused_path(RESULTS_DIR, stem), result)


def command_line() -> str:
    """This script's command line, as the results files record it."""
    return " ".join([Path(sys.executable).name, *sys.argv])


def md_table(columns: str, align: str = "l") -> None:
    """Print a Markdown table's head: ``columns`` as ``"a | b | c"``, ``align`` ``l`` or ``r``
    per column (the last letter repeated)."""
    n = columns.count(" | ") + 1
    rule = "|".join("---:" if a == "r" else "---" for a in align.ljust(n, align[-1]))
    print(f"| {columns} |\n|{rule}|")


def call_times(fn: Any, n: int) -> list[float]:
    """Seconds of each of ``n`` calls of ``fn()``."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def xla_cost(compiled: Any) -> dict[str, float]:
    """XLA's ``cost_analysis()`` of a compiled program as one dict (``{}`` when it has none)."""
    cost = compiled.cost_analysis()
    return (cost[0] if cost else {}) if isinstance(cost, list | tuple) else (cost or {})


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


def trainer_env(platform: str, xla_flags: str = "", extra: dict | None = None) -> dict[str, str]:
    """A trainer run's environment: ``JAX_PLATFORMS`` pinned (``cuda`` on GPU, so a machine
    without one fails instead of measuring the CPU), ``extra``, ``xla_flags`` appended."""
    env = {**os.environ, "JAX_PLATFORMS": "cuda" if platform == "gpu" else "cpu", **(extra or {})}
    flags = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    if flags:
        env["XLA_FLAGS"] = flags
    return env


def trainer_command(
    workdir: Path,
    overrides: list[str],
    nproc: int = 1,
    devices: int = 1,
    backend: str = "xla",
    wrap: tuple[str, ...] = (),
    launcher: str = "jddp.launch",
) -> list[str]:
    """``python -m jddp.train <overrides> workdir=...``: one process, under ``python -m
    jddp.launch`` (P or D > 1), ``srun -N1 -n P --cpus-per-task=<cores / P>`` (``launcher="srun"``)
    or ``mpirun -np P`` (``backend="mpi"``); each rank started through ``wrap``."""
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
    """Run the trainer (:func:`trainer_command`) to the end and read its ``metrics.jsonl``
    (``jddp.plot.load_metrics``): ``train/compile_s`` and, for every logging window ending after
    step ``skip_steps``, ``train/step_time_s``, ``train/img_per_s`` (a custom task's
    ``train/examples_per_s``), ``perf/input_wait_fraction`` (all keys: ``timed_rows``); every
    ``train/loss``, the last eval line, the ``mem/`` keys (their last values). Output:
    ``workdir/train.log``. A failed run raises SystemExit, or with ``check=False`` returns
    ``{"error": ...}``. ``tree``: the checkout whose jddp runs (the working directory, first on
    ``sys.path``)."""
    from jddp.plot import MetricsError, load_metrics

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
    try:
        rows = load_metrics(workdir) if rc == 0 else None
    except MetricsError as e:
        rows, stderr = None, f"{stderr}\n{e}"
    if rows is None:
        message = f"{' '.join(cmd)} failed ({rc}):\n{stderr[-2000:]}"
        if check:
            raise SystemExit(message)
        return {"command": cmd, "error": message[-3000:], "wall_s": wall}
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
        "memory": {k: v for r in rows for k, v in r.items() if k.startswith("mem/")},
        "input_wait_fraction": [r.get("perf/input_wait_fraction") for r in timed],
        "losses": {r["step"]: r["train/loss"] for r in rows if "train/loss" in r},
        "eval": evals[-1] if evals else None,
        "stdout_tail": stdout[-1500:],
    }


def layout_overrides(layout: str) -> list[str]:
    """A ``--layouts`` value's overrides: ``SHARD`` (``dist.shard``) or ``SHARD+REMAT`` (with
    that ``model.remat``; without it ``none``)."""
    shard, _, remat = layout.partition("+")
    return [f"dist.shard={shard}", f"model.remat={remat or 'none'}"]


# ----------------------------------------------------------------------- the architecture
def model_figures(
    model: str, stem: str, width: int, num_classes: int, image_size: int
) -> dict[str, Any]:
    """Parameter shapes and count and the forward multiply-accumulates of one example of the
    ``jddp.models`` network, built abstractly and traced (:func:`forward_macs`)."""
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


def peak_flops(
    machine: dict[str, Any], platform: str = "cpu", tflops: float | None = None
) -> tuple[float | None, str]:
    """The peak FLOP/s for MFU and how it was reckoned: ``tflops`` if given, else on a CPU an
    assumed FP32 vector peak (cores x clock x FLOP/cycle of its widest FMA units), else None."""
    if tflops:
        return tflops * 1e12, f"given: {tflops} TFLOP/s"
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
