"""What forking the ranks from the launcher's imports saves (``python -m jddp.launch``, its
default) against a new interpreter per rank (``--spawn``, as before and as torchrun does).

    .venv/bin/python experiments/bench_launch_start.py [--nproc 2] [--pairs 5] [--steps 4]

Each pair runs the same short training twice under ``jddp.launch --nproc N
--devices-per-proc 1``, forked and spawned in alternating order (the compilation cache warm
from a first unmeasured run, so compiles do not count), each in a fresh workdir: the CPU
seconds of the launcher and everything it started (``RUSAGE_CHILDREN``), the wall seconds, and
the seconds until the first train line reached ``metrics.jsonl``. The losses of every run must
be equal (the same program, the same data). Prints a table, writes
``results/launch-start-<date>-<machine>.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib
from cases import case

MODES = ("forked", "spawned")


def losses(workdir: Path) -> list[float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [row["train/loss"] for row in rows if "train/loss" in row]


def first_line_s(workdir: Path, started: float, job: subprocess.Popen) -> float | None:
    """Seconds from ``started`` until ``metrics.jsonl`` holds a train line (polled)."""
    metrics = workdir / "metrics.jsonl"
    while job.poll() is None:
        if metrics.exists() and '"train/loss"' in metrics.read_text():
            return time.monotonic() - started
        time.sleep(0.01)
    return None


def run_once(mode: str, nproc: int, steps: int, folder: Path, env: dict) -> dict:
    """One launch; its CPU seconds, wall seconds, first line's seconds and losses."""
    workdir = Path(tempfile.mkdtemp(dir=folder))
    overrides = [*case("tiny", "model.name=resnet10"), f"train.steps={steps}"]
    command = benchlib.trainer_command(workdir, overrides, nproc=nproc, devices=1)
    if mode == "spawned":
        command.insert(command.index("--"), "--spawn")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    job = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = first_line_s(workdir, started, job)
    _, err = job.communicate()
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if job.returncode != 0:
        raise SystemExit(f"{mode} run failed ({job.returncode}): {err.decode()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu_s": cpu, "wall_s": wall, "first_line_s": first, "losses": losses(workdir)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    benchlib.output_args(ap)
    args = ap.parse_args()
    env = benchlib.trainer_env("cpu")
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        run_once("forked", args.nproc, args.steps, folder, env)  # fills the compilation cache
        for pair in range(args.pairs):
            order = MODES if pair % 2 == 0 else MODES[::-1]
            for mode in order:
                runs[mode].append(run_once(mode, args.nproc, args.steps, folder, env))
    reference = runs["forked"][0]["losses"]
    same = all(r["losses"] == reference for mode in MODES for r in runs[mode])
    print(f"\njddp.launch --nproc {args.nproc} --devices-per-proc 1, the tests' tiny ResNet-10, "
          f"{args.steps} steps, {args.pairs} alternating pairs; losses equal: {same}")  # fmt: skip
    benchlib.md_table("ranks | CPU-s (median, p10-p90) | wall s | first train line s", "lr")
    summary = {}
    for mode in MODES:
        figures = {
            key: benchlib.median_p10_p90([r[key] for r in runs[mode]])
            for key in ("cpu_s", "wall_s", "first_line_s")
        }
        summary[mode] = figures
        cpu, wall, first = (figures[k] for k in ("cpu_s", "wall_s", "first_line_s"))
        print(f"| {mode} | {cpu['median']:.2f} ({cpu['p10']:.2f}-{cpu['p90']:.2f}) | "
              f"{wall['median']:.2f} | {first['median']:.2f} |")  # fmt: skip
    saved = summary["spawned"]["cpu_s"]["median"] - summary["forked"]["cpu_s"]["median"]
    print(f"forking saves {saved:.2f} CPU-s a launch ({saved / args.nproc:.2f} a rank)")
    if not same:
        raise SystemExit("the forked and spawned runs' losses differ")
    result = {
        "machine": benchlib.machine_info(args.machine),
        "command": benchlib.command_line(),
        "nproc": args.nproc,
        "steps": args.steps,
        "pairs": args.pairs,
        "losses_equal": same,
        "summary": summary,
        "runs": {
            mode: [{k: v for k, v in r.items() if k != "losses"} for r in runs[mode]]
            for mode in MODES
        },
    }
    machine = args.machine or benchlib.machine_info()["name"]
    benchlib.save_result("launch-start", machine, result, args.out)


if __name__ == "__main__":
    sys.exit(main())
