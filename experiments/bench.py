"""Training throughput benchmark: jddp vs PyTorch DistributedDataParallel, interleaved.

Usage (repo root, the project's virtualenv plus ``experiments/requirements-bench.txt``):

    .venv/bin/python experiments/bench.py                  # the CPU matrix below, ~9 min here
    .venv/bin/python experiments/bench.py --dtypes float32 --rounds 2 \\
        --configs jddp-2x1,jddp-2x1-1t,jddp-2x1-pin,torch-ddp-2x1     # thread variants
    .venv/bin/python experiments/bench.py --dtypes float32 \\
        --configs jddp-2x1,jddp-mpi-2x1,torch-ddp-2x1     # jddp's two backends (xla, mpi)
    .venv/bin/python experiments/bench.py --profile --dtypes float32 \\
        --configs jddp-2x1,torch-ddp-2x1                  # where one step's time goes
    .venv/bin/python experiments/bench.py --platform gpu --preset resnet50-imagenet \\
        --configs jddp-1x8,jddp-8x1,torch-ddp-8x1 --peak-tflops 989   # a GPU box (not run here)
    .venv/bin/python experiments/bench.py --quick --no-plot   # smoke run, ~15 s here (tests use it)
    .venv/bin/python experiments/bench.py --regenerate-results-md   # RESULTS.md's tables only

Default workload: jddp's ResNet-18 with the CIFAR stem (3x3/1 conv, no max-pool), width 64, 10
classes, synthetic 32x32x3 images, global batch 128, SGD lr 0.1 momentum 0.9 with L2 weight decay
5e-4 added to the gradient (jddp's ``sgd``: ``optax.chain(add_decayed_weights(5e-4), sgd(0.1,
momentum=0.9))``; PyTorch ``SGD(lr=0.1, momentum=0.9, weight_decay=5e-4)``). ``--preset
resnet50-imagenet`` is ResNet-50, 224x224, 1000 classes, global batch 256 (GPU only: far too slow
for a 2-core CPU).

Configurations (``--configs``, comma separated; ``P`` processes):

* ``jddp-PxD``: jddp, P processes x D JAX devices each (D > 1 on CPU forces D host devices with
  ``--xla_force_host_platform_device_count``). P > 1 joins the processes with
  ``jddp.distributed.initialize`` from the ``JDDP_*`` variables that ``python -m jddp.launch``
  sets (CPU collectives: gloo), so the step's ``pmean`` spans every process. The step is
  ``jddp.setup.build_steps`` (one jitted ``shard_map`` program, state donated) on
  ``jddp.state.create_train_state``; the batch is placed with ``jddp.data.loader.place_batch``.
  This is jddp's ``dist.backend=xla``.
* ``jddp-mpi-PxD``: jddp's ``dist.backend=mpi``: P MPI ranks x D JAX devices each, started by
  ``mpirun -np P`` (the one next to ``sys.executable``: the virtualenv's MPICH). Built as
  ``jddp.trainer`` builds it: ``jddp.comm.make_comm("mpi")`` (``MpiComm``), a mesh over the
  rank's own devices, each rank its rows of the global batch (``batch_layout`` with the MPI
  rank and size), rank 0's initial state on every rank (``comm.broadcast_state``) and
  ``make_train_step(..., comm)``: a jitted local ``shard_map`` stage (forward, backward,
  ``pmean`` over the rank's devices), then a single-device jit that sums every gradient leaf
  over the ranks with ``mpi4jax.allreduce`` and applies the update (state not donated). The
  driver talks to rank 0 only (``mpirun`` gives stdin to rank 0): rank 0 relays each command
  to the other ranks (point-to-point, polled with sleeps: a blocking MPICH wait spins a core)
  and sends every rank's reply (``gather``), so the
  group reports per-rank times like the others. An exception in any rank calls
  ``MPI_Abort``, and ``mpirun`` ends the job on any rank's death, so a failure ends the
  group with ``mpirun``'s log (all ranks' output) in the error, never a hang; the driver ends
  ``mpirun`` (SIGTERM, then SIGKILL to what is left of its process tree) when it stops.
  ``-pin`` pins rank i to CPU i; ``-1t`` and ``-noynnconv`` set the same ``XLA_FLAGS``
  (``mpirun`` passes the environment on). ``--profile`` does not support it. On GPU each rank
  sets ``CUDA_VISIBLE_DEVICES`` to its D GPUs from its rank (untested, like the GPU path).
* ``torch-ddp-PxT``: ``experiments/peers/torch_ddp.py``, P processes; on CPU T is the intra-op
  threads of each process (``torch.set_num_threads``; gloo), on GPU T must be 1 (one GPU per
  process, NCCL).
* suffixes (combinable, e.g. ``jddp-2x1-pin-noynnconv``): ``-pin``: process i is pinned to CPU i
  (mod the CPU count) with ``sched_setaffinity`` before jax/torch start (XLA then sizes its
  thread pools for 1 core); ``-1t`` (jddp): ``XLA_FLAGS`` gets ``--xla_cpu_multi_thread_eigen=false
  intra_op_parallelism_threads=1``; ``-noynnconv`` (jddp): ``XLA_FLAGS`` gets
  ``--xla_cpu_experimental_ynn_fusion_type=-individual_convolution`` (convolutions leave
  YNNPACK, XLA:CPU's default conv library in jax 0.10, for XLA's own conv emitter/runtime).

Default ``--configs``: ``jddp-1x1,jddp-2x1,jddp-2x1-pin,torch-ddp-2x1,torch-ddp-2x1-pin``, each
in ``--dtypes float32,bfloat16``.
bfloat16 = jddp's ``train.precision=bfloat16`` (model and step compute dtype bf16, BatchNorm
statistics, residual adds, head and logits in f32, parameters, gradients and the gradient
all-reduce in f32) and ``torch.autocast(dtype=torch.bfloat16)`` for PyTorch (parameters,
gradients, all-reduce f32).

Method. Every configuration runs in its own long-lived worker processes (started by this script
with the same environment apart from the variables named above; no ``MALLOC_*`` or
``LD_PRELOAD`` is set for either side: glibc malloc defaults, recorded in the JSON). A group is
started, compiled and warmed up (``--warmup`` steps) while the others wait, one at a time; then
``--rounds`` rounds run ``--steps-per-round`` timed steps of each group in turn (A B C A B C ...,
all groups of one dtype alive together, dtypes one after the other). Idle groups block on a
pipe. Data loading is not timed: each rank reuses one fixed random batch (its rows of the global
batch). A step's time is the slowest rank's wall time for ``step(state, batch)`` until the new
state and metrics are ready (``jax.block_until_ready``; PyTorch CPU ops are synchronous, CUDA
is synchronised). Reported: median step time (p10, p90), images/s = global batch / median,
compile time (jddp: ``lower`` + ``compile``; PyTorch: eager, none), the first step's time, peak
host memory (``ru_maxrss`` of each worker, read at its end), and model FLOPs per step from XLA's
cost analysis of jddp's compiled step (``compiled.cost_analysis()["flops"]`` of the per-device
SPMD program x devices; PyTorch runs the same model and is given the same count). ``jddp-mpi``'s
step is two jitted programs joined in Python, not one: its compile time is ``lower`` +
``compile`` of the grads stage (the function ``make_train_step`` hands to ``MpiComm.compose``,
jitted the same way, so the step's own jit finds the executable in JAX's cache), while the
small update jit (all-reduce + optimizer) compiles inside the first step, which the "1st step"
column shows; its FLOPs are the count of an xla-backend jddp configuration of the same run and
dtype (same model, batch, work), or when there is none the grads stage's cost analysis x
devices (the update's few FLOPs left out); ``model_flops_source`` says which. MFU = achieved
FLOP/s over ``--peak-tflops``; on CPU the default peak is an assumption: cores x clock (``cpu MHz``
of /proc/cpuinfo) x 64 FP32 FLOP/cycle (AVX-512, two FMA units per core), and MFU is given for
float32 only (bfloat16 may run on AMX units with a much higher peak: achieved GFLOP/s only).
Ratios are jddp / ``torch-ddp-<same P>x*`` images/s at the same dtype (the pinned PyTorch run
for a pinned jddp run). ``--recompute FILE`` re-derives MFU and ratios of a results file.

``--profile``: instead of timing rounds, rank 0 of each group traces one step (after warm-up)
and prints where its time goes: jddp with ``jax.profiler`` (``--xla_cpu_enable_xprof_traceme``)
joined with the optimised HLO (``--xla_dump_to``) into per-thunk categories (conv forward,
conv input-gradient, conv weight-gradient, transposes/copies, ...), PyTorch with
``torch.profiler`` per aten op. Times are summed over threads. Caveat: a thunk that hands its
work to XLA's intra-op pool and returns (XLA's own multi-threaded convolutions) is timed only
for the hand-off, so the split is complete only for 1-thread processes (``-pin``) or YNNPACK
fusions; compare the category sum with the step time.

Writes ``experiments/results/<date>-<machine>.json`` (``-runN`` suffix when it exists; machine =
``--machine`` or the host name) with the machine, versions, commit, command and every step time,
prints a table and writes ``<same stem>-throughput.png`` (matplotlib).

``experiments/RESULTS.md``: every run (not ``--quick``) and every ``--recompute`` ends by
regenerating the tables between ``<!-- bench.py: generated tables begin -->`` and ``<!-- bench.py:
generated tables end -->`` (in its "Training throughput" section; put there, before the section's
first subsection, when the markers are missing) from every throughput JSON in
``experiments/results/`` written by this script: timed runs only, told apart by their fields (not
``--quick``, not ``--profile``; other scripts' ``allreduce-*``, ``scaling-model-*``,
``precision-*``, ``overhead-*`` files are skipped), oldest first, each with its file, date,
machine, commit and command and the printed table's columns. Text outside the markers is kept; the
same JSON files give the same block. ``--no-results-md`` skips this; ``--regenerate-results-md``
only does this (no benchmark run).

``--quick``: a smoke run of the whole pipeline, not a measurement (``tests/test_bench.py`` runs it):
``jddp-1x1`` and, if torch is importable, ``torch-ddp-1x1`` (without torch the peer is skipped with
a note); ResNet-18 of width 8 on 8x8 images, global batch 8, float32, 1 warm-up step, 1 round of
1 timed step. Any of those options given explicitly still wins. It writes
``experiments/results/<date>-<machine>-quick.json`` (replaced by the next quick run; ignored by
git) unless ``--out`` says otherwise, and ``"method": {"quick": true}`` marks the file. Only the
standard library is imported by the driver; jax/torch load in the workers, matplotlib for the plot.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import glob
import importlib.util
import json
import os
import queue
import re
import resource
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path


def _import_benchlib():
    """``experiments/benchlib.py``: imported by name when this file runs as a script or worker
    (its folder is on ``sys.path``), loaded from its path when this file is (tests)."""
    try:
        import benchlib
    except ModuleNotFoundError as e:
        if e.name != "benchlib":
            raise
        path = Path(__file__).resolve().with_name("benchlib.py")
        spec = importlib.util.spec_from_file_location("benchlib", path)
        benchlib = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = benchlib
        spec.loader.exec_module(benchlib)
    return benchlib


benchlib = _import_benchlib()
REPO, RESULTS_DIR = benchlib.REPO, benchlib.RESULTS_DIR
machine_info, percentile = benchlib.machine_info, benchlib.percentile
RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"
PEERS_DIR = Path(__file__).resolve().parent / "peers"
TAG = "@@BENCH "
REPLY_TIMEOUT_S = 900
DEFAULT_CONFIGS = "jddp-1x1,jddp-2x1,jddp-2x1-pin,torch-ddp-2x1,torch-ddp-2x1-pin"
NO_YNN_CONV_XLA_FLAG = "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution"
ONE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
# --quick: the smallest run that still goes through every stage (workers, rounds, JSON, plot).
QUICK_DEFAULTS = dict(
    configs="jddp-1x1,torch-ddp-1x1",
    dtypes="float32",
    rounds=1,
    steps_per_round=1,
    warmup=1,
    width=8,
    image_size=8,
    global_batch=8,
)
PRESETS = {
    "resnet18-cifar": dict(
        model="resnet18", stem="cifar", image_size=32, num_classes=10, global_batch=128
    ),
    "resnet50-imagenet": dict(
        model="resnet50", stem="imagenet", image_size=224, num_classes=1000, global_batch=256
    ),
}


# ----------------------------------------------------------------------------------- configs
@dataclass
class Workload:
    """What every configuration trains: model, input, batch, precision."""

    model: str = "resnet18"
    stem: str = "cifar"
    width: int = 64
    num_classes: int = 10
    image_size: int = 32
    global_batch: int = 128
    dtype: str = "float32"
    platform: str = "cpu"


@dataclass
class GroupSpec:
    """One configuration at one dtype: its processes and their environment."""

    name: str
    framework: str  # "jddp" | "torch"
    nproc: int
    per_proc: int  # jddp: devices per process; torch: CPU threads (GPU: 1 device)
    variant: str  # "" or "-"-joined suffixes: "pin", "1t", "noynnconv"

    def has(self, suffix: str) -> bool:
        return suffix in self.variant.split("-")

    work: Workload
    extra_env: dict[str, str] = field(default_factory=dict)
    backend: str = "xla"  # jddp's dist.backend: "xla" (jddp-PxD) | "mpi" (jddp-mpi-PxD)

    @property
    def mpi(self) -> bool:
        """Whether the ranks are started by ``mpirun`` (jddp's MPI backend)."""
        return self.framework == "jddp" and self.backend == "mpi"

    @property
    def key(self) -> str:
        return f"{self.name}/{self.work.dtype}"


CONFIG_RE = re.compile(r"^(jddp|jddp-mpi|torch-ddp)-(\d+)x(\d+)((?:-(?:1t|pin|noynnconv))*)$")


def parse_config(name: str, work: Workload) -> GroupSpec:
    """``jddp-2x1``, ``jddp-mpi-2x1``, ``torch-ddp-2x1``, ``jddp-2x1-1t``, ... ->
    :class:`GroupSpec`."""
    m = CONFIG_RE.match(name)
    if not m:
        raise ValueError(
            f"bad config {name!r}: expected jddp-PxD, jddp-mpi-PxD or torch-ddp-PxT "
            "[-pin] [-1t] [-noynnconv]"
        )
    fw = "torch" if m.group(1) == "torch-ddp" else "jddp"
    nproc, per, variant = int(m.group(2)), int(m.group(3)), m.group(4).strip("-")
    if nproc < 1 or per < 1:
        raise ValueError(f"bad config {name!r}: counts must be >= 1")
    if fw != "jddp" and {"1t", "noynnconv"} & set(variant.split("-")):
        raise ValueError(f"{name!r}: -1t and -noynnconv are XLA flags, for jddp configs only")
    if fw == "torch" and work.platform == "gpu" and per != 1:
        raise ValueError(f"{name!r}: on GPU each PyTorch process drives one GPU (use -Px1)")
    backend = "mpi" if m.group(1) == "jddp-mpi" else "xla"
    return GroupSpec(name, fw, nproc, per, variant, work, backend=backend)


# ------------------------------------------------------------------------------------ worker
def _send(msg: dict) -> None:
    sys.stdout.write(TAG + json.dumps(msg) + "\n")
    sys.stdout.flush()


def _threads_now() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _replier(world=None):
    """How a worker answers the driver: one ``TAG`` line on stdout, or under MPI (``world``:
    mpi4py's ``COMM_WORLD``) a ``gather`` to rank 0, which sends every rank's message in rank
    order (so the driver reads the same messages from one ``mpirun`` as from P processes)."""
    if world is None:
        return _send

    def reply(msg: dict) -> None:
        msgs = world.gather(msg, root=0)
        if msgs is not None:  # rank 0
            for m in msgs:
                _send(m)

    return reply


def _commands(world=None):
    """The driver's commands, split into words: stdin lines, or under MPI rank 0's stdin lines
    relayed to every rank (``mpirun`` gives stdin to rank 0 only). Ends on
    ``quit`` (kept) or when stdin closes (every rank stops)."""
    if world is None:
        for line in sys.stdin:
            yield line.split()
        return
    rank = world.Get_rank()
    while True:
        if rank == 0:
            line = sys.stdin.readline()
            cmd = line.split() if line else None
            for other in range(1, world.Get_size()):
                world.send(cmd, dest=other, tag=7)
        else:
            # Not a blocking bcast: MPICH busy-polls while it waits, so an idle rank would
            # burn a core for hours while the other configurations are being timed. Poll
            # and sleep instead (a 2 ms delay on a command is nothing next to a step).
            while not world.Iprobe(source=0, tag=7):
                time.sleep(0.002)
            cmd = world.recv(source=0, tag=7)
        if cmd is None:  # rank 0 read EOF: the driver is gone
            return
        yield cmd


def _serve(step_once, profile_once, finish, world=None) -> None:
    """The worker's command loop: ``run K`` | ``profile`` | ``quit`` on stdin (under MPI: rank 0
    reads them and relays them to the other ranks, see :func:`_commands`)."""
    reply = _replier(world)
    for cmd in _commands(world):
        if not cmd:
            continue
        if cmd[0] == "run":
            times, losses = [], []
            for _ in range(int(cmd[1])):
                t, loss = step_once()
                times.append(t)
                losses.append(loss)
            reply({"step_s": times, "loss": losses})
        elif cmd[0] == "profile":
            reply({"profile": profile_once()})
        elif cmd[0] == "quit":
            extra = finish()
            reply({"maxrss_mib": _maxrss_mib(), "threads": _threads_now(), **extra})
            return


def worker_jddp(spec: dict) -> None:
    """One jddp process: build, compile, warm up, then serve timing commands.

    ``spec["backend"] == "mpi"``: one rank of ``mpirun``, built as jddp's trainer builds
    ``dist.backend=mpi``: ``make_comm(job, "mpi")`` (``MpiComm``), a mesh over this rank's devices,
    this rank's rows of the global batch, rank 0's initial state (``broadcast_state``) and
    ``jddp.setup.build_steps`` (a local ``shard_map`` grads stage, then a single-device jit
    with ``mpi4jax.allreduce`` and the update). That step is not one jitted program: the grads
    stage is lowered and compiled ahead (the step's own ``jax.jit`` of the same function then
    finds it in JAX's cache) and its cost analysis is reported; the update jit compiles in the
    first step.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import jddp.comm
    import jddp.distributed
    import jddp.mesh
    import jddp.models
    import jddp.state
    from jddp.api import load_config
    from jddp.config import DistConfig
    from jddp.data.loader import batch_layout, place_batch
    from jddp.setup import build_steps

    w = Workload(**spec["work"])
    mpi = spec.get("backend") == "mpi"
    backend = "mpi" if mpi else "xla"
    job = jddp.distributed.initialize(DistConfig(backend=backend))
    comm = jddp.comm.make_comm(job, backend)  # as the trainer: the comm, then the mesh
    mesh = jddp.mesh.make_mesh(jddp.mesh.select_devices())
    rank = comm.process_index
    world = comm.world if mpi else None
    dtype = jnp.bfloat16 if w.dtype == "bfloat16" else jnp.float32
    factory = jddp.models.MODELS[w.model]
    model = factory(
        num_classes=w.num_classes, stem=w.stem, width=w.width, dtype=dtype, rngs=nnx.Rngs(0)
    )
    tx = optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.1, momentum=0.9))
    model_def, state = jddp.state.create_train_state(model, tx, mesh)
    state = comm.broadcast_state(state, mesh)  # xla: as is; mpi: rank 0's values everywhere
    cfg = load_config(overrides=[f"train.precision={w.dtype}", f"dist.backend={backend}"])
    step, _ = build_steps(cfg, model_def, tx, mesh, comm)
    rng = np.random.default_rng(1)
    shape = (w.global_batch, w.image_size, w.image_size, 3)
    layout = batch_layout(mesh, w.global_batch, comm.process_index, comm.process_count)
    host = {
        "images": rng.standard_normal(shape, dtype=np.float32)[layout.rows],
        "labels": rng.integers(0, w.num_classes, w.global_batch).astype(np.int32)[layout.rows],
    }
    batch = place_batch(host, mesh, layout)
    jax.block_until_ready(batch)

    t0 = time.perf_counter()
    # xla: the whole step; mpi: its grads stage (MpiComm's jax.jit of the same function reuses
    # this compilation from JAX's cache; the update jit compiles during the first step).
    lowered = (jax.jit(step.grads_stage) if mpi else step).lower(state, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    cost = cost or {}
    run = step if mpi else compiled

    box = {"state": state}

    def step_once() -> tuple[float, float]:
        t = time.perf_counter()
        new_state, metrics = run(box["state"], batch)
        jax.block_until_ready((new_state, metrics))
        elapsed = time.perf_counter() - t
        box["state"] = new_state
        return elapsed, float(metrics["train/loss"])

    warm = [step_once() for _ in range(spec["warmup"])]

    def profile_once() -> dict:
        trace_dir = spec["trace_dir"] + f"/rank{rank}"
        with jax.profiler.trace(trace_dir):
            t, _ = step_once()
        if rank != 0:
            return {"step_s": t}
        return {"step_s": t, **jddp_profile_breakdown(spec["dump_dir"], trace_dir)}

    # mpi: the cost analysis is the grads stage's, kept apart from the whole-step count
    # ("flops_per_device") that the xla configurations report and the others borrow.
    prefix = "grads_stage_" if mpi else ""
    reply = _replier(world)
    reply(
        {
            "rank": rank,
            "pid": os.getpid(),
            "dist_backend": comm.name,
            "compiled": "grads stage (the update jit compiles in the 1st step)" if mpi else "step",
            "lower_s": t1 - t0,
            "compile_only_s": t2 - t1,
            "compile_s": t2 - t0,
            "warmup_s": [t for t, _ in warm],
            "warmup_loss": [loss for _, loss in warm],
            f"{prefix}flops_per_device": cost.get("flops"),
            f"{prefix}bytes_accessed_per_device": cost.get("bytes accessed"),
            "devices": len(mesh.devices.flat) * (comm.process_count if mpi else 1),
            "local_devices": len(mesh.local_devices),
            "process_count": comm.process_count,
            "threads": _threads_now(),
            "affinity": sorted(os.sched_getaffinity(0)),
            "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind,
        }
    )

    def finish() -> dict:
        if not mpi and jax.process_count() > 1:
            jax.distributed.shutdown()
        return {}

    _serve(step_once, profile_once, finish, world)


MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")  # as jddp.comm's


def mpi_worker_main(spec: dict) -> int:
    """One rank of a ``jddp-mpi`` group under ``mpirun``. Before jax loads: pin (``-pin``: rank
    i to CPU i) and, on GPUs, choose this rank's devices. Only rank 0 keeps stdout (the reply
    channel); any exception in any rank aborts the whole MPI job, so no rank waits forever in a
    collective and ``mpirun`` exits with the traceback in its log."""
    rank = next((int(os.environ[v]) for v in MPI_RANK_VARIABLES if v in os.environ), None)
    if rank is None:
        print("jddp-mpi worker: no MPI rank in the environment (run by mpirun)", file=sys.stderr)
        return 2
    if rank != 0:
        os.dup2(2, 1)  # other ranks' stray prints go to the log, never between rank 0's replies
    if spec["pin_by_rank"]:
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    if spec["work"]["platform"] == "gpu" and spec["nproc"] > 1:
        first = rank * spec["per_proc"]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(
            map(str, range(first, first + spec["per_proc"]))
        )
    try:
        worker_jddp(spec)
    except BaseException:
        traceback.print_exc()
        print(f"jddp-mpi worker rank {rank} failed: aborting the MPI job", file=sys.stderr)
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
    return 0


def worker_torch(spec: dict) -> None:
    """One PyTorch DDP process (the peer in ``experiments/peers/torch_ddp.py``)."""
    sys.path.insert(0, str(PEERS_DIR))
    import torch
    import torch.distributed as dist
    import torch_ddp

    w = Workload(**spec["work"])
    cfg = torch_ddp.PeerConfig(
        model=w.model,
        stem=w.stem,
        width=w.width,
        num_classes=w.num_classes,
        image_size=w.image_size,
        global_batch=w.global_batch,
        dtype=w.dtype,
        device="cuda" if w.platform == "gpu" else "cpu",
        threads=spec["threads"],
    )
    torch_ddp.set_threads(cfg.threads)
    torch_ddp.init_process_group(cfg.device)
    runner = torch_ddp.DDPRunner(cfg)
    warm = [runner.step() for _ in range(spec["warmup"])]

    def profile_once() -> dict:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t, _ = runner.step()
        if runner.rank != 0:
            return {"step_s": t}
        return {"step_s": t, **torch_profile_breakdown(prof)}

    _send(
        {
            "rank": runner.rank,
            "compile_s": None,
            "warmup_s": [t for t, _ in warm],
            "warmup_loss": [loss for _, loss in warm],
            "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
            "threads": _threads_now(),
            "affinity": sorted(os.sched_getaffinity(0)),
            "backend": dist.get_backend(),
            "mkldnn": torch.backends.mkldnn.is_available(),
        }
    )

    def finish() -> dict:
        dist.destroy_process_group()
        return {}

    _serve(runner.step, profile_once, finish)


# ----------------------------------------------------------------------------------- profile
def _hlo_computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    comps: dict[str, list[str]] = {}
    cur, entry = None, None
    for line in text.splitlines():
        m = re.match(r"^(ENTRY )?%(\S+) ", line)
        if m and line.rstrip().endswith("{"):
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
        elif cur is not None:
            comps[cur].append(line)
    return comps, entry


def _classify(inst: str, comps: dict[str, list[str]]) -> str:
    """Category of one top-level HLO instruction of the optimised step (a thunk)."""
    called = re.search(r"calls=%([\w.\-]+)", inst)
    body = "\n".join(comps.get(called.group(1), [])) if called else ""
    convs = [ln for ln in (body + "\n" + inst).splitlines() if " convolution(" in ln]
    if convs:
        conv = convs[0]
        if "lhs_dilate" in conv:
            return "conv input-grad (strided)"
        window = re.search(r"size=(\d+)x", conv)
        if window and int(window.group(1)) >= 4:  # the weight gradient: window = feature map
            return "conv weight-grad"
        if "transpose(jvp" in inst or "transpose(jvp" in conv:
            return "conv input-grad"
        return "conv forward"
    head = inst.split("(")[0]
    if " dot(" in body or " dot(" in inst:
        return "dot (fc)"
    if "all-reduce" in head:
        return "all-reduce"
    if "transpose" in head or "copy" in head:
        return "transpose/copy"
    if " reduce(" in body or " reduce(" in inst:
        return "reduce (BN statistics, loss)"
    return "elementwise/other"


def jddp_profile_breakdown(dump_dir: str, trace_dir: str) -> dict:
    """Thunk time per category (summed over threads) of one traced jddp step."""
    from jax._src.lib import _profile_data

    hlo_files = sorted(glob.glob(f"{dump_dir}/*jit_step*cpu_after_optimizations.txt"))
    pb = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not hlo_files or not pb:
        return {"error": f"no HLO dump ({len(hlo_files)}) or trace ({len(pb)})"}
    comps, entry = _hlo_computations(Path(hlo_files[-1]).read_text())
    kinds = {}
    for line in comps.get(entry, []):
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
        if m:
            kinds[m.group(1)] = _classify(line, comps)
    ms: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    top: collections.Counter = collections.Counter()
    data = _profile_data.ProfileData.from_file(pb[0])
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                if ev.name in kinds:
                    ms[kinds[ev.name]] += ev.duration_ns / 1e6
                    count[kinds[ev.name]] += 1
                    top[f"{ev.name} [{kinds[ev.name]}]"] += ev.duration_ns / 1e6
    ynn = sum(1 for ln in comps.get(entry, []) if "__ynn_fusion" in ln)
    return {
        "thread_ms_by_category": dict(ms.most_common()),
        "ops_by_category": dict(count),
        "top_ops_ms": dict(top.most_common(12)),
        "ynn_fusions_in_entry": ynn,
        "hlo_file": hlo_files[-1],
    }


def torch_profile_breakdown(prof) -> dict:
    """Self CPU time per aten op (summed over threads) of one profiled PyTorch step."""
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    groups: collections.Counter = collections.Counter()
    for e in rows:
        name = e.key
        if "convolution_backward" in name or "mkldnn_convolution_backward" in name:
            cat = "conv backward (input+weight grad)"
        elif "convolution" in name or "conv2d" in name:
            cat = "conv forward"
        elif "batch_norm" in name:
            cat = "batch norm (fwd+bwd)"
        elif "allreduce" in name.lower() or "gloo" in name.lower() or "c10d" in name:
            cat = "DDP all-reduce / c10d"
        elif "sgd" in name.lower() or "_foreach" in name:
            cat = "optimizer"
        else:
            cat = "other"
        groups[cat] += e.self_cpu_time_total / 1e3
    return {
        "self_cpu_ms_by_category": dict(groups.most_common()),
        "top_ops_ms": {e.key: e.self_cpu_time_total / 1e3 for e in rows[:12]},
    }


# ------------------------------------------------------------------------------------ driver
class Group:
    """The running processes of one :class:`GroupSpec`, talking over pipes.

    One pipe pair per process, or for a ``jddp-mpi`` group one ``mpirun -np P`` whose rank 0
    relays the commands to the other ranks and sends all P replies, in rank order."""

    def __init__(self, spec: GroupSpec, args: argparse.Namespace, tmp: Path):
        self.spec = spec
        self.procs: list[subprocess.Popen] = []
        self.queues: list[queue.Queue] = []
        self.logs: list[Path] = []
        self.ready: list[dict] = []
        self.runs: list[list[dict]] = []  # per round, per rank
        self.profile: list[dict] = []
        self.final: list[dict] = []
        self.per_queue = spec.nproc if spec.mpi else 1  # replies per pipe and command
        port = _free_port()
        work = asdict(spec.work)
        ncpu = os.cpu_count() or 1
        for rank in range(1 if spec.mpi else spec.nproc):
            wspec = {
                "framework": spec.framework,
                "backend": spec.backend,
                "nproc": spec.nproc,
                "per_proc": spec.per_proc,
                "work": work,
                "warmup": args.warmup,
                "threads": spec.per_proc,
                "pin_by_rank": spec.mpi and spec.has("pin"),
                "trace_dir": str(tmp / f"trace-{spec.name}-{spec.work.dtype}"),
                "dump_dir": str(tmp / f"hlo-{spec.name}-{spec.work.dtype}-r{rank}"),
            }
            env = worker_env(spec, rank, port, args, wspec["dump_dir"])
            cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", json.dumps(wspec)]
            if spec.mpi:
                cmd[:0] = [str(mpirun_path()), "-np", str(spec.nproc)]
            elif spec.has("pin"):
                cmd[2:2] = ["--_pin", str(rank % ncpu)]
            who = "mpirun" if spec.mpi else f"rank{rank}"
            log = tmp / f"{spec.name}-{spec.work.dtype}-{who}.log"
            self.logs.append(log)
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(log, "w"),
                text=True,
                bufsize=1,
                start_new_session=spec.mpi,  # a Ctrl-C goes to the driver, which stops mpirun
            )
            q: queue.Queue = queue.Queue()
            threading.Thread(target=_pump, args=(proc, q, log), daemon=True).start()
            self.procs.append(proc)
            self.queues.append(q)

    def replies(self) -> list[dict]:
        out = []
        for i, q in enumerate(self.queues):
            for _ in range(self.per_queue):
                try:
                    msg = q.get(timeout=REPLY_TIMEOUT_S)
                except queue.Empty:
                    msg = None
                if msg is None:
                    raise self._failure(i)
                out.append(msg)
        return out

    def _failure(self, i: int) -> RuntimeError:
        """The error for a worker (or ``mpirun``) that closed its pipe or did not answer."""
        try:
            rc = self.procs[i].wait(timeout=10)
        except subprocess.TimeoutExpired:
            rc = None
        what = f"no reply in {REPLY_TIMEOUT_S} s" if rc is None else f"exit status {rc}"
        if self.spec.mpi:  # all ranks' output is in the one log, hydra's verdict at its end
            who = f"mpirun -np {self.spec.nproc} ({what}; a failed rank ends the whole job)"
        else:
            who = f"rank {i} ({what})"
        tail = self.logs[i].read_text(errors="replace")[-3000:]
        return RuntimeError(f"{self.spec.key}: {who}; log tail:\n{tail}")

    def command(self, text: str) -> list[dict]:
        for p in self.procs:
            p.stdin.write(text + "\n")
            p.stdin.flush()
        return self.replies()

    def stop(self) -> None:
        for p in self.procs:
            if self.spec.mpi:
                _stop_mpirun(p)
                continue
            if p.poll() is None:
                p.kill()
            p.wait()


def mpirun_path() -> Path:
    """The ``mpirun`` next to this Python (the virtualenv's MPICH), as jddp's tests use it."""
    return Path(sys.executable).parent / "mpirun"


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children[int(fields[1])].append(int(stat.split("/")[2]))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _stop_mpirun(p: subprocess.Popen) -> None:
    """End an ``mpirun`` and every rank below it. MPICH's hydra starts each rank in a session of
    its own, so a process group kill would miss them: SIGTERM to ``mpirun`` (hydra ends the
    ranks), then SIGKILL, by process id, to whatever of its process tree is still there."""
    below = _descendants(p.pid)
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    deadline = time.monotonic() + 10
    while True:
        alive = [pid for pid in below if Path(f"/proc/{pid}").exists()]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _pump(proc: subprocess.Popen, q: queue.Queue, log: Path) -> None:
    with open(log, "a") as f:
        for line in proc.stdout:
            if line.startswith(TAG):
                q.put(json.loads(line[len(TAG) :]))
            else:
                f.write(line)
    q.put(None)


def worker_env(spec: GroupSpec, rank: int, port: int, args, dump_dir: str) -> dict[str, str]:
    """The same base environment for every worker, plus the configuration's own variables."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for key in (
        "JDDP_COORDINATOR_ADDRESS",
        "JDDP_NUM_PROCESSES",
        "JDDP_PROCESS_ID",
        "JAX_COORDINATOR_ADDRESS",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        env.pop(key, None)
    xla_flags = env.get("XLA_FLAGS", "").split()
    if spec.framework == "jddp":
        env["JAX_PLATFORMS"] = "cuda" if spec.work.platform == "gpu" else "cpu"
        if spec.work.platform == "cpu":
            xla_flags = [
                f for f in xla_flags if not f.startswith("--xla_force_host_platform_device_count")
            ]
            xla_flags.append(f"--xla_force_host_platform_device_count={spec.per_proc}")
        elif spec.nproc > 1 and not spec.mpi:  # one process per group of GPUs (mpi: by rank)
            first = rank * spec.per_proc
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(first, first + spec.per_proc)))
        if spec.nproc > 1 and not spec.mpi:  # mpi: mpirun tells each rank its place
            env.update(
                JDDP_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JDDP_NUM_PROCESSES=str(spec.nproc),
                JDDP_PROCESS_ID=str(rank),
                JDDP_LOCAL_RANK=str(rank),
            )
        if spec.has("1t"):
            xla_flags += ONE_THREAD_XLA_FLAGS.split()
        if spec.has("noynnconv"):
            xla_flags.append(NO_YNN_CONV_XLA_FLAG)
        if args.profile:
            xla_flags += [
                "--xla_cpu_enable_xprof_traceme=true",
                f"--xla_dump_to={dump_dir}",
                "--xla_dump_hlo_as_text",
                "--xla_dump_hlo_module_re=.*jit_step.*",
            ]
        env["XLA_FLAGS"] = " ".join(xla_flags)
    else:
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(spec.nproc),
        )
    env.update(spec.extra_env)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slowest(per_rank: list[list[float]]) -> list[float]:
    return [max(ts) for ts in zip(*per_rank, strict=True)]


