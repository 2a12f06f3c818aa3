"""Whether a rank's last line reaches the user when it aborts an MPI job and ``mpiexec``'s
proxy runs late (a busy machine; CI once lost every line of ``test_mpi``'s refused launch).

    .venv/bin/python experiments/abort_lines.py [--trials 30] [--pause-s 1.0]

Each trial runs ``mpirun -np 2`` (MPICH's hydra, the virtualenv's) of ranks that join MPI, wait
for a go, print one line on stderr and stop the job the way jddp's commands do after an error
(``jddp.cli.stop_peers``: ``MPI_Abort`` under ``dist.backend=mpi``). The script pauses hydra's
proxy (SIGSTOP) before the go and resumes it ``--pause-s`` seconds after both ranks said they
printed, as a scheduler starving it would. ``drained``: jddp's path (the pipes read to the last
byte before the abort); ``undrained``: the same with that wait taken out, as before. Prints a
table; writes ``results/abort-lines-<date>-<machine>.json``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib

REPO = Path(__file__).resolve().parent.parent
MODES = ("undrained", "drained")

RANK = """
import os, sys, time
from mpi4py import MPI
from jddp import cli, distributed
from jddp.proc import outputs
folder, mode = sys.argv[1], sys.argv[2]
if mode == "undrained":
    outputs.wait_until_read = lambda *args, **kwargs: True
world = MPI.COMM_WORLD
rank = world.Get_rank()
job = distributed.Job(distributed.Launch("mpi"), rank, world.Get_size())
open(f"{folder}/ready{rank}", "w").close()
while not os.path.exists(f"{folder}/go"):
    time.sleep(0.01)
print(f"jddp: error: the last words of rank {rank}", file=sys.stderr)
open(f"{folder}/printed{rank}", "w").close()
cli.stop_peers(job, 2)
"""


def wait_for_files(folder: Path, stem: str, ranks: int, job: subprocess.Popen) -> None:
    while not all((folder / f"{stem}{r}").exists() for r in range(ranks)):
        if job.poll() is not None:
            raise SystemExit(f"mpirun ended ({job.returncode}) before every rank made {stem}")
        time.sleep(0.01)


def trial(mode: str, pause_s: float) -> int:
    """One job; how many of its 2 ranks' lines reached mpirun's stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        command = [benchlib.mpirun(), "-np", "2", sys.executable, "-c", RANK, tmp, mode]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for_files(folder, "ready", 2, job)
        proxies = [int(p) for p in benchlib.sh("pgrep", "-P", str(job.pid)).split()]
        for pid in proxies:
            os.kill(pid, signal.SIGSTOP)
        (folder / "go").touch()
        wait_for_files(folder, "printed", 2, job)
        time.sleep(pause_s)
        for pid in proxies:
            os.kill(pid, signal.SIGCONT)
        _, err = job.communicate()
        if job.returncode != 2:
            raise SystemExit(f"mpirun exited {job.returncode}, not the abort's 2: {err[-2000:]}")
        return sum(f"the last words of rank {r}".encode() in err for r in range(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--pause-s", type=float, default=1.0)
    benchlib.output_args(ap)
    args = ap.parse_args()
    lines: dict[str, list[int]] = {mode: [] for mode in MODES}
    for _ in range(args.trials):  # alternating, so a slow spell of the machine hits both
        for mode in MODES:
            lines[mode].append(trial(mode, args.pause_s))
    print(f"\nmpirun -np 2, hydra's proxy paused {args.pause_s} s while both ranks print and "
          f"abort; {args.trials} trials each")  # fmt: skip
    benchlib.md_table("before the abort | both lines | one line | no line", "lr")
    summary = {}
    for mode in MODES:
        counts = {n: lines[mode].count(n) for n in (2, 1, 0)}
        summary[mode] = {"both": counts[2], "one": counts[1], "none": counts[0]}
        print(f"| {mode} | {counts[2]} | {counts[1]} | {counts[0]} |")
    result = {
        "machine": benchlib.machine_info(args.machine),
        "command": benchlib.command_line(),
        "mpich": benchlib.version("mpich"),
        "trials": args.trials,
        "pause_s": args.pause_s,
        "summary": summary,
        "lines_per_trial": lines,
    }
    machine = args.machine or benchlib.machine_info()["name"]
    benchlib.save_result("abort-lines", machine, result, args.out)


if __name__ == "__main__":
    sys.exit(main())
