"""Input pipeline throughput: the host pipeline alone, and end to end against the step alone.

Three data sets, each with the augmentation a real recipe would use:

* ``mem224``: in-memory uint8 224x224x3 (no augmentation; 512 images, batch 256);
* ``cifar``: in-memory uint8 32x32x3 with ``data.augment=cifar`` (8,192 images, batch 512);
* ``jpeg``: an image folder of 500x375 JPEGs (quality 90) cut from scikit-learn's two sample
  photos, decoded to 224 with ``data.augment=imagenet`` (random-resized crop in the decode,
  JPEG DCT-scaled ``draft``; batch 128).

For each: (1) the pipeline alone, ``HostBatches`` through ``host_iterator``, images/s against
the number and kind of workers; (2) the step alone: jddp's jitted train step with a nearly free
model (mean over every 8th row and column + dense, so the input is all there is), the batch
already placed;
(3) end to end: ``TrainBatches.iterate`` (host workers + placement thread) feeding that step.
"Input efficiency" = end-to-end images/s / step-alone images/s.

    .venv/bin/python experiments/bench_input.py                # ~3 min on the 2-core VM
    .venv/bin/python experiments/bench_input.py --cases jpeg --workers 0,1,2,4

Prints a table and writes ``experiments/results/input-<date>-<machine>.json`` (``-runN`` when it
exists), with the machine, commit and the 1-minute load average before and after each case.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import REPO, RESULTS_DIR, machine_info, unused_path  # noqa: E402

sys.path.insert(0, str(REPO))

CASES = {
    "mem224": {"size": 224, "n": 512, "batch": 256, "augment": "none"},
    "cifar": {"size": 32, "n": 8192, "batch": 512, "augment": "cifar"},
    "jpeg": {"size": 224, "n": 320, "batch": 128, "augment": "imagenet"},
}


def make_jpeg_folder(root: Path, n: int) -> Path:
    """``n`` 500x375 JPEGs (q90): random crops (scaled 0.6-1x) of the two sample photos."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(p) for p in load_sample_images().images]  # 427x640 each
    rng = np.random.default_rng(0)
    for i in range(n):
        photo = photos[i % 2]
        scale = rng.uniform(0.6, 1.0)
        w, h = int(640 * scale), int(427 * scale)
        left, top = rng.integers(0, 640 - w + 1), rng.integers(0, 427 - h + 1)
        img = photo.resize(
            (500, 375), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h)
        )
        if rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        for split in ("train",) if i >= 8 else ("train", "val"):
            folder = root / split / f"c{i % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            img.save(folder / f"{i:04d}.jpg", quality=90)
    return root


def make_source(case: str, spec: dict, tmp: Path):
    from jddp.data.formats.imagefolder import ImageFolderSource
    from jddp.data.source import ArraySource

    if case == "jpeg":
        return ImageFolderSource(make_jpeg_folder(tmp / "jpeg", spec["n"]), spec["size"])
    rng = np.random.default_rng(0)
    shape = (spec["n"], spec["size"], spec["size"], 3)
    images = rng.integers(0, 256, shape, dtype=np.uint8)
    labels = rng.integers(0, 10, spec["n"])
    return ArraySource(images, labels, 10, [0.5] * 3, [0.25] * 3, case)


def pipeline_alone(source, spec, workers: int, kind: str, steps: int) -> dict:
    """Images/s of the host pipeline alone (first batch, incl. worker start, excluded)."""
    from jddp.data.pipeline import HostBatches, host_iterator

    host = HostBatches(source, spec["batch"], 0, slice(0, spec["batch"]), spec["augment"])
    it = host_iterator(host, range(steps + 1), workers, kind)
    try:
        next(it)
        start = time.perf_counter()
        count = sum(1 for _ in it)
        seconds = time.perf_counter() - start
    finally:
        if hasattr(it, "close"):
            it.close()
    return {"img_per_s": count * spec["batch"] / seconds, "seconds": seconds, "steps": count}


