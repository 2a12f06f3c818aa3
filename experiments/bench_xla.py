"""jddp's XLA defaults, measured end to end with the trainer (``python -m jddp.train``).

    .venv/bin/python experiments/bench_xla.py [--rounds 2] [--steps 8]          # CPU
    python3 experiments/bench_xla.py --platform gpu [--steps 30] [--out X.json]  # a lent GPU

CPU: the ``xla-cpu`` case (``cases.py``) under jddp's defaults (the XLA:CPU flag of
``jddp/xla_setup.py``) and XLA's own (``JDDP_XLA_DEFAULTS=0``), alternating, each once with an
empty compilation cache ("cold") and once on the cache it filled ("warm"): median step time after
the first two steps, ``train/compile_s`` (the first step, compilation included) cold and warm.
GPU: the ``rn50-gpu`` case once per XLA:GPU flag set (:data:`GPU_FLAG_SETS`; a set JAX does not
start with is skipped with a note, :func:`usable_flag_sets`), each into an empty cache, then
XLA's defaults on the first run's cache. ``--smoke``: the GPU mode on the CPU, tiny. Prints a
table and writes ``results/xla-<date>-<machine>.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib
from cases import case, value

# (name, XLA_FLAGS added to the environment's own). XLA:GPU's default autotune level is 4.
GPU_FLAG_SETS = [
    ("XLA defaults", ""),
    ("autotune 0", "--xla_gpu_autotune_level=0"),
    ("autotune 2", "--xla_gpu_autotune_level=2"),
    ("command buffers off", "--xla_gpu_enable_command_buffer="),
    ("latency-hiding sched", "--xla_gpu_enable_latency_hiding_scheduler=true"),
]
GPU_NOTE = (
    "one GPU: no collective to overlap, so the latency-hiding scheduler row measures its "
    "scheduling alone, not its multi-GPU effect"
)


def trainer_env(platform: str, xla_flags: str = "", extra: dict | None = None) -> dict:
    """The environment of a trainer run: ``JAX_PLATFORMS`` pinned (``cuda`` on GPU, so a
    machine without one fails instead of measuring the CPU) and ``xla_flags`` appended."""
    env = {**os.environ, "JAX_PLATFORMS": "cuda" if platform == "gpu" else "cpu", **(extra or {})}
    flags = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    if flags:
        env["XLA_FLAGS"] = flags
    return env


def run_case(workdir: Path, cache: Path, steps: int, overrides: list[str], env: dict,
             skip_steps: int = 2, check: bool = True) -> dict:  # fmt: skip
    """One trainer run of ``overrides`` for ``steps`` steps with compilation cache ``cache``."""
    more = [f"train.steps={steps}", f"train.compilation_cache_dir={cache}"]
    return benchlib.run_trainer(
        workdir, [*overrides, *more], env=env, skip_steps=skip_steps, check=check
    )


def usable_flag_sets(flag_sets, platform: str) -> tuple[list, list[dict]]:
    """The ``(name, flags)`` sets with which JAX starts on ``platform``, and a note for each
    one left out (an unknown XLA flag aborts the process at start-up)."""
    keep, skipped = [], []
    for name, flags in flag_sets:
        if not flags:
            keep.append((name, flags))
            continue
        probe = subprocess.run(
            [sys.executable, "-c", "import jax; jax.devices()"],
            capture_output=True, text=True, env=trainer_env(platform, flags), timeout=300,
        )  # fmt: skip
        if probe.returncode == 0:
            keep.append((name, flags))
        else:
            last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
            skipped.append({"config": name, "xla_flags": flags, "why": last[-300:]})
            print(f"bench_xla: skipped {name!r} ({flags}): JAX does not start with it: {last}")
    return keep, skipped


def main_cpu(args) -> dict:
    runs: dict[str, list[dict]] = {"jddp defaults": [], "XLA defaults": []}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, defaults in (("jddp defaults", True), ("XLA defaults", False)):
                cache, run = Path(tmp) / f"cache-{name[:4]}-{r}", {}
                env = {**trainer_env("cpu"), "JDDP_XLA_DEFAULTS": "1" if defaults else "0"}
                for kind in ("cold", "warm"):
                    workdir = Path(tmp) / f"{name[:4]}-{r}-{kind}"
                    run[kind] = run_case(workdir, cache, args.steps, case("xla-cpu"), env)
                runs[name].append(run)
                loads.append(os.getloadavg()[0])
    rows = []
    for name, rs in runs.items():
        steps = [s for r in rs for s in r["cold"]["step_s"] + r["warm"]["step_s"]]
        rows.append(
            {
                "config": name,
                "step_s_median": statistics.median(steps),
                "img_per_s": 64 / statistics.median(steps),
                "first_step_cold_s": statistics.median(r["cold"]["compile_s"] for r in rs),
                "first_step_warm_s": statistics.median(r["warm"]["compile_s"] for r in rs),
                "input_wait_fraction_max": max(
                    w for r in rs for w in r["cold"]["input_wait_fraction"]
                ),
            }
        )
    base = rows[1]["step_s_median"]
    print(f"{'config':<14} {'step s':>8} {'img/s':>7} {'speed-up':>8} {'1st step cold s':>16} "
          f"{'1st step warm s':>16} {'input wait':>10}")  # fmt: skip
    for row in rows:
        row["speedup_vs_xla_defaults"] = base / row["step_s_median"]
        print(
            f"{row['config']:<14} {row['step_s_median']:>8.3f} {row['img_per_s']:>7.1f} "
            f"{row['speedup_vs_xla_defaults']:>7.2f}x {row['first_step_cold_s']:>16.2f} "
            f"{row['first_step_warm_s']:>16.2f} {row['input_wait_fraction_max']:>10.4f}"
        )
    return {"workload": case("xla-cpu"), "rows": rows, "runs": runs, "load_avg_1min": loads}


def main_gpu(args) -> dict:
    """One run per usable flag set (each compiling into an empty cache), then XLA's defaults
    again on the first run's cache (warm)."""
    workload = case("smoke" if args.smoke else "rn50-gpu")
    platform = "cpu" if args.smoke else "gpu"
    batch = int(value(workload, "data.global_batch_size"))
    flag_sets, skipped = usable_flag_sets(GPU_FLAG_SETS, platform)
    keep = Path(args.logs) if args.logs else None
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = keep or Path(tmp)
        for i, (name, flags) in enumerate(flag_sets):
            workdir = base / f"xla-{i}"
            env = trainer_env(platform, flags)
            runs[name] = run_case(workdir, Path(tmp) / f"cache-{i}", args.steps, workload, env,
                                  check=False)  # fmt: skip
            runs[name]["xla_flags"] = flags
            print(f"bench_xla: {name}: {summary(runs[name], batch)}", flush=True)
        warm = run_case(base / "xla-warm", Path(tmp) / "cache-0", max(4, args.steps // 3),
                        workload, trainer_env(platform), check=False)  # fmt: skip
    rows = []
    for name, run in runs.items():
        row = {"config": name, "xla_flags": run["xla_flags"]}
        if "error" in run:
            row["error"] = run["error"].splitlines()[-1][:200]
        else:
            med = statistics.median(run["step_s"])
            row.update(
                step_s_median=med,
                step_s_p10=benchlib.percentile(run["step_s"], 0.1),
                step_s_p90=benchlib.percentile(run["step_s"], 0.9),
                img_per_s=batch / med,
                first_step_cold_s=run["compile_s"],
                input_wait_fraction_max=max(run["input_wait_fraction"]),
            )
        rows.append(row)
    base_row = rows[0]
    if "error" not in warm and "step_s_median" in base_row:
        base_row["first_step_warm_s"] = warm["compile_s"]
    print_gpu_table(rows, skipped, warm)
    return {
        "workload": workload,
        "smoke": args.smoke,
        "note": GPU_NOTE,
        "rows": rows,
        "skipped": skipped,
        "runs": runs,
        "warm_run": warm,
    }


def summary(run: dict, batch: int) -> str:
    if "error" in run:
        return "FAILED: " + run["error"].splitlines()[-1][:200]
    med = statistics.median(run["step_s"])
    first = run["compile_s"]
    return f"median step {med * 1e3:.1f} ms, {batch / med:,.0f} img/s, 1st step {first:.1f} s"


def print_gpu_table(rows: list[dict], skipped: list[dict], warm: dict) -> None:
    base = rows[0].get("step_s_median")
    print(f"\n{'XLA flag set':<22} {'step ms':>8} {'p10-p90 ms':>13} {'img/s':>8} {'vs dflt':>7} "
          f"{'1st step s':>10} {'in wait':>7}")  # fmt: skip
    for row in rows:
        if "error" in row:
            print(f"{row['config']:<22} FAILED: {row['error']}")
            continue
        rel = f"{base / row['step_s_median']:.2f}x" if base else "-"
        span = f"{row['step_s_p10'] * 1e3:.1f}-{row['step_s_p90'] * 1e3:.1f}"
        print(
            f"{row['config']:<22} {row['step_s_median'] * 1e3:>8.1f} {span:>13} "
            f"{row['img_per_s']:>8,.0f} {rel:>7} {row['first_step_cold_s']:>10.1f} "
            f"{row['input_wait_fraction_max']:>7.3f}"
        )
    for s in skipped:
        print(f"{s['config']:<22} skipped: the installed XLA does not start with {s['xla_flags']}")
    if "error" in warm:
        print("compilation cache: the warm run FAILED: " + warm["error"].splitlines()[-1][:200])
    elif "first_step_cold_s" in rows[0]:
        print(
            f"compilation cache (XLA defaults): 1st step {rows[0]['first_step_cold_s']:.1f} s cold,"
            f" {warm['compile_s']:.1f} s warm"
        )
    print(f"note: {GPU_NOTE}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--rounds", type=int, default=2, help="CPU: rounds of both settings")
    parser.add_argument("--steps", type=int, default=None, help="train steps (8 CPU, 30 GPU)")
    parser.add_argument("--smoke", action="store_true", help="GPU mode's code on CPU, tiny")
    parser.add_argument("--machine", default=None, help="name in the file name (default: vm/host)")
    parser.add_argument("--out", default=None, help="JSON path (default experiments/results/)")
    parser.add_argument("--logs", default=None, help="GPU mode: keep the run folders here")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 30 if args.platform == "gpu" and not args.smoke else 8
    machine = args.machine or ("vm" if args.platform == "cpu" else None)
    result = main_gpu(args) if args.platform == "gpu" else main_cpu(args)
    loads = result.pop("load_avg_1min", [os.getloadavg()[0]])
    result = {
        "benchmark": "bench_xla",
        "platform": args.platform,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": benchlib.machine_info(machine, {"load_avg_1min": loads}),
        "steps": args.steps,
        **result,
    }
    if args.out:
        benchlib.write_json(Path(args.out), result)
    else:
        name = result["machine"]["name"]
        benchlib.save_result("xla", name if args.platform == "cpu" else f"gpu-{name}", result)
    failed = [r["config"] for r in result["rows"] if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