def summarise(g: Group, flops_by_dtype: dict[str, float]) -> dict:
    """One record per group: the slowest rank's step times and what follows from them."""
    spec, w = g.spec, g.spec.work
    rounds = [_slowest([r["step_s"] for r in rnd]) for rnd in g.runs]
    times = [t for rnd in rounds for t in rnd]
    rec = {
        "config": spec.name,
        "framework": spec.framework,
        "dist_backend": spec.backend if spec.framework == "jddp" else None,
        "dtype": w.dtype,
        "processes": spec.nproc,
        (
            "devices_per_process" if spec.framework == "jddp" else "threads_per_process"
        ): spec.per_proc,
        "variant": spec.variant or None,
        "global_batch": w.global_batch,
        "env": {k: v for k, v in spec.extra_env.items()},
        "xla_flags": worker_env(spec, 0, 0, argparse.Namespace(profile=False), "").get("XLA_FLAGS")
        if spec.framework == "jddp"
        else None,
        "step_s_by_round": rounds,
        "loss_rank0": [x for rnd in g.runs for x in rnd[0]["loss"]],
        "warmup_s": _slowest([r["warmup_s"] for r in g.ready]),
        "compile_s": max(
            (r["compile_s"] for r in g.ready if r.get("compile_s") is not None), default=None
        ),
        "compile_what": (
            "lower + compile of the grads stage (the update jit compiles in the 1st step)"
            if spec.mpi
            else "lower + compile of the step"
            if spec.framework == "jddp"
            else None
        ),
        "worker_ready": g.ready,
        "worker_final": g.final,
        "maxrss_mib_per_process": [r["maxrss_mib"] for r in g.final],
    }
    if g.profile:
        rec["profile"] = g.profile
    if not times:
        return rec
    med = statistics.median(times)
    flops, source = None, None
    if spec.mpi:  # two programs: the xla step's count if there is one, else the grads stage's
        flops = flops_by_dtype.get(w.dtype)
        source = "XLA cost_analysis of jddp's xla-backend step (same model, dtype and batch)"
        per_dev = g.ready[0].get("grads_stage_flops_per_device")
        if flops is None and per_dev:
            flops = per_dev * g.ready[0]["devices"]
            source = "XLA cost_analysis of this step's grads stage (the update is not counted)"
    elif spec.framework == "jddp":
        per_dev = g.ready[0].get("flops_per_device")
        flops = per_dev * g.ready[0]["devices"] if per_dev else None
        source = "XLA cost_analysis of this step"
    else:
        flops = flops_by_dtype.get(w.dtype)
        source = "XLA cost_analysis of jddp's step (same model, dtype and batch)"
    rec.update(
        timed_steps=len(times),
        median_step_s=med,
        p10_step_s=percentile(times, 0.1),
        p90_step_s=percentile(times, 0.9),
        min_step_s=min(times),
        max_step_s=max(times),
        median_step_s_without_first_of_round=(
            statistics.median([t for rnd in rounds for t in rnd[1:]])
            if all(len(r) > 1 for r in rounds)
            else None
        ),
        img_per_s=w.global_batch / med,
        first_step_s=rec["warmup_s"][0] if rec["warmup_s"] else None,
        model_flops_per_step=flops,
        model_flops_source=source if flops else None,
        achieved_gflops=flops / med / 1e9 if flops else None,
        step_s=times,
    )
    return rec


