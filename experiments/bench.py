"""Training throughput: jddp's trainer vs PyTorch DistributedDataParallel, side by side in one run.

    .venv/bin/python experiments/bench.py [--configs jddp-1x1,jddp-2x1,torch-ddp-2x1] [--quick]

Configurations ``jddp-PxD``, ``jddp-mpi-PxD``, ``jddp-srun-Px1`` (the trainer, read through
:func:`benchlib.run_trainer`) and ``torch-ddp-PxT`` (``peers/torch_ddp.py``), suffixes ``-pin``,
``-1t``, ``-noynnconv``, ``-xladefaults``, ``-compile``; the method and the table's columns are
in ``experiments/README.md``. Writes ``results/<date>-<machine>.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib
from cases import synthetic

HERE = Path(__file__).resolve()
PEER = HERE.parent / "peers" / "torch_ddp.py"
DEFAULT_CONFIGS = "jddp-1x1,jddp-2x1,jddp-2x1-pin,torch-ddp-2x1,torch-ddp-2x1-pin"
XLA_FLAGS = {
    "noynnconv": "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution",
    "1t": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
}
PRESETS = {
    # --quick's: the smallest ResNet, as the tests' tiny runs train.
    "resnet10-cifar": dict(
        model="resnet10", stem="cifar", image_size=32, num_classes=10, global_batch=128
    ),
    "resnet18-cifar": dict(
        model="resnet18", stem="cifar", image_size=32, num_classes=10, global_batch=128
    ),
    "resnet50-imagenet": dict(
        model="resnet50", stem="imagenet", image_size=224, num_classes=1000, global_batch=256
    ),
}
# --quick: the smallest run that still goes through every stage (a smoke test, not a figure).
QUICK = dict(configs="jddp-1x1,torch-ddp-1x1", dtypes="float32", rounds=1, steps_per_round=1,
             warmup=1, preset="resnet10-cifar", width=4, image_size=8, global_batch=8)  # fmt: skip
CONFIG_RE = re.compile(
    r"^(jddp|jddp-mpi|jddp-srun|torch-ddp)-(\d+)x(\d+)((?:-(?:1t|pin|noynnconv|xladefaults|compile))*)$"
)


def pin_and_exec(argv: list[str]) -> None:
    """``bench.py --_pin -- CMD...``: pin this rank (``JDDP_PROCESS_ID`` from ``jddp.launch``,
    ``PMI_RANK`` from MPICH, ``SLURM_PROCID`` from srun) to one CPU, then become ``CMD``."""
    env = os.environ
    rank = int(env.get("JDDP_PROCESS_ID") or env.get("PMI_RANK") or env.get("SLURM_PROCID") or 0)
    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    os.execv(argv[0], argv)


def parse_config(name: str, platform: str) -> dict:
    """``jddp-2x1-pin`` -> ``{"name", "framework", "backend", "nproc", "per_proc", "variants"}``."""
    m = CONFIG_RE.match(name)
    if not m:
        raise ValueError(
            f"bad config {name!r}: expected jddp-PxD, jddp-mpi-PxD, jddp-srun-Px1 or torch-ddp-PxT "
            "[-pin] [-1t] [-noynnconv] [-xladefaults] [-compile]"
        )
    framework = "torch" if m.group(1) == "torch-ddp" else "jddp"
    variants = set(m.group(4).strip("-").split("-")) - {""}
    if framework == "torch" and variants & {"1t", "noynnconv", "xladefaults"}:
        raise ValueError(f"{name!r}: -1t, -noynnconv and -xladefaults are for jddp only")
    if framework == "jddp" and "compile" in variants:
        raise ValueError(f"{name!r}: -compile (torch.compile) is for torch-ddp only")
    if framework == "torch" and platform == "gpu" and int(m.group(3)) != 1:
        raise ValueError(f"{name!r}: on GPU each PyTorch process drives one GPU (use -Px1)")
    if m.group(1) == "jddp-srun" and int(m.group(3)) != 1:
        raise ValueError(f"{name!r}: srun runs one device per task (use -Px1)")
    backend = "mpi" if m.group(1) == "jddp-mpi" else "xla"
    launcher = "srun" if m.group(1) == "jddp-srun" else "jddp.launch"
    return dict(name=name, framework=framework, backend=backend, launcher=launcher,
                nproc=int(m.group(2)), per_proc=int(m.group(3)),
                variants=sorted(variants))  # fmt: skip


def jddp_env(spec: dict, platform: str) -> dict[str, str]:
    """The environment of a jddp run: platform pinned, the configuration's XLA flags."""
    flags = " ".join(XLA_FLAGS[v] for v in spec["variants"] if v in XLA_FLAGS)
    defaults = {"JDDP_XLA_DEFAULTS": "0"} if "xladefaults" in spec["variants"] else {}
    return benchlib.trainer_env(platform, flags, defaults)


