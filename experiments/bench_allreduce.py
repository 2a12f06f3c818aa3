"""Gradient all-reduce benchmark: mpi4jax vs XLA/gloo, 2 processes on one machine.

    .venv/bin/python experiments/bench_allreduce.py [--iters N] [--elements N] [--warmup N]
        [--layouts flat,leaves] [--backends mpi4jax,gloo] [--dtypes float32,bfloat16]

Starts its own processes (``mpirun -np 2`` for ``mpi4jax``; two ``jax.distributed`` processes
for ``gloo``); the method is in ``experiments/README.md``. A call's time is the slowest rank's
after a barrier; every rank feeds ``rank + 1`` and every result must be 3 (exit 1 if not).
Writes ``results/allreduce-<date>-<machine>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib
from benchlib import percentile, sh

N_PROCS = 2
EXPECTED = N_PROCS * (N_PROCS + 1) / 2  # sum over ranks of (rank + 1)
WORKER_TIMEOUT_S = 600


def layout_shapes(layout: str, spec: dict) -> list[tuple[int, ...]]:
    """``flat``: one buffer of ``spec["elements"]``; ``leaves``: the model's parameter shapes."""
    return [(spec["elements"],)] if layout == "flat" else [tuple(s) for s in spec["leaf_shapes"]]


# --------------------------------------------------------------------------------- workers
def _cases(spec: dict, backend: str) -> list[dict]:
    cases = []
    for layout, dtype in itertools.product(spec["layouts"], spec["dtypes"]):
        names = [backend]
        if backend == "mpi4jax":  # bf16 two more ways, and the no-communication baseline
            names += ["mpi4jax-allgather", "mpi4jax-rs-ag"] if dtype == "bfloat16" else []
            names.append("local-x+1")
        cases += [{"backend": name, "layout": layout, "dtype": dtype} for name in names]
    return cases


def _time_case(fn, args, spec: dict, barrier) -> tuple[object, list[float]]:
    import jax

    for _ in range(spec["warmup"]):
        jax.block_until_ready(fn(*args))
    times, out = [], None
    for _ in range(spec["iters"]):
        barrier()
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return out, times


def _check(leaves, expected: float) -> tuple[bool, float, float]:
    import numpy as np

    arrays = [np.asarray(leaf).astype(np.float32) for leaf in leaves]
    lo, hi = min(float(a.min()) for a in arrays), max(float(a.max()) for a in arrays)
    return lo == hi == expected, lo, hi


def _run_cases(spec: dict, backend: str, rank: int, build, barrier) -> list[dict]:
    """``build(case, shapes, np_dtype) -> (fn, args, output_leaves, expected)`` per case."""
    import jax.numpy as jnp
    import numpy as np

    records = []
    for case in _cases(spec, backend):
        shapes = layout_shapes(case["layout"], spec)
        np_dtype = np.dtype(jnp.dtype(case["dtype"]))
        rec = dict(case, rank=rank, tensors=len(shapes), elements=sum(map(math.prod, shapes)))
        rec["bytes"] = rec["elements"] * np_dtype.itemsize
        try:
            fn, args, out_leaves, expected = build(case, shapes, np_dtype)
            t0 = time.perf_counter()
            out, times = _time_case(fn, args, spec, barrier)
            ok, lo, hi = _check(out_leaves(out), expected)
            rec.update(
                status="ok" if ok else "WRONG",
                times_s=times,
                result_min=lo,
                result_max=hi,
                case_wall_s=time.perf_counter() - t0,
            )
        except Exception as e:  # record and go on (e.g. an unsupported dtype)
            rec.update(status="error", error=f"{type(e).__name__}: {e}"[:500])
            barrier()
        what = f"{case['layout']} {case['dtype']} {case['backend']}"
        print(f"[{backend} rank {rank}] {what}: {rec['status']}", file=sys.stderr, flush=True)
        records.append(rec)
    return records


def worker_mpi4jax(spec: dict, result_dir: Path) -> None:
    import jax
    import jax.numpy as jnp
    import mpi4jax
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    assert size == N_PROCS, f"expected {N_PROCS} MPI ranks, got {size}"

    def allreduce(tree):
        return jax.tree.map(lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=comm), tree)

    def allgather_bits(tree):
        def one(x):
            bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
            got = jax.lax.bitcast_convert_type(mpi4jax.allgather(bits, comm=comm), x.dtype)
            # Explicit f32 adds: XLA:CPU's reduce over a leading axis of 2 (.sum(0)) was ~10x
            # slower than the whole exchange here.
            total = got[0].astype(jnp.float32)
            for i in range(1, size):
                total = total + got[i].astype(jnp.float32)
            return total.astype(x.dtype)

        return jax.tree.map(one, tree)

    def reduce_scatter_allgather(tree):
        # jddp's own bf16 path: alltoall of uint16 bits, f32 adds, allgather of the sums.
        from jddp import MpiComm

        jddp_comm = MpiComm("bfloat16")
        return jax.tree.map(lambda x: jddp_comm.bf16_allreduce_sum(x).astype(x.dtype), tree)

    def build(case, shapes, np_dtype):
        xs = [jnp.asarray(np.full(s, rank + 1, dtype=np_dtype)) for s in shapes]
        if case["backend"] == "local-x+1":  # no communication: one output buffer per leaf
            return jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t)), (xs,), list, rank + 2
        body = {
            "mpi4jax": allreduce,
            "mpi4jax-allgather": allgather_bits,
            "mpi4jax-rs-ag": reduce_scatter_allgather,
        }[case["backend"]]
        # Called directly (no .lower().compile(): with mpi4jax inside, a compiled object
        # worked only on its first call).
        return jax.jit(body), (xs,), list, EXPECTED

    records = _run_cases(spec, "mpi4jax", rank, build, comm.Barrier)
    library = MPI.Get_library_version().strip().splitlines()[0]
    info = {"devices": [str(d) for d in jax.devices()], "mpi_library": library}
    (result_dir / f"mpi4jax-rank{rank}.json").write_text(
        json.dumps({"info": info, "records": records})
    )


