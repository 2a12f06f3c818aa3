"""Mixed precision on the default run: accuracy and speed of ``train.precision`` float32 vs
bfloat16 on ``configs/digits.yaml`` (ResNet-18 on scikit-learn's digits, 220 steps).

    .venv/bin/python experiments/bench_precision.py [--repeats 2] [--steps 220]

Each repeat trains once per precision, alternating (f32, bf16, f32, bf16, ...) so a slow phase
of a shared machine hits both. Reported per run: final eval accuracy on the 360 held-out digits
(what the issue's "within 1 point" is about) and training throughput, the median of the
``train/img_per_s`` log lines (each covers ``log.every_steps`` steps; the first, which
includes compilation, is dropped). Writes ``results/precision-<date>-<machine>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchlib import REPO, RESULTS_DIR, machine_info

PRECISIONS = ("float32", "bfloat16")


def train_once(precision: str, steps: int, workdir: Path) -> dict:
    """One CLI run of the digits config; its final eval and median logged throughput."""
    cmd = [
        sys.executable, "-m", "jddp.train", "--config", "configs/digits.yaml",
        f"workdir={workdir}", f"train.precision={precision}", f"train.steps={steps}",
        "log.progress=off", "checkpoint.every_steps=0",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    speeds = [r["train/img_per_s"] for r in rows if "train/img_per_s" in r][1:]
    return {
        "precision": precision,
        "eval_accuracy": evals[-1]["eval/accuracy"],
        "final_train_loss": [r["train/loss"] for r in rows if "train/loss" in r][-1],
        "img_per_s_median": statistics.median(speeds),
        "img_per_s_windows": speeds,
        "command": " ".join(cmd[1:]),
    }


def main(argv: list[str] | None = None) -> int:
    """Run, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=220)
    parser.add_argument("--machine", default=None)
    parser.add_argument("--out", default=None)
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
    date = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else RESULTS_DIR / f"precision-{date}-{machine['name']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "date": date, "machine": machine, "argv": sys.argv, "runs": runs, "summary": summary,
        "accuracy_gap_points": gap_points, "bf16_speedup": speedup,
    }  # fmt: skip
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")
    return 0 if abs(gap_points) <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
