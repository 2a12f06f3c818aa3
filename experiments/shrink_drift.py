"""How far the losses of a run resumed on fewer devices drift from the uninterrupted run's.

    .venv/bin/python experiments/shrink_drift.py [--config configs/digits.yaml] [--from 2]
        [--to 1] [--at 110] [--machine NAME] [--out PATH]

The elastic restart of ``python -m jddp.ray --min-workers`` (or a resume on another topology)
continues a run on fewer devices: every step still sees the same examples, but the gradient
mean adds its terms in another order, and BatchNorm normalises either fixed groups of rows
(``model.bn_group_size``, the default) or the global batch (``model.sync_batchnorm=true``) over
another device count. Float reductions in another order differ by ~1e-7; training amplifies
that. This measures it on the default config: the uninterrupted run on ``--from`` fake CPU
devices (one process), then the same run resumed from its checkpoint at step ``--at`` on
``--to`` devices, both with per-device and with synchronised BatchNorm, through the trainer
(:func:`benchlib.run_trainer`). Prints the relative loss difference after the restart (the
first step, after 10, 50 and all steps) and the final eval accuracy of both; writes
``results/shrink-drift-<date>-<machine>.json``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib

VARIANTS = {"groups (default)": [], "sync_batchnorm": ["model.sync_batchnorm=true"]}


def losses(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read(workdir) if "train/loss" in r}


def read(workdir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def final_accuracy(workdir: Path) -> float:
    return [r["eval/accuracy"] for r in read(workdir) if "eval/accuracy" in r][-1]


def train(config: str, workdir: Path, devices: int, overrides: list[str]) -> None:
    cmd = [sys.executable, "-m", "jddp.train", "--config", config, f"workdir={workdir}",
           "log.every_steps=1", "log.progress=off", *overrides]  # fmt: skip
    env = benchlib.trainer_env("cpu", f"--xla_force_host_platform_device_count={devices}")
    done = subprocess.run(cmd, env=env, cwd=benchlib.REPO, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/digits.yaml")
    ap.add_argument("--from", dest="devices_from", type=int, default=2)
    ap.add_argument("--to", dest="devices_to", type=int, default=1)
    ap.add_argument("--at", type=int, default=110, help="the step the run resumes from")
    benchlib.output_args(ap)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in VARIANTS.items():
            straight = Path(tmp) / f"{len(rows)}-straight"
            saves = [*overrides, f"checkpoint.every_steps={args.at}"]
            train(args.config, straight, args.devices_from, saves)
            shrunk = Path(tmp) / f"{len(rows)}-shrunk"
            shutil.copytree(straight, shrunk)
            for step in (p for p in (shrunk / "checkpoints").iterdir() if p.name.isdigit()):
                if int(step.name) > args.at:
                    shutil.rmtree(step)
            train(args.config, shrunk, args.devices_to, saves)
            want, got = losses(straight), losses(shrunk)
            after = [s for s in sorted(want) if s > args.at]
            drift = [abs(got[s] - want[s]) / abs(want[s]) for s in after]
            rows.append({
                "batchnorm": name, "steps_after": len(after),
                "drift_first": drift[0], "drift_max_10": max(drift[:10]),
                "drift_max_50": max(drift[:50]), "drift_max_all": max(drift),
                "drift_by_step": dict(zip(after, drift, strict=True)),
                "eval_accuracy": {"straight": final_accuracy(straight),
                                  "shrunk": final_accuracy(shrunk)},
            })  # fmt: skip
    benchlib.md_table(
        "BatchNorm | first step after | max of 10 | max of 50 | max of all | eval accuracy "
        "(straight, resumed)",
        "lr",
    )
    for r in rows:
        acc = r["eval_accuracy"]
        print(f"| {r['batchnorm']} | {r['drift_first']:.1e} | {r['drift_max_10']:.1e} | "
              f"{r['drift_max_50']:.1e} | {r['drift_max_all']:.1e} | {acc['straight']:.4f}, "
              f"{acc['shrunk']:.4f} |")  # fmt: skip
    result = {
        "machine": benchlib.machine_info(args.machine),
        "command": benchlib.command_line(),
        "config": args.config,
        "devices": {"from": args.devices_from, "to": args.devices_to, "at_step": args.at},
        "rows": rows,
    }
    print("wrote", benchlib.save_result("shrink-drift", args.machine, result, args.out))


if __name__ == "__main__":
    main()
