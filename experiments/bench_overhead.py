"""Overhead of jddp's data-parallel step on one device, and the trainer's input-wait fraction.

    .venv/bin/python experiments/bench_overhead.py                  # ~3-4 min on a 2-core VM
    .venv/bin/python experiments/bench_overhead.py --width 16 --rounds 10 --no-trainer  # quick

1. **Step overhead**: jddp's train step as the trainer builds it (``jddp.build.build_steps`` on
   a 1-device mesh, ``XlaComm``, the ``sys/stop`` flag column in the batch) against a plain
   ``jax.jit`` step written out by hand (same ResNet-18, weights, optax SGD-momentum update,
   BatchNorm statistics carried, state donated, the same batch on the device), each compiled
   once (XLA's FLOPs and all-reduce count reported), timed interleaved for ``--rounds`` rounds
   with the order rotating, plus an A/A control (the plain step again with its own buffers).
   Ratios of medians and medians of per-round ratios, with 95% bootstrap intervals.
2. **Input wait**: the trainer (``benchlib.run_trainer``) on ``configs/digits.yaml`` and on
   synthetic 32 px data; its logged ``perf/input_wait_fraction`` windows and run mean (< 5%).

Prints the tables and writes ``results/overhead-<date>-<machine>.json``. The method in full:
``experiments/README.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import RESULTS_DIR, machine_info, percentile, run_trainer, unused_path, write_json
from cases import case

WAIT_KEY = "perf/input_wait_fraction"
TARGET_OVERHEAD = 0.02
TARGET_WAIT = 0.05


# ------------------------------------------------------------------------------ step overhead
def build_steps(
    width: int, batch: int, image_size: int, lr: float, control: bool = True
) -> dict[str, Any]:
    """Both compiled steps, their states and batches on the device, and their XLA costs.

    Returns ``{"jddp": side, "plain": side, "stop_flag": fn}`` (plus ``"plain-copy"``, the
    plain step again with its own state buffers, when ``control``: timed against ``plain`` it
    shows the bias and noise of the method itself) where a side is a dict with
    ``step`` (the compiled program), ``state``, ``batch``, ``compile_s``, ``flops``,
    ``bytes_accessed`` and ``all_reduces`` (count in the optimised HLO).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from jddp import XlaComm, build_steps, create_train_state, load_config, make_mesh
    from jddp.data.loader import batch_layout, place_batch  # jddp-internal: the trainer's
    from jddp.models import resnet18
    from jddp.run.stop import StopRequest  # placement and its per-step stop flag, as it adds them

    dtype = jnp.float32
    num_classes = 10

    def model() -> nnx.Module:
        return resnet18(
            num_classes=num_classes, stem="cifar", width=width, dtype=dtype, rngs=nnx.Rngs(0)
        )

    rng = np.random.default_rng(1)
    images = rng.standard_normal((batch, image_size, image_size, 3), dtype=np.float32)
    labels = rng.integers(0, num_classes, batch).astype(np.int32)
    tx = optax.sgd(lr, momentum=0.9)

    # A: jddp, as the trainer builds it (jddp.build.build_steps on a 1-device mesh + stop flags).
    mesh = make_mesh(jax.devices()[:1])
    layout = batch_layout(mesh, batch)
    model_def, jstate = create_train_state(model(), tx, mesh)
    jstep, _ = build_steps(load_config(), model_def, tx, mesh, XlaComm())
    jbatch = place_batch({"images": images, "labels": labels}, mesh, layout)

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

    pjit_step = jax.jit(plain_step, donate_argnums=0)

    def compile_side(fn, state, batch) -> dict[str, Any]:
        t0 = time.perf_counter()
        compiled = fn.lower(state, batch).compile()
        compile_s = time.perf_counter() - t0
        cost = compiled.cost_analysis()
        if isinstance(cost, list | tuple):
            cost = cost[0] if cost else {}
        cost = cost or {}
        hlo = compiled.as_text() or ""
        return {
            "step": compiled,
            "state": state,
            "batch": batch,
            "compile_s": compile_s,
            "flops": cost.get("flops"),
            "bytes_accessed": cost.get("bytes accessed"),
            "all_reduces": len(re.findall(r"\ball-reduce(?:-start)?\(", hlo)),
            "hlo_instructions": sum(1 for line in hlo.splitlines() if " = " in line),
        }

    sides = {
        "jddp": compile_side(jstep, jstate, jbatch),
        "plain": compile_side(pjit_step, plain_state(), pbatch),
    }
    if control:
        sides["plain-copy"] = compile_side(
            jax.jit(plain_step, donate_argnums=0), plain_state(), pbatch
        )
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


