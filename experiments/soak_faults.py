"""Soak of the whole fault story: faults during a 2-process run, then the same command again.

    .venv/bin/python experiments/soak_faults.py [--kills 12] [--steps 200]

In turn: ``kill -9`` of a rank, ``kill -9`` of the launcher, ``SIGUSR1`` to the launcher (exit
75), ``SIGSTOP`` of a rank (exit 124 after ``dist.step_timeout_s``), then a full disk (exit 1);
after each, no process of the job may be left and the rerun resumes; every loss must be bitwise
the uninterrupted run's. The method and the pass rule: ``experiments/README.md``. Writes
``results/soak-<date>-<machine>.json``.
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
import uuid
from pathlib import Path

import benchlib
from cases import case

FAULTS = (
    "kill -9 of a rank",
    "kill -9 of the launcher",
    "SIGUSR1 to the launcher",
    "SIGSTOP of a rank",
)
STALL_TIMEOUT_S = 20  # dist.step_timeout_s of the soak's runs
TAG = "JDDP_SOAK_TAG"  # inherited by everything the job starts, workers included


def command(workdir: Path, steps: int, worker_kind: str) -> list[str]:
    """``python -m jddp.launch --nproc 2 --devices-per-proc 1 -- python -m jddp.train ...``."""
    workers = ["data.worker_kind=process", "data.workers=2"] if worker_kind == "process" else []
    overrides = case("tiny", f"train.steps={steps}", f"dist.step_timeout_s={STALL_TIMEOUT_S}")
    return benchlib.trainer_command(workdir, [*overrides, *workers], 2, 1)


def losses(workdir: Path) -> dict[int, float]:
    """Every logged step's ``train/loss`` (none yet: empty)."""
    from jddp.plot import MetricsError, load_metrics

    try:
        return {r["step"]: r["train/loss"] for r in load_metrics(workdir) if "train/loss" in r}
    except MetricsError:
        return {}


def job_pids(tag: str) -> list[int]:
    """Live processes whose environment holds ``TAG=tag``."""
    found, marker = [], f"{TAG}={tag}".encode()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes():
                if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX":
                    found.append(int(proc.name))
        except OSError:
            continue
    return found


def job_and_ranks(tag: str, launcher: int) -> tuple[list[int], list[int]]:
    """The job's live processes and, among them, its ranks (``jddp.train``, not the launcher)."""
    pids, ranks = job_pids(tag), []
    for pid in pids:
        try:
            if pid != launcher and b"jddp.train" in Path(f"/proc/{pid}/cmdline").read_bytes():
                ranks.append(pid)
        except OSError:
            pass
    return pids, ranks