def run_jddp(spec: dict, work: dict, args, workdir: Path, cache: Path) -> dict:
    """One trainer run of a jddp configuration (:func:`benchlib.run_trainer`)."""
    overrides = [
        *synthetic(work["model"], work["stem"], args.width, work["num_classes"],
                   work["image_size"], work["global_batch"], precision=work["dtype"]),
        f"train.steps={args.warmup + args.steps_per_round}", "log.every_steps=1",
        f"train.compilation_cache_dir={cache}", "checkpoint.every_steps=0",
    ]  # fmt: skip
    pin = (sys.executable, str(HERE), "--_pin", "--") if "pin" in spec["variants"] else ()
    run = benchlib.run_trainer(
        workdir, overrides, nproc=spec["nproc"], devices=spec["per_proc"],
        backend=spec["backend"], wrap=pin, launcher=spec["launcher"],
        env=jddp_env(spec, args.platform),
        skip_steps=args.warmup, check=False,
    )  # fmt: skip
    if "error" not in run:
        run["first_step_s"] = run["compile_s"]
        run["input_wait_max"] = max((w or 0.0) for w in run["input_wait_fraction"] or [0.0])
    return run


def run_torch(spec: dict, work: dict, args) -> dict:
    """One run of the PyTorch DDP peer; its rank 0's JSON record."""
    gpu = args.platform == "gpu"
    cmd = [
        sys.executable, str(PEER), "--nproc", str(spec["nproc"]),
        "--threads", str(spec["per_proc"]), "--steps", str(args.steps_per_round),
        "--warmup", str(args.warmup), "--dtype", work["dtype"], "--model", work["model"],
        "--stem", work["stem"], "--image-size", str(work["image_size"]),
        "--width", str(args.width), "--num-classes", str(work["num_classes"]),
        "--global-batch", str(work["global_batch"]),
    ]  # fmt: skip
    cmd += ["--pin"] if "pin" in spec["variants"] else []
    cmd += ["--compile"] if "compile" in spec["variants"] else []
    if gpu:
        cmd += ["--device", "cuda", "--impl", "torchvision", "--channels-last", "--cudnn-benchmark"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=benchlib.REPO)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"command": cmd, "error": f"exit {out.returncode}: {out.stderr[-2000:]}"}
    record = json.loads(lines[-1])
    return {"command": cmd, "step_s": record["step_s"], "first_step_s": record["warmup_s"][0],
            "compile_s": None, "peer": record}  # fmt: skip


