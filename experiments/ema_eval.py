"""What an EMA of the weights gives: the default run (ResNet-18 on digits) with
``train.ema_decay`` at a few decays, its raw eval against its EMA eval at every eval.

    .venv/bin/python experiments/ema_eval.py [--decays 0.9,0.99,0.999] [--machine NAME] [--out PATH]

Each decay is one ``python -m jddp.train --config configs/digits.yaml train.ema_decay=D``
(warm-up on, the default: decay min(D, (1+n)/(10+n)) at update n); the parameters' trajectory
is the same in every run (the EMA changes none of it), so the raw columns agree across rows and
the EMA columns show what averaging adds. Accuracy, not speed: deterministic on one machine.
Writes ``results/ema-<date>-<machine>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import benchlib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decays", default="0.9,0.99,0.999", help="comma-separated EMA decays")
    ap.add_argument("--config", default=str(benchlib.REPO / "configs" / "digits.yaml"))
    benchlib.output_args(ap)
    args = ap.parse_args()
    info = benchlib.machine_info(args.machine)
    rows = []
    benchlib.md_table(
        "decay | step | eval/loss | eval/accuracy | eval_ema/loss | eval_ema/accuracy"
    )
    for decay in [float(d) for d in args.decays.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp) / "run"
            benchlib.run_trainer(
                workdir, [f"--config={args.config}", f"train.ema_decay={decay}", "log.progress=off"]
            )
            from jddp.metrics import read_metrics

            evals = [r for r in read_metrics(workdir) if "eval_ema/loss" in r]
        for r in evals:
            row = {
                "decay": decay,
                "step": r["step"],
                **{k: r[k] for k in ("eval/loss", "eval/accuracy")},
                **{k: r[k] for k in ("eval_ema/loss", "eval_ema/accuracy")},
            }
            rows.append(row)
            print(
                f"| {decay:g} | {r['step']} | {r['eval/loss']:.4f} | {r['eval/accuracy']:.4f} "
                f"| {r['eval_ema/loss']:.4f} | {r['eval_ema/accuracy']:.4f} |"
            )
    result = info | {
        "command": benchlib.command_line(),
        "config": args.config,
        "rows": rows,
    }
    benchlib.save_result("ema", info["name"], result, args.out)


if __name__ == "__main__":
    main()
