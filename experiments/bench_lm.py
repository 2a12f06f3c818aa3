"""The language-model example through the trainer: held-out loss, tokens/s and MFU.

    .venv/bin/python experiments/bench_lm.py [--configs 1x1,2x1] [--steps 600] [--skip 40]
        [--platform cpu|gpu] [--peak-tflops T] [--machine NAME] [--out PATH] [--quick]
        [--size 100m] [--layouts none,full,none+blocks] [--set KEY=VALUE ...]

``python -m jddp.train --config configs/lm_stdlib.yaml`` as ``PxD`` (:func:`benchlib.run_trainer`):
final ``eval/loss`` (nats per byte) against the unigram baseline, ``train/tokens_per_s``, model
FLOPs (:func:`step_flops`), GFLOP/s and MFU, and the step's memory per device as the run logs it
(``mem/step_bytes_per_device``). ``--size 100m``: the GPT scaled to ~100M parameters
(``cases.GPT_100M``); ``--layouts``: each ``dist.shard`` value (``SHARD+REMAT``: with that
``model.remat``) run in turn on every config; ``--set``: more overrides (e.g.
``train.precision=bfloat16 data.global_batch_size=256``). Writes
``results/lm-<date>-<machine>.json``.

On a lent GPU, the 100M GPT in bfloat16 under each layout (``gpu_session.sh shard``)::

    python3 experiments/bench_lm.py --platform gpu --peak-tflops 989 --configs 1x1 --size 100m \
        --layouts none,full,none+blocks --steps 120 --skip 40 \
        --set train.precision=bfloat16 data.global_batch_size=256
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

import benchlib
from cases import GPT_100M, with_overrides

CONFIG = "configs/lm_stdlib.yaml"
SIZES = {"config": [], "100m": GPT_100M}  # --size: the model's overrides


def step_flops(config: dict) -> float:
    """Model FLOPs of one train step: 6 x the forward MACs of one full-length sequence (traced,
    :func:`benchlib.forward_macs`; padding is computed too) x the global batch."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from examples import lm_stdlib

    seq_len = config["data"]["options"]["seq_len"]
    abstract = nnx.eval_shape(lambda: lm_stdlib.gpt(config["model"], jnp.float32, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)

    def forward(state, tokens):
        return nnx.merge(graphdef, state)(tokens)

    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    macs = benchlib.forward_macs(forward, state, tokens)
    return 6.0 * macs * config["data"]["global_batch_size"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="1x1,2x1", help="PxD: processes x devices each")
    ap.add_argument("--steps", type=int, default=600, help="train.steps (the config's: 600)")
    ap.add_argument("--skip", type=int, default=40, help="windows ending after this step timed")
    ap.add_argument("--platform", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--peak-tflops", type=float, help="peak for MFU (CPU default: assumed)")
    ap.add_argument("--quick", action="store_true", help="smoke run, numbers meaningless")
    ap.add_argument("--size", choices=list(SIZES), default="config", help="config: the file's")
    ap.add_argument("--layouts", default="none", help="dist.shard values (SHARD+REMAT)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides")
    benchlib.output_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.skip = 20, 5

    from examples import lm_stdlib
    from jddp import config as config_lib

    base = with_overrides([*SIZES[args.size], f"train.steps={args.steps}"], *args.set)
    config = config_lib.to_dict(config_lib.load(benchlib.REPO / CONFIG, base))
    flops = step_flops(config)
    train, evals = lm_stdlib.data(config["data"])
    baseline = lm_stdlib.unigram_baseline(train, evals)
    machine = benchlib.machine_info(args.machine)
    peak, peak_note = benchlib.peak_flops(machine, args.platform, args.peak_tflops)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec, layout in itertools.product(args.configs.split(","), args.layouts.split(",")):
            nproc, devices = (int(x) for x in spec.split("x"))
            overrides = with_overrides(
                ["--config", CONFIG, *base, "log.progress=off"], *benchlib.layout_overrides(layout)
            )
            run = benchlib.run_trainer(
                Path(tmp) / f"{spec}-{layout}",
                overrides,
                nproc=nproc,
                devices=devices,
                skip_steps=args.skip,
            )
            rows = run.pop("timed_rows")
            step_s = benchlib.median_p10_p90(run["step_s"])
            tokens_s = benchlib.median_p10_p90([r["train/tokens_per_s"] for r in rows])
            achieved = flops / step_s["median"]
            records.append(
                {
                    "config": spec,
                    "layout": layout,
                    "eval_loss": run["eval"]["eval/loss"],
                    "eval_accuracy": run["eval"]["eval/accuracy"],
                    "tokens_per_s": tokens_s,
                    "examples_per_s": benchlib.median_p10_p90(run["img_per_s"]),
                    "step_s": step_s,
                    "compile_s": run["compile_s"],
                    "wall_s": run["wall_s"],
                    "achieved_gflops": achieved / 1e9,
                    "mfu": achieved / peak if peak else None,
                    "memory": run["memory"],
                    "command": run["command"],
                }
            )
    print(
        f"\nunigram baseline {baseline:.4f} nats/byte; model FLOPs/step {flops / 1e9:.2f} G; "
        f"{peak_note}\n"
    )
    benchlib.md_table(
        "config | layout | eval loss (nats/byte) | tokens/s | step s | GFLOP/s | MFU "
        "| step MiB/device | compile s | wall s",
        "llr",
    )
    for r in records:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        step_bytes = r["memory"].get("mem/step_bytes_per_device")
        mib = f"{step_bytes / 2**20:,.1f}" if step_bytes else "-"
        print(
            f"| {r['config']} | {r['layout']} | {r['eval_loss']:.4f} | "
            f"{r['tokens_per_s']['median']:,.0f} | {r['step_s']['median']:.4f} | "
            f"{r['achieved_gflops']:.1f} | {mfu} | {mib} | {r['compile_s'] or 0:.1f} | "
            f"{r['wall_s']:.0f} |"
        )
    result = {
        "machine": machine,
        "command": benchlib.command_line(),
        "config_file": CONFIG,
        "overrides": base,
        "config": config,
        "steps": args.steps,
        "skip": args.skip,
        "quick": args.quick,
        "unigram_baseline": baseline,
        "step_flops": flops,
        "peak_flops": peak,
        "peak_note": peak_note,
        "records": records,
    }
    benchlib.save_result("lm", machine["name"] + "-quick" * args.quick, result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