def summarise(spec: dict, work: dict, runs: list[dict], flops: float, peak: float | None) -> dict:
    """One record per configuration and dtype: every round's run, the timed steps' statistics."""
    ok = [r for r in runs if "error" not in r]
    times = [t for r in ok for t in r["step_s"]]
    rec = {**spec, "dtype": work["dtype"], "global_batch": work["global_batch"], "runs": runs}
    if not times:
        return rec
    stats = benchlib.median_p10_p90(times)
    med = stats["median"]
    return {
        **rec,
        "timed_steps": len(times),
        "step_s": times,
        "median_step_s": med,
        "p10_step_s": stats["p10"],
        "p90_step_s": stats["p90"],
        "img_per_s": work["global_batch"] / med,
        "first_step_s": ok[0]["first_step_s"],
        "input_wait_max": max(
            (r["input_wait_max"] for r in ok if "input_wait_max" in r), default=None
        ),  # fmt: skip
        "model_flops_per_step": flops,
        "achieved_gflops": flops / med / 1e9,
        "mfu": flops / med / peak if peak else None,
    }


def add_ratios(records: list[dict], platform: str) -> None:
    """jddp images/s over PyTorch's (eager and ``-compile``), same dtype: the PyTorch run with as
    many processes (on GPU: GPUs) and the same pinning, else the first of that dtype."""
    for r in records:
        if r["framework"] != "jddp" or "img_per_s" not in r:
            continue
        devices = r["nproc"] * (r["per_proc"] if platform == "gpu" else 1)
        for compiled, suffix in ((False, ""), (True, "_compiled")):
            peers = [
                p for p in records if p["framework"] == "torch" and "img_per_s" in p
                and p["dtype"] == r["dtype"] and ("compile" in p["variants"]) == compiled
            ]  # fmt: skip
            pin = "pin" in r["variants"]
            same = [p for p in peers if p["nproc"] == devices and ("pin" in p["variants"]) == pin]
            if same or peers:
                peer = (same or peers)[0]
                r[f"ratio_vs{suffix}"] = peer["name"]
                r[f"ratio_img_per_s{suffix}"] = r["img_per_s"] / peer["img_per_s"]