def wait_gone(tag: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not job_pids(tag):
            return True
        time.sleep(0.2)
    return False


def disk_full_round(tmp: Path, args: argparse.Namespace, env: dict, want: dict) -> dict:
    """The run with its checkpoints on a 1.5 MB tmpfs: exit 1 and one line when it fills, no
    half-written save, then (the tmpfs grown to 50 MB) the same command to the end."""
    disk, wd = tmp / "small-disk", tmp / "full-disk"
    disk.mkdir()
    wd.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(disk)]
    mounted = subprocess.run(mount, capture_output=True, text=True)
    if mounted.returncode != 0:
        return {"skipped": f"cannot mount a tmpfs: {mounted.stderr.strip()}"}
    try:
        (wd / "checkpoints").symlink_to(disk)
        cmd = command(wd, args.steps, args.worker_kind)
        full = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [x for x in full.stderr.splitlines() if "jddp: error:" in x]
        # (the launcher prefixes each rank's line: the full disk stops the rank that writes)
        half = [p.name for p in disk.iterdir() if not p.name.isdigit()]
        subprocess.run(["mount", "-o", "remount,size=50m", str(disk)], check=True)
        again = subprocess.run(cmd, capture_output=True, text=True, env=env)
        got = losses(wd)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    bitwise = sorted(got) == list(range(1, args.steps + 1)) and all(got[s] == want[s] for s in want)
    result = {
        "exit": full.returncode,
        "error_lines": lines,
        "half_written_saves": half,
        "rerun_exit": again.returncode,
        "bitwise_equal": bitwise,
    }
    result["pass"] = (
        full.returncode == 1
        and any(why in x for x in lines for why in ("No space left on device", "not enough space"))
        and not half
        and again.returncode == 0
        and bitwise
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=12, help="faults, taken in turn")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker-kind", choices=("process", "thread"), default="process")
    benchlib.output_args(parser, machine="vm")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    tag = uuid.uuid4().hex
    env = {**os.environ, "JAX_PLATFORMS": "cpu", TAG: tag}
    events = []
    with tempfile.TemporaryDirectory() as tmp:
        ref, wd = Path(tmp) / "reference", Path(tmp) / "soak"
        cmd = command(ref, args.steps, args.worker_kind)
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise SystemExit(f"soak: the reference run failed:\n{out.stderr[-2000:]}")
        want = losses(ref)
        cmd = command(wd, args.steps, args.worker_kind)
        for k in range(args.kills):
            job = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
            before = max(losses(wd), default=0)
            deadline = time.monotonic() + 180
            # Strike somewhere between "still compiling" and a few steps past the last line.
            target_step = before + rng.randint(0, 6)
            while time.monotonic() < deadline and job.poll() is None:
                if max(losses(wd), default=0) >= target_step:
                    break
                time.sleep(0.05)
            time.sleep(rng.uniform(0, 1.5))
            fault = FAULTS[k % len(FAULTS)]
            pids, ranks = job_and_ranks(tag, job.pid)
            while fault == FAULTS[2] and not ranks and job.poll() is None:
                # SLURM's USR1 comes minutes into a job; one in the launcher's first 0.1 s,
                # before Python runs its handler, ends it as any process (138, nothing to save)
                time.sleep(0.2)
                pids, ranks = job_and_ranks(tag, job.pid)
            workers = len(pids) - len(ranks) - 1
            if job.poll() is not None:
                fault, victim = "none (the run had finished)", None
            elif fault in (FAULTS[0], FAULTS[3]) and ranks:
                victim = rng.choice(ranks)
            else:
                fault = FAULTS[1] if fault == FAULTS[0] else fault
                victim = job.pid
            if victim is not None:
                sig = {FAULTS[2]: signal.SIGUSR1, FAULTS[3]: signal.SIGSTOP}.get(fault)
                os.kill(victim, sig or signal.SIGKILL)
            code = job.wait()
            gone = wait_gone(tag, 15)
            leftovers = job_pids(tag)
            for pid in leftovers:
                os.kill(pid, signal.SIGKILL)
            event = {"fault": k + 1, "what": fault, "exit": code, "logged_steps": max(losses(wd),
                     default=0), "other_processes_at_the_fault": workers,
                     "no_leftover_within_15s": gone, "leftover_pids": leftovers}  # fmt: skip
            events.append(event)
            print(json.dumps(event), flush=True)
        final = subprocess.run(cmd, capture_output=True, text=True, env=env)
        got = losses(wd)
        final_leftovers = job_pids(tag)
        disk = disk_full_round(Path(tmp), args, env, want)
        print(json.dumps(disk), flush=True)
    bitwise = sorted(got) == list(range(1, args.steps + 1)) and all(got[s] == want[s] for s in want)
    clean = all(e["no_leftover_within_15s"] for e in events) and not final_leftovers
    saved = all(e["exit"] == 75 for e in events if e["what"] == FAULTS[2])
    stalled = all(e["exit"] == 124 for e in events if e["what"] == FAULTS[3])
    disk_ok = disk.get("skipped") is not None or disk["pass"]
    verdict = (
        "PASS"
        if final.returncode == 0 and bitwise and clean and saved and stalled and disk_ok
        else "FAIL"
    )
    print(
        f"soak: {args.kills} faults, final run exit {final.returncode}, losses bitwise equal: "
        f"{bitwise}, every SIGUSR1 exit 75: {saved}, every SIGSTOP exit 124: {stalled}, full "
        f"disk: {disk.get('skipped') or disk['pass']}, no leftover process: {clean} -> {verdict}"
    )
    result = {
        "benchmark": "soak_faults",
        "command": benchlib.command_line(),
        "machine": benchlib.machine_info(args.machine),
        "steps": args.steps,
        "worker_kind": args.worker_kind,
        "events": events,
        "final_returncode": final.returncode,
        "bitwise_equal": bitwise,
        "no_leftover_process": clean,
        "every_sigusr1_exit_75": saved,
        "full_disk": disk,
        "every_sigstop_exit_124": stalled,
        "verdict": verdict,
    }
    benchlib.save_result("soak", args.machine, result, args.out)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
