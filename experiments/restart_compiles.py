"""Whether a job started again loads its train step from the persistent compilation cache on
every process, or compiles it again.

    .venv/bin/python experiments/restart_compiles.py [--before PATH] [--starts 4] [--machine NAME]

Each checkout (this one, and ``PATH``: another, ``git worktree add /tmp/before COMMIT``) gets
an empty compilation cache, then ``--starts`` runs of the same 2-process job (``jddp.launch
--nproc 2``, the tiny ResNet, 2 steps, a new workdir each: what a restart or a resume compiles),
each rank a new interpreter. Per start: the ranks whose JAX log says it compiled ``jit_step``
(a cache miss), the job's wall time and rank 0's ``train/compile_s``. The first start compiles
by design; every later one should compile nothing.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

import benchlib
from cases import case

# The test suite's tiny run (cases.py), per-device BatchNorm, no periodic saves, 2 steps.
TINY = case("tiny", "model.name=resnet10", "model.sync_batchnorm=false", "train.steps=2",
            "checkpoint.every_steps=0", "data.workers=0")  # fmt: skip
MISS = re.compile(r"^\[rank (\d+)\].*CACHE MISS for 'jit_step'", re.M)


def starts(tree: Path, count: int, scratch: Path) -> list[dict]:
    """``count`` runs of the job from ``tree`` on one empty cache under ``scratch``."""
    env = benchlib.trainer_env("cpu", extra={
        "JAX_COMPILATION_CACHE_DIR": str(scratch / "cache"),
        "JAX_DEBUG_LOG_MODULES": "jax._src.compiler",
    })  # fmt: skip
    rows = []
    for i in range(count):
        workdir = scratch / f"run{i}"
        out = benchlib.run_trainer(workdir, TINY, nproc=2, env=env, tree=tree)
        log = (workdir / "train.log").read_text()
        rows.append({
            "start": i + 1,
            "ranks_compiling_the_step": sorted({int(r) for r in MISS.findall(log)}),
            "wall_s": round(out["wall_s"], 2),
            "compile_s": out["compile_s"],
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="another checkout, measured first")
    ap.add_argument("--starts", type=int, default=4)
    benchlib.output_args(ap)
    args = ap.parse_args(argv)
    trees = {"before": Path(args.before)} if args.before else {}
    trees["this checkout"] = benchlib.REPO
    results = {}
    for name, tree in trees.items():
        with tempfile.TemporaryDirectory(prefix="restart-compiles-") as scratch:
            results[name] = {"tree": str(tree), "starts": starts(tree, args.starts, Path(scratch))}
    benchlib.md_table("checkout | start | ranks compiling the step | wall s | compile_s (rank 0)",
                      "llllr")  # fmt: skip
    for name, result in results.items():
        for row in result["starts"]:
            ranks = ", ".join(map(str, row["ranks_compiling_the_step"])) or "none"
            print(f"| {name} | {row['start']} | {ranks} | {row['wall_s']:.1f} | "
                  f"{row['compile_s']:.2f} |")  # fmt: skip
    info = benchlib.machine_info(args.machine)
    info.update(command=benchlib.command_line(), results=results)
    benchlib.save_result("restart-compiles", info["name"], info, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
