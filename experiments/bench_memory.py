"""Memory per device under each ``dist.shard`` layout and ``model.remat``, compile only.

    .venv/bin/python experiments/bench_memory.py                       # ~10 min on a 2-core VM
    .venv/bin/python experiments/bench_memory.py --models lm100m --devices 8

For each model, layout and remat setting the train step is built as the trainer builds it
(``jddp.build.build_layout`` and ``build_steps``) over ``--devices`` fake CPU devices and
compiled for an *abstract* state (``jax.ShapeDtypeStruct`` with the layout's shardings: no
parameter or optimizer state is ever allocated on the devices), then:

* ``state``: the train state's bytes one device holds at rest (each array's shard shape under
  the layout) -- what a run logs as ``mem/state_bytes_per_device``;
* ``step``: XLA's memory analysis of the compiled step on one device, arguments + outputs +
  temporaries - aliased -- what a run logs as ``mem/step_bytes_per_device``.

Models: ``lm100m``, the GPT of ``examples/lm_stdlib.py`` scaled to ~100M parameters (width
768, 14 layers, 12 heads, 128 bytes of context) with ``configs/lm_stdlib.yaml``'s AdamW and
global batch 32; ``resnet50``, ImageNet stem, 1000 classes, 224 px, SGD with momentum, 16
images per device. Writes ``results/memory-<date>-<machine>.json``.
"""

from __future__ import annotations

import argparse
import os
import sys

DEVICES = 8
if __name__ == "__main__":  # the fake devices, before JAX loads
    count = sys.argv[sys.argv.index("--devices") + 1] if "--devices" in sys.argv else DEVICES
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
    ).strip()
    os.environ["JAX_PLATFORMS"] = "cpu"

from typing import Any  # noqa: E402

import benchlib  # noqa: E402
from benchlib import command_line, machine_info, md_table, save_result  # noqa: E402
from cases import GPT_100M  # noqa: E402

LAYOUTS = [("none", "none"), ("optimizer", "none"), ("full", "none"), ("none", "blocks"),
           ("full", "blocks")]  # fmt: skip
MODELS = {
    "lm100m": {
        "config": "configs/lm_stdlib.yaml",
        "overrides": [*GPT_100M, "data.global_batch_size=32"],
    },  # fmt: skip
    "resnet50": {
        "config": None,
        "overrides": [
            "model.name=resnet50",
            "model.stem=imagenet",
            "model.num_classes=1000",
            "data.name=synthetic",
            "data.image_size=224",
        ],
        "rows_per_device": 16,
    },  # fmt: skip
}


def abstract_batch(model: str, rows: int, mesh: Any) -> dict[str, Any]:
    """Shape structs of one global batch, split over the devices."""
    import jax
    import numpy as np

    from jddp.mesh import batch_sharded

    split = batch_sharded(mesh)
    if model == "resnet50":
        return {
            "images": jax.ShapeDtypeStruct((rows, 224, 224, 3), np.uint8, sharding=split),
            "labels": jax.ShapeDtypeStruct((rows,), np.int32, sharding=split),
        }
    return {
        "tokens": jax.ShapeDtypeStruct((rows, 129), np.uint8, sharding=split),
        "lengths": jax.ShapeDtypeStruct((rows,), np.int32, sharding=split),
    }


def abstract_state(cfg: Any, tx: Any, mesh: Any, layout: Any) -> tuple[Any, Any, int]:
    """The model's definition (its small constant part on the devices), the train state as
    shape structs laid out by ``layout``, and the parameter count."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding

    from jddp.build import build_model
    from jddp.mesh import put_replicated
    from jddp.state import abstract_train_state, split_model

    model_def, params, model_state = split_model(build_model(cfg, nnx.Rngs(0)))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    shapes = abstract_train_state(params, model_state, tx)
    del params
    specs = layout.state_specs(shapes)
    state = jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
        shapes,
        specs,
    )
    return put_replicated(model_def, mesh), state, count


def measure(model: str, shard: str, remat: str, devices: int) -> dict[str, Any]:
    """One row: the step of ``model`` under ``dist.shard=shard`` and ``model.remat=remat``."""
    import jax

    from jddp import XlaComm, load_config
    from jddp.build import build_layout, build_steps
    from jddp.mesh import make_mesh
    from jddp.optimizer import make_optimizer
    from jddp.run.memory import step_bytes

    spec = MODELS[model]
    config = str(benchlib.REPO / spec["config"]) if spec["config"] else None
    overrides = list(spec["overrides"])
    if "rows_per_device" in spec:
        overrides.append(f"data.global_batch_size={spec['rows_per_device'] * devices}")
    cfg = load_config(config, [*overrides, f"dist.shard={shard}", f"model.remat={remat}"])
    rows = cfg.data.global_batch_size
    mesh, comm = make_mesh(jax.devices()[:devices]), XlaComm()
    tx, schedule = make_optimizer(cfg.optim, rows, 1000)
    layout = build_layout(cfg, mesh, comm)
    model_def, state, params = abstract_state(cfg, tx, mesh, layout)
    step, _ = build_steps(cfg, model_def, tx, mesh, comm, schedule=schedule, layout=layout)
    compiled = step.lower(state, {"data": abstract_batch(model, rows, mesh)}).compile()
    stats = compiled.memory_analysis()
    return {
        "model": model,
        "params": params,
        "optimizer": cfg.optim.name,
        "global_batch_size": rows,
        "devices": devices,
        "shard": shard,
        "remat": remat,
        "state_bytes_per_device": layout.bytes_per_device(state),
        "step_bytes_per_device": step_bytes(compiled),
        "memory_analysis": {
            f: int(getattr(stats, f))
            for f in (
                "argument_size_in_bytes",
                "output_size_in_bytes",
                "alias_size_in_bytes",
                "temp_size_in_bytes",
            )
        },  # fmt: skip
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--devices", type=int, default=DEVICES)
    parser.add_argument("--machine", default=None, help="the machine's name in the results")
    parser.add_argument("--out", default=None, help="the JSON to write (default: results/)")
    args = parser.parse_args()
    info = machine_info(args.machine)
    rows = []
    md_table("model | dist.shard | model.remat | state MiB/device | x none | step MiB/device "
             "| x none", "llllrrr")  # fmt: skip
    base: dict[str, dict[str, int]] = {}
    for model in args.models:
        for shard, remat in LAYOUTS:
            row = measure(model, shard, remat, args.devices)
            rows.append(row)
            ref = base.setdefault(model, row)
            state, step = row["state_bytes_per_device"], row["step_bytes_per_device"]
            print(
                f"| {model} ({row['params'] / 1e6:.1f}M, {row['optimizer']}, "
                f"b{row['global_batch_size']}) | {shard} | {remat} | {state / 2**20:.1f} "
                f"| {state / ref['state_bytes_per_device']:.3f} | {step / 2**20:.1f} "
                f"| {step / ref['step_bytes_per_device']:.3f} |",
                flush=True,
            )
    result = {"machine": info, "command": command_line(), "devices": args.devices, "rows": rows}
    save_result("memory", info["name"], result, args.out)


if __name__ == "__main__":
    main()
