"""XLA:GPU flag sets and the compilation cache, measured end to end with the trainer:
``python3 experiments/bench_xla.py --platform gpu [--matrix tune] [--batches 256,384]`` (on the
CPU: ``--smoke``). The ``rn50-gpu`` case once per flag set and batch, each into an empty
compilation cache, then run 0 again on its cache (warm); the method: ``experiments/README.md``.
Writes ``results/xla-<date>-gpu-<machine>.json`` (or ``--out``)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib
from benchlib import trainer_env
from cases import case, value

# (name, XLA_FLAGS added to the environment's own). XLA:GPU's default autotune level is 4.
GPU_FLAG_SETS = [
    ("XLA defaults", ""),
    ("autotune 0", "--xla_gpu_autotune_level=0"),
    ("autotune 2", "--xla_gpu_autotune_level=2"),
    ("command buffers off", "--xla_gpu_enable_command_buffer="),
    ("latency-hiding sched", "--xla_gpu_enable_latency_hiding_scheduler=true"),
]
# --matrix tune (issue 39), per batch size: CUDA graphs around convolutions (newer XLA names the
# type CONVOLUTION, older ones record cuDNN calls as CUDNN), an autotune cache kept on disk
TUNE_FLAG_SETS = [
    GPU_FLAG_SETS[0],
    GPU_FLAG_SETS[4],
    ("cmd buffers +conv", "--xla_gpu_enable_command_buffer=+CONVOLUTION"),
    ("cmd buffers +cudnn", "--xla_gpu_enable_command_buffer=+CUDNN"),
    ("autotune cache", "--xla_gpu_per_fusion_autotune_cache_dir={tmp}/autotune"),
]
UNBUILT = ["BatchNorm in bf16: jddp normalises in float32 and has no key for it (unmeasured)"]
GPU_NOTE = (
    "one GPU: no collective to overlap, so the latency-hiding scheduler row measures its "
    "scheduling alone, not its multi-GPU effect"
)


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


def main_gpu(args) -> dict:
    """One run per usable flag set (each compiling into an empty cache), then XLA's defaults
    again on the first run's cache (warm)."""
    base_case = case("smoke" if args.smoke else "rn50-gpu")
    platform = "cpu" if args.smoke else "gpu"
    batches = args.batches or [int(value(base_case, "data.global_batch_size"))]
    matrix = TUNE_FLAG_SETS if args.matrix == "tune" else GPU_FLAG_SETS
    flag_sets, skipped = usable_flag_sets(matrix, platform)
    flag_sets = [(f"{name} @{b}" if len(batches) > 1 else name, flags, b)
                 for b in batches for name, flags in flag_sets]  # fmt: skip
    keep = Path(args.logs) if args.logs else None
    runs: dict[str, dict] = {}
    rows, run0 = [], base_case
    with tempfile.TemporaryDirectory() as tmp:
        base = keep or Path(tmp)
        for i, (name, flags, batch) in enumerate(flag_sets):
            workdir = base / f"xla-{i}"
            flags = flags.format(tmp=tmp)
            env = trainer_env(platform, flags)
            workload = [o for o in base_case if not o.startswith("data.global_batch_size=")]
            workload.append(f"data.global_batch_size={batch}")
            if i == 0:
                run0 = workload  # the warm run repeats run 0 on its cache
            run = run_case(
                workdir, Path(tmp) / f"cache-{i}", args.steps, workload, env, check=False
            )
            runs[name] = {**run, "xla_flags": flags}
            row = {"config": name, "xla_flags": flags, "global_batch": batch}
            if "error" in run:
                row["error"] = run["error"].splitlines()[-1][:200]
                print(f"bench_xla: {name}: FAILED: {row['error']}", flush=True)
            else:
                step = benchlib.median_p10_p90(run["step_s"])
                row.update(
                    step_s_median=step["median"],
                    step_s_p10=step["p10"],
                    step_s_p90=step["p90"],
                    img_per_s=batch / step["median"],
                    first_step_cold_s=run["compile_s"],
                    input_wait_fraction_max=max(run["input_wait_fraction"]),
                )
                ms, first = step["median"] * 1e3, run["compile_s"]
                print(f"bench_xla: {name}: median step {ms:.1f} ms, 1st step {first:.1f} s")
            rows.append(row)
        warm = run_case(base / "xla-warm", Path(tmp) / "cache-0", max(4, args.steps // 3),
                        run0, trainer_env(platform), check=False)  # fmt: skip
    base_row = rows[0]
    if "error" not in warm and "step_s_median" in base_row:
        base_row["first_step_warm_s"] = warm["compile_s"]
    print_gpu_table(rows, skipped, warm)
    for note in UNBUILT:
        print(f"bench_xla: not in the matrix: {note}")
    return dict(workload=base_case, batches=batches, unbuilt=UNBUILT, smoke=args.smoke,
                note=GPU_NOTE, rows=rows, skipped=skipped, runs=runs, warm_run=warm)  # fmt: skip


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
    parser.add_argument(
        "--platform", choices=["gpu"], required=True, help="gpu only (CPU: bench.py -xladefaults)"
    )
    parser.add_argument("--steps", type=int, default=None, help="train steps (30; --smoke: 8)")
    parser.add_argument("--smoke", action="store_true", help="GPU mode's code on CPU, tiny")
    parser.add_argument("--logs", default=None, help="GPU mode: keep the run folders here")
    parser.add_argument("--batches", type=lambda t: [int(b) for b in t.split(",")],
                        help="global batches, each with every flag set")  # fmt: skip
    parser.add_argument("--matrix", choices=["flags", "tune"], default="flags")
    benchlib.output_args(parser)
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 8 if args.smoke else 30
    loads = [benchlib.load1()]
    result = main_gpu(args)
    result = {
        "benchmark": "bench_xla",
        "platform": args.platform,
        "command": benchlib.command_line(),
        "machine": benchlib.machine_info(args.machine, {"load_avg_1min": loads}),
        "steps": args.steps,
        **result,
    }
    benchlib.save_result("xla", f"gpu-{result['machine']['name']}", result, args.out)
    return 1 if any("error" in r for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