def derive(records: list[dict], peak_by_dtype: dict[str, float | None]) -> None:
    """Fields computed from the measured ones: MFU and the jddp / PyTorch ratios."""
    for r in records:
        peak = peak_by_dtype.get(r["dtype"])
        gflops = r.get("achieved_gflops")
        r["mfu"] = gflops * 1e9 / peak if gflops and peak else None
        r.pop("ratio_vs", None)
        r.pop("ratio_img_per_s", None)
    add_ratios(records)


def add_ratios(records: list[dict]) -> None:
    """jddp images/s over PyTorch DDP's: same dtype and process count, pinned if jddp is."""
    for r in records:
        if r["framework"] != "jddp" or "img_per_s" not in r:
            continue
        peers = [
            p
            for p in records
            if p["framework"] == "torch" and p["dtype"] == r["dtype"] and "img_per_s" in p
        ]

        def pick(procs: int, variant: str | None, peers=peers) -> list[dict]:
            return [p for p in peers if p["processes"] == procs and p["variant"] == variant]

        # PyTorch variants are only "pin" or none; jddp's XLA-flag suffixes have no peer.
        want = "pin" if "pin" in (r["variant"] or "").split("-") else None
        same = pick(r["processes"], want) or pick(2, want) or pick(r["processes"], None)
        if same:
            r["ratio_vs"] = same[0]["config"]
            r["ratio_img_per_s"] = r["img_per_s"] / same[0]["img_per_s"]


