"""``dist.shard``: memory per device (none vs optimizer) and step time of any layouts.

    .venv/bin/python experiments/bench_shard_update.py                 # ~15 min on a 2-core VM
    .venv/bin/python experiments/bench_shard_update.py --no-time       # memory only
    .venv/bin/python experiments/bench_shard_update.py --no-memory --rounds 2 \
        --layouts none,full --time-models cifar,lm                     # full's step time
    .venv/bin/python experiments/bench_shard_update.py --no-memory --rounds 2 \
        --layouts none,none+blocks --time-models cifar,lm              # model.remat's cost

1. Memory (a subprocess per device count, fake CPU devices): ResNet-50 (ImageNet stem, 1000
   classes, SGD with momentum, float32, 224 px) and the any-task transformer of
   ``examples/lm_stdlib.py`` (``configs/lm_stdlib.yaml``: AdamW), 16 rows per device, on 4 and
   8 devices. The step is built as the trainer builds it (``jddp.build.build_steps``, the
   state laid out by ``build_layout(...).place``) and compiled; the table gives the optimizer
   state's bytes on one device (from the placed arrays) and XLA's ``memory_analysis()`` of the
   compiled step, per device: arguments, outputs, aliased (donated) bytes, temporaries and
   its peak.
2. Step time: ResNet-18 CIFAR (``cases.py``'s ``cifar-recipe``, width 64, batch 128) and the
   GPT of ``configs/lm_stdlib.yaml`` through the trainer (``benchlib.run_trainer``) as
   ``jddp.launch --nproc 2`` (``--topology PxD``: P processes of D devices), each
   ``--layouts`` value in turn (``--rounds`` rounds, the order
   rotated every round), with the 1-minute load before each run: the VM is shared. A
   ``--layouts`` value ``SHARD+REMAT`` (``none+blocks``) also sets ``model.remat``. The memory
   of all three layouts and ``model.remat``: ``bench_memory.py``.

Writes ``results/shard-update-<date>-<machine>.json`` (machine, command, commit, every figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import benchlib
from benchlib import layout_overrides, machine_info, median_p10_p90, run_trainer, save_result
from cases import case

MODELS = ("resnet50", "lm")
ROWS_PER_DEVICE = 16


# ------------------------------------------------------------------------------ memory
def memory_worker(model: str, devices: int) -> list[dict[str, Any]]:
    """Both modes of ``model`` on this process's ``devices`` fake devices (run in a subprocess
    whose XLA_FLAGS give it that many)."""
    import jax
    import numpy as np
    from flax import nnx

    from jddp import XlaComm, load_config
    from jddp.build import build_layout, build_model, build_steps
    from jddp.mesh import batch_sharded, make_mesh
    from jddp.optimizer import make_optimizer
    from jddp.shard.specs import bytes_held
    from jddp.state import create_train_state

    rows = ROWS_PER_DEVICE * devices
    if model == "resnet50":
        base = [
            "model.name=resnet50", "model.stem=imagenet", "model.num_classes=1000",
            "data.name=synthetic", "data.image_size=224",
        ]  # fmt: skip
        config: Any = None

        def batch(mesh):
            sharding = batch_sharded(mesh)
            return {
                "images": jax.ShapeDtypeStruct((rows, 224, 224, 3), np.uint8, sharding=sharding),
                "labels": jax.ShapeDtypeStruct((rows,), np.int32, sharding=sharding),
            }
    else:
        base, config = [], str(benchlib.REPO / "configs" / "lm_stdlib.yaml")

        def batch(mesh):
            sharding = batch_sharded(mesh)
            return {
                "tokens": jax.ShapeDtypeStruct((rows, 129), np.uint8, sharding=sharding),
                "lengths": jax.ShapeDtypeStruct((rows,), np.int32, sharding=sharding),
            }

    out = []
    for sharded in (False, True):
        cfg = load_config(
            config,
            [
                *base,
                f"data.global_batch_size={rows}",
                f"dist.shard={'optimizer' if sharded else 'none'}",
            ],
        )
        mesh, comm = make_mesh(jax.devices()[:devices]), XlaComm()
        tx, schedule = make_optimizer(cfg.optim, rows, 1000)
        model_def, state = create_train_state(build_model(cfg, nnx.Rngs(0)), tx, mesh)
        layout = build_layout(cfg, mesh, comm)
        if layout is not None:
            state = layout.place(state)
        step, _ = build_steps(cfg, model_def, tx, mesh, comm, schedule=schedule, layout=layout)
        compiled = step.lower(state, {"data": batch(mesh)}).compile()
        mem = compiled.memory_analysis()
        fields = (
            "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "peak_memory_in_bytes",
        )  # fmt: skip
        stats = {f: int(getattr(mem, f, -1)) for f in fields}
        params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
        out.append(
            {
                "model": model,
                "devices": devices,
                "mode": "sharded" if sharded else "replicated",
                "optimizer": cfg.optim.name,
                "param_bytes": int(params),
                "opt_state_bytes_per_device": bytes_held(state.opt_state),
                "opt_state_bytes_total": int(
                    sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.opt_state))
                ),
                "memory_analysis": stats,
                # arguments + outputs - donated + temporaries: the live bytes at the peak
                "live_bytes": stats["argument_size_in_bytes"]
                + stats["output_size_in_bytes"]
                - stats["alias_size_in_bytes"]
                + stats["temp_size_in_bytes"],
            }
        )
        del state, step, compiled
    return out


def memory(models: list[str], device_counts: list[int]) -> list[dict[str, Any]]:
    rows = []
    for model in models:
        for devices in device_counts:
            env = dict(os.environ)
            env["XLA_FLAGS"] = (
                f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
            ).strip()
            env["JAX_PLATFORMS"] = "cpu"
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--_memory", model, str(devices), f.name]
                subprocess.run(cmd, check=True, env=env, cwd=benchlib.REPO)
                got = json.loads(Path(f.name).read_text())
            rows += got
            for r in got:
                m = r["memory_analysis"]
                print(
                    f"| {model} | {devices} | {r['mode']} | {r['optimizer']} "
                    f"| {r['opt_state_bytes_per_device'] / 2**20:.2f} "
                    f"| {m['argument_size_in_bytes'] / 2**20:.1f} "
                    f"| {m['output_size_in_bytes'] / 2**20:.1f} "
                    f"| {m['alias_size_in_bytes'] / 2**20:.1f} "
                    f"| {m['temp_size_in_bytes'] / 2**20:.1f} "
                    f"| {m['peak_memory_in_bytes'] / 2**20:.1f} |",
                    flush=True,
                )
    return rows


# ------------------------------------------------------------------------------ step time
TIME_MODELS = {
    # ResNet-18 CIFAR (width 64, batch 128, synthetic 32 px images)
    "cifar": lambda steps: case("cifar-recipe", f"train.steps={steps}", "log.every_steps=5"),
    # the GPT of examples/lm_stdlib.py as configs/lm_stdlib.yaml trains it (batch 32)
    "lm": lambda steps: [
        "--config",
        "configs/lm_stdlib.yaml",
        f"train.steps={steps}",
        "log.every_steps=5",
        "train.eval_every_steps=0",
        "data.options.max_files=300",
    ],  # fmt: skip
}


def step_time(
    rounds: int,
    steps: int,
    skip: int,
    layouts: list[str],
    models: list[str],
    topology: tuple[int, int] = (2, 1),
) -> list[dict[str, Any]]:
    """Alternating trainer runs (``jddp.launch --nproc P``, ``D`` devices each: ``topology``
    ``(P, D)``, by default 2 processes of one device) of each model under each ``dist.shard``
    layout (``SHARD+REMAT``: with that ``model.remat``), the order rotated every round."""
    runs = []
    nproc, devices, env = topology[0], topology[1], None
    if nproc == 1 and devices > 1:  # one plain process (jddp.launch would join gloo)
        from jddp.launch import merge_xla_flags

        env = {**os.environ, "XLA_FLAGS": merge_xla_flags(os.environ.get("XLA_FLAGS"), devices)}
        devices = 1  # the launcher's count: none
    for model in models:
        base = TIME_MODELS[model](steps)
        for r in range(rounds):
            order = layouts[r % len(layouts) :] + layouts[: r % len(layouts)]
            for layout in order:
                load = os.getloadavg()[0]
                with tempfile.TemporaryDirectory() as tmp:
                    got = run_trainer(
                        Path(tmp) / "run",
                        [*base, *layout_overrides(layout)],
                        nproc=nproc,
                        devices=devices,
                        env=env,
                        skip_steps=skip,
                    )
                row = {
                    "model": model,
                    "topology": f"{topology[0]}x{topology[1]}",
                    "round": r,
                    "mode": layout,
                    "load1_before": load,
                    "load1_after": os.getloadavg()[0],
                    "step_s": got["step_s"],
                    "compile_s": got["compile_s"],
                    "losses": got["losses"],
                    "command": got["command"],
                }
                runs.append(row)
                med = statistics.median(row["step_s"])
                print(
                    f"| {model} | {r} | {layout} | {med:.3f} | {load:.2f} "
                    f"| {row['load1_after']:.2f} |",
                    flush=True,
                )
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--devices", default="4,8")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every layout, timed")
    ap.add_argument(
        "--layouts",
        default="none,optimizer",
        help="dist.shard values timed (SHARD+REMAT: with model.remat=REMAT)",
    )
    ap.add_argument("--time-models", default="cifar", help="cifar and/or lm")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument(
        "--topology",
        default="2x1",
        help="PxD: P processes of D devices each (1x2: one process, its collectives XLA's own)",
    )
    ap.add_argument("--skip", type=int, default=10, help="steps before the timed windows")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--machine", default=None, help="the machine's name in the results file")
    ap.add_argument("--_memory", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._memory:
        model, devices, path = args._memory
        Path(path).write_text(json.dumps(memory_worker(model, int(devices))))
        return
    result: dict[str, Any] = {
        "machine": machine_info(args.machine),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    if not args.no_memory:
        print(
            "| model | devices | update | optimizer | opt. state MiB/device | arguments | "
            "outputs | donated | temporaries | peak MiB |\n|---|---:|---|---|" + "---:|" * 6
        )
        result["memory"] = memory(args.models.split(","), [int(d) for d in args.devices.split(",")])
    if not args.no_time:
        print("\n| model | round | dist.shard | step s (median) | load before | load after |")
        print("|---|---:|---|---:|---:|---:|")
        layouts, models = args.layouts.split(","), args.time_models.split(",")
        procs, devices = (int(n) for n in args.topology.split("x"))
        runs = step_time(args.rounds, args.steps, args.skip, layouts, models, (procs, devices))
        result["step_time"] = {"runs": runs}
        for model in models:
            for mode in layouts:
                times = [t for r in runs if (r["model"], r["mode"]) == (model, mode)
                         for t in r["step_s"]]  # fmt: skip
                result["step_time"][f"{model}/{mode}"] = s = median_p10_p90(times)
                print(f"{model} dist.shard={mode}: median {s['median']:.4f} s "
                      f"(p10 {s['p10']:.4f}, p90 {s['p90']:.4f})")  # fmt: skip
    save_result("shard-update", result["machine"]["name"], result)


if __name__ == "__main__":
    main()
