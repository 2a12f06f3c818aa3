"""What computing the non-finite check once (``jddp.step.computed_once``) does to the train step:
its optimised HLO's size, its compile time and its step time, against the same step with the
check left for XLA to copy into every select (``computed_once`` replaced by the identity here,
nowhere in jddp).

    .venv/bin/python experiments/bench_finite_check.py [--steps 30] [--smoke]

On a GPU: ``cases.py``'s ``rn50-gpu`` (ResNet-50, bf16, 224 px, global batch 256, SGD); the
step built as the trainer builds it (``jddp.build.build_steps``), in this process, without the
compilation cache; each variant compiled, warmed up, then ``--steps`` steps timed one by one
(``block_until_ready``), in alternating order over ``--rounds``. ``--smoke``: the tests' tiny
ResNet-10 on the CPU. Prints a table, writes ``results/finite-check-<date>-<machine>.json``.
"""

from __future__ import annotations

import argparse
import re
import time

import benchlib
from cases import CASES, case

VARIANTS = ("once", "copied")  # jddp's step; the check copied into every select (before)


def overrides(smoke: bool) -> list[str]:
    """The trainer case's ``key=value`` overrides."""
    if smoke:
        return case("tiny", "model.name=resnet10", "model.sync_batchnorm=false")
    return [o for o in CASES["rn50-gpu"] if "=" in o]


def build(cfg, variant: str):
    """The trainer's step, state and one placed batch, with ``variant``'s check."""
    import jax
    import numpy as np
    from flax import nnx

    import jddp.step
    from jddp import XlaComm, build_steps, create_train_state, make_mesh
    from jddp.build import build_model
    from jddp.data.loader import place_batch, process_rows_of
    from jddp.optimizer import make_optimizer

    once = jddp.step.computed_once
    jddp.step.computed_once = once if variant == "once" else (lambda flag: flag)
    try:
        mesh = make_mesh(jax.devices()[:1])
        rows, size = cfg.data.global_batch_size, cfg.data.image_size
        tx, schedule = make_optimizer(cfg.optim, rows, 1000)
        model_def, state = create_train_state(build_model(cfg, nnx.Rngs(0)), tx, mesh)
        step, _ = build_steps(cfg, model_def, tx, mesh, XlaComm(), schedule=schedule)
        rng = np.random.default_rng(0)
        images = rng.integers(0, 255, (rows, size, size, 3), dtype=np.uint8)
        labels = rng.integers(0, cfg.model.num_classes, rows).astype(np.int32)
        local = {"images": images, "labels": labels}
        batch = {"data": place_batch(local, mesh, process_rows_of(mesh, rows))}
        start = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        compile_s = time.perf_counter() - start
    finally:
        jddp.step.computed_once = once
    text = compiled.as_text()
    return (
        compiled,
        state,
        batch,
        {
            "compile_s": compile_s,
            "hlo_instructions": len(re.findall(r"^\s*(?:ROOT )?%\S+ = ", text, re.M)),
            "and_instructions": len(re.findall(r" and\(", text)),
        },
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant and round")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="the tiny ResNet-10 on the CPU")
    ap.add_argument("--copied-first", action="store_true", help="compile 'copied' first")
    benchlib.output_args(ap)
    args = ap.parse_args(argv)
    import jax

    from jddp import load_config

    cfg = load_config(None, overrides(args.smoke))
    order = VARIANTS[::-1] if args.copied_first else VARIANTS  # the first compile pays warm-up
    built = {v: build(cfg, v) for v in order}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in order if r % 2 == 0 else order[::-1]:
            compiled, state, batch, _ = built[v]
            for i in range(args.warmup + args.steps):
                start = time.perf_counter()
                state, metrics = compiled(state, batch)
                jax.block_until_ready((state, metrics))
                if i >= args.warmup:
                    times[v].append(time.perf_counter() - start)
            built[v] = (compiled, state, batch, built[v][3])
    rows = {}
    benchlib.md_table(
        "variant | HLO instructions | and | compile s | step ms median | p10 | p90", "lr"
    )
    for v in VARIANTS:
        stats = benchlib.median_p10_p90(times[v])
        rows[v] = {**built[v][3], "step_s": stats, "steps_timed": len(times[v])}
        ms = [f"{stats[k] * 1e3:.2f}" for k in ("median", "p10", "p90")]
        cells = [v, rows[v]["hlo_instructions"], rows[v]["and_instructions"]]
        print(" | ".join(["", *map(str, cells), f"{rows[v]['compile_s']:.1f}", *ms, ""]).strip())
    result = {
        "what": "the train step with the non-finite check computed once vs copied into every "
        "select (jddp.step.computed_once replaced by the identity)",
        "command": benchlib.command_line(),
        "machine": benchlib.machine_info(args.machine, {"device": str(jax.devices()[0])}),
        "overrides": overrides(args.smoke),
        "variants": rows,
    }
    benchlib.save_result("finite-check", args.machine or benchlib.machine_info()["name"], result,
                         args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
