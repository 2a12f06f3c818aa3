"""Bytes each device sends per train step, within a node and between nodes, read from the
compiled programs of each state layout; and the step time the scaling model predicts from them.

    .venv/bin/python experiments/comm_volume.py [--models gpt100m,resnet50] [--nodes 2,8]
        [--per-node 8] [--machine NAME] [--out PATH]

For each model and node count, one child process with ``nodes x per-node`` fake CPU devices
builds the trainer's own step (``jddp.build.build_steps``) under each layout — ``none``,
``optimizer``, ``full`` (split over every device), and the hybrids ``optimizer/node`` and
``full/node`` (``dist.shard_group`` = a node's devices: split within a node, replicated across
nodes) — compiles it for one row per device (what crosses the wire does not depend on the
batch), and reads every all-reduce, all-gather and reduce-scatter of the compiled program: its
bytes and its replica groups. A device's node is its index // per-node (devices ordered as
``jddp.mesh.make_mesh`` orders them: a process's, i.e. a node's, devices are contiguous).

What one device sends for a collective of S bytes (the whole array: an all-reduce's operand,
an all-gather's result, a reduce-scatter's operand) over a group of r devices on N nodes, g
per node (ring algorithms; a group spanning nodes runs hierarchically, as NCCL does: within
the node, then one exchange of each device's 1/g between nodes, then within the node):

* all-reduce: within 2(g-1)/g S; between 2(N-1)/N S/g
* all-gather, reduce-scatter: within (g-1)/g S; between (N-1)/N S/g

The time model (:func:`predicted_step_s`; ASSUMPTIONS, stated as flags and in the JSON): the
step's compute is the measured one-GPU step of the same model (an H200, experiments/RESULTS.md
section 9: the 100M GPT bf16 at batch 256, 60.8 ms; ResNet-50 bf16 at batch 256, 38.4 ms):
weak scaling, each GPU keeps its batch; within a node NVLink at ``--nvlink-gbs`` GB/s per GPU
(nccl-tests bus bandwidth); between nodes one link of ``--link-gbits`` Gbit/s per node, shared
by its GPUs; a latency ``--alpha-us`` per ring step of each collective (2(r-1) steps for an
all-reduce, r-1 for the others); communication not overlapped with compute (an upper bound:
XLA:GPU overlaps part of it), and the perfectly overlapped bound beside it. Not modelled:
contention, stragglers, the input pipeline. Writes ``results/comm-volume-<date>-<machine>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import benchlib
from cases import GPT_100M

LAYOUTS = {  # label -> (dist.shard, dist.shard_group; "node": the devices of a node)
    "none": ("none", "all"),
    "optimizer": ("optimizer", "all"),
    "full": ("full", "all"),
    "optimizer/node": ("optimizer", "node"),
    "full/node": ("full", "node"),
}
MODELS = {
    # the 100M GPT of section 9 (128 bytes of context), one sequence per device
    "gpt100m": [
        "--config", "configs/lm_stdlib.yaml", *GPT_100M, "model.options.seq_len=128",
        "data.options.seq_len=128", "train.precision=bfloat16",
    ],
    # configs/imagenet_resnet50.yaml's model at 32x32 (the parameters are the same)
    "resnet50": [
        "model.name=resnet50", "model.stem=imagenet", "model.num_classes=1000",
        "data.name=synthetic", "data.image_size=32", "train.precision=bfloat16",
    ],
}  # fmt: skip
COMPUTE_S = {"gpt100m": 0.0608, "resnet50": 0.0384}  # one H200, RESULTS.md section 9 and 1
KINDS = ("all-reduce", "all-gather", "reduce-scatter")
# replica_groups={{0,1},{2,3}} or the iota form [2,2]<=[4] (with a transpose T(1,0))
GROUPS = r"replica_groups=(\{[^=]*?\}\}|\{\}|\[[^ ,]*\]<=\[[^ ]*?\](?:T\([\d,]+\))?)"
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u8": 1,
               "s8": 1, "pred": 1, "u16": 2, "s16": 2}  # fmt: skip


# ------------------------------------------------------------------------ in the child process
def parse_groups(text: str, devices: int) -> list[list[int]]:
    """An HLO ``replica_groups`` attribute: ``{{0,1},{2,3}}`` or the iota form
    ``[2,2]<=[4]`` / ``[2,2]<=[2,2]T(1,0)``."""
    text = text.strip()
    if text.startswith("{"):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", text)]
    import numpy as np

    m = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if not m:
        raise ValueError(f"replica_groups {text!r}")
    shape = [int(x) for x in m.group(1).split(",")]
    ids = np.arange(devices).reshape([int(x) for x in m.group(2).split(",")])
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(shape).tolist()


def shape_bytes(text: str) -> int:
    """Bytes of an HLO result type: ``f32[8,128]{1,0}`` or a tuple of them."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text):
        if dtype in DTYPE_BYTES:
            n = 1
            for d in dims.split(","):
                n *= int(d) if d else 1
            total += n * DTYPE_BYTES[dtype]
    return total