def run_block(specs: list[GroupSpec], args, tmp: Path, log) -> list[Group]:
    """Start every group of one block (one at a time), interleave the rounds, stop them."""
    groups: list[Group] = []
    try:
        for spec in specs:
            t = time.perf_counter()
            log(f"start {spec.key} ({spec.nproc} proc) ...")
            g = Group(spec, args, tmp)
            groups.append(g)
            g.ready = g.replies()
            r0 = g.ready[0]
            comp = f"compile {r0['compile_s']:.1f} s, " if r0.get("compile_s") else ""
            warm = ", ".join(f"{x:.2f}" for x in _slowest([r["warmup_s"] for r in g.ready]))
            log(f"  ready in {time.perf_counter() - t:.0f} s ({comp}warm-up steps {warm} s)")
        if args.profile:
            for g in groups:
                g.profile = [r["profile"] for r in g.command("profile")]
                log(f"  profiled {g.spec.key}: {json.dumps(g.profile[0])[:2000]}")
        else:
            for rnd in range(args.rounds):
                for g in groups:
                    replies = g.command(f"run {args.steps_per_round}")
                    g.runs.append(replies)
                    ts = ", ".join(f"{x:.2f}" for x in _slowest([r["step_s"] for r in replies]))
                    log(f"  round {rnd + 1}/{args.rounds} {g.spec.key}: {ts} s")
        for g in groups:
            g.final = g.command("quit")
    finally:
        for g in groups:
            for p in g.procs if g.final else []:  # told to quit: let them end on their own
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
            g.stop()
    return groups