def time_stop_flag(stop_flag, n: int = 200) -> list[float]:
    """Host seconds of the trainer's per-step ``sys/stop`` placement (``n`` calls)."""
    import jax

    out = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(stop_flag())
        out.append(time.perf_counter() - t)
    return out


def ratio_stats(
    a: list[float], b: list[float], resamples: int = 2000, seed: int = 0
) -> dict[str, Any]:
    """``a`` / ``b`` for step times timed in the same rounds.

    ``of_medians``: median(a) / median(b). ``paired_*``: the per-round ratios a_i / b_i (steps
    run seconds apart), their median and p10-p90. Both get a 95% bootstrap interval (rounds
    resampled with replacement, fixed seed): how far this run's noise alone could move them.
    """
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
    out: dict[str, Any] = {
        name: {
            "median_s": statistics.median(ts),
            "p10_s": percentile(ts, 0.1),
            "p90_s": percentile(ts, 0.9),
            "n": len(ts),
        }
        for name, ts in times.items()
    }
    out["ratios"] = {
        f"{name}/plain": ratio_stats(times[name], times["plain"])
        for name in times
        if name != "plain"
    }
    return out


# ----------------------------------------------------------------------------------- input wait
def input_wait(label: str, overrides: list[str], workdir: Path, log) -> dict[str, Any]:
    """One trainer run (:func:`benchlib.run_trainer`): its logged input-wait windows and the
    run's mean (wait seconds / wall seconds over all windows). Raises SystemExit if it fails."""
    log(f"  {label}: python -m jddp.train {' '.join(overrides)}")
    run = run_trainer(workdir, overrides)
    fractions, step_s = run["input_wait_fraction"], run["step_s"]
    # Each window's wall time = its mean step time x its steps (windows start after step 1).
    starts = [1, *run["steps"][:-1]]
    walls = [(s - s0) * t for s, s0, t in zip(run["steps"], starts, step_s, strict=True)]
    m = re.search(r"input wait\s+([0-9.]+)%", run["stdout_tail"])
    return {
        "label": label,
        "command": "python -m jddp.train " + " ".join(overrides),
        "run_mean_fraction": sum(f * w for f, w in zip(fractions, walls, strict=True)) / sum(walls),
        "summary_mean_percent": float(m.group(1)) if m else None,  # as the summary prints it
        "window_median": statistics.median(fractions),
        "window_max": max(fractions),
        "step_time_median_s": statistics.median(step_s),
        "compile_s": run["compile_s"],
        "windows": [
            {"step": s, "wait_fraction": f, "step_time_s": t}
            for s, f, t in zip(run["steps"], fractions, step_s, strict=True)
        ],  # fmt: skip
        "wall_s": run["wall_s"],
    }


# ------------------------------------------------------------------------------------ report
LABELS = {
    "jddp": "jddp make_train_step (1-device mesh)",
    "plain": "plain jax.jit",
    "plain-copy": "plain jax.jit, 2nd copy (A/A control)",
}


