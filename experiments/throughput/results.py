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
from .flops import COUNTING, train_step_flops
from .runner import Group, slowest, worker_env
from .tables import plot, print_table


def _base_record(g: Group) -> dict:
    """What a group's record holds whether or not it timed any step."""
    spec, w = g.spec, g.spec.work
    compile_what = "lower + compile of the step" if spec.framework == "jddp" else None
    if spec.framework == "torch" and spec.has("compile"):
        compile_what = "torch.compile: compiled inside the 1st warm-up step (1st step s)"
    if spec.mpi:
        compile_what = (
            "lower + compile of the grads stage (the update jit compiles in the 1st step)"
        )
    xla_flags, client_env = None, None
    if spec.framework == "jddp":
        env = worker_env(spec, 0, 0, argparse.Namespace(profile=False), "")
        xla_flags = env.get("XLA_FLAGS")
        client_env = {k: v for k, v in env.items() if k.startswith("XLA_PYTHON_CLIENT_")}
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
        "xla_client_env": client_env,  # JAX's GPU allocator settings (GPU: no preallocation)
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
        xla_flops_per_step=flops,
        xla_flops_source=source if flops else None,
        step_s=times,
    )
    return rec


def _migrate(r: dict) -> None:
    """Results written before the analytic count held XLA's count in ``model_flops_*``: move it
    to the ``xla_*`` fields, where it is now kept."""
    if "xla_flops_per_step" in r or "median_step_s" not in r:
        return
    if (r.get("model_flops_source") or "XLA").startswith("XLA"):
        r["xla_flops_per_step"] = r.pop("model_flops_per_step", None)
        r["xla_flops_source"] = r.pop("model_flops_source", None)


def add_flops(r: dict, workload: dict, peak: float | None) -> None:
    """Model FLOPs per step from the architecture (:mod:`.flops`), XLA's count beside it, the
    achieved GFLOP/s and the MFU of each."""
    _migrate(r)
    if "median_step_s" not in r:
        return
    analytic = train_step_flops({**workload, "global_batch": r["global_batch"]})
    med, xla = r["median_step_s"], r.get("xla_flops_per_step")
    r["model_flops_per_step"] = analytic
    r["model_flops_source"] = COUNTING if analytic else None
    r["achieved_gflops"] = analytic / med / 1e9 if analytic else None
    r["xla_achieved_gflops"] = xla / med / 1e9 if xla else None
    r["mfu"] = analytic / med / peak if analytic and peak else None
    r["xla_mfu"] = xla / med / peak if xla and peak else None


def derive(records: list[dict], peak_by_dtype: dict[str, float | None], workload: dict) -> None:
    """Fields computed from the measured ones: FLOPs, MFU and the jddp / PyTorch ratios."""
    for r in records:
        add_flops(r, workload, peak_by_dtype.get(r["dtype"]))
        for key in RATIO_KEYS:
            r.pop(key, None)
    add_ratios(records, workload.get("platform", "cpu"))


RATIO_KEYS = ("ratio_vs", "ratio_img_per_s", "ratio_vs_compiled", "ratio_img_per_s_compiled")


def _variants(r: dict) -> set[str]:
    return set((r.get("variant") or "").split("-")) - {""}


def _peer(r: dict, peers: list[dict], compiled: bool, platform: str) -> dict | None:
    """The PyTorch record to compare jddp record ``r`` with: eager or ``-compile``, pinned if
    ``r`` is; on CPU the same process count (else 2 processes, else unpinned), on GPU the same
    number of GPUs (one per PyTorch process)."""
    peers = [p for p in peers if ("compile" in _variants(p)) == compiled]
    pin = "pin" in _variants(r)

    def pick(procs: int, pinned: bool) -> list[dict]:
        return [p for p in peers if p["processes"] == procs and ("pin" in _variants(p)) == pinned]

    if platform == "gpu":
        same = pick(r["processes"] * r.get("devices_per_process", 1), pin)
    else:  # jddp's XLA-flag suffixes have no peer
        same = pick(r["processes"], pin) or pick(2, pin) or pick(r["processes"], False)
    return same[0] if same else None


def add_ratios(records: list[dict], platform: str = "cpu") -> None:
    """jddp images/s over PyTorch DDP's (eager and, where run, ``torch.compile``), same dtype."""
    for r in records:
        if r["framework"] != "jddp" or "img_per_s" not in r:
            continue
        peers = [
            p
            for p in records
            if p["framework"] == "torch" and p["dtype"] == r["dtype"] and "img_per_s" in p
        ]
        for compiled, suffix in ((False, ""), (True, "_compiled")):
            peer = _peer(r, peers, compiled, platform)
            if peer:
                r[f"ratio_vs{suffix}"] = peer["config"]
                r[f"ratio_img_per_s{suffix}"] = r["img_per_s"] / peer["img_per_s"]


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
        result["workload"],
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
        for suffix in ("", "_compiled"):
            if f"ratio_img_per_s{suffix}" in r:
                print(
                    f"ratio {r['config']}/{r['dtype']} vs {r[f'ratio_vs{suffix}']}/{r['dtype']}: "
                    f"{r[f'ratio_img_per_s{suffix}']:.2f}x images/s"
                )
