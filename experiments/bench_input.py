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
import functools
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
    """jddp's train step for the nearly free model (:mod:`nearly_free`)."""
    import optax
    from flax import nnx
    from nearly_free import PoolDense

    from jddp.comm import XlaComm
    from jddp.mesh import make_mesh
    from jddp.state import create_train_state
    from jddp.step import PixelNorm, make_train_step

    mesh = make_mesh()
    tx = optax.sgd(0.1)
    model_def, state = create_train_state(PoolDense(10, nnx.Rngs(0)), tx, mesh)
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


# --- per-core decode + augment, one library at a time -------------------------------------


def _decoders() -> dict:
    """Library -> ``fn(data, box_of, size) -> uint8 [size,size,3]`` (crop, then resize)."""
    import io
    import math

    import cv2
    import simplejpeg
    from PIL import Image

    from jddp.data.decode import decode_crop, draft_factor, resize_crop

    def pillow(data, box_of, size):  # jddp up to 76cf202: Pillow draft + antialiased resize
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            left, top, right, bottom = box_of(height, width)
            img.draft(
                "RGB",
                (
                    math.ceil(width * size / (right - left)),
                    math.ceil(height * size / (bottom - top)),
                ),
            )
            sx, sy = img.size[0] / width, img.size[1] / height
            img = img.convert("RGB")
            box = (left * sx, top * sy, right * sx, bottom * sy)
            return np.asarray(img.resize((size, size), Image.Resampling.BILINEAR, box=box))

    def scaled(box, sx, sy):
        left, top, right, bottom = box
        return left * sx, top * sy, right * sx, bottom * sy

    def simplejpeg_pillow(data, box_of, size):
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        box = box_of(height, width)
        f = draft_factor(box, size)
        arr = simplejpeg.decode_jpeg(
            data, "RGB", min_height=-(-height // f), min_width=-(-width // f)
        )
        img = Image.fromarray(arr)
        box = scaled(box, arr.shape[1] / width, arr.shape[0] / height)
        return np.asarray(img.resize((size, size), Image.Resampling.BILINEAR, box=box))

    reduced = {
        1: cv2.IMREAD_COLOR,
        2: cv2.IMREAD_REDUCED_COLOR_2,
        4: cv2.IMREAD_REDUCED_COLOR_4,
        8: cv2.IMREAD_REDUCED_COLOR_8,
    }

    def opencv(data, box_of, size):
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)  # header only
        box = box_of(height, width)
        f = draft_factor(box, size)
        arr = cv2.imdecode(np.frombuffer(data, np.uint8), reduced[f])
        arr = cv2.cvtColor(arr, cv2.COLOR_BGR2RGB)
        return resize_crop(arr, scaled(box, arr.shape[1] / width, arr.shape[0] / height), size)

    def jddp(data, box_of, size):
        return decode_crop(data, box_of, size, "bench")

    decoders = {
        "pillow (jddp before)": pillow,
        "simplejpeg + pillow resize": simplejpeg_pillow,
        "opencv imdecode + opencv resize": opencv,
        "simplejpeg + opencv resize (jddp now)": jddp,
    }
    try:  # optional: pip install --target DIR imagecodecs; PYTHONPATH=DIR
        import imagecodecs

        def icodecs(data, box_of, size):  # libjpeg-turbo too, no DCT scaling offered
            arr = imagecodecs.jpeg8_decode(data)
            return resize_crop(arr, box_of(*arr.shape[:2]), size)

        decoders["imagecodecs + opencv resize"] = icodecs
    except ImportError:
        print("(imagecodecs not installed: its row is skipped)")
    return decoders


def dali_row(datas: list[bytes], count: int, size: int = 224) -> dict | None:
    """DALI's CPU operators (optional: ``pip install --target DIR nvidia-dali-cuda130``, then
    ``PYTHONPATH=DIR``): ``decoders.image_random_crop`` + ``resize`` + ``flip``, one thread,
    batches of 64, CPU-only pipeline (``device_id=None``)."""
    try:
        from nvidia.dali import fn, pipeline_def, types
    except ImportError:
        print("(nvidia-dali not installed: its row is skipped)")
        return None
    batch = 64
    arrays = [np.frombuffer(d, np.uint8) for d in datas]

    @pipeline_def(batch_size=batch, num_threads=1, device_id=None)
    def pipe():
        jpegs = fn.external_source(
            source=lambda: [arrays[i % len(arrays)] for i in range(batch)], batch=True
        )
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
        images = fn.resize(images, resize_x=size, resize_y=size)
        return fn.flip(images, horizontal=fn.random.coin_flip())

    p = pipe()
    p.build()
    for _ in range(2):
        p.run()
    rounds = max(1, count // batch)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(rounds):
        p.run()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "img_per_s": rounds * batch / wall,
        "img_per_cpu_s": rounds * batch / cpu,
        "ms_per_image": 1e3 * wall / (rounds * batch),
        "mad_vs_pillow": None,
    }


