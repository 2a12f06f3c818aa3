"""Where one CPU training step's time goes: jddp's trainer against the PyTorch peer, one core each.

    .venv/bin/python experiments/profile_step.py [--batch 64] [--cpu 0] [--quick]

ResNet-18 (CIFAR stem) float32 on one core: ``python -m jddp.train`` with ``log.profile_steps``
(its ``jax.profiler`` trace) and ``peers/torch_ddp.py``'s step under ``torch.profiler``; ms per
step by op category, and the convolutions' GFLOP/s beside a large matmul's. What the tables
mean: ``experiments/README.md``. Writes ``results/profile-<date>-<machine>.json``.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

import benchlib
from cases import synthetic

CATEGORIES = ("conv forward", "conv backward", "transposes and copies", "other ops")


def jddp_category(op: str) -> str:
    """The category of an XLA:CPU op of the trace (names as in the optimised HLO: the forward
    convolutions keep JAX's ``conv_general_dilated``, the gradients are XLA's ``convolution``)."""
    if op.startswith("conv_general_dilated"):
        return "conv forward"
    if op.startswith("convolution"):
        return "conv backward"
    if "transpose" in op or op.startswith("copy"):
        return "transposes and copies"
    return "other ops"


def torch_category(op: str) -> str:
    """The category of an ``aten::`` op (self time, so nested calls are not counted twice)."""
    if "convolution" in op and "backward" in op:
        return "conv backward"
    if "convolution" in op:
        return "conv forward"
    if op in ("aten::copy_", "aten::contiguous", "aten::clone"):
        return "transposes and copies"
    return "other ops"


def profile_jddp(args, work: Path) -> dict:
    """Train ``warmup`` steps, trace ``steps`` more, train one (the trace's end ``b`` of
    ``log.profile_steps='a:b'`` must be a step of the run); ms per step by category, and the
    ops that took longest."""
    first = args.warmup + 1
    overrides = [
        *synthetic("resnet18", "cifar", 64, 10, 32, args.batch),
        f"train.steps={first + args.steps}", "log.every_steps=1",
        f"log.profile_steps={first}:{first + args.steps}", "checkpoint.every_steps=0",
        f"train.compilation_cache_dir={work / 'cache'}",
    ]  # fmt: skip
    run = benchlib.run_trainer(work / "jddp", overrides)
    untraced = [s for step, s in zip(run["steps"], run["step_s"], strict=True) if step < first]
    trace = next((work / "jddp" / "profile").rglob("*.trace.json.gz"), None)
    if trace is None:
        raise SystemExit(f"no trace.json.gz under {work / 'jddp' / 'profile'}")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    # The trainer marks each traced step's dispatch ("train", step_num); it starts the trace
    # once the steps before have finished, so the trace holds exactly these steps.
    traced = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train")
    if not traced:
        raise SystemExit(f"{trace}: no step markers (a jddp from before 2026-11-25?)")
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    # XLA:CPU's ops as they run (HLO instruction names; not Python frames or the executor's
    # own spans): one event per op run, not nested, so the durations add up to the step.
    op_name = re.compile(r"^[a-z][a-z0-9_.-]*$")
    op_us = collections.Counter()
    for e in events:
        thread = threads.get((e.get("pid"), e.get("tid")), "")
        if e.get("ph") == "X" and thread.startswith("tf_XLA") and op_name.match(e["name"]):
            op_us[e["name"]] += e["dur"]
    ms = collections.Counter()
    for name, us in op_us.items():
        ms[jddp_category(name)] += us / 1000 / len(traced)
    top = {name: us / 1000 / len(traced) for name, us in op_us.most_common(25)}
    return {
        "ms": dict(ms),
        "traced_steps": traced,
        "top_ops_ms": top,
        "untraced_step_s": untraced,
        "command": run["command"],
    }


def profile_torch(args) -> dict:
    """The peer's step on a one-process gloo group; ms per step by category."""
    sys.path.insert(0, str(Path(__file__).parent / "peers"))
    import torch
    import torch_ddp
    from torch.profiler import ProfilerActivity, profile

    from jddp.launch import find_free_port

    port = find_free_port()
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    torch_ddp.set_threads(1)
    torch_ddp.init_process_group("cpu")
    runner = torch_ddp.DDPRunner(torch_ddp.PeerConfig(global_batch=args.batch))
    times = [runner.step()[0] for _ in range(args.warmup)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        times += [runner.step()[0] for _ in range(args.steps)]
    ms = collections.Counter()
    for row in prof.key_averages():
        ms[torch_category(row.key)] += row.self_cpu_time_total / 1000 / args.steps
    torch_ddp.dist.destroy_process_group()
    return {"ms": dict(ms), "untraced_step_s": times[1 : args.warmup], "torch": torch.__version__}


def matmul_gflops(size: int = 2048, repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of a ``size``-square float32 matmul on this process's core, best of ``repeats``,
    in JAX (XLA:CPU) and in PyTorch (one thread): a practical ceiling for dense float32 work."""
    import numpy as np
    import torch

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    a, b = np.random.default_rng(0).standard_normal((2, size, size), dtype=np.float32)

    def best(call) -> float:
        call()  # compiles / warms
        return 2 * size**3 / min(benchlib.call_times(call, repeats)) / 1e9

    dot = jax.jit(jax.numpy.dot)
    ja, jb = jax.device_put(a), jax.device_put(b)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    return {
        "jax": best(lambda: dot(ja, jb).block_until_ready()),
        "torch": best(lambda: torch.mm(ta, tb)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3, help="untraced steps first (>= 2)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cpu", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="batch 8, smoke run")
    benchlib.output_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.warmup, args.steps = 8, 2, 1
    if args.warmup < 2 or args.steps < 1:
        parser.error("--warmup must be >= 2 (the first step compiles) and --steps >= 1")
    os.sched_setaffinity(0, {args.cpu})  # inherited by the trainer's process
    with tempfile.TemporaryDirectory(prefix="jddp-profile-") as tmp:
        jddp = profile_jddp(args, Path(tmp))
    peer = profile_torch(args)
    figures = benchlib.model_figures("resnet18", "cifar", 64, 10, 32)
    conv_gflop = benchlib.train_step_flops(figures, args.batch) / 1e9
    matmul = matmul_gflops()
    machine = benchlib.machine_info(args.machine)
    budget_ms = sum(peer["ms"].values()) / 1.2

    print(f"ms per step, ResNet-18 CIFAR float32, batch {args.batch}, one core (CPU {args.cpu})")
    benchlib.md_table("category | jddp | PyTorch", "lr")
    for cat in CATEGORIES:
        print(f"| {cat} | {jddp['ms'].get(cat, 0):,.0f} | {peer['ms'].get(cat, 0):,.0f} |")
    print(f"| **sum** | {sum(jddp['ms'].values()):,.0f} | {sum(peer['ms'].values()):,.0f} |")
    conv_ms_each = [
        r["ms"].get("conv forward", 0) + r["ms"].get("conv backward", 0) for r in (jddp, peer)
    ]
    conv_ms = conv_ms_each[0]
    print(f"| 1.2× budget (PyTorch's sum / 1.2) | {budget_ms:,.0f} | |")
    print(f"| jddp's convolutions alone | {conv_ms:,.0f} | |")
    untraced = [statistics.median(r["untraced_step_s"]) * 1000 for r in (jddp, peer)]
    print("| untraced steps before (median) | {:,.0f} | {:,.0f} |".format(*untraced))

    conv_rate = [conv_gflop / (ms / 1000) for ms in conv_ms_each]
    print(f"\nGFLOP/s on the same core ({conv_gflop:,.0f} GFLOP of convolutions a step)")
    print("| | jddp (XLA:CPU) | PyTorch (oneDNN) |\n|---|---:|---:|")
    print("| convolutions, forward + backward | {:,.0f} | {:,.0f} |".format(*conv_rate))
    print(f"| float32 matmul 2048² | {matmul['jax']:,.0f} | {matmul['torch']:,.0f} |")

    result = {
        "machine": machine,
        "command": benchlib.command_line(),
        "batch": args.batch, "cpu": args.cpu, "warmup": args.warmup, "steps": args.steps,
        "jddp": jddp, "torch": peer, "budget_1_2x_ms": budget_ms, "jddp_conv_ms": conv_ms,
        "conv_gflop_per_step": conv_gflop,
        "conv_gflops": {"jddp": conv_rate[0], "torch": conv_rate[1]},
        "matmul_2048_gflops": matmul,
    }  # fmt: skip
    benchlib.save_result("profile", machine["name"] + "-quick" * args.quick, result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
