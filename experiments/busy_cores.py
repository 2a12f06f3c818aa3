"""How many cores the whole machine kept busy while a command ran, every few seconds.

    .venv/bin/python experiments/busy_cores.py [--every 5] [--out results/NAME.json] -- CMD ...

Reads ``/proc/stat`` (every process counted: Ray's and SLURM's daemons and tasks, which the
test suite's ``JDDP_TEST_USAGE`` leaves out) and ``/proc/meminfo``; prints the mean busy cores
and the lowest available memory, and writes the samples with the command, machine and commit
(RESULTS.md §12: the test suite's time).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

import benchlib


def _cpu_ticks() -> tuple[int, int]:
    """(all ticks, idle + iowait ticks) since boot, summed over the cores."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return sum(ticks), ticks[3] + ticks[4]


def _available_mib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return -1


def sample(every_s: float, stop: threading.Event, samples: list[dict]) -> None:
    """Append ``{"t_s", "busy_cores", "available_mib"}`` every ``every_s`` until ``stop``."""
    cores = os.cpu_count() or 1
    start, (total, idle) = time.monotonic(), _cpu_ticks()
    while not stop.wait(every_s):
        now_total, now_idle = _cpu_ticks()
        spent = max(now_total - total, 1)
        busy = cores * (1 - (now_idle - idle) / spent)
        t_s, available_mib = round(time.monotonic() - start, 1), _available_mib()
        samples.append({"t_s": t_s, "busy_cores": round(busy, 2), "available_mib": available_mib})
        total, idle = now_total, now_idle


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: busy_cores.py [--every S] [--out FILE] -- CMD ...", file=sys.stderr)
        return 2
    at = argv.index("--")
    ap = argparse.ArgumentParser()
    ap.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    benchlib.output_args(ap)
    args, command = ap.parse_args(argv[:at]), argv[at + 1 :]
    samples: list[dict] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(args.every, stop, samples), daemon=True)
    started = time.monotonic()
    sampler.start()
    returncode = subprocess.call(command)
    stop.set()
    sampler.join()
    wall_s = time.monotonic() - started
    mean = sum(s["busy_cores"] for s in samples) / max(len(samples), 1)
    low = min((s["available_mib"] for s in samples), default=-1)
    print(
        f"busy_cores: {mean:.2f} of {os.cpu_count()} on average over {wall_s:.0f} s "
        f"(~{mean * wall_s:.0f} CPU-s); lowest available memory {low} MiB; exit {returncode}"
    )
    result = {
        "benchmark": "busy-cores",
        "command": " ".join(command),
        "machine": benchlib.machine_info(args.machine),
        "wall_s": round(wall_s, 1),
        "returncode": returncode,
        "mean_busy_cores": round(mean, 3),
        "samples": samples,
    }
    benchlib.save_result("busy-cores", result["machine"]["name"], result, args.out)
    return returncode


if __name__ == "__main__":
    sys.exit(main())