def _decode_rows(fn, datas, u, flip, size: int, n: int) -> list[np.ndarray]:
    """``n`` random-resized crops (+ flips) of ``datas`` (cycled) decoded by ``fn``."""
    from jddp.data import augment as aug

    outs = []
    for i in range(n):
        img = fn(datas[i % len(datas)], lambda h, w, r=u[i]: aug.random_resized_box(r, h, w), size)
        outs.append(img[:, ::-1] if flip[i] else img)
    return outs


def decoder_rows(args, tmp: Path) -> list[dict]:
    """Images/s on one core (this thread) of decode + random-resized crop + flip to 224, per
    library, for the raw 500x375 JPEGs and the same re-encoded at shorter side 256."""
    from jddp.data import augment as aug
    from jddp.pack import shrink_to_max_side  # what python -m jddp.pack --max-side stores

    folder = make_jpeg_folder(tmp / "decoders", 16)
    raw = [f.read_bytes() for f in sorted(folder.rglob("*.jpg"))[:16]]
    sets = {
        "500x375 q90": raw,
        "shorter side 256 q90": [shrink_to_max_side(d, 256, 90) for d in raw],
    }
    size, count = 224, args.decode_images
    keys = aug.example_keys(0, 0, np.arange(count))
    u = aug.uniforms(keys, aug.RRC_DRAWS)
    flip = aug.flips(keys)
    rows = []
    for set_name, datas in sets.items():
        reference = None
        for lib, fn in _decoders().items():
            crop = functools.partial(_decode_rows, fn, datas, u, flip, size)
            crop(8)  # warm up (imports, allocator)
            start, cpu = time.perf_counter(), time.thread_time()
            crop(count)
            wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
            outs = crop(min(count, 64))
            reference = reference if reference is not None else outs
            diffs = [np.abs(a.astype(int) - b).mean() for a, b in zip(outs, reference, strict=True)]
            mad = float(np.mean(diffs))
            row = {
                "case": "decoders",
                "what": f"{lib}, {set_name}",
                "library": lib,
                "images": set_name,
                "img_per_s": count / wall,
                "img_per_cpu_s": count / cpu,
                "ms_per_image": 1e3 * wall / count,
                "mad_vs_pillow": mad,
                "load1_before": load1(),
            }
            rows.append(row)
            print_decoder_row(row)
        dali = dali_row(datas, count)
        if dali is not None:
            lib = "DALI CPU (image_random_crop + resize + flip)"
            rows.append(
                {
                    "case": "decoders",
                    "what": f"{lib}, {set_name}",
                    "library": lib,
                    "images": set_name,
                    **dali,
                    "load1_before": load1(),
                }
            )
            print_decoder_row(rows[-1])
    return rows


def print_decoder_row(row: dict) -> None:
    mad = row["mad_vs_pillow"]
    print(
        f"| {row['images']} | {row['library']} | {row['ms_per_image']:.2f} | "
        f"{row['img_per_s']:,.0f} | {row['img_per_cpu_s']:,.0f} | "
        f"{'-' if mad is None else f'{mad:.2f}'} | {row['load1_before']:.2f} |",
        flush=True,
    )


# --- end to end through the trainer -------------------------------------------------------


WARM_STEPS = 15


