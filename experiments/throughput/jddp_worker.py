"""One jddp worker process: build the step as the trainer does (``jddp.build.build_steps``),
compile, warm up, then serve the driver's timing commands (:mod:`.protocol`).

``backend == "mpi"``: one rank of ``mpirun`` (see :mod:`.mpi_worker`), built as jddp's trainer
builds ``dist.backend=mpi``: ``make_comm(job, "mpi")`` (``MpiComm``), a mesh over this rank's
devices, this rank's rows of the global batch, rank 0's initial state (``broadcast_state``). Its
step is two jitted programs: the grads stage (``step.grads_stage``) is lowered and compiled ahead
(the step's own ``jax.jit`` of the same function then finds it in JAX's cache) and its cost
analysis is reported; the update jit compiles in the first step.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

from .protocol import replier, serve, threads_now
from .specs import Workload


def _build(spec: dict) -> SimpleNamespace:
    """Job, comm, mesh, model, optimizer, state, step and this rank's fixed batch."""
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
    from jddp.build import build_steps
    from jddp.config import DistConfig
    from jddp.data.loader import batch_layout, place_batch

    w = Workload(**spec["work"])
    mpi = spec.get("backend") == "mpi"
    backend = "mpi" if mpi else "xla"
    job = jddp.distributed.initialize(DistConfig(backend=backend))
    comm = jddp.comm.make_comm(job, backend)  # as the trainer: the comm, then the mesh
    mesh = jddp.mesh.make_mesh(jddp.mesh.select_devices())
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
    return SimpleNamespace(mpi=mpi, comm=comm, mesh=mesh, state=state, step=step, batch=batch)


def _compile(b: SimpleNamespace) -> tuple[object, dict, dict]:
    """(what to call per step, its timings, XLA's cost analysis of what was compiled).

    xla: the whole step; mpi: its grads stage (``MpiComm``'s ``jax.jit`` of the same function
    reuses this compilation from JAX's cache; the update jit compiles during the first step)."""
    import jax

    t0 = time.perf_counter()
    lowered = (jax.jit(b.step.grads_stage) if b.mpi else b.step).lower(b.state, b.batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    timings = {"lower_s": t1 - t0, "compile_only_s": t2 - t1, "compile_s": t2 - t0}
    return (b.step if b.mpi else compiled), timings, cost or {}


def _ready(b: SimpleNamespace, timings: dict, cost: dict, warm: list) -> dict:
    """The first reply: how the worker was built, compiled and warmed up."""
    import jax

    # mpi: the cost analysis is the grads stage's, kept apart from the whole-step count
    # ("flops_per_device") that the xla configurations report and the others borrow.
    prefix = "grads_stage_" if b.mpi else ""
    compiled = "grads stage (the update jit compiles in the 1st step)" if b.mpi else "step"
    return {
        "rank": b.comm.process_index,
        "pid": os.getpid(),
        "dist_backend": b.comm.name,
        "compiled": compiled,
        **timings,
        "warmup_s": [t for t, _ in warm],
        "warmup_loss": [loss for _, loss in warm],
        f"{prefix}flops_per_device": cost.get("flops"),
        f"{prefix}bytes_accessed_per_device": cost.get("bytes accessed"),
        "devices": len(b.mesh.devices.flat) * (b.comm.process_count if b.mpi else 1),
        "local_devices": len(b.mesh.local_devices),
        "process_count": b.comm.process_count,
        "threads": threads_now(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
    }


def worker_jddp(spec: dict) -> None:
    """One jddp process: build, compile, warm up, then serve timing commands."""
    import jax

    from .breakdown import jddp_profile_breakdown

    b = _build(spec)
    run, timings, cost = _compile(b)
    rank, world = b.comm.process_index, (b.comm.world if b.mpi else None)
    box = {"state": b.state}

    def step_once() -> tuple[float, float]:
        t = time.perf_counter()
        new_state, metrics = run(box["state"], b.batch)
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

    replier(world)(_ready(b, timings, cost, warm))

    def finish() -> dict:
        if not b.mpi and jax.process_count() > 1:
            jax.distributed.shutdown()
        return {}

    serve(step_once, profile_once, finish, world)