def worker_gloo(spec: dict, result_dir: Path) -> None:
    """One of ``python -m jddp.launch --nproc 2``'s ranks (its coordinator and process id)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    process_id = int(os.environ["JDDP_PROCESS_ID"])
    coordinator = os.environ["JDDP_COORDINATOR_ADDRESS"]
    jax.distributed.initialize(coordinator, num_processes=N_PROCS, process_id=process_id)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    psum = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P("data")
        )
    )
    barriers = itertools.count(1)

    def barrier():
        multihost_utils.sync_global_devices(f"bench-{next(barriers)}")

    compiled: dict[str, dict] = {}

    def build(case, shapes, np_dtype):
        xs = [
            jax.make_array_from_process_local_data(
                sharding, np.full((1, *s), process_id + 1, dtype=np_dtype)
            )
            for s in shapes
        ]
        assert xs[0].shape == (N_PROCS, *shapes[0])
        # What XLA:CPU really runs: how many all-reduce ops, in which element types.
        text = psum.lower(xs).compile().as_text()
        ops = [
            re.split(r" all-reduce(?:-start)?\(", ln)[0]
            for ln in text.splitlines()
            if re.search(r" all-reduce(?:-start)?\(", ln)
        ]
        compiled[f"{case['layout']}/{case['dtype']}"] = {
            "all_reduce_ops": len(ops),
            "element_types": sorted({t for op in ops for t in re.findall(r"(\w+)\[", op)}),
            "promoted": "_promoted" in text,
        }
        return psum, (xs,), lambda out: [x.addressable_data(0) for x in out], EXPECTED

    records = _run_cases(spec, "gloo", process_id, build, barrier)
    info = {
        "devices": [str(d) for d in jax.devices()],
        "local_devices": [str(d) for d in jax.local_devices()],
        "compiled_all_reduces": compiled,
        "collectives": jax.config.jax_cpu_collectives_implementation,
    }
    out = json.dumps({"info": info, "records": records})
    (result_dir / f"gloo-rank{process_id}.json").write_text(out)
    jax.distributed.shutdown()


# ---------------------------------------------------------------------------------- driver
def launch(spec_path: Path, result_dir: Path, backend: str) -> dict:
    """The two ranks of ``backend``: ``mpirun -np 2`` (mpi4jax) or ``python -m jddp.launch``."""
    worker = [sys.executable, str(Path(__file__).resolve()), "--worker", backend, "--spec",
              str(spec_path), "--result-dir", str(result_dir)]  # fmt: skip
    if backend == "mpi4jax":
        cmd = [benchlib.mpirun(), "-np", str(N_PROCS), *worker]
    else:
        cmd = [sys.executable, "-m", "jddp.launch", "--nproc", str(N_PROCS), "--", *worker]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    return {
        "command": cmd,
        "returncode": proc.returncode,
        "wall_s": time.perf_counter() - t0,
        "stderr_tail": proc.stderr[-2000:],
    }


def combine(rank_files: list[Path]) -> tuple[list[dict], list[dict]]:
    """One record per case: per-call time = slowest rank's; ok only if every rank checked."""
    per_rank = [json.loads(f.read_text()) for f in rank_files]
    infos = [r["info"] for r in per_rank]
    out = []
    for recs in zip(*(r["records"] for r in per_rank), strict=True):
        r0 = recs[0]
        rec = {k: r0[k] for k in ("backend", "layout", "dtype", "tensors", "elements", "bytes")}
        statuses = [r["status"] for r in recs]
        rec["status"] = statuses[0] if len(set(statuses)) == 1 else "/".join(statuses)
        errors = [r["error"] for r in recs if "error" in r]
        if errors:
            rec["error"] = errors[0]
        if all("times_s" in r for r in recs):
            times = [max(ts) for ts in zip(*(r["times_s"] for r in recs), strict=True)]
            med = statistics.median(times)
            local = rec["backend"].startswith("local")
            algbw = rec["bytes"] / med / 1e9
            rec.update(
                iters=len(times),
                median_ms=med * 1e3,
                min_ms=min(times) * 1e3,
                max_ms=max(times) * 1e3,
                p10_ms=percentile(times, 0.1) * 1e3,
                p90_ms=percentile(times, 0.9) * 1e3,
                mean_ms=statistics.fmean(times) * 1e3,
                algbw_GBps=algbw,
                busbw_GBps=None if local else algbw * 2 * (N_PROCS - 1) / N_PROCS,
                times_ms=[t * 1e3 for t in times],
                per_rank_median_ms=[statistics.median(r["times_s"]) * 1e3 for r in recs],
                result_range=[
                    min(r["result_min"] for r in recs),
                    max(r["result_max"] for r in recs),
                ],
            )
        out.append(rec)
    return out, infos