def print_table(records: list[dict]) -> None:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    print()
    benchlib.md_table(
        "config | dtype | timed steps | step s, median (p10-p90) | img/s | jddp / PyTorch | "
        "jddp / PyTorch compiled | 1st step s | input wait (max) | GFLOP/s | MFU",
        "llr",
    )
    for r in records:
        if "median_step_s" not in r:
            error = next((x["error"] for x in r["runs"] if "error" in x), "not run")
            print(f"| {r['name']} | {r['dtype']} | FAILED: {error.splitlines()[-1][:120]} |")
            continue
        ratio = f(r.get("ratio_img_per_s"), ".2f")
        ratio_c = f(r.get("ratio_img_per_s_compiled"), ".2f")
        print(
            f"| {r['name']} | {r['dtype']} | {r['timed_steps']} | {r['median_step_s']:.3f} "
            f"({r['p10_step_s']:.3f}-{r['p90_step_s']:.3f}) | {r['img_per_s']:.1f} | {ratio} | "
            f"{ratio_c} | {f(r['first_step_s'], '.2f')} | {f(r['input_wait_max'], '.2%')} | "
            f"{r['achieved_gflops']:.1f} | {f(r['mfu'], '.1%')} |"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps-per-round", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of every run")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="resnet18-cifar")
    for key in ("image-size", "num-classes", "global-batch"):
        ap.add_argument(f"--{key}", type=int)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--platform", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--peak-tflops", type=float, help="peak for MFU (CPU default: assumed)")
    ap.add_argument("--quick", action="store_true", help="smoke run, numbers meaningless")
    benchlib.output_args(ap)
    if ap.parse_known_args(argv)[0].quick:
        ap.set_defaults(**QUICK)  # options given on the command line still win
    args = ap.parse_args(argv)
    if min(args.rounds, args.steps_per_round, args.warmup) < 1:
        ap.error("--rounds, --steps-per-round and --warmup must be >= 1")
    args.dtype_list = [d for d in args.dtypes.split(",") if d]
    if not args.dtype_list or set(args.dtype_list) - {"float32", "bfloat16"}:
        ap.error("--dtypes: float32 and/or bfloat16")
    try:
        args.specs = [parse_config(c, args.platform) for c in args.configs.split(",") if c]
    except ValueError as e:
        ap.error(str(e))
    torch_names = [s["name"] for s in args.specs if s["framework"] == "torch"]
    try:
        import torch  # noqa: F401
    except ImportError:
        if torch_names and not args.quick:
            ap.error(f"{', '.join(torch_names)} need torch: "
                     ".venv/bin/pip install -r experiments/requirements-bench.txt")  # fmt: skip
        if torch_names:
            print(f"note: torch is not installed: skipping {', '.join(torch_names)}")
        args.specs = [s for s in args.specs if s["framework"] == "jddp"]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["--_pin", "--"]:
        pin_and_exec(argv[2:])
    args = parse_args(argv)
    work = dict(PRESETS[args.preset])
    for key in ("image_size", "num_classes", "global_batch"):
        work[key] = getattr(args, key) or work[key]
    started = dt.datetime.now(dt.UTC)
    machine = benchlib.machine_info(args.machine)
    peak, peak_note = benchlib.peak_flops(machine, args.platform, args.peak_tflops)
    figures = benchlib.model_figures(
        work["model"], work["stem"], args.width, work["num_classes"], work["image_size"]
    )
    flops = benchlib.train_step_flops(figures, work["global_batch"])
    records, load, interrupted = [], [benchlib.load1()], False
    with tempfile.TemporaryDirectory(prefix="jddp-bench-") as tmp:
        for dtype in args.dtype_list:
            work_d = {**work, "dtype": dtype}
            runs: dict[str, list[dict]] = {s["name"]: [] for s in args.specs}
            try:  # a cut run (SIGINT, e.g. a deadline) still reports the rounds it finished
                for rnd in range(args.rounds):
                    for spec in args.specs:
                        name = spec["name"]
                        if spec["framework"] == "torch":
                            run = run_torch(spec, work_d, args)
                        else:
                            workdir = Path(tmp) / f"{name}-{dtype}-{rnd}"
                            cache = Path(tmp) / f"cache-{name}-{dtype}"
                            run = run_jddp(spec, work_d, args, workdir, cache)
                        runs[name].append(run)
                        steps = ", ".join(f"{t:.3f}" for t in run.get("step_s", []))
                        print(f"round {rnd + 1}/{args.rounds} {name}/{dtype}: "
                              f"{run.get('error', steps + ' s')[:300]}", flush=True)  # fmt: skip
            except KeyboardInterrupt:
                print("interrupted: reporting the finished runs")
                interrupted = True
            peak_d = peak if dtype == "float32" or args.peak_tflops else None
            records += [summarise(s, work_d, runs[s["name"]], flops, peak_d) for s in args.specs]
            load.append(benchlib.load1())
            if interrupted:
                break
    add_ratios(records, args.platform)
    result = {
        "benchmark": "train-throughput",
        "date_utc": started.isoformat(timespec="seconds"),
        "command": shlex.join([".venv/bin/python", "experiments/bench.py", *argv]),
        "machine": machine,
        "workload": {**work, "width": args.width, "platform": args.platform,
                     "params": figures["params"], "forward_macs": figures["forward_macs"]},
        "method": {"rounds": args.rounds, "steps_per_round": args.steps_per_round,
                   "warmup": args.warmup, "quick": args.quick, "peak_flops": peak,
                   "peak_note": peak_note, "flops_counting": benchlib.train_step_flops.__doc__},
        "loadavg_1min": load,
        "records": records,
    }  # fmt: skip
    print(f"\n{machine['name']}: {machine['cpu_model']} x{machine['cpu_count']}, commit "
          f"{machine['git_commit']}; {work['model']} {work['stem']} {work['image_size']}px, "
          f"global batch {work['global_batch']}, {flops / 1e9:.1f} GFLOP per step; MFU peak: "
          f"{peak_note}")  # fmt: skip
    print_table(records)
    benchlib.save_result("", machine["name"] + "-quick" * args.quick, result, args.out)
    return 1 if any("median_step_s" not in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