def collectives(hlo: str, devices: int) -> list[dict]:
    """Every all-reduce, all-gather and reduce-scatter of a compiled (partitioned) module:
    its kind, the bytes of its whole array S, and device 0's group."""
    found = []
    pattern = re.compile(r"=\s*(\S.*?)\s+(all-reduce|all-gather|reduce-scatter)(?:-start)?\(")
    for line in hlo.splitlines():
        m = pattern.search(line)
        if not m or "-done" in line:
            continue
        result, kind = m.group(1), m.group(2)
        groups_text = re.search(GROUPS, line)
        groups = parse_groups(groups_text.group(1), devices) if groups_text else [[*range(devices)]]
        if not groups or not groups[0]:
            groups = [[*range(devices)]]
        group = next(g for g in groups if 0 in g) if any(0 in g for g in groups) else groups[0]
        nbytes = shape_bytes(result)
        if kind == "reduce-scatter":
            nbytes *= len(group)  # the result is one device's share
        found.append({"kind": kind, "bytes": nbytes, "group": group})
    return found


def child(model: str, devices: int, per_node: int) -> None:
    """Compile each layout's step on ``devices`` fake devices; print one JSON line."""
    import jax
    from flax import nnx

    from jddp import XlaComm, load_config
    from jddp.build import build_layout, build_mesh, build_model, build_steps
    from jddp.data.loader import place_batch
    from jddp.optimizer import make_optimizer
    from jddp.state import abstract_train_state, split_model

    args = MODELS[model]
    config = args[1] if args[0] == "--config" else None
    overrides = args[2:] if config else args
    out, built = {}, None
    for label, (shard, group) in LAYOUTS.items():
        group = str(per_node) if group == "node" else group
        cfg = load_config(config, [*overrides, f"data.global_batch_size={devices}",
                                   f"dist.shard={shard}", f"dist.shard_group={group}",
                                   "optim.name=adamw"])  # fmt: skip
        comm = XlaComm()
        mesh, where = build_mesh(cfg, comm)
        layout = build_layout(cfg, mesh, comm)
        tx, schedule = make_optimizer(cfg.optim, devices, 100)
        if built is None:  # the same model under every layout: built once
            built = split_model(build_model(cfg, nnx.Rngs(0)))
        model_def, params, model_state = built
        shapes = abstract_train_state(params, model_state, tx)
        specs = layout.state_specs(shapes)
        shardings = layout.shardings(specs)
        state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
        )
        step, _ = build_steps(cfg, model_def, tx, mesh, comm, schedule=schedule, layout=layout)
        batch = example_batch(model, devices)
        placed = {"data": place_batch(batch, mesh, where)}
        hlo = step.lower(state, placed).compile().as_text()
        params_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
        out[label] = {"collectives": collectives(hlo, devices), "param_bytes": params_bytes}
    print(json.dumps(out))


def example_batch(model: str, devices: int) -> dict:
    import numpy as np

    if model == "gpt100m":
        return {"tokens": np.ones((devices, 129), np.uint8),
                "lengths": np.full(devices, 129, np.int32)}  # fmt: skip
    return {"images": np.zeros((devices, 32, 32, 3), np.uint8),
            "labels": np.zeros(devices, np.int32)}  # fmt: skip