def print_table(records: list[dict]) -> None:
    """The table as RESULTS.md shows it (Markdown)."""
    benchlib.md_table(
        "backend | layout | wire dtype | MB | median ms (p10–p90) | busbw GB/s | check", "lllrrrl"
    )
    for r in records:
        row = f"| {r['backend']} | {r['layout']} | {r['dtype']} | {r['bytes'] / 1e6:.1f} |"
        if "median_ms" not in r:
            print(f"{row} - | - | {r['status']}: {r.get('error', '')[:60]} |")
            continue
        busbw = "–" if r["busbw_GBps"] is None else f"{r['busbw_GBps']:.2f}"
        print(f"{row} {r['median_ms']:.1f} ({r['p10_ms']:.1f}–{r['p90_ms']:.1f}) | {busbw} | "
              f"{r['status']} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10, help="timed calls per case (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2)")
    ap.add_argument("--elements", type=int, help="the 'flat' buffer's size (default: the model's)")
    ap.add_argument("--layouts", default="flat,leaves", help="flat and/or leaves")
    ap.add_argument("--backends", default="mpi4jax,gloo", help="mpi4jax and/or gloo")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="float32 and/or bfloat16")
    benchlib.output_args(ap)
    ap.add_argument("--worker", choices=["mpi4jax", "gloo"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        if args.worker == "mpi4jax":
            worker_mpi4jax(spec, Path(args.result_dir))
        else:
            worker_gloo(spec, Path(args.result_dir))
        return 0

    def split(s: str, allowed: set[str]) -> list[str]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        bad = set(items) - allowed
        if bad or not items:
            ap.error(f"choose from {sorted(allowed)}, got {s!r}")
        return items

    model = benchlib.model_figures("resnet18", "cifar", 64, 10, 32)  # jddp's, as the trainer's
    spec = {
        "iters": args.iters,
        "warmup": args.warmup,
        "elements": args.elements or model["params"],
        "leaf_shapes": model["param_shapes"],
        "layouts": split(args.layouts, {"flat", "leaves"}),
        "dtypes": split(args.dtypes, {"float32", "bfloat16"}),
    }
    if args.iters < 1 or args.warmup < 0 or spec["elements"] < 1:
        ap.error("--iters >= 1, --warmup >= 0, --elements >= 1")
    backends = split(args.backends, {"mpi4jax", "gloo"})
    started = dt.datetime.now(dt.UTC)
    load_before = os.getloadavg()
    records, launches, worker_info = [], {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_allreduce-") as tmp:
        tmp_path = Path(tmp)
        spec_path = tmp_path / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for backend in backends:
            print(f"running {backend} ...", file=sys.stderr, flush=True)
            launches[backend] = launch(spec_path, tmp_path, backend)
            files = [tmp_path / f"{backend}-rank{r}.json" for r in range(N_PROCS)]
            if not all(f.exists() for f in files):
                print(f"{backend} failed: {json.dumps(launches[backend])}", file=sys.stderr)
                continue
            recs, infos = combine(files)
            records += recs
            worker_info[backend] = infos[0]
            print(f"{backend}: {launches[backend]['wall_s']:.1f} s", file=sys.stderr)

    mpichversion = Path(sys.executable).parent / "mpichversion"
    mpich = sh(str(mpichversion)) if mpichversion.exists() else None
    machine = benchlib.machine_info(args.machine, extra={"mpichversion": mpich})
    result = {
        "benchmark": "allreduce",
        "date_utc": started.isoformat(timespec="seconds"),
        "command": [Path(sys.executable).name, *sys.argv],
        "cwd": os.getcwd(),
        "machine": machine,
        "loadavg_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "processes": N_PROCS,
        "spec": spec,
        "notes": (
            "time per call = slowest rank's; barrier before each timed call; inputs "
            "already in the wire dtype; algbw = bytes/median; busbw = algbw*2(n-1)/n"
        ),
        "launches": launches,
        "worker_info": worker_info,
        "records": records,
    }
    print()
    print_table(records)
    benchlib.save_result("allreduce", machine["name"], result, args.out)
    bad = [r for r in records if r["status"] not in ("ok", "error")]
    return 1 if bad or not records else 0


if __name__ == "__main__":
    sys.exit(main())
