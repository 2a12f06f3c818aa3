"""From the workers' replies to results: one record per group (:func:`summarise`), the derived
fields (MFU, jddp / PyTorch ratios: :func:`derive`), the FLOP peak, output paths and
``--recompute``."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
from pathlib import Path

from . import common
from .runner import Group, slowest, worker_env
from .tables import plot, print_table


def _base_record(g: Group) -> dict:
    """What a group's record holds whether or not it timed any step."""
    spec, w = g.spec, g.spec.work
    compile_what = "lower + compile of the step" if spec.framework == "jddp" else None
    if spec.mpi:
        compile_what = (
            "lower + compile of the grads stage (the update jit compiles in the 1st step)"
        )
    xla_flags = None
    if spec.framework == "jddp":
        xla_flags = worker_env(spec, 0, 0, argparse.Namespace(profile=False), "").get("XLA_FLAGS")
    per_proc_key = "devices_per_process" if spec.framework == "jddp" else "threads_per_process"
    rec = {
        "config": spec.name,
        "framework": spec.framework,
        "dist_backend": spec.backend if spec.framework == "jddp" else None,
        "dtype": w.dtype,
        "processes": spec.nproc,
        per_proc_key: spec.per_proc,
        "variant": spec.variant or None,
        "global_batch": w.global_batch,
        "env": {k: v for k, v in spec.extra_env.items()},
        "xla_flags": xla_flags,
        "step_s_by_round": [slowest([r["step_s"] for r in rnd]) for rnd in g.runs],
        "loss_rank0": [x for rnd in g.runs for x in rnd[0]["loss"]],
        "warmup_s": slowest([r["warmup_s"] for r in g.ready]),
        "compile_s": max(
            (r["compile_s"] for r in g.ready if r.get("compile_s") is not None), default=None
        ),
        "compile_what": compile_what,
        "worker_ready": g.ready,
        "worker_final": g.final,
        "maxrss_mib_per_process": [r["maxrss_mib"] for r in g.final],
    }
    if g.profile:
        rec["profile"] = g.profile
    return rec


def _xla_flops(g: Group, flops_by_dtype: dict[str, float]) -> tuple[float | None, str]:
    """FLOPs of one step from XLA's cost analysis, and where the count comes from."""
    spec, ready = g.spec, g.ready[0]
    if spec.mpi:  # two programs: the xla step's count if there is one, else the grads stage's
        flops = flops_by_dtype.get(spec.work.dtype)
        source = "XLA cost_analysis of jddp's xla-backend step (same model, dtype and batch)"
        per_dev = ready.get("grads_stage_flops_per_device")
        if flops is None and per_dev:
            flops = per_dev * ready["devices"]
            source = "XLA cost_analysis of this step's grads stage (the update is not counted)"
        return flops, source
    if spec.framework == "jddp":
        per_dev = ready.get("flops_per_device")
        return (per_dev * ready["devices"] if per_dev else None), "XLA cost_analysis of this step"
    source = "XLA cost_analysis of jddp's step (same model, dtype and batch)"
    return flops_by_dtype.get(spec.work.dtype), source


def summarise(g: Group, flops_by_dtype: dict[str, float]) -> dict:
    """One record per group: the slowest rank's step times and what follows from them."""
    rec = _base_record(g)
    rounds = rec["step_s_by_round"]
    times = [t for rnd in rounds for t in rnd]
    if not times:
        return rec
    med = statistics.median(times)
    flops, source = _xla_flops(g, flops_by_dtype)
    rec.update(
        timed_steps=len(times),
        median_step_s=med,
        p10_step_s=common.benchlib.percentile(times, 0.1),
        p90_step_s=common.benchlib.percentile(times, 0.9),
        min_step_s=min(times),
        max_step_s=max(times),
        median_step_s_without_first_of_round=(
            statistics.median([t for rnd in rounds for t in rnd[1:]])
            if all(len(r) > 1 for r in rounds)
            else None
        ),
        img_per_s=g.spec.work.global_batch / med,
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


def output_path(arg: str | None, date: str, machine: str, quick: bool = False) -> Path:
    if arg:
        return Path(arg)
    if quick:  # a smoke run: one file, replaced each time, never a real result's name
        return common.RESULTS_DIR / f"{date}-{machine}-quick.json"
    return common.benchlib.unused_path(common.RESULTS_DIR, f"{date}-{machine}")


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
