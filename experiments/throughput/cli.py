"""The command line: parse, run the configurations block by block (one block per dtype), write
the JSON, print the table, plot, regenerate RESULTS.md. Also the workers' entry (``--_worker``).

Only the standard library is imported here; jax/torch load in the workers, matplotlib for the
plot. The method and every option are described in ``experiments/README.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from . import common
from .results import (
    default_peak_flops,
    derive,
    output_path,
    peak_by_dtype,
    print_ratios,
    recompute,
    summarise,
)
from .results_md import update_results_md
from .runner import Group, mpirun_path, run_block
from .specs import DEFAULT_CONFIGS, PRESETS, QUICK_DEFAULTS, Workload, parse_config
from .tables import plot, print_table

DESCRIPTION = "Training throughput benchmark: jddp vs PyTorch DistributedDataParallel, interleaved."


def _workload_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help="comma-separated jddp-PxD / jddp-mpi-PxD / torch-ddp-PxT, suffixes -pin -1t "
        "-noynnconv",
    )
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument(
        "--steps-per-round",
        type=int,
        default=2,
        help="timed steps of a group per round (default 2)",
    )
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after start (default 2)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="resnet18-cifar")
    ap.add_argument("--model", choices=["resnet18", "resnet50"])
    ap.add_argument("--stem", choices=["cifar", "imagenet"])
    ap.add_argument("--image-size", type=int)
    ap.add_argument("--num-classes", type=int)
    ap.add_argument("--global-batch", type=int)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--platform", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak for MFU (default on CPU: an assumed AVX-512 FP32 peak)",
    )
    ap.add_argument(
        "--profile", action="store_true", help="trace one step per group instead of timing rounds"
    )


def _output_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--machine", default=None, help="name in the output file (default: host)")
    ap.add_argument("--out", default=None, help="JSON path (default experiments/results/...)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (not a measurement): jddp-1x1 (+ torch-ddp-1x1 if torch is installed), "
        "width 8, 8x8 images, batch 8, float32, 1 warm-up, 1 timed step; writes "
        "results/<date>-<machine>-quick.json unless --out is given",
    )
    ap.add_argument(
        "--recompute",
        metavar="JSON",
        help="recompute derived fields (MFU, ratios) of a results file, reprint, replot",
    )
    ap.add_argument(
        "--no-results-md",
        action="store_true",
        help="do not regenerate the tables of experiments/RESULTS.md at the end "
        "(--quick never touches it)",
    )
    ap.add_argument(
        "--regenerate-results-md",
        action="store_true",
        help="only rebuild the generated tables of experiments/RESULTS.md from the JSON files in "
        "experiments/results/ (no benchmark run)",
    )
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    ap.add_argument("--_pin", type=int, help=argparse.SUPPRESS)


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="experiments/bench.py", description=DESCRIPTION)
    _workload_options(ap)
    _output_options(ap)
    if ap.parse_known_args(argv)[0].quick:
        ap.set_defaults(**QUICK_DEFAULTS)  # options given on the command line still win
    return ap, ap.parse_args(argv)


def run_worker(args: argparse.Namespace) -> int:
    """A worker process (started by :class:`.runner.Group`): jax or torch load only here."""
    spec = json.loads(args._worker)
    if spec.get("backend") == "mpi":
        from .mpi_worker import mpi_worker_main

        return mpi_worker_main(spec)
    if args._pin is not None:
        os.sched_setaffinity(0, {args._pin})
    if spec["framework"] == "jddp":
        from .jddp_worker import worker_jddp as worker
    else:
        from .torch_worker import worker_torch as worker
    worker(spec)
    return 0


def _config_names(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """``--configs``, without the PyTorch ones under ``--quick`` when torch is missing."""
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    torch_names = [n for n in names if n.startswith("torch-ddp")]
    if torch_names and not common.importable("torch"):
        if not args.quick:
            ap.error(
                f"{', '.join(torch_names)} need torch: "
                ".venv/bin/pip install -r experiments/requirements-bench.txt"
            )
        print(f"note: torch is not installed: skipping {', '.join(torch_names)}", file=sys.stderr)
        names = [n for n in names if n not in torch_names]
        if not names:
            ap.error("--quick: no configuration left to run without torch")
    return names


def _check_mpi(ap: argparse.ArgumentParser, args: argparse.Namespace, blocks: list) -> None:
    mpi_names = list(dict.fromkeys(s.name for block in blocks for s in block if s.mpi))
    if mpi_names and args.profile:
        ap.error(f"--profile does not support {', '.join(mpi_names)} (two jitted programs)")
    if mpi_names:
        missing = [m for m in ("mpi4py", "mpi4jax") if not common.importable(m)]
        missing += [] if mpirun_path().exists() else [str(mpirun_path())]
        if missing:
            ap.error(
                f"{', '.join(mpi_names)} need {', '.join(missing)}: bash scripts/setup.sh "
                "installs MPICH, mpi4py and mpi4jax into the virtualenv"
            )


def plan(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[dict, list[list]]:
    """The workload (preset plus overrides) and the groups to run, one block per dtype."""
    preset = dict(PRESETS[args.preset])
    for key in ("model", "stem", "image_size", "num_classes", "global_batch"):
        if getattr(args, key) is not None:
            preset[key] = getattr(args, key)
    if args.platform == "cpu" and preset["model"] == "resnet50" and preset["image_size"] >= 160:
        print(
            "warning: ResNet-50 at this size takes minutes per step on a small CPU", file=sys.stderr
        )
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or set(dtypes) - {"float32", "bfloat16"}:
        ap.error("--dtypes: float32 and/or bfloat16")
    if args.rounds < 1 or args.steps_per_round < 1 or args.warmup < 1:
        ap.error("--rounds, --steps-per-round and --warmup must be >= 1")
    names = _config_names(ap, args)
    try:
        blocks = [
            [
                parse_config(
                    n, Workload(**preset, width=args.width, dtype=d, platform=args.platform)
                )
                for n in names
            ]
            for d in dtypes
        ]
    except ValueError as e:
        ap.error(str(e))
    _check_mpi(ap, args, blocks)
    return preset, blocks


def measure(blocks: list[list], args: argparse.Namespace, log) -> tuple[list, list, list]:
    """Run every block; a failed block is recorded and the others still run."""
    load = [os.getloadavg()]
    groups: list[Group] = []
    failures: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="jddp-bench-") as tmp:
        for block in blocks:
            try:
                groups += run_block(block, args, Path(tmp), log)
            except (RuntimeError, OSError) as e:  # keep the blocks that finished
                log(f"block {[s.key for s in block]} failed: {e}")
                failures.append({"block": [s.key for s in block], "error": str(e)[-4000:]})
            load.append(os.getloadavg())
    return groups, failures, load


def records_of(groups: list[Group], peaks: dict, workload: dict) -> list[dict]:
    """One record per group, FLOPs, MFU and ratios derived."""
    flops_by_dtype = {}
    for g in groups:
        if g.spec.framework == "jddp" and g.ready and g.ready[0].get("flops_per_device"):
            flops_by_dtype.setdefault(
                g.spec.work.dtype, g.ready[0]["flops_per_device"] * g.ready[0]["devices"]
            )
    records = [summarise(g, flops_by_dtype) for g in groups]
    derive(records, peaks, workload)
    return records


def method_of(args: argparse.Namespace, peak: float | None, peak_note: str) -> dict:
    return {
        "rounds": args.rounds,
        "steps_per_round": args.steps_per_round,
        "warmup": args.warmup,
        "profile": args.profile,
        "quick": args.quick,
        "interleaving": "groups of one dtype alive together, A B C A B C ...; dtypes in turn",
        "step_time": "slowest rank's wall time of step(state, batch) until outputs ready",
        "data": "one fixed random batch per rank, reused; loading not timed",
        "allocator": "same environment for every worker; no MALLOC_*/LD_PRELOAD set by the "
        "benchmark (see machine.allocator_env): glibc malloc defaults",
        "peak_flops": peak,
        "peak_note": peak_note,
    }


def report(result: dict, out: Path, args: argparse.Namespace) -> None:
    """The printed summary, the profile breakdowns and the plot."""
    machine, preset, records = result["machine"], result["workload"], result["records"]
    print()
    print(
        f"{machine['name']}: {machine['cpu_model']} x{machine['cpu_count']}, "
        f"jax {machine['versions']['jax']}, torch {machine['versions']['torch']}, "
        f"commit {machine['git_commit']}; {preset['model']} {preset['stem']} "
        f"{preset['image_size']}px, global batch {preset['global_batch']}"
    )
    print(f"MFU peak: {result['method']['peak_note']}")
    print_table(records)
    print_ratios(records)
    if args.profile:
        for r in records:
            for rank0 in r.get("profile", [])[:1]:
                cats = rank0.get("thread_ms_by_category") or rank0.get("self_cpu_ms_by_category")
                print(
                    f"\n{r['config']}/{r['dtype']} rank 0 traced step {rank0['step_s']:.2f} s; "
                    "ms summed over threads:"
                )
                for k, v in (cats or {}).items():
                    print(f"  {k:<36} {v:9.1f}")
    print(f"\nwrote {out}")
    if not args.no_plot and not args.profile and any("img_per_s" in r for r in records):
        png = out.with_name(out.stem + "-throughput.png")
        title = (
            f"{preset['model']} {preset['stem']} {preset['image_size']}px, global batch "
            f"{preset['global_batch']}, {machine['name']} ({machine['cpu_count']} CPUs), "
            f"{result['date_utc'][:10]}, commit {machine['git_commit']}"
        )
        if plot(records, png, title):
            print(f"wrote {png}")


def benchmark(ap: argparse.ArgumentParser, args: argparse.Namespace, argv) -> int:
    """A benchmark run: plan, measure, write the JSON, report, regenerate RESULTS.md."""
    preset, blocks = plan(ap, args)
    started = dt.datetime.now(dt.UTC)
    machine = common.benchlib.machine_info(args.machine)
    peak, peak_note = (
        (args.peak_tflops * 1e12, f"given: {args.peak_tflops} TFLOP/s")
        if args.peak_tflops
        else default_peak_flops(machine, args.platform)
    )
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    groups, failures, load = measure(blocks, args, log)
    workload = preset | {"width": args.width, "platform": args.platform}
    peaks = peak_by_dtype(peak, args.peak_tflops is not None, args.platform)
    records = records_of(groups, peaks, workload)
    out = output_path(args.out, started.date().isoformat(), machine["name"], quick=args.quick)
    argv = argv if argv is not None else sys.argv[1:]
    result = {
        "benchmark": "train-throughput",
        "date_utc": started.isoformat(timespec="seconds"),
        "wall_s": time.perf_counter() - t_start,
        "command": shlex.join([".venv/bin/python", "experiments/bench.py", *argv]),
        "machine": machine,
        "workload": workload,
        "method": method_of(args, peak, peak_note),
        "loadavg_1_5_15": load,
        "records": records,
        "failures": failures,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    report(result, out, args)
    md_rc = 0 if args.quick or args.no_results_md else update_results_md()
    return 1 if failures else md_rc


def main(argv: list[str] | None = None) -> int:
    ap, args = parse_args(argv)
    if args._worker:
        return run_worker(args)
    if args.regenerate_results_md and (args.quick or args.no_results_md):
        ap.error("--regenerate-results-md does not go with --quick or --no-results-md")
    if args.regenerate_results_md and not args.recompute:
        return update_results_md()
    if args.recompute:
        rc = recompute(Path(args.recompute), plot_it=not args.no_plot)
        quick = json.loads(Path(args.recompute).read_text())["method"].get("quick")
        if args.no_results_md or quick:
            return rc
        return update_results_md() or rc
    return benchmark(ap, args, argv)