def make_step(source, spec):
    """jddp's train step for the nearly free model: mean of a 1/64 pixel subsample + dense."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jddp.comm import XlaComm
    from jddp.mesh import make_mesh
    from jddp.state import create_train_state
    from jddp.step import PixelNorm, make_train_step

    class PoolDense(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.dense = nnx.Linear(3, 10, rngs=rngs)

        def __call__(self, x_BxHxWxC: jax.Array) -> jax.Array:
            # every 8th row and column: XLA fuses the uint8 -> float normalisation into this
            # slice, so the step reads 1/64 of the pixels and costs next to nothing
            return self.dense(jnp.mean(x_BxHxWxC[:, ::8, ::8], axis=(1, 2)))

    mesh = make_mesh()
    tx = optax.sgd(0.1)
    model_def, state = create_train_state(PoolDense(nnx.Rngs(0)), tx, mesh)
    step = make_train_step(model_def, tx, mesh, XlaComm(), pixel_norm=PixelNorm.of(source))
    return mesh, state, step


def step_alone(step, state, batch, steps: int) -> tuple[dict, object]:
    state, metrics = step(state, batch)  # compile
    float(metrics["train/loss"])
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    float(metrics["train/loss"])
    seconds = time.perf_counter() - start
    rows = batch["images"].shape[0]
    return {"img_per_s": steps * rows / seconds, "seconds": seconds, "steps": steps}, state


def end_to_end(source, spec, mesh, step, state, workers, kind, steps: int) -> tuple[dict, object]:
    from jddp.data.loader import TrainBatches

    batches = TrainBatches(
        source, spec["batch"], 0, mesh, augment=spec["augment"], workers=workers, worker_kind=kind
    )
    it = batches.iterate(0, steps + 1, prefetch=2)
    state, metrics = step(state, next(it))
    float(metrics["train/loss"])
    start = time.perf_counter()
    count = 0
    for batch in it:
        state, metrics = step(state, batch)
        count += 1
    float(metrics["train/loss"])
    seconds = time.perf_counter() - start
    rate = count * spec["batch"] / seconds
    return {"img_per_s": rate, "seconds": seconds, "steps": count}, state


def load1() -> float:
    return os.getloadavg()[0]


def settle() -> None:
    """Wait (up to 20 s) until worker processes of the last run are gone: a closing grain
    process pool still decoding would otherwise steal the cores from the next measurement."""
    import multiprocessing

    deadline = time.time() + 20
    while multiprocessing.active_children() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)


def run_case(case: str, args, tmp: Path) -> list[dict]:
    """Step alone first; then per worker kind (threads first): pipeline alone, end to end."""
    from jddp.data.loader import TrainBatches

    spec = CASES[case]
    source = make_source(case, spec, tmp)
    base = {"case": case, **spec}
    steps = args.steps if case != "jpeg" else max(4, args.steps // 2)
    mesh, state, step = make_step(source, spec)
    host = TrainBatches(source, spec["batch"], 0, mesh, augment=spec["augment"])
    load = load1()
    alone, state = step_alone(step, state, host.place(host.host_batch(0)), args.steps)
    rows = [{**base, "what": "step alone", "workers": None, "kind": None, **alone}]
    rows[-1].update(load1_before=load, load1_after=load1())
    print_row(rows[-1])
    for kind in args.kinds:
        for what, counts in (("pipeline", args.workers), ("end to end", args.e2e_workers)):
            for w in counts:
                if w == 0 and kind != args.kinds[0]:
                    continue
                load = load1()
                if what == "pipeline":
                    r = pipeline_alone(source, spec, w, kind, steps)
                else:
                    r, state = end_to_end(source, spec, mesh, step, state, w, kind, steps)
                    r["input_efficiency"] = r["img_per_s"] / alone["img_per_s"]
                rows.append({**base, "what": what, "workers": w, "kind": kind, **r})
                rows[-1].update(load1_before=load, load1_after=load1())
                print_row(rows[-1])
                if kind == "process":
                    settle()
    return rows


def print_row(r: dict) -> None:
    eff = r.get("input_efficiency")
    print(
        f"| {r['case']} | {r['what']} | {r['workers'] if r['workers'] is not None else '-'} | "
        f"{r['kind'] or '-'} | {r['img_per_s']:,.0f} | "
        f"{f'{eff:.2f}' if eff is not None else '-'} | {r['load1_before']:.2f} |",
        flush=True,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="mem224,cifar,jpeg")
    p.add_argument("--workers", default="0,1,2,4", help="pipeline-alone worker counts")
    p.add_argument("--e2e-workers", default="0,1,2", help="end-to-end worker counts")
    p.add_argument("--kinds", default="thread,process")
    p.add_argument("--steps", type=int, default=20, help="timed steps (jpeg: half)")
    p.add_argument("--machine", default=None, help="machine name in the file name")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.workers = [int(w) for w in args.workers.split(",")]
    args.e2e_workers = [int(w) for w in args.e2e_workers.split(",")]
    args.kinds = args.kinds.split(",")
    info = machine_info(args.machine, {"load1_start": load1()})
    print("| case | what | workers | kind | images/s | input efficiency | load (1 min) |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            rows.extend(run_case(case, args, Path(tmp)))
    info["load1_end"] = load1()
    stamp = date.today().isoformat()
    out = Path(args.out) if args.out else unused_path(RESULTS_DIR, f"input-{stamp}-{info['name']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = " ".join([Path(sys.executable).name, *sys.argv])
    out.write_text(json.dumps({"machine": info, "command": cmd, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
