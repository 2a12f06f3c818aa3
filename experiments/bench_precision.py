"""Mixed precision on the default run: accuracy and speed of ``train.precision`` float32 vs
bfloat16 on ``configs/digits.yaml``, alternating, ``--repeats`` times each.

    .venv/bin/python experiments/bench_precision.py [--repeats 2] [--steps 220]

Exit 1 if the accuracy gap exceeds 1 point. Writes ``results/precision-<date>-<machine>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
from pathlib import Path

import benchlib
from benchlib import machine_info, run_trainer
from cases import case

PRECISIONS = ("float32", "bfloat16")


def train_once(precision: str, steps: int, workdir: Path) -> dict:
    """One CLI run of the digits config; its final eval and median logged throughput."""
    overrides = case(
        "digits", f"train.precision={precision}", f"train.steps={steps}", "checkpoint.every_steps=0"
    )
    run = run_trainer(workdir, overrides)
    return {
        "precision": precision,
        "eval_accuracy": run["eval"]["eval/accuracy"],
        "final_train_loss": run["losses"][max(run["losses"])],
        "img_per_s_median": statistics.median(run["img_per_s"][1:]),  # the first: compiling
        "img_per_s_windows": run["img_per_s"][1:],
        "command": " ".join(run["command"][1:]),
    }


def main(argv: list[str] | None = None) -> int:
    """Run, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=220)
    benchlib.output_args(parser)
    args = parser.parse_args(argv)
    machine = machine_info(args.machine)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for precision in PRECISIONS:
                run = train_once(precision, args.steps, Path(tmp) / f"{precision}-{i}")
                print(f"{precision:9s} run {i}: accuracy {run['eval_accuracy']:.4f}, "
                      f"{run['img_per_s_median']:.1f} img/s", flush=True)  # fmt: skip
                runs.append(run)
    summary = {}
    for precision in PRECISIONS:
        mine = [r for r in runs if r["precision"] == precision]
        summary[precision] = {
            "eval_accuracy_mean": statistics.mean(r["eval_accuracy"] for r in mine),
            "img_per_s_median": statistics.median(r["img_per_s_median"] for r in mine),
        }
    f32, bf16 = summary["float32"], summary["bfloat16"]
    gap_points = 100 * (f32["eval_accuracy_mean"] - bf16["eval_accuracy_mean"])
    speedup = bf16["img_per_s_median"] / f32["img_per_s_median"]
    print("\n| precision | eval accuracy (mean) | img/s (median) |\n|---|---:|---:|")
    for precision, s in summary.items():
        print(f"| {precision} | {s['eval_accuracy_mean']:.4f} | {s['img_per_s_median']:.1f} |")
    print(f"\nbf16 accuracy gap: {gap_points:+.2f} points (target within 1); "
          f"bf16 speed-up: {speedup:.2f}x")  # fmt: skip
    record = {
        "date": datetime.date.today().isoformat(), "machine": machine, "argv": sys.argv,
        "runs": runs, "summary": summary, "accuracy_gap_points": gap_points,
        "bf16_speedup": speedup,
    }  # fmt: skip
    benchlib.save_result("precision", machine["name"], record, args.out)
    return 0 if abs(gap_points) <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
