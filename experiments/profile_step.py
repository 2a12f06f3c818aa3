"""Where one CPU training step's time goes: jddp's trainer against the PyTorch peer, one core each.

    .venv/bin/python experiments/profile_step.py [--batch 64] [--warmup 3] [--steps 2]
        [--cpu 0] [--machine NAME] [--quick]

Both run ResNet-18 (CIFAR stem, width 64) in float32 on ``--batch`` synthetic images, pinned to
one core (``--cpu``; each process of a 2-process run on 2 cores holds one). jddp: ``python -m
jddp.train`` with ``log.profile_steps`` (one process, one device, no communication), its
``jax.profiler`` trace read back. PyTorch: ``experiments/peers/torch_ddp.py``'s step (DDP over a
one-process gloo group, so no communication either) under ``torch.profiler``. Every op's own
time is put in a category; table and ``results/profile-<date>-<machine>.json`` give ms per step.
The "1.2x budget" row is PyTorch's step over 1.2: what jddp's whole step would have to fit in
to be 1.2x PyTorch (issue 22's goal).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import socket
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
    if op == "aten::convolution_backward":
        return "conv backward"
    if "convolution" in op:
        return "conv forward"
    if op in ("aten::copy_", "aten::contiguous", "aten::clone"):
        return "transposes and copies"
    return "other ops"


def profile_jddp(args, work: Path) -> dict:
    """Train ``warmup`` steps, trace ``steps`` more, train one; ms per step by category."""
    first = args.warmup + 1
    overrides = [
        *synthetic("resnet18", "cifar", 64, 10, 32, args.batch),
        f"train.steps={first + args.steps}", "log.every_steps=1",  # b of 'a:b' is a step too
        f"log.profile_steps={first}:{first + args.steps}", "checkpoint.every_steps=0",
        f"train.compilation_cache_dir={work / 'cache'}",
    ]  # fmt: skip
    run = benchlib.run_trainer(work / "jddp", overrides)
    untraced = [s for step, s in zip(run["steps"], run["step_s"], strict=True) if step < first]
    trace = next((work / "jddp" / "profile").rglob("*.trace.json.gz"))
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    op_name = re.compile(r"^[a-z][a-z0-9_.-]*$")  # HLO instruction names; not Python frames
    own_us, runs = collections.Counter(), collections.Counter()
    for e in events:
        thread = threads.get((e.get("pid"), e.get("tid")), "")
        if e.get("ph") == "X" and thread.startswith("tf_XLA") and op_name.match(e["name"]):
            own_us[e["name"]] += e["dur"]
            runs[e["name"]] += 1
    # The trace holds whole steps, but not always ``steps`` of them (the loop dispatches one step
    # ahead): most ops run once a step, so the commonest run count is the number of steps.
    traced = collections.Counter(runs.values()).most_common(1)[0][0]
    ms = collections.Counter()
    for name, us in own_us.items():
        ms[jddp_category(name)] += us / 1000 / traced
    return {
        "ms": dict(ms),
        "traced_steps": traced,
        "untraced_step_s": untraced,
        "command": run["command"],
    }


def profile_torch(args) -> dict:
    """The peer's step on a one-process gloo group; ms per step by category."""
    sys.path.insert(0, str(Path(__file__).parent / "peers"))
    import torch
    import torch_ddp
    from torch.profiler import ProfilerActivity, profile

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3, help="untraced steps first (>= 2)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cpu", type=int, default=0)
    parser.add_argument("--machine", default=None)
    parser.add_argument("--quick", action="store_true", help="batch 8, smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.warmup, args.steps = 8, 2, 1
    os.sched_setaffinity(0, {args.cpu})  # inherited by the trainer's process
    with tempfile.TemporaryDirectory(prefix="jddp-profile-") as tmp:
        jddp = profile_jddp(args, Path(tmp))
    peer = profile_torch(args)
    budget_ms = sum(peer["ms"].values()) / 1.2

    print(f"ms per step, ResNet-18 CIFAR float32, batch {args.batch}, one core (CPU {args.cpu})")
    print("| category | jddp | PyTorch |\n|---|---:|---:|")
    for cat in CATEGORIES:
        print(f"| {cat} | {jddp['ms'].get(cat, 0):,.0f} | {peer['ms'].get(cat, 0):,.0f} |")
    print(f"| **sum** | {sum(jddp['ms'].values()):,.0f} | {sum(peer['ms'].values()):,.0f} |")
    conv_ms = jddp["ms"].get("conv forward", 0) + jddp["ms"].get("conv backward", 0)
    print(f"| 1.2x budget (PyTorch's sum / 1.2) | {budget_ms:,.0f} | |")
    print(f"| jddp's convolutions alone | {conv_ms:,.0f} | |")
    untraced = [statistics.median(r["untraced_step_s"]) * 1000 for r in (jddp, peer)]
    print("| untraced steps before (median) | {:,.0f} | {:,.0f} |".format(*untraced))

    result = {
        "machine": benchlib.machine_info(args.machine),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "batch": args.batch, "cpu": args.cpu, "profiled_steps": args.steps,
        "jddp": jddp, "torch": peer, "budget_1_2x_ms": budget_ms, "jddp_conv_ms": conv_ms,
    }  # fmt: skip
    machine = result["machine"]["name"] + ("-quick" if args.quick else "")
    benchlib.save_result("profile", machine, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