# ------------------------------------------------------------------------------- the model
def sent_bytes(c: dict, per_node: int) -> tuple[float, float, int, int]:
    """(within a node, between nodes, ring steps within, ring steps between) one device sends
    for collective ``c``."""
    group = c["group"]
    r = len(group)
    nodes = len({d // per_node for d in group})
    g = r // nodes
    s = c["bytes"]
    factor = 2 if c["kind"] == "all-reduce" else 1
    within = factor * (g - 1) / g * s if g > 1 else 0.0
    between = factor * (nodes - 1) / nodes * s / g if nodes > 1 else 0.0
    return within, between, factor * (g - 1), factor * (nodes - 1)


def predicted_step_s(row: dict, compute_s: float, link_gbits: float, args) -> dict[str, float]:
    """The scaling model's step time from a layout's bytes (module docstring)."""
    per_gpu_between = link_gbits / 8 * 1e9 / args.per_node  # bytes/s, the node's link shared
    t_comm = (
        row["within_bytes"] / (args.nvlink_gbs * 1e9)
        + row["between_bytes"] / per_gpu_between
        + (row["steps_within"] + row["steps_between"]) * args.alpha_us * 1e-6
    )
    return {"no_overlap_s": compute_s + t_comm, "overlapped_s": max(compute_s, t_comm)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt100m,resnet50")
    ap.add_argument("--nodes", default="2,8")
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument(
        "--nvlink-gbs",
        type=float,
        default=360.0,
        help="ASSUMPTION: NVLink bus bandwidth per GPU, GB/s (H100/H200 nccl-tests)",
    )
    ap.add_argument(
        "--alpha-us",
        type=float,
        default=5.0,
        help="ASSUMPTION: latency per ring step of a collective, microseconds",
    )
    ap.add_argument("--links", default="25,100", help="Gbit/s between nodes, per node")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    benchlib.output_args(ap)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.per_node)
        return
    links = [float(x) for x in args.links.split(",")]
    rows = []
    for model in args.models.split(","):
        for nodes in (int(n) for n in args.nodes.split(",")):
            devices = nodes * args.per_node
            env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
                f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count="
                f"{devices} --xla_backend_optimization_level=0").strip())  # fmt: skip
            cmd = [sys.executable, __file__, "--child", model, str(devices),
                   "--per-node", str(args.per_node)]  # fmt: skip
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=benchlib.REPO)
            if done.returncode:
                sys.exit(f"{model} on {nodes} nodes failed:\n{done.stderr[-3000:]}")
            for label, got in json.loads(done.stdout.strip().splitlines()[-1]).items():
                row = {"model": model, "nodes": nodes, "devices": devices, "layout": label,
                       "param_bytes": got["param_bytes"], "within_bytes": 0.0,
                       "between_bytes": 0.0, "steps_within": 0, "steps_between": 0,
                       "collectives": {k: 0 for k in KINDS}}  # fmt: skip
                for c in got["collectives"]:
                    w, b, sw, sb = sent_bytes(c, args.per_node)
                    row["within_bytes"] += w
                    row["between_bytes"] += b
                    row["steps_within"] += sw
                    row["steps_between"] += sb
                    row["collectives"][c["kind"]] += 1
                row["predicted"] = {
                    f"{link:g}gbit": predicted_step_s(row, COMPUTE_S[model], link, args)
                    for link in links
                }
                rows.append(row)
    print_table(rows, links)
    result = {
        "machine": benchlib.machine_info(args.machine),
        "command": benchlib.command_line(),
        "assumptions": {
            "compute_s": COMPUTE_S,
            "nvlink_gbs_per_gpu": args.nvlink_gbs,
            "alpha_us_per_ring_step": args.alpha_us,
            "links_gbit_per_node": links,
            "per_node": args.per_node,
            "overlap": "none (upper bound) and perfect (lower)",
        },  # fmt: skip
        "rows": rows,
    }
    print("wrote", benchlib.save_result("comm-volume", args.machine, result, args.out))


def print_table(rows: list[dict], links: list[float]) -> None:
    cols = ["model", "nodes x 8", "layout", "sent within MiB", "sent between MiB", "collectives"]
    cols += [f"step ms @ {link:g} Gbit/s (overlapped)" for link in links]
    benchlib.md_table(" | ".join(cols), "l")
    for r in rows:
        cells = [r["model"], str(r["nodes"]), r["layout"], f"{r['within_bytes'] / 2**20:,.1f}",
                 f"{r['between_bytes'] / 2**20:,.1f}",
                 " ".join(f"{k} {v}" for k, v in r["collectives"].items())]  # fmt: skip
        for link in links:
            p = r["predicted"][f"{link:g}gbit"]
            cells.append(f"{1e3 * p['no_overlap_s']:,.1f} ({1e3 * p['overlapped_s']:,.1f})")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