def trainer_run(
    tmp: Path,
    name: str,
    overrides: list[str],
    devices: int,
    steps: int,
    pythonpath: str | None = None,
) -> dict:
    """``python -m jddp.train`` with the nearly free model on ``devices`` CPU devices; images/s
    and input-wait fraction from its own metrics.jsonl (the windows after step
    WARM_STEPS: before, it compiles and eats the batches built ahead meanwhile)."""
    import subprocess

    workdir = tmp / f"run-{name}"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        PYTHONPATH=os.pathsep.join([pythonpath or str(REPO), str(Path(__file__).parent)]),
    )
    cmd = [
        sys.executable,
        "-m",
        "jddp.train",
        f"workdir={workdir}",
        "model.name=nearly_free:factory",
        "model.num_classes=2",
        "data.global_batch_size=128",
        "data.augment=imagenet",
        f"train.steps={steps}",
        "log.every_steps=5",
        "log.progress=lines",
        "train.eval_every_steps=0",
        "checkpoint.every_steps=0",
        *overrides,
    ]
    start = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(f"{name}: exit {out.returncode}: {out.stderr[-2000:]}")
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    # the first 15 steps run on the batches the workers built ahead during compilation
    windows = [x for x in lines if "train/img_per_s" in x and x["step"] > WARM_STEPS]
    rates = sorted(x["train/img_per_s"] for x in windows)
    waits = [x["perf/input_wait_fraction"] for x in windows]
    return {
        "case": "trainer",
        "what": name,
        "img_per_s": float(np.median(rates)),
        "img_per_s_windows": rates,
        "input_wait_fraction": float(np.median(waits)),
        "devices": devices,
        "steps": steps,
        "wall_s": wall,
        "command": " ".join(cmd[1:]),
        "load1_before": load1(),
    }


def trainer_rows(args, tmp: Path) -> list[dict]:
    """The raw JPEG folder and its pack (``--max-side 256``), ``data.augment=imagenet``, 2
    devices, default workers; with ``--before COMMIT`` also the folder at that commit."""
    import subprocess

    folder = make_jpeg_folder(tmp / "e2e", args.e2e_images)
    packed = tmp / "e2e-packed"
    subprocess.run(
        [sys.executable, "-m", "jddp.pack", str(folder), str(packed), "--max-side", "256"],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    cases = [
        ("imagefolder 500x375", ["data.name=imagefolder", f"data.path={folder}"], None),
        ("packed --max-side 256", ["data.name=packed", f"data.path={packed}"], None),
    ]
    if args.before:
        old = tmp / "before"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(old), args.before],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        cases.insert(
            0,
            (
                f"imagefolder 500x375 at {args.before}",
                ["data.name=imagefolder", f"data.path={folder}"],
                str(old),
            ),
        )
    rows = []
    try:
        for name, overrides, pythonpath in cases:
            row = trainer_run(tmp, name.replace(" ", "_"), overrides, 2, args.e2e_steps, pythonpath)
            row["what"] = name
            rows.append(row)
            print(
                f"| {name} | {row['img_per_s']:,.0f} | {row['input_wait_fraction']:.2f} | "
                f"{row['load1_before']:.2f} |",
                flush=True,
            )
    finally:
        if args.before:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(old)], cwd=REPO, capture_output=True
            )
    return rows


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
    p.add_argument("--decoders", action="store_true", help="per-core rate of each JPEG library")
    p.add_argument("--decode-images", type=int, default=200, help="images per --decoders row")
    p.add_argument("--trainer", action="store_true", help="end to end through python -m jddp.train")
    p.add_argument("--e2e-images", type=int, default=512)
    p.add_argument("--e2e-steps", type=int, default=60)
    p.add_argument("--before", default=None, help="--trainer: also the folder at this commit")
    args = p.parse_args()
    args.workers = [int(w) for w in args.workers.split(",")]
    args.e2e_workers = [int(w) for w in args.e2e_workers.split(",")]
    args.kinds = args.kinds.split(",")
    info = machine_info(args.machine, {"load1_start": load1()})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.decoders:
            print(
                "| images | library | ms/image | images/s | images/CPU-s | MAD vs Pillow | load |"
            )
            print("|---|---|---|---|---|---|---|")
            rows.extend(decoder_rows(args, Path(tmp)))
        if args.trainer:
            print("| python -m jddp.train, 2 devices | images/s | input wait | load |")
            print("|---|---|---|---|")
            rows.extend(trainer_rows(args, Path(tmp)))
        if not (args.decoders or args.trainer):
            print("| case | what | workers | kind | images/s | input efficiency | load (1 min) |")
            print("|---|---|---|---|---|---|---|")
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