# ---------------------------------------------------------------------------------- reporting
def default_peak_flops(machine: dict, platform_name: str) -> tuple[float | None, str]:
    if platform_name != "cpu" or not machine.get("cpu_mhz"):
        return None, "none given (--peak-tflops): achieved FLOP/s only"
    cores, ghz = machine["cpu_count"], machine["cpu_mhz"] / 1e3
    per_cycle = 64 if "avx512f" in machine["isa"] else 32
    peak = cores * ghz * 1e9 * per_cycle
    return peak, (
        f"assumed FP32 vector peak: {cores} cores x {ghz:.2f} GHz x {per_cycle} FLOP/cycle "
        f"({'AVX-512' if per_cycle == 64 else 'AVX2'}, 2 FMA units/core) = "
        f"{peak / 1e9:.1f} GFLOP/s; MFU for float32 only (bfloat16 runs on AMX/AVX512-BF16 "
        "units with a far higher, unknown peak: achieved GFLOP/s only)"
    )


def peak_by_dtype(peak: float | None, given: bool, platform_name: str) -> dict:
    """The assumed CPU FP32 peak applies to float32 only; a given peak to both dtypes."""
    if given or platform_name != "cpu":
        return {"float32": peak, "bfloat16": peak}
    return {"float32": peak, "bfloat16": None}


