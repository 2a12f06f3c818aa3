"""Soak of the whole fault story: random ``kill -9`` during a 2-process run, then the same command.

An uninterrupted run of ``python -m jddp.launch --nproc 2`` gives the reference per-step losses.
The same command is then started again and again in a fresh workdir; each time, after a random
delay, one ``kill -9`` hits a random rank or the launcher itself (alternately). After every kill the
script checks that no process of the job is left within 15 s (ranks die with their launcher),
then reruns the same command, which resumes from the newest checkpoint. After ``--kills`` kills
the last rerun goes to the end. Pass: every step's loss is bitwise the reference's, every step
logged once, no leftover process.

Usage (repo root): ``.venv/bin/python experiments/soak_faults.py [--kills 10] [--steps 40]``.
Prints each kill and a verdict; writes ``experiments/results/soak-<date>-<machine>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib
from cases import case


def command(workdir: Path, steps: int) -> list[str]:
    """``python -m jddp.launch --nproc 2 --devices-per-proc 1 -- python -m jddp.train ...``."""
    return benchlib.trainer_command(workdir, case("tiny", f"train.steps={steps}"), 2, 1)


def losses(workdir: Path) -> dict[int, float]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def job_pids(workdir: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"workdir={workdir}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def wait_gone(workdir: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not job_pids(workdir):
            return True
        time.sleep(0.2)
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--machine", default="vm")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    events = []
    with tempfile.TemporaryDirectory() as tmp:
        ref, wd = Path(tmp) / "reference", Path(tmp) / "soak"
        out = subprocess.run(command(ref, args.steps), capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise SystemExit(f"soak: the reference run failed:\n{out.stderr[-2000:]}")
        want = losses(ref)
        for k in range(args.kills):
            job = subprocess.Popen(command(wd, args.steps), env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
            before = max(losses(wd), default=0)
            deadline = time.monotonic() + 120
            # Kill somewhere between "still compiling" and a few steps past the last line.
            target_step = before + rng.randint(0, 6)
            while time.monotonic() < deadline and job.poll() is None:
                if max(losses(wd), default=0) >= target_step:
                    break
                time.sleep(0.05)
            time.sleep(rng.uniform(0, 1.5))
            ranks = [p for p in job_pids(wd) if p != job.pid]
            if job.poll() is not None:
                victim, who = None, "none (the run had finished)"
            elif ranks and k % 2 == 0:  # alternate: a rank, then the launcher
                victim = rng.choice(ranks)
                who = f"rank pid {victim}"
            else:
                victim, who = job.pid, "the launcher"
            if victim is not None:
                os.kill(victim, signal.SIGKILL)
            job.wait()
            gone = wait_gone(wd, 15)
            leftovers = job_pids(wd)
            for pid in leftovers:
                os.kill(pid, signal.SIGKILL)
            event = {"kill": k + 1, "victim": who, "logged_steps": max(losses(wd), default=0),
                     "no_leftover_within_15s": gone, "leftover_pids": leftovers}  # fmt: skip
            events.append(event)
            print(json.dumps(event), flush=True)
        final = subprocess.run(command(wd, args.steps), capture_output=True, text=True, env=env)
        got = losses(wd)
    bitwise = sorted(got) == list(range(1, args.steps + 1)) and all(got[s] == want[s] for s in want)
    clean = all(e["no_leftover_within_15s"] for e in events)
    verdict = "PASS" if final.returncode == 0 and bitwise and clean else "FAIL"
    print(f"soak: {args.kills} kills, final run exit {final.returncode}, losses bitwise equal: "
          f"{bitwise}, no leftover process: {clean} -> {verdict}")  # fmt: skip
    result = {
        "benchmark": "soak_faults",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": benchlib.machine_info(args.machine),
        "steps": args.steps,
        "events": events,
        "final_returncode": final.returncode,
        "bitwise_equal": bitwise,
        "no_leftover_process": clean,
        "verdict": verdict,
    }
    benchlib.save_result("soak", args.machine, result)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
