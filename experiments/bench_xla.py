"""jddp's XLA defaults, measured end to end with the trainer (``python -m jddp.train``).

1. The XLA:CPU flag jddp sets (convolutions off YNNPACK, ``jddp/xla_setup.py``) against XLA's
   own defaults (``JDDP_XLA_DEFAULTS=0``): median step time of the steps after the first two.
2. The persistent compilation cache: time to the first step (``train/compile_s``, which is the
   first step's wall time including compilation) with an empty cache ("cold") and again with
   the cache the cold run filled ("warm", as a restarted or resumed run sees it).

Runs alternate between the two flag settings, so drifts of a shared machine hit both alike.
Usage (repo root): ``.venv/bin/python experiments/bench_xla.py [--rounds 2] [--steps 8]``.
Prints a table and writes ``experiments/results/xla-<date>-<machine>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib

WORKLOAD = [
    "data.name=synthetic",
    "data.image_size=32",
    "data.global_batch_size=64",
    "data.augment=cifar",
    "model.name=resnet18",
    "model.width=32",
    "optim.schedule=constant",
    "log.every_steps=1",
    "log.progress=off",
    "checkpoint.async_save=false",
]


def run_trainer(workdir: Path, cache: Path, steps: int, defaults: bool) -> dict:
    """One ``python -m jddp.train`` run; its compile time and per-step times."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JDDP_XLA_DEFAULTS": "1" if defaults else "0"}
    cmd = [
        sys.executable, "-m", "jddp.train", f"workdir={workdir}", *WORKLOAD,
        f"train.steps={steps}", f"train.compilation_cache_dir={cache}",
    ]  # fmt: skip
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=benchlib.REPO)
    if out.returncode != 0:
        raise SystemExit(f"bench_xla: {' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    compile_s = next(r["train/compile_s"] for r in rows if "train/compile_s" in r)
    timed = [r for r in rows if "train/step_time_s" in r and r["step"] > 2]
    return {
        "compile_s": compile_s,
        "step_s": [r["train/step_time_s"] for r in timed],
        "input_wait_fraction": [r["perf/input_wait_fraction"] for r in timed],
        "wall_s": time.perf_counter() - start,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--machine", default="vm")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"jddp defaults": [], "XLA defaults": []}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, defaults in (("jddp defaults", True), ("XLA defaults", False)):
                cache = Path(tmp) / f"cache-{name[:4]}-{r}"
                cold = run_trainer(Path(tmp) / f"{name[:4]}-{r}-cold", cache, args.steps, defaults)
                warm = run_trainer(Path(tmp) / f"{name[:4]}-{r}-warm", cache, args.steps, defaults)
                runs[name].append({"cold": cold, "warm": warm})
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
    result = {
        "benchmark": "bench_xla",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": benchlib.machine_info(args.machine, {"load_avg_1min": loads}),
        "workload": WORKLOAD,
        "steps": args.steps,
        "rows": rows,
        "runs": runs,
    }
    benchlib.save_result("xla", args.machine, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