# One row format for the printed table and the tables of RESULTS.md: (cell, printed header,
# printed width (negative: left-aligned), markdown header).
TABLE_COLUMNS = (
    ("config", "config", -22, "config"),
    ("dtype", "dtype", -8, "dtype"),
    ("n", "n", 2, "timed steps"),
    ("step", "step s median (p10-p90)", 25, "step s, median (p10-p90)"),
    ("img_s", "img/s", 7, "img/s"),
    ("ratio", "x torch", 7, "jddp / PyTorch DDP img/s"),
    ("compile", "compile s", 9, "compile s"),
    ("first", "1st step s", 10, "1st step s"),
    ("rss", "RSS MiB/proc", 12, "peak RSS MiB per process"),
    ("gflops", "GFLOP/s", 8, "GFLOP/s"),
    ("mfu", "MFU", 6, "MFU"),
)


def record_cells(r: dict) -> dict[str, str] | None:
    """The formatted cells of one record (``None``: no timed steps), for every table."""
    if "median_step_s" not in r:
        return None

    def num(key: str, fmt: str) -> str:
        return format(r[key], fmt) if r.get(key) is not None else "-"

    return {
        "config": r["config"],
        "dtype": r["dtype"],
        "n": str(r["timed_steps"]),
        "step": f"{r['median_step_s']:.3f} ({r['p10_step_s']:.3f}-{r['p90_step_s']:.3f})",
        "img_s": f"{r['img_per_s']:.1f}",
        "ratio": num("ratio_img_per_s", ".2f"),
        "ratio_vs": r.get("ratio_vs") or "",
        "compile": num("compile_s", ".1f"),
        "first": num("first_step_s", ".2f"),
        "rss": "/".join(f"{x:.0f}" for x in r["maxrss_mib_per_process"]),
        "gflops": f"{r['achieved_gflops']:.1f}" if r.get("achieved_gflops") else "-",
        "mfu": f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-",
    }


def print_table(records: list[dict]) -> None:
    def line(cells: dict[str, str]) -> str:
        return " ".join(
            format(cells[k], f"<{-w}" if w < 0 else f">{w}") for k, _, w, _ in TABLE_COLUMNS
        )

    head = line({k: h for k, h, _, _ in TABLE_COLUMNS})
    print(head)
    print("-" * len(head))
    for r in records:
        cells = record_cells(r)
        if cells is None:
            print(f"{r['config']:<22} {r['dtype']:<8} (no timed steps)")
        else:
            print(line(cells))


def markdown_table(records: list[dict]) -> list[str]:
    """``print_table``'s rows as a markdown table (the PyTorch peer named next to each ratio)."""
    lines = [
        "| " + " | ".join(h for _, _, _, h in TABLE_COLUMNS) + " |",
        "|" + "|".join("---" if w < 0 else "---:" for _, _, w, _ in TABLE_COLUMNS) + "|",
    ]
    for r in records:
        cells = record_cells(r)
        if cells is None:
            cells = {k: "-" for k, _, _, _ in TABLE_COLUMNS}
            cells.update(config=r["config"], dtype=r["dtype"], n="0")
        elif cells["ratio_vs"]:
            cells["ratio"] += f" (vs {cells['ratio_vs']})"
        lines.append("| " + " | ".join(cells[k] for k, _, _, _ in TABLE_COLUMNS) + " |")
    return lines


