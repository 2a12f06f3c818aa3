"""What a periodic checkpoint costs a training run on this machine: ResNet-18 (11.2 M
parameters, SGD momentum: a ~90 MB state) on synthetic 32x32 images, batch 32, one process,
with no periodic save, a save every K steps written in the background (``checkpoint.
async_save=true``, the default) or in the step's thread, and saves by the clock
(``checkpoint.every_minutes``, the default cadence's mechanism at a short period).

    .venv/bin/python experiments/checkpoint_cost.py [--steps 40] [--every 5] [--machine NAME]

Each case is one ``python -m jddp.train`` (``log.every_steps=1``: every step's own
``train/step_time_s``). The cost of a save is the training time it adds: the sum of the step
times past the first (compile) step, minus the no-save run's, divided by the saves; the
default cadence (``every_minutes=30``) then costs that once per 1,800 s of training. Writes
``results/checkpoint-cost-<date>-<machine>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import benchlib

BASE = [
    "model.name=resnet18",
    "data.name=synthetic",
    "data.image_size=32",
    "data.global_batch_size=32",
    "optim.schedule=constant",
    "log.every_steps=1",
    "log.progress=off",
    "checkpoint.keep=1000",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5, help="K of the every-K-steps cases")
    ap.add_argument("--minutes", type=float, default=0.1, help="every_minutes of the clock case")
    benchlib.output_args(ap)
    args = ap.parse_args()
    info = benchlib.machine_info(args.machine)
    cases = {
        "no periodic save": ["checkpoint.every_minutes=0"],
        f"every {args.every} steps, async": [f"checkpoint.every_steps={args.every}"],
        f"every {args.every} steps, sync": [
            f"checkpoint.every_steps={args.every}",
            "checkpoint.async_save=false",
        ],
        f"every_minutes={args.minutes:g}, async": [f"checkpoint.every_minutes={args.minutes}"],
    }
    rows = []
    baseline = None
    benchlib.md_table(
        "case | periodic saves | steps 2..N (s) | median step (s) | cost per save (s) "
        "| default cadence (30 min) costs"
    )
    for name, overrides in cases.items():
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp) / "run"
            out = benchlib.run_trainer(workdir, [*BASE, f"train.steps={args.steps}", *overrides])
            saved = sorted(
                int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()
            )
            size_mb = (
                sum(
                    f.stat().st_size
                    for f in (workdir / "checkpoints" / str(saved[-1])).rglob("*")
                    if f.is_file()
                )
                / 1e6
            )
        periodic = [s for s in saved if s != args.steps]
        past_compile = [t for s, t in zip(out["steps"], out["step_s"], strict=True) if s > 1]
        total = sum(past_compile)
        if baseline is None:
            baseline = total
        per_save = (total - baseline) / len(periodic) if periodic else None
        share = None if per_save is None else per_save / 1800.0
        row = {
            "case": name,
            "overrides": overrides,
            "periodic_saves": len(periodic),
            "saved_steps": saved,
            "checkpoint_mb": size_mb,
            "steps_total_s": total,
            "median_step_s": benchlib.percentile(past_compile, 0.5),
            "cost_per_save_s": per_save,
            "default_cadence_fraction": share,
        }
        rows.append(row)
        print(
            f"| {name} | {len(periodic)} | {total:.2f} | {row['median_step_s']:.3f} | "
            + ("-" if per_save is None else f"{per_save:.3f}")
            + " | "
            + ("-" if share is None else f"{100 * share:.3f}% of training time")
            + " |"
        )
    print(f"checkpoint size: {rows[0]['checkpoint_mb']:.0f} MB")
    result = info | {
        "command": benchlib.command_line(),
        "base": BASE,
        "steps": args.steps,
        "rows": rows,
    }
    benchlib.save_result("checkpoint-cost", info["name"], result, args.out)


if __name__ == "__main__":
    main()