def print_table(result: dict[str, Any]) -> None:
    """The step-overhead and input-wait tables in Markdown."""
    s = result["step_overhead"]
    st = s["stats"]
    print("\n| step | median s | p10–p90 s | XLA GFLOP | all-reduces | compile s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, c in s["compiled"].items():
        gf = f"{c['flops'] / 1e9:.3f}" if c["flops"] is not None else "–"
        print(
            f"| {LABELS.get(name, name)} | {st[name]['median_s']:.4f} | {st[name]['p10_s']:.4f}–"
            f"{st[name]['p90_s']:.4f} | {gf} | {c['all_reduces']} | {c['compile_s']:.1f} |"
        )
    print(
        "\n| ratio | of medians (95% bootstrap) | paired per round: median (95% bootstrap) "
        "| paired p10–p90 |"
    )
    print("|---|---:|---:|---:|")
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
    if result.get("input_wait"):
        print(
            "\n| trainer run | step s (median) | input wait: run mean | window median | "
            "window max |"
        )
        print("|---|---:|---:|---:|---:|")
        for r in result["input_wait"]:
            if "error" in r:
                print(f"| {r['label']} | failed: {r['error'][:200]} | | | |")
                continue
            print(
                f"| {r['label']} | {r['step_time_median_s']:.4f} | "
                f"{100 * r['run_mean_fraction']:.3f}% | {100 * r['window_median']:.3f}% | "
                f"{100 * r['window_max']:.3f}% |"
            )
        print(f"target: input wait < {100 * TARGET_WAIT:.0f}%")


def main(argv: list[str] | None = None) -> int:
    """Run both measurements, print the tables, write the JSON file."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=32, help="ResNet-18 base width (64 standard)")
    p.add_argument("--batch", type=int, default=64, help="images per step")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each before timing")
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds (one step each)")
    p.add_argument("--trainer-steps", type=int, default=40, help="steps of each trainer run")
    p.add_argument("--no-trainer", action="store_true", help="skip the input-wait runs")
    p.add_argument(
        "--no-control", action="store_true", help="skip the A/A control (a 2nd plain step)"
    )
    p.add_argument("--machine", default=None, help="machine name in the file name")
    p.add_argument("--out", default=None, help="JSON path (default: results/overhead-...)")
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import jax

    date = datetime.date.today().isoformat()
    machine = machine_info(args.machine)
    machine["loadavg_before"] = os.getloadavg()
    machine["jax_backend"] = jax.default_backend()
    machine["device_kind"] = jax.devices()[0].device_kind
    command = " ".join([Path(sys.executable).name, *sys.argv] if argv is None else argv)
    log(
        f"bench_overhead: {machine['cpu_model']} x{machine['cpu_count']}, commit "
        f"{machine['git_commit']}{' (dirty)' if machine['git_dirty'] else ''}; "
        f"ResNet-18 cifar width {args.width}, batch {args.batch}, {args.image_size}px"
    )

    log("step overhead: compiling both steps")
    sides = build_steps(
        args.width, args.batch, args.image_size, lr=0.01, control=not args.no_control
    )
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
        "stop_flag_s": time_stop_flag(stop_flag),
    }
    del sides

    input_wait_runs = []
    if not args.no_trainer:
        log("input wait: the real trainer")
        with tempfile.TemporaryDirectory(prefix="jddp-overhead-") as tmp:
            more = [f"train.steps={args.trainer_steps}", "train.eval_every_steps=0",
                    "checkpoint.every_steps=0", "log.every_steps=5"]  # fmt: skip
            synthetic = [
                "model.name=resnet18", "model.stem=cifar", f"model.width={args.width}",
                "data.name=synthetic", f"data.image_size={args.image_size}",
                f"data.global_batch_size={args.batch}", "optim.lr=0.01", "log.progress=off",
            ]  # fmt: skip
            runs = [
                ("configs/digits.yaml", case("digits", *more), "digits"),
                (f"synthetic 32px, width {args.width}, batch {args.batch}", synthetic + more,
                 "synthetic"),
            ]  # fmt: skip
            for label, overrides, name in runs:
                try:
                    input_wait_runs.append(input_wait(label, overrides, Path(tmp) / name, log))
                except SystemExit as e:
                    log(f"  {e}")
                    input_wait_runs.append({"label": label, "error": str(e)})

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
        "input_wait": input_wait_runs,
    }
    print_table(result)
    out = args.out or unused_path(RESULTS_DIR, f"overhead-{date}-{machine['name']}")
    write_json(Path(out), json.loads(json.dumps(result, default=float)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
