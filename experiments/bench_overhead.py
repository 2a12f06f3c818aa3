"""Overhead of jddp's data-parallel step on one device against a plain ``jax.jit`` step.

    .venv/bin/python experiments/bench_overhead.py                  # ~2 min on a 2-core VM
    .venv/bin/python experiments/bench_overhead.py --width 16 --rounds 10   # quick

jddp's train step as the trainer builds it against a plain ``jax.jit`` step written out by hand,
timed interleaved, with an A/A control (:func:`build_steps`). The method in full:
``experiments/README.md``. Writes ``results/overhead-<date>-<machine>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time
from typing import Any

import benchlib
from benchlib import machine_info, percentile

TARGET_OVERHEAD = 0.02


# ------------------------------------------------------------------------------ step overhead
def build_steps(width: int, batch: int, image_size: int, lr: float) -> dict[str, Any]:
    """``{"jddp": side, "plain": side, "plain-copy": side, "stop_flag": fn}``: a side is the
    compiled ``step``, its ``state`` and ``batch`` on the device, ``compile_s`` and XLA's costs
    (``flops``, ``all_reduces``, ...); ``plain-copy`` is the plain step again, its own buffers."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from jddp import XlaComm, build_steps, create_train_state, load_config, make_mesh
    from jddp.data.loader import place_batch, process_rows_of  # jddp-internal: the trainer's
    from jddp.models import resnet18
    from jddp.proc.signals import (
        StopRequest,  # placement and its per-step stop flag, as it adds them
    )

    dtype = jnp.float32

    def model() -> nnx.Module:
        return resnet18(num_classes=10, stem="cifar", width=width, dtype=dtype, rngs=nnx.Rngs(0))

    rng = np.random.default_rng(1)
    images = rng.standard_normal((batch, image_size, image_size, 3), dtype=np.float32)
    labels = rng.integers(0, 10, batch).astype(np.int32)
    tx = optax.sgd(lr, momentum=0.9)

    # A: jddp, as the trainer builds it (jddp.build.build_steps on a 1-device mesh + stop flags).
    mesh = make_mesh(jax.devices()[:1])
    layout = process_rows_of(mesh, batch)
    model_def, jstate = create_train_state(model(), tx, mesh)
    jstep, _ = build_steps(load_config(), model_def, tx, mesh, XlaComm())
    jbatch = {"data": place_batch({"images": images, "labels": labels}, mesh, layout)}

    def stop_flag() -> dict[str, jax.Array]:  # what the loop adds to every batch
        rows = layout.rows.stop - layout.rows.start
        return place_batch(StopRequest().flags(rows), mesh, layout)

    jbatch = {**jbatch, **stop_flag()}

    # B: a plain single-device jax.jit step, written out by hand.
    device = jax.devices()[0]
    graphdef, params, stats, rest = nnx.split(model(), nnx.Param, nnx.BatchStat, ...)
    pbatch = jax.device_put((images, labels), device)

    def plain_state():  # fresh buffers: each side donates its own
        state = (params, stats, tx.init(params))
        return jax.device_put(jax.tree.map(lambda x: np.array(x, copy=True), state), device)

    def plain_step(state, batch):
        params, stats, opt_state = state
        images, labels = batch

        def loss_fn(p):
            m = nnx.merge(graphdef, p, stats, rest, copy=True)
            m.train()
            logits = m(images.astype(dtype))
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), labels
            ).mean()
            return loss, (logits, nnx.state(m, nnx.BatchStat))

        (loss, (logits, new_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        accuracy = (jnp.argmax(logits, -1) == labels).astype(jnp.float32).mean()
        return (params, new_stats, opt_state), {"loss": loss, "accuracy": accuracy}

    def compile_side(fn, state, batch) -> dict[str, Any]:
        t0 = time.perf_counter()
        compiled = fn.lower(state, batch).compile()
        side = {"step": compiled, "state": state, "batch": batch}
        cost, hlo = benchlib.xla_cost(compiled), compiled.as_text() or ""
        return {
            **side,
            "compile_s": time.perf_counter() - t0,
            "flops": cost.get("flops"),
            "bytes_accessed": cost.get("bytes accessed"),
            "all_reduces": len(re.findall(r"\ball-reduce(?:-start)?\(", hlo)),
            "hlo_instructions": sum(1 for line in hlo.splitlines() if " = " in line),
        }

    sides = {"jddp": compile_side(jstep, jstate, jbatch)}
    for name in ("plain", "plain-copy"):  # the copy: the method's own bias and noise (A/A)
        sides[name] = compile_side(jax.jit(plain_step, donate_argnums=0), plain_state(), pbatch)
    return {**sides, "stop_flag": stop_flag}


def time_steps(sides: dict[str, Any], warmup: int, rounds: int, log) -> dict[str, list[float]]:
    """Warm every side up, then time them interleaved, the order rotating each round
    (A B C, B C A, C A B, ...; A B, B A with two); returns every timed step per side."""
    import jax

    def one(side: dict[str, Any]) -> float:
        t = time.perf_counter()
        state, metrics = side["step"](side["state"], side["batch"])
        jax.block_until_ready((state, metrics))
        dt = time.perf_counter() - t
        side["state"] = state  # the old buffers were donated
        return dt

    names = list(sides)
    for name in names:
        side = sides[name]
        side["warmup_s"] = [one(side) for _ in range(warmup)]
        log(f"  warm-up {name}: " + ", ".join(f"{t:.3f}" for t in side["warmup_s"]) + " s")
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(one(sides[name]))
        if (r + 1) % max(1, rounds // 5) == 0:
            last = ", ".join(f"{n} {times[n][-1]:.3f} s" for n in names)
            log(f"  round {r + 1}/{rounds}: {last}")
    return times


def ratio_stats(
    a: list[float], b: list[float], resamples: int = 2000, seed: int = 0
) -> dict[str, Any]:
    """``a`` / ``b`` timed in the same rounds: ``of_medians`` and the per-round ratios'
    ``paired_*`` median and p10-p90, each with a 95% bootstrap interval (rounds resampled)."""
    import numpy as np

    x, y = np.asarray(a), np.asarray(b)
    paired = x / y
    idx = np.random.default_rng(seed).integers(0, len(x), (resamples, len(x)))
    boot_of_medians = np.median(x[idx], axis=1) / np.median(y[idx], axis=1)
    boot_paired = np.median(paired[idx], axis=1)
    return {
        "of_medians": float(np.median(x) / np.median(y)),
        "of_medians_ci95": [float(v) for v in np.percentile(boot_of_medians, [2.5, 97.5])],
        "paired_median": float(np.median(paired)),
        "paired_p10": percentile(list(paired), 0.1),
        "paired_p90": percentile(list(paired), 0.9),
        "paired_median_ci95": [float(v) for v in np.percentile(boot_paired, [2.5, 97.5])],
    }


def summarise_steps(times: dict[str, list[float]]) -> dict[str, Any]:
    """Median and p10-p90 of every side, and the ratios ``jddp/plain`` (the overhead) and
    ``plain-copy/plain`` (the A/A control: what the method reports for identical programs)."""
    out: dict[str, Any] = {}
    for name, ts in times.items():
        stats = benchlib.median_p10_p90(ts)
        out[name] = {
            "median_s": stats["median"],
            "p10_s": stats["p10"],
            "p90_s": stats["p90"],
            "n": len(ts),
        }
    out["ratios"] = {
        f"{name}/plain": ratio_stats(times[name], times["plain"])
        for name in times
        if name != "plain"
    }
    return out


# ------------------------------------------------------------------------------------ report
LABELS = {
    "jddp": "jddp make_train_step (1-device mesh)",
    "plain": "plain jax.jit",
    "plain-copy": "plain jax.jit, 2nd copy (A/A control)",
}


def print_table(result: dict[str, Any]) -> None:
    """The step-overhead tables in Markdown."""
    s = result["step_overhead"]
    st = s["stats"]
    print()
    benchlib.md_table("step | median s | p10–p90 s | XLA GFLOP | all-reduces | compile s", "lr")
    for name, c in s["compiled"].items():
        gf = f"{c['flops'] / 1e9:.3f}" if c["flops"] is not None else "–"
        print(
            f"| {LABELS.get(name, name)} | {st[name]['median_s']:.4f} | {st[name]['p10_s']:.4f}–"
            f"{st[name]['p90_s']:.4f} | {gf} | {c['all_reduces']} | {c['compile_s']:.1f} |"
        )
    print()
    benchlib.md_table(
        "ratio | of medians (95% bootstrap) | paired per round: median (95% bootstrap) | "
        "paired p10–p90",
        "lr",
    )
    for key, r in st["ratios"].items():
        lo, hi = r["of_medians_ci95"]
        plo, phi = r["paired_median_ci95"]
        print(
            f"| {key} | {r['of_medians']:.4f} ({lo:.4f}–{hi:.4f}) | {r['paired_median']:.4f} "
            f"({plo:.4f}–{phi:.4f}) | {r['paired_p10']:.4f}–{r['paired_p90']:.4f} |"
        )
    print(
        f"\nXLA FLOPs jddp / plain: {s['flops_ratio']:.5f}; target: step ratio ≤ "
        f"{1 + TARGET_OVERHEAD:.2f}"
    )
    sf = s["stop_flag_s"]
    print(f"trainer's per-step stop-flag placement: median {statistics.median(sf) * 1e6:.0f} µs")


def main(argv: list[str] | None = None) -> int:
    """Run both measurements, print the tables, write the JSON file."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=32, help="ResNet-18 base width (64 standard)")
    p.add_argument("--batch", type=int, default=64, help="images per step")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each before timing")
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds (one step each)")
    benchlib.output_args(p)
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import jax

    date = datetime.date.today().isoformat()
    machine = machine_info(args.machine)
    machine["loadavg_before"] = os.getloadavg()
    machine["jax_backend"] = jax.default_backend()
    machine["device_kind"] = jax.devices()[0].device_kind
    command = benchlib.command_line() if argv is None else " ".join(argv)
    log(f"step overhead: compiling, ResNet-18 width {args.width}, batch {args.batch}")
    sides = build_steps(args.width, args.batch, args.image_size, lr=0.01)
    stop_flag = sides.pop("stop_flag")
    log("  compiled: " + ", ".join(f"{k} {v['compile_s']:.1f} s" for k, v in sides.items()))
    times = time_steps(sides, args.warmup, args.rounds, log)
    compiled = {
        k: {f: v for f, v in s.items() if f not in ("step", "state", "batch")}
        for k, s in sides.items()
    }
    fj, fp = compiled["jddp"]["flops"], compiled["plain"]["flops"]
    step_overhead = {
        "stats": summarise_steps(times),
        "compiled": compiled,
        "flops_ratio": fj / fp if fj and fp else None,
        "times_s": times,
        "stop_flag_s": benchlib.call_times(lambda: jax.block_until_ready(stop_flag()), 200),
    }
    del sides

    machine["loadavg_after"] = os.getloadavg()
    result = {
        "benchmark": "overhead",
        "date": date,
        "machine": machine,
        "command": command,
        "method": {
            **vars(args),
            "model": "jddp.models.resnet18, stem=cifar, 10 classes, float32",
            "optimizer": "optax.sgd(0.01, momentum=0.9)",
            "timing": "wall time of one call until outputs are ready; interleaved, order "
            "rotating each round; each side compiled once via lower().compile()",
        },  # fmt: skip
        "step_overhead": step_overhead,
        "input_wait": [],  # its runs were removed on 2026-11-25 (RESULTS.md, "Overhead")
    }
    print_table(result)
    benchlib.save_result(
        "overhead", machine["name"], json.loads(json.dumps(result, default=float)), args.out
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
