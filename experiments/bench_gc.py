"""What Python's garbage collector costs a jddp process, and what jddp's setting saves
(``jddp/compat/collector.py``): ``python3 experiments/bench_gc.py [--pairs 5]``.

Each pair runs the same command twice, once with Python's collector settings
(``JDDP_GC_DEFAULTS=0``) and once with jddp's, in alternating order; the CPU seconds are the
children's (``getrusage``), the compilation cache warm from a first, unmeasured run. Cases: the
tests' tiny ``python -m jddp.train`` run (ResNet-10 of width 4 on 8x8 synthetic images, 2 fake
CPU devices, 4 steps) and ``examples/custom_cnn_digits.py`` (``jddp.fit``; 1,000 steps in the
figures of 2026-11-28, 400 since the example's learning rate went up).
Writes ``results/gc-<date>-<machine>.json`` (or ``--out``)."""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib
from benchlib import trainer_env
from cases import case

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_cnn_digits.py"
# The test suite's tiny run (cases.py), one process, per-device BatchNorm, no periodic saves.
TINY = case("tiny", "model.name=resnet10", "model.sync_batchnorm=false", "train.steps=4",
            "checkpoint.every_steps=0", "checkpoint.resume=false")  # fmt: skip
CASES = {
    "tiny train CLI": lambda wd: [sys.executable, "-m", "jddp.train", f"workdir={wd}", *TINY],
    "custom_cnn_digits.py": lambda wd: [sys.executable, str(EXAMPLE)],
}


def cpu_s(cmd: list[str], env: dict[str, str], cwd: Path) -> float:
    """The CPU seconds (user + system) of ``cmd`` and its children, run to its end."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, env=env, cwd=cwd, check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: %(default)s")
    benchlib.output_args(ap)
    args = ap.parse_args()
    base = trainer_env("cpu", "--xla_force_host_platform_device_count=2")
    settings = {
        name: {**base, "JDDP_GC_DEFAULTS": flag} for name, flag in (("python", "0"), ("jddp", "1"))
    }
    rows = []
    benchlib.md_table("case | Python's settings, CPU-s | jddp's, CPU-s | ratio", "lr")
    for name in args.cases.split(","):
        command = CASES[name]
        with tempfile.TemporaryDirectory() as tmp:
            cmd = command(Path(tmp) / "run")
            cpu_s(cmd, settings["jddp"], Path(tmp))  # warms the compilation cache
            runs: dict[str, list[float]] = {"python": [], "jddp": []}
            for pair in range(args.pairs):
                order = ("python", "jddp") if pair % 2 == 0 else ("jddp", "python")
                for setting in order:
                    runs[setting].append(round(cpu_s(cmd, settings[setting], Path(tmp)), 3))
        python, jddp = statistics.mean(runs["python"]), statistics.mean(runs["jddp"])
        rows.append({"case": name, "command": cmd, "cpu_s": runs, "ratio": round(jddp / python, 3)})
        print(f"| {name} | {python:.2f} | {jddp:.2f} | {jddp / python:.3f} |")
    machine = benchlib.machine_info(args.machine)
    result = {"command": benchlib.command_line(), "machine": machine, "pairs": args.pairs,
              "rows": rows}  # fmt: skip
    benchlib.save_result("gc", machine["name"], result, args.out)


if __name__ == "__main__":
    main()
