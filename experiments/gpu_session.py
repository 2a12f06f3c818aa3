"""The Python side of ``experiments/gpu_session.sh`` (a lent GPU machine's session kit).

    python3 experiments/gpu_session.py env  OUT_DIR   # environment record: OUT_DIR/env.json
    python3 experiments/gpu_session.py e2e  OUT_DIR   # trainer throughput vs the input targets
    python3 experiments/gpu_session.py mpi  OUT_DIR   # dist.backend=mpi vs xla, one GPU

``--smoke`` (or ``JDDP_GPU_SMOKE=1``): the same code on a CPU, tiny (``"smoke": true``). Run
folders go to ``--logs DIR``; every run is a case of ``cases.py`` (:func:`benchlib.run_trainer`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import benchlib
from bench_xla import run_case
from benchlib import trainer_env
from cases import case, value, with_overrides

SMOKE = os.environ.get("JDDP_GPU_SMOKE") == "1"
# Distributions the record names, beyond benchlib.VERSIONED.
MORE_VERSIONS = ("jax-cuda13-pjrt", "jax-cuda12-pjrt", "array-record", "tensorboardX", "pytest")
MODULES = ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "grain", "mpi4py", "mpi4jax")
ENV_VARS = (
    "XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_ALLOCATOR", "JAX_PLATFORMS", "MPI4JAX_USE_CUDA_MPI", "CUDA_PATH",
    "PYTHONPATH", "LD_LIBRARY_PATH",
)  # fmt: skip


# ----------------------------------------------------------------------------- env
def env_record(out: Path) -> int:
    """What ran: machine_info, where each module came from (the carried wheels must shadow the
    image's), JAX's devices, nvidia-smi, nvcc and the environment variables that change a run."""
    from importlib import import_module

    def attempt(fn, failed: str = "not importable"):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            return f"{failed}: {type(e).__name__}: {e}"

    info = benchlib.machine_info(None, {"smoke": SMOKE})
    info["versions"].update({d: benchlib.version(d) for d in MORE_VERSIONS})
    files = {m: attempt(lambda m=m: getattr(import_module(m), "__file__", None)) for m in MODULES}
    info["module_files"] = files
    info["mpi4jax_cuda_support"] = attempt(lambda: import_module("mpi4jax").has_cuda_support())
    info["jax_backend"] = attempt(lambda: import_module("jax").default_backend(), "failed")
    info["jax_devices"] = attempt(
        lambda: [str(d) for d in import_module("jax").devices()], "failed"
    )
    info["nvidia_smi"] = benchlib.sh("nvidia-smi")
    info["nvcc"] = (benchlib.sh("nvcc", "--version") or "").splitlines()[-1:]
    info["env"] = {k: os.environ.get(k) for k in ENV_VARS}
    benchlib.write_json(out / "env.json", info)
    v = info["versions"]
    print(f"commit     {info['git_commit']} (from {info['git_commit_source']}, dirty: "
          f"{info['git_dirty']})")  # fmt: skip
    print(f"gpu        {'; '.join(info['gpus']) or '-'}  driver {info['gpu_driver']}")
    print(f"python     {info['python']}  jax {v['jax']} jaxlib {v['jaxlib']} "
          f"cuda13-plugin {v['jax-cuda13-plugin']}  backend {info.get('jax_backend')}")  # fmt: skip
    print(f"libraries  flax {v['flax']} optax {v['optax']} orbax {v['orbax-checkpoint']} "
          f"grain {v['grain']} torch {v['torch']} torchvision {v['torchvision']}")  # fmt: skip
    print(f"mpi        mpi4py {v['mpi4py']} mpich {v['mpich']} mpi4jax {v['mpi4jax']}  "
          f"cuda bridge {info['mpi4jax_cuda_support']}  "
          f"MPI4JAX_USE_CUDA_MPI={os.environ.get('MPI4JAX_USE_CUDA_MPI')!r}")  # fmt: skip
    print(f"flax from  {files['flax']}")
    return 0


# ----------------------------------------------------------------------------- e2e
def e2e_cases(smoke: bool, jpeg_root: Path) -> dict[str, dict]:
    """The end-to-end trainer runs and their img/s targets (H100; None: no target)."""
    rn50 = case("rn50-gpu", "log.every_steps=10")
    jpeg = ["data.name=imagefolder", f"data.path={jpeg_root}", "data.augment=imagenet"]
    packed = ["data.name=packed", f"data.path={jpeg_root}-packed", "data.augment=imagenet"]
    cases = {
        "rn50-mem224": dict(workload=rn50, steps=60, every=10, target=5200),
        "rn18-cifar": dict(workload=case("cifar-recipe"), steps=400, every=50, target=68000),
        "rn50-jpeg": dict(workload=with_overrides(rn50, *jpeg, "data.workers=14"), steps=40,
                          every=10, target=5200, jpegs=1024),
        # the same folder packed at --max-side 256 (issue 20's GPU target)
        "rn50-packed": dict(workload=with_overrides(rn50, *packed, "data.workers=14"), steps=40,
                            every=10, target=7200, jpegs=1024, pack=True),
    }  # fmt: skip
    if smoke:
        tiny = case("smoke", "log.every_steps=3")
        cifar = case("cifar-recipe", "model.width=8", "data.global_batch_size=16",
                     "log.every_steps=3")  # fmt: skip
        cases["rn50-mem224"].update(workload=tiny, steps=12, every=3)
        cases["rn18-cifar"].update(workload=cifar, steps=12, every=3)
        cases["rn50-jpeg"].update(workload=with_overrides(tiny, *jpeg, "data.workers=2"),
                                  steps=9, every=3, jpegs=48)  # fmt: skip
        cases["rn50-packed"].update(workload=with_overrides(tiny, *packed, "data.workers=2"),
                                    steps=9, every=3, jpegs=48)  # fmt: skip
    return cases


def e2e(out: Path, logs: Path, cases_wanted: list[str] | None, extra: list[str]) -> int:
    from bench_input import make_jpeg_folder, pack

    platform = "cpu" if SMOKE else "gpu"
    rows, runs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        cases = e2e_cases(SMOKE, Path(tmp) / "jpeg")
        for name, one in cases.items():
            if cases_wanted and name not in cases_wanted:
                continue
            if "jpegs" in one and not (Path(tmp) / "jpeg").exists():
                start = time.perf_counter()
                make_jpeg_folder(Path(tmp) / "jpeg", one["jpegs"])
                print(f"e2e: {one['jpegs']} JPEGs made in {time.perf_counter() - start:.0f} s")
            if one.get("pack"):
                pack(Path(tmp) / "jpeg", Path(tmp) / "jpeg-packed")
            wl = with_overrides(one["workload"], *extra)
            batch = int(value(wl, "data.global_batch_size"))
            # one cache for all cases: a case compiling the step another did starts warm
            run = run_case(logs / f"e2e-{name}", Path(tmp) / "cache", one["steps"], wl,
                           trainer_env(platform), one["every"], check=False)  # fmt: skip
            runs[name] = {**run, "workload": wl}
            row = {"case": name, "global_batch": batch, "target_img_per_s": one["target"]}
            if "error" in run:
                row["error"] = run["error"].splitlines()[-1][:200]
            elif not run["step_s"]:
                row["error"] = "no timed window (too few steps)"
            else:
                step = statistics.median(run["step_s"])
                row.update(
                    steps_per_s=1 / step,
                    img_per_s=statistics.median(run["img_per_s"]),
                    input_wait_fraction=statistics.median(run["input_wait_fraction"]),
                    input_wait_fraction_max=max(run["input_wait_fraction"]),
                    compile_s=run["compile_s"],
                    windows=len(run["step_s"]),
                )
                if one["target"]:
                    row["meets_target"] = row["img_per_s"] >= one["target"]
            rows.append(row)
            print(f"e2e: {name}: {row}", flush=True)
    mem = next((r for r in rows if r["case"] == "rn50-mem224" and "img_per_s" in r), None)
    for r in rows:
        if r["case"] in ("rn50-jpeg", "rn50-packed") and mem and "img_per_s" in r:
            r["vs_in_memory"] = r["img_per_s"] / mem["img_per_s"]
    result = {
        "benchmark": "gpu_e2e",
        "smoke": SMOKE,
        "command": benchlib.command_line(),
        "machine": benchlib.machine_info(None),
        "rows": rows,
        "runs": runs,
    }
    benchlib.write_json(out / "e2e.json", result)
    print(f"\n{'case':<12} {'batch':>5} {'steps/s':>8} {'img/s':>9} {'target':>8} {'met':>4} "
          f"{'input wait':>10} {'1st step s':>10}")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<12} FAILED: {r['error']}")
            continue
        target = f"{r['target_img_per_s']:,}" if r["target_img_per_s"] else "-"
        met = {True: "yes", False: "NO"}.get(r.get("meets_target"), "-")
        print(
            f"{r['case']:<12} {r['global_batch']:>5} {r['steps_per_s']:>8.1f} "
            f"{r['img_per_s']:>9,.0f} {target:>8} {met:>4} {r['input_wait_fraction']:>10.3f} "
            f"{r['compile_s']:>10.1f}"
        )
    if any("vs_in_memory" in r for r in rows):
        jpeg = next(r for r in rows if "vs_in_memory" in r)  # the folder's, else the pack's
        workers, ratio = value(runs[jpeg["case"]]["workload"], "data.workers"), jpeg["vs_in_memory"]
        print(f"{jpeg['case']} (data.workers={workers}) / in-memory img/s: {ratio:.2f}")
    if SMOKE:
        print("(smoke: tiny sizes on the CPU; the numbers mean nothing)")
    return 1 if any("error" in r for r in rows) else 0


# ----------------------------------------------------------------------------- mpi
def mpi_compare(out: Path, logs: Path, steps: int) -> int:
    """``mpirun -np 2`` with ``dist.backend=mpi`` (two ranks sharing the GPU) against one xla
    process with ``train.grad_accum_steps=2`` (the same halves, each with its own BatchNorm
    statistics): losses must agree to 1e-4 (matmul precision ``highest``: TF32 would mask or fake
    a difference)."""
    platform = "cpu" if SMOKE else "gpu"
    common = {"JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    env_x = trainer_env(platform, extra=common)
    # Two processes on one GPU: neither may take JAX's default 75% of its memory.
    env_m = trainer_env(platform, extra={**common, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.4"})
    env_m.pop("MPI4JAX_USE_CUDA_MPI", None)  # mpi4jax stages GPU buffers through the host
    overrides = case("mpi-tiny", f"train.steps={steps}", "train.compilation_cache_dir=null")
    result = {"benchmark": "gpu_mpi", "smoke": SMOKE, "steps": steps, "base": overrides}
    accum = [*overrides, "train.grad_accum_steps=2"]
    runs = {
        "xla": benchlib.run_trainer(logs / "mpi-xla-1proc", accum, env=env_x, check=False,
                                    timeout=480),
        "mpi": benchlib.run_trainer(logs / "mpi-mpi-2ranks", overrides, nproc=2, backend="mpi",
                                    env=env_m, check=False, timeout=480),
    }  # fmt: skip
    for name, run in runs.items():
        result[f"{name}_command"] = " ".join(run["command"])
        result.setdefault("wall_s", {})[name] = run["wall_s"]
        if "error" in run:
            result["error"] = f"{name} run failed: {run['error'][-1500:]}"
    result["env"] = {
        "MPI4JAX_USE_CUDA_MPI": env_m.get("MPI4JAX_USE_CUDA_MPI"),
        "XLA_PYTHON_CLIENT_MEM_FRACTION (mpi ranks)": env_m["XLA_PYTHON_CLIENT_MEM_FRACTION"],
        "JAX_DEFAULT_MATMUL_PRECISION": "highest",
    }
    if "error" not in result:
        got, want = runs["mpi"]["losses"], runs["xla"]["losses"]
        rel = {s: abs(got[s] - want[s]) / abs(want[s]) for s in want if s in got}
        worst = max(rel.values(), default=float("nan"))
        missing = [s for s in range(1, steps + 1) if s not in rel]
        bad = [s for s, r in rel.items() if r > 1e-4]
        result.update(losses_mpi=got, losses_xla=want, max_rel_diff=worst)
        result["match_rel_1e-4"] = not missing and not bad
        if missing or bad:
            result["first_mismatch_step"] = min(missing + bad)
    result["machine"] = benchlib.machine_info(None)
    benchlib.write_json(out / "mpi.json", result)
    print(f"\nmpi vs xla, {steps} steps, {platform}{' (smoke)' if SMOKE else ''}")
    if "error" in result:
        print(f"FAILED: {result['error'][:500]}")
        return 1
    print(f"{'step':>4} {'xla (1 proc, accum 2)':>22} {'mpi (2 ranks)':>14} {'rel diff':>9}")
    for s in sorted(want):
        if s in (1, 2, steps // 2, steps) and s in got:
            print(f"{s:>4} {want[s]:>22.6f} {got[s]:>14.6f} {rel[s]:>9.1e}")
    wall = result["wall_s"]
    print(f"max rel diff {worst:.2e}; match at rel 1e-4: {result['match_rel_1e-4']}; wall s: "
          f"xla {wall['xla']:.0f}, mpi {wall['mpi']:.0f}; MPI4JAX_USE_CUDA_MPI unset: staged "
          "through the host")  # fmt: skip
    return 0 if result["match_rel_1e-4"] else 1


def main() -> int:
    global SMOKE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["env", "e2e", "mpi"])
    ap.add_argument("out", type=Path)
    ap.add_argument("--logs", type=Path, default=None, help="run folders (default OUT/../logs)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--cases", default=None, help="e2e: comma-separated subset")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="e2e: an override for every case (repeatable)",
    )
    ap.add_argument("--steps", type=int, default=20, help="mpi: train steps")
    args = ap.parse_args()
    SMOKE = SMOKE or args.smoke
    logs = args.logs or Path(tempfile.mkdtemp(prefix="jddp-gpu-logs-"))
    if args.what == "env":
        return env_record(args.out)
    if args.what == "e2e":
        return e2e(args.out, logs, args.cases.split(",") if args.cases else None, args.set)
    return mpi_compare(args.out, logs, args.steps)


if __name__ == "__main__":
    sys.exit(main())