def plot(records: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    recs = [r for r in records if "img_per_s" in r]
    configs = list(dict.fromkeys(r["config"] for r in recs))
    dtypes = list(dict.fromkeys(r["dtype"] for r in recs))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(configs) + 1.5), 4.5))
    width = 0.8 / max(len(dtypes), 1)
    colors = {"float32": "#4C72B0", "bfloat16": "#DD8452"}
    for j, dtype in enumerate(dtypes):
        xs, ys, lo, hi = [], [], [], []
        for i, c in enumerate(configs):
            r = next((r for r in recs if r["config"] == c and r["dtype"] == dtype), None)
            if r is None:
                continue
            b = r["global_batch"]
            xs.append(i + (j - (len(dtypes) - 1) / 2) * width)
            ys.append(r["img_per_s"])
            lo.append(r["img_per_s"] - b / r["p90_step_s"])
            hi.append(b / r["p10_step_s"] - r["img_per_s"])
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=dtype, color=colors.get(dtype))
        ax.bar_label(bars, fmt="%.1f", padding=2, fontsize=8)
    ax.set_xticks(range(len(configs)), configs, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel("images/s (median; bars: p10-p90 step time)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def importable(module: str) -> bool:
    """Whether ``module`` can be found, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def output_path(arg: str | None, date: str, machine: str, quick: bool = False) -> Path:
    if arg:
        return Path(arg)
    if quick:  # a smoke run: one file, replaced each time, never a real result's name
        return RESULTS_DIR / f"{date}-{machine}-quick.json"
    return benchlib.unused_path(RESULTS_DIR, f"{date}-{machine}")


def recompute(path: Path, plot_it: bool) -> int:
    """Re-derive MFU and ratios of a results file with the current rules (measured data kept)."""
    result = json.loads(path.read_text())
    method, machine = result["method"], result["machine"]
    given = method.get("peak_note", "").startswith("given")
    derive(
        result["records"],
        peak_by_dtype(method.get("peak_flops"), given, result["workload"]["platform"]),
    )
    if not given and result["workload"]["platform"] == "cpu" and machine.get("cpu_mhz"):
        method["peak_note"] = default_peak_flops(machine, "cpu")[1]
    result.setdefault("recomputed_utc", []).append(
        dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    )
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"MFU peak: {method.get('peak_note')}")
    print_table(result["records"])
    print_ratios(result["records"])
    print(f"rewrote {path}")
    if plot_it:
        w = result["workload"]
        date = result["date_utc"][:10]
        png = path.with_name(path.stem + "-throughput.png")
        title = (
            f"{w['model']} {w['stem']} {w['image_size']}px, global batch {w['global_batch']}, "
            f"{machine['name']} ({machine['cpu_count']} CPUs), {date}, "
            f"commit {machine['git_commit']}"
        )
        if plot(result["records"], png, title):
            print(f"wrote {png}")
    return 0


def print_ratios(records: list[dict]) -> None:
    for r in records:
        if "ratio_img_per_s" in r:
            print(
                f"ratio {r['config']}/{r['dtype']} vs {r['ratio_vs']}/{r['dtype']}: "
                f"{r['ratio_img_per_s']:.2f}x images/s"
            )


# ------------------------------------------------------------------------------- RESULTS.md
RESULTS_MD_BEGIN = "<!-- bench.py: generated tables begin -->"
RESULTS_MD_END = "<!-- bench.py: generated tables end -->"
RESULTS_MD_SECTION = "## Training throughput: jddp vs PyTorch DDP (CPU)"
# Other scripts' results share the folder; their JSON is told apart by its fields as well.
OTHER_RESULT_PREFIXES = ("allreduce-", "scaling-model-", "precision-", "overhead-")


def is_throughput_result(result: object) -> bool:
    """A timed (not ``--quick``, not ``--profile``) results file written by this script."""
    if not isinstance(result, dict) or result.get("benchmark") != "train-throughput":
        return False
    method, records = result.get("method"), result.get("records")
    if not isinstance(method, dict) or method.get("quick") or method.get("profile"):
        return False
    return isinstance(records, list) and any("median_step_s" in r for r in records)


def throughput_results(results_dir: Path) -> list[tuple[Path, dict]]:
    """Every throughput results file of ``results_dir``, oldest run first."""
    found = []
    for path in sorted(results_dir.glob("*.json")):
        if path.name.startswith(OTHER_RESULT_PREFIXES) or "-quick" in path.name:
            continue
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"RESULTS.md: skipping {path.name}: {e}", file=sys.stderr)
            continue
        if is_throughput_result(result):
            found.append((path, result))
    return sorted(found, key=lambda pr: (pr[1].get("date_utc") or "", pr[0].name))


def _wrap(text: str, indent: str = "") -> list[str]:
    """Markdown prose wrapped at 100 columns (never inside a word or an option name)."""
    return textwrap.wrap(
        text, 100, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    )


def _markdown_run(path: Path, result: dict, md_dir: Path, peak_note: bool) -> list[str]:
    """One results file in RESULTS.md: where it came from, then :func:`markdown_table`."""
    m, w, method = result.get("machine", {}), result.get("workload", {}), result["method"]
    rel = Path(os.path.relpath(path, md_dir)).as_posix()
    date = (result.get("date_utc") or "?").replace("T", " ").replace("+00:00", " UTC")
    gpus = m.get("gpus") or []  # nvidia-smi -L lines
    hardware = f"{m.get('cpu_model') or 'unknown CPU'} ({m.get('cpu_count')} CPUs); "
    if not gpus:
        hardware += "no GPU"
    elif len(set(g.split(" (UUID")[0].split(": ", 1)[-1] for g in gpus)) == 1:
        hardware += f"{len(gpus)} × {gpus[0].split(' (UUID')[0].split(': ', 1)[-1]}"
    else:
        hardware += "GPUs: " + ", ".join(g.split(" (UUID")[0] for g in gpus)
    versions = ", ".join(
        f"{k} {v}" for k, v in (m.get("versions") or {}).items() if v and k in ("jax", "torch")
    )
    dirty = m.get("git_dirty_paths") or []
    commit = f"`{m.get('git_commit')}`" + (
        f" plus {len(dirty)} uncommitted paths (`machine.git_dirty_paths`)" if dirty else ""
    )
    command = result.get("command") or "?"
    if isinstance(command, list):
        command = shlex.join(command)
    load = [f"{x[0]:.1f}" for x in result.get("loadavg_1_5_15") or []]
    warmup = method.get("warmup")
    timing = (
        f"{warmup} warm-up step{'' if warmup == 1 else 's'}, then {method.get('rounds')} "
        f"interleaved rounds × {method.get('steps_per_round')} timed steps"
    )
    lines = [f"#### `{rel}`", ""]
    for bullet in (
        f"**Run**: {date}; machine `{m.get('name')}`: {hardware}; {versions}; commit {commit}",
        None,  # the command: one line, never wrapped
        f"**Workload**: {w.get('model')} ({w.get('stem')} stem, width {w.get('width')}), "
        f"{w.get('image_size')}×{w.get('image_size')} images, {w.get('num_classes')} classes, "
        f"global batch {w.get('global_batch')}, {w.get('platform')}; {timing}"
        + (f"; 1-minute load average (start, after each dtype): {', '.join(load)}" if load else ""),
        *([f"**MFU peak**: {method.get('peak_note') or 'none'}"] if peak_note else []),
    ):
        lines += _wrap(f"- {bullet}", "  ") if bullet else [f"- **Command**: `{command}`"]
    if result.get("failures"):
        failed = ", ".join(k for f in result["failures"] for k in f.get("block", []))
        lines += _wrap(f"- **Failed** (no rows): {failed}; errors in the JSON's `failures`", "  ")
    return [*lines, "", *markdown_table(result["records"]), ""]


def results_md_block(results_dir: Path, md_dir: Path) -> str:
    """The generated part of RESULTS.md, markers included."""
    runs = throughput_results(results_dir)
    lines = [
        RESULTS_MD_BEGIN,
        "<!-- Written by experiments/bench.py from the JSON files in results/ after each",
        "non-quick run and --recompute, or by --regenerate-results-md. Edit outside the",
        "markers. -->",
        "",
        "### Throughput tables (generated from the results files)",
        "",
        *_wrap(
            "One table per timed `bench.py` run in `results/` (`--quick` smoke runs and "
            "`--profile` runs are left out), oldest first. Step s: the slowest rank's wall time "
            "of a step, median (p10-p90) of the timed steps; img/s: global batch / median; "
            "jddp / PyTorch DDP img/s: jddp's images/s over those of the PyTorch configuration "
            "named, same run and dtype; compile s: jddp's `lower` + `compile` (`jddp-mpi-*`: of "
            "the grads stage only, its update jit compiles in the 1st step; PyTorch runs "
            "eagerly: -); 1st step s: the first warm-up step; peak RSS: `ru_maxrss` of each "
            "process; GFLOP/s: model FLOPs per step (XLA's cost analysis of jddp's step, used for "
            "both sides and for `jddp-mpi-*`) / median; MFU: GFLOP/s over the stated peak."
        ),
        "",
    ]
    if not runs:
        lines += ["(No throughput results files yet.)", ""]
    peak_notes = {result["method"].get("peak_note") for _, result in runs}
    if len(peak_notes) == 1:  # one note for all, not one per file
        lines += [*_wrap(f"MFU peak of every file below: {peak_notes.pop() or 'none'}."), ""]
    for path, result in runs:
        lines += _markdown_run(path, result, md_dir, peak_note=len(peak_notes) > 1)
    return "\n".join([*lines, RESULTS_MD_END])


def regenerate_results_md(results_dir: Path | None = None, md_path: Path | None = None) -> bool:
    """Rewrite the generated tables of RESULTS.md from ``results_dir``; text outside the markers
    is kept. Without markers the block goes into the throughput section (before its first
    ``###`` subsection; the section is appended if missing). Returns whether the file changed."""
    results_dir = RESULTS_DIR if results_dir is None else Path(results_dir)
    md_path = RESULTS_MD if md_path is None else Path(md_path)
    text = md_path.read_text() if md_path.exists() else "# Experiment results\n"
    block = results_md_block(results_dir, md_path.parent)
    n_begin, n_end = text.count(RESULTS_MD_BEGIN), text.count(RESULTS_MD_END)
    if (n_begin, n_end) == (1, 1) and text.index(RESULTS_MD_BEGIN) < text.index(RESULTS_MD_END):
        head, rest = text.split(RESULTS_MD_BEGIN)
        new = head + block + rest.split(RESULTS_MD_END)[1]
    elif n_begin or n_end:
        raise ValueError(
            f"{md_path}: expected one {RESULTS_MD_BEGIN!r} before one {RESULTS_MD_END!r}, found "
            f"{n_begin} and {n_end}: fix the markers by hand"
        )
    else:
        lines = text.splitlines()
        try:
            start = lines.index(RESULTS_MD_SECTION)
        except ValueError:
            lines += ["", RESULTS_MD_SECTION, ""]
            start = len(lines) - 2
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith(("## ", "### "))),
            len(lines),
        )
        while end > start + 1 and not lines[end - 1].strip():
            end -= 1
        after = lines[end:]
        while after and not after[0].strip():
            after.pop(0)
        new = "\n".join([*lines[:end], "", block, *([""] + after if after else [])]) + "\n"
    if new == text:
        return False
    tmp = md_path.with_name(md_path.name + ".tmp")
    tmp.write_text(new)
    os.replace(tmp, md_path)
    return True


def update_results_md() -> int:
    """Regenerate RESULTS.md's tables after a run; 1 (with a message) when that fails."""
    md_path = RESULTS_MD
    try:
        changed = regenerate_results_md(RESULTS_DIR, md_path)
    except (OSError, ValueError) as e:
        print(f"RESULTS.md not regenerated: {e}", file=sys.stderr)
        return 1
    n = len(throughput_results(RESULTS_DIR))
    print(f"{'regenerated' if changed else 'unchanged:'} {md_path} ({n} throughput files)")
    return 0


# -------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help="comma-separated jddp-PxD / jddp-mpi-PxD / torch-ddp-PxT, suffixes -pin -1t "
        "-noynnconv",
    )
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument(
        "--steps-per-round",
        type=int,
        default=2,
        help="timed steps of a group per round (default 2)",
    )
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after start (default 2)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="resnet18-cifar")
    ap.add_argument("--model", choices=["resnet18", "resnet50"])
    ap.add_argument("--stem", choices=["cifar", "imagenet"])
    ap.add_argument("--image-size", type=int)
    ap.add_argument("--num-classes", type=int)
    ap.add_argument("--global-batch", type=int)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--platform", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak for MFU (default on CPU: an assumed AVX-512 FP32 peak)",
    )
    ap.add_argument(
        "--profile", action="store_true", help="trace one step per group instead of timing rounds"
    )
    ap.add_argument("--machine", default=None, help="name in the output file (default: host)")
    ap.add_argument("--out", default=None, help="JSON path (default experiments/results/...)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (not a measurement): jddp-1x1 (+ torch-ddp-1x1 if torch is installed), "
        "width 8, 8x8 images, batch 8, float32, 1 warm-up, 1 timed step; writes "
        "results/<date>-<machine>-quick.json unless --out is given",
    )
    ap.add_argument(
        "--recompute",
        metavar="JSON",
        help="recompute derived fields (MFU, ratios) of a results file, reprint, replot",
    )
    ap.add_argument(
        "--no-results-md",
        action="store_true",
        help="do not regenerate the tables of experiments/RESULTS.md at the end "
        "(--quick never touches it)",
    )
    ap.add_argument(
        "--regenerate-results-md",
        action="store_true",
        help="only rebuild the generated tables of experiments/RESULTS.md from the JSON files in "
        "experiments/results/ (no benchmark run)",
    )
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    ap.add_argument("--_pin", type=int, help=argparse.SUPPRESS)
    if ap.parse_known_args(argv)[0].quick:
        ap.set_defaults(**QUICK_DEFAULTS)  # options given on the command line still win
    args = ap.parse_args(argv)

    if args._worker:
        spec = json.loads(args._worker)
        if spec.get("backend") == "mpi":
            return mpi_worker_main(spec)
        if args._pin is not None:
            os.sched_setaffinity(0, {args._pin})
        (worker_jddp if spec["framework"] == "jddp" else worker_torch)(spec)
        return 0

    if args.regenerate_results_md and (args.quick or args.no_results_md):
        ap.error("--regenerate-results-md does not go with --quick or --no-results-md")
    if args.regenerate_results_md and not args.recompute:
        return update_results_md()
    if args.recompute:
        rc = recompute(Path(args.recompute), plot_it=not args.no_plot)
        quick = json.loads(Path(args.recompute).read_text())["method"].get("quick")
        if args.no_results_md or quick:
            return rc
        return update_results_md() or rc

    preset = dict(PRESETS[args.preset])
    for key in ("model", "stem", "image_size", "num_classes", "global_batch"):
        if getattr(args, key) is not None:
            preset[key] = getattr(args, key)
    if args.platform == "cpu" and preset["model"] == "resnet50" and preset["image_size"] >= 160:
        print(
            "warning: ResNet-50 at this size takes minutes per step on a small CPU", file=sys.stderr
        )
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or set(dtypes) - {"float32", "bfloat16"}:
        ap.error("--dtypes: float32 and/or bfloat16")
    if args.rounds < 1 or args.steps_per_round < 1 or args.warmup < 1:
        ap.error("--rounds, --steps-per-round and --warmup must be >= 1")
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    torch_names = [n for n in names if n.startswith("torch-ddp")]
    if torch_names and not importable("torch"):
        if not args.quick:
            ap.error(
                f"{', '.join(torch_names)} need torch: "
                ".venv/bin/pip install -r experiments/requirements-bench.txt"
            )
        print(f"note: torch is not installed: skipping {', '.join(torch_names)}", file=sys.stderr)
        names = [n for n in names if n not in torch_names]
        if not names:
            ap.error("--quick: no configuration left to run without torch")
    try:
        blocks = [
            [
                parse_config(
                    n, Workload(**preset, width=args.width, dtype=d, platform=args.platform)
                )
                for n in names
            ]
            for d in dtypes
        ]
    except ValueError as e:
        ap.error(str(e))
    mpi_names = list(dict.fromkeys(s.name for block in blocks for s in block if s.mpi))
    if mpi_names and args.profile:
        ap.error(f"--profile does not support {', '.join(mpi_names)} (two jitted programs)")
    if mpi_names:
        missing = [m for m in ("mpi4py", "mpi4jax") if not importable(m)]
        missing += [] if mpirun_path().exists() else [str(mpirun_path())]
        if missing:
            ap.error(
                f"{', '.join(mpi_names)} need {', '.join(missing)}: bash scripts/setup.sh "
                "installs MPICH, mpi4py and mpi4jax into the virtualenv"
            )

    started = dt.datetime.now(dt.UTC)
    machine = machine_info(args.machine)
    peak, peak_note = (
        (args.peak_tflops * 1e12, f"given: {args.peak_tflops} TFLOP/s")
        if args.peak_tflops
        else default_peak_flops(machine, args.platform)
    )
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    load = [os.getloadavg()]
    groups: list[Group] = []
    failures: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="jddp-bench-") as tmp:
        for block in blocks:
            try:
                groups += run_block(block, args, Path(tmp), log)
            except (RuntimeError, OSError) as e:  # keep the blocks that finished
                log(f"block {[s.key for s in block]} failed: {e}")
                failures.append({"block": [s.key for s in block], "error": str(e)[-4000:]})
            load.append(os.getloadavg())
    flops_by_dtype = {}
    for g in groups:
        if g.spec.framework == "jddp" and g.ready and g.ready[0].get("flops_per_device"):
            flops_by_dtype.setdefault(
                g.spec.work.dtype, g.ready[0]["flops_per_device"] * g.ready[0]["devices"]
            )
    records = [summarise(g, flops_by_dtype) for g in groups]
    derive(records, peak_by_dtype(peak, args.peak_tflops is not None, args.platform))

    date = started.date().isoformat()
    out = output_path(args.out, date, machine["name"], quick=args.quick)
    result = {
        "benchmark": "train-throughput",
        "date_utc": started.isoformat(timespec="seconds"),
        "wall_s": time.perf_counter() - t_start,
        "command": shlex.join(
            [
                ".venv/bin/python",
                "experiments/bench.py",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "machine": machine,
        "workload": preset | {"width": args.width, "platform": args.platform},
        "method": {
            "rounds": args.rounds,
            "steps_per_round": args.steps_per_round,
            "warmup": args.warmup,
            "profile": args.profile,
            "quick": args.quick,
            "interleaving": "groups of one dtype alive together, A B C A B C ...; dtypes in turn",
            "step_time": "slowest rank's wall time of step(state, batch) until outputs ready",
            "data": "one fixed random batch per rank, reused; loading not timed",
            "allocator": "same environment for every worker; no MALLOC_*/LD_PRELOAD set by the "
            "benchmark (see machine.allocator_env): glibc malloc defaults",
            "peak_flops": peak,
            "peak_note": peak_note,
        },
        "loadavg_1_5_15": load,
        "records": records,
        "failures": failures,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print()
    print(
        f"{machine['name']}: {machine['cpu_model']} x{machine['cpu_count']}, "
        f"jax {machine['versions']['jax']}, torch {machine['versions']['torch']}, "
        f"commit {machine['git_commit']}; {preset['model']} {preset['stem']} "
        f"{preset['image_size']}px, global batch {preset['global_batch']}"
    )
    print(f"MFU peak: {peak_note}")
    print_table(records)
    print_ratios(records)
    if args.profile:
        for r in records:
            for rank0 in r.get("profile", [])[:1]:
                cats = rank0.get("thread_ms_by_category") or rank0.get("self_cpu_ms_by_category")
                print(
                    f"\n{r['config']}/{r['dtype']} rank 0 traced step {rank0['step_s']:.2f} s; "
                    "ms summed over threads:"
                )
                for k, v in (cats or {}).items():
                    print(f"  {k:<36} {v:9.1f}")
    print(f"\nwrote {out}")
    if not args.no_plot and not args.profile and any("img_per_s" in r for r in records):
        png = out.with_name(out.stem + "-throughput.png")
        title = (
            f"{preset['model']} {preset['stem']} {preset['image_size']}px, global batch "
            f"{preset['global_batch']}, {machine['name']} ({machine['cpu_count']} CPUs), "
            f"{date}, commit {machine['git_commit']}"
        )
        if plot(records, png, title):
            print(f"wrote {png}")
    md_rc = 0 if args.quick or args.no_results_md else update_results_md()
    return 1 if failures else md_rc


if __name__ == "__main__":
    sys.exit(main())
