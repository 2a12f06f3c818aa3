"""Input pipeline throughput: per-core decoders, the host pipeline alone, and the trainer.

    .venv/bin/python experiments/bench_input.py --decoders --pipeline --trainer   # ~6 min
    .venv/bin/python experiments/bench_input.py --formats --trainer --cases folder parquet

``--decoders``: decode + random-resized crop per JPEG library, one core; ``--pipeline``: the host
pipeline alone per worker count and kind; ``--formats``: WebDataset indexing, Parquet by index;
``--trainer`` (default): ``python -m jddp.train`` end to end on 2 CPU devices with a nearly free
model (:mod:`nearly_free`). What each measures: ``experiments/README.md``. Writes
``results/input-<date>-<machine>.json`` with the 1-minute load average per row.
"""

from __future__ import annotations

import argparse
import functools
import io
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib
import numpy as np
from benchlib import REPO, load1, machine_info, run_trainer

WARM_STEPS = 15  # trainer windows up to here: compilation, and the batches built meanwhile


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
        box = (left, top, left + w, top + h)
        img = photo.resize((500, 375), Image.Resampling.BILINEAR, box=box)
        if rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        for split in ("train",) if i >= 8 else ("train", "val"):
            folder = root / split / f"c{i % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            img.save(folder / f"{i:04d}.jpg", quality=90)
    return root


def pack(folder: Path, out: Path, max_side: int = 256) -> Path:
    cmd = [sys.executable, "-m", "jddp.pack", str(folder), str(out), "--max-side", str(max_side)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    return out


# --------------------------------------------------------------------------- the decoders
def decoders() -> dict:
    """Library -> ``fn(data, box_of, size) -> uint8 [size,size,3]`` (crop, then resize)."""
    from PIL import Image

    from jddp.data.decode import decode_crop

    def scaled(box, arr, height, width):
        sx, sy = arr.shape[1] / width, arr.shape[0] / height
        return box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy

    def pillow(data, box_of, size):  # jddp up to 76cf202: Pillow draft + antialiased resize
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            box = box_of(height, width)
            want = [math.ceil(n * size / (box[2 + k] - box[k])) for k, n in enumerate(img.size)]
            img.draft("RGB", tuple(want))
            arr_box = scaled(box, np.empty((img.size[1], img.size[0])), height, width)
            img = img.convert("RGB")
            return np.asarray(img.resize((size, size), Image.Resampling.BILINEAR, box=arr_box))

    return {
        "pillow (jddp before)": pillow,
        "simplejpeg + opencv resize (jddp now)": lambda d, b, s: decode_crop(d, b, s, "bench"),
    }


def crops(fn, datas: list[bytes], u: np.ndarray, flip: np.ndarray, n: int) -> list[np.ndarray]:
    """``n`` random-resized 224 px crops (+ flips) of ``datas`` (cycled), decoded by ``fn``."""
    from jddp.data import augment as aug

    out = []
    for i in range(n):
        img = fn(datas[i % len(datas)], lambda h, w, r=u[i]: aug.random_resized_box(r, h, w), 224)
        out.append(img[:, ::-1] if flip[i] else img)
    return out


def decoder_rows(args, tmp: Path) -> list[dict]:
    from jddp.data import augment as aug
    from jddp.data.pack_writer import shrink_to_max_side  # what jddp.pack --max-side stores

    raw = [f.read_bytes() for f in sorted(make_jpeg_folder(tmp / "dec", 16).rglob("*.jpg"))[:16]]
    sets = {
        "500x375 q90": raw,
        "shorter side 256 q90": [shrink_to_max_side(d, 256, 90) for d in raw],
    }
    keys = aug.example_keys(0, 0, np.arange(max(args.decode_images, 64)))
    u, flip = aug.uniforms(keys, aug.RRC_DRAWS), aug.flips(keys)
    print("| images | library | ms/image | images/s | images/CPU-s | MAD vs Pillow | load |")
    print("|---|---|---|---|---|---|---|")
    rows, libraries = [], decoders()
    for images, datas in sets.items():
        reference = None
        for library, fn in libraries.items():
            run = functools.partial(crops, fn, datas, u, flip)
            run(8)  # warm up
            start, cpu = time.perf_counter(), time.thread_time()
            run(args.decode_images)
            wall = (time.perf_counter() - start) / args.decode_images
            cpu = (time.thread_time() - cpu) / args.decode_images
            outs = run(64)
            reference = reference or outs
            diffs = [np.abs(a.astype(int) - b).mean() for a, b in zip(outs, reference, strict=True)]
            mad = float(np.mean(diffs))
            load = load1()
            rows.append({"library": library, "images": images, "ms_per_image": 1e3 * wall,
                         "img_per_s": 1 / wall, "img_per_cpu_s": 1 / cpu, "mad_vs_pillow": mad,
                         "case": "decoders", "load1": load})  # fmt: skip
            cells = [f"{1e3 * wall:.2f}", f"{1 / wall:,.0f}", f"{1 / cpu:,.0f}", f"{mad:.2f}"]
            print("| " + " | ".join([images, library, *cells, f"{load:.2f}"]) + " |", flush=True)
    return rows


# --------------------------------------------------------------------- the pipeline alone
def pipeline_rows(args, tmp: Path) -> list[dict]:
    """``HostBatches`` (imagenet augmentation, batch 128) through ``host_iterator``, per worker
    count and kind; the first batch (worker start) is not timed."""
    from jddp.data.formats.imagefolder import ImageFolderSource
    from jddp.data.formats.packed import load as load_packed
    from jddp.data.pipeline import HostBatches, host_iterator

    folder = make_jpeg_folder(tmp / "pipe", args.e2e_images)
    sources = {"JPEG folder 500x375": ImageFolderSource(folder, 224)}
    sources["packed --max-side 256"] = load_packed(
        str(pack(folder, tmp / "pipe-packed")), 224, 0, None
    ).train
    print("| data | workers | kind | images/s | load |\n|---|---|---|---|---|")
    rows = []
    for name, source in sources.items():
        for kind in ("thread", "process"):
            for workers in args.workers:
                if workers == 0 and kind == "process":
                    continue
                host = HostBatches(source, 128, 0, slice(0, 128), "imagenet")
                it = host_iterator(host, range(args.pipeline_steps + 1), workers, kind)
                next(it)
                start = time.perf_counter()
                rate = sum(128 for _ in it) / (time.perf_counter() - start)
                getattr(it, "close", lambda: None)()
                row, load = {"case": "pipeline", "data": name, "workers": workers}, load1()
                rows.append({**row, "kind": kind, "img_per_s": rate, "load1": load})
                print(f"| {name} | {workers} | {kind} | {rate:,.0f} | {load:.2f} |", flush=True)
                time.sleep(1.0 if kind == "process" else 0)  # let a closing process pool go
    return rows


# --------------------------------------------------------------------------- the trainer
def shard_sets(folder: Path, tmp: Path) -> tuple[Path, Path]:
    """``folder`` as the Hub's Parquet (100 rows per row group, as ``datasets`` writes image
    sets) and as WebDataset shards (about 16 MB each): the same files' bytes."""
    from shard_writers import write_parquet_like_the_hub, write_webdataset

    mb = sum(f.stat().st_size for f in folder.rglob("*.jpg")) / 1e6
    shards = max(1, round(mb / 16))
    write_parquet_like_the_hub(folder, tmp / "parquet", shards=shards, row_group_rows=100)
    write_webdataset(folder, tmp / "wds", shards=shards)
    return tmp / "parquet", tmp / "wds"


def format_rows(args, tmp: Path) -> list[dict]:
    """WebDataset index building (members/s, page cache warm) and Parquet read by index from
    the host pipeline alone with the row-group cache holding all of the set or one group."""
    from jddp.data.formats import parquet as pq_format
    from jddp.data.formats import webdataset as wds
    from jddp.data.pipeline import HostBatches

    folder = make_jpeg_folder(tmp / "formats", args.e2e_images)
    parquet, shards = shard_sets(folder, tmp / "formats-shards")
    tars = sorted(shards.glob("*.tar"))
    members = sum(len(wds.tar_members(tar)[0]) for tar in tars) * args.index_repeats
    start = time.perf_counter()
    for _ in range(args.index_repeats):
        for tar in tars:
            wds.build_index(tar, None, None)  # the headers, and each label member read
    seconds = time.perf_counter() - start
    rate = members / seconds
    rows = [
        {
            "case": "webdataset index",
            "members": members,
            "seconds": seconds,
            "members_per_s": rate,
            "load1": load1(),
        }
    ]
    print("| WebDataset index (page cache warm) | members/s |\n|---|---|")
    print(f"| {len(tars)} shards x {args.index_repeats}, {members:,} members | {rate:,.0f} |")
    print("| host pipeline, Parquet read by index, 0 workers | images/s |\n|---|---|")
    for label, cache in (("cache holds the set", 1 << 34), ("cache holds one row group", 1)):
        pq_format.ROW_GROUP_CACHE_BYTES = cache
        source = pq_format.load(str(parquet), 224, 0, None).train
        batches = HostBatches(source, 64, 0, slice(None), "imagenet")
        batches(0)
        start = time.perf_counter()
        for step in range(1, args.pipeline_steps + 1):
            batches(step)
        rate = 64 * args.pipeline_steps / (time.perf_counter() - start)
        rows.append(
            {"case": "parquet by index", "cache": label, "img_per_s": rate, "load1": load1()}
        )
        print(f"| {label} | {rate:,.0f} |", flush=True)
    return rows


def trainer_rows(args, tmp: Path) -> list[dict]:
    folder = make_jpeg_folder(tmp / "e2e", args.e2e_images)
    packed = pack(folder, tmp / "e2e-packed")
    parquet, shards = shard_sets(folder, tmp / "e2e-shards")
    free = [
        "model.name=nearly_free:factory",
        "model.num_classes=2",
        "log.every_steps=5",
        "log.progress=off",
        "train.eval_every_steps=0",
        "checkpoint.every_steps=0",
        f"train.steps={args.e2e_steps}",
    ]
    jpeg = ["data.augment=imagenet", "data.global_batch_size=128", "data.image_size=224"]
    cases = {
        "in-memory 224 px (256, none)": [
            "data.name=synthetic",
            "data.image_size=224",
            "data.global_batch_size=256",
        ],
        "in-memory 32 px (512, cifar)": [
            "data.name=synthetic",
            "data.image_size=32",
            "data.global_batch_size=512",
            "data.augment=cifar",
        ],
        "JPEG folder 500x375 (128, imagenet)": [
            "data.name=imagefolder",
            f"data.path={folder}",
            *jpeg,
        ],
        "packed --max-side 256 (128, imagenet)": ["data.name=packed", f"data.path={packed}", *jpeg],
        "Parquet, the Hub's layout (128, imagenet)": [
            "data.name=parquet",
            f"data.path={parquet}",
            *jpeg,
        ],
        "WebDataset shards (128, imagenet)": [
            "data.name=webdataset",
            f"data.path={shards}/*.tar",
            *jpeg,
        ],
    }
    if args.cases:
        chosen = [c for c in cases if any(word.lower() in c.lower() for word in args.cases)]
        cases = {f"{c} #{r + 1}": cases[c] for r in range(args.repeats) for c in chosen}
    trees = {name: REPO for name in cases}
    if args.before:
        old = tmp / "before"
        worktree = ["git", "worktree", "add", "--detach", str(old), args.before]
        subprocess.run(worktree, cwd=REPO, check=True, capture_output=True)
        name = f"JPEG folder 500x375 (128, imagenet) at {args.before}"
        cases, trees[name] = {name: cases["JPEG folder 500x375 (128, imagenet)"], **cases}, old
    print("| python -m jddp.train, 2 devices | images/s | input wait | load |\n|---|---|---|---|")
    rows = []
    try:
        for i, (name, overrides) in enumerate(cases.items()):
            path = os.pathsep.join([str(trees[name]), str(Path(__file__).parent)])
            env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu")
            load = load1()
            r = run_trainer(tmp / f"run{i}", [*free, *overrides], devices=2, env=env,
                            skip_steps=WARM_STEPS, tree=trees[name])  # fmt: skip
            rate = float(np.median(r["img_per_s"]))
            wait = float(np.median(r["input_wait_fraction"]))
            rows.append({"case": "trainer", "data": name, "img_per_s": rate,
                         "input_wait_fraction": wait, "windows_img_per_s": r["img_per_s"],
                         "command": " ".join(map(str, r["command"])), "load1": load})  # fmt: skip
            print(f"| {name} | {rate:,.0f} | {wait:.2f} | {load:.2f} |", flush=True)
    finally:
        if args.before:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(old)], cwd=REPO, capture_output=True
            )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--decoders", action="store_true", help="per-core rate of each JPEG library")
    p.add_argument("--pipeline", action="store_true", help="the host pipeline alone")
    p.add_argument("--trainer", action="store_true", help="python -m jddp.train end to end")
    p.add_argument("--formats", action="store_true", help="WebDataset index rate, Parquet reads")
    p.add_argument("--index-repeats", type=int, default=20, help="--formats: index builds")
    p.add_argument("--cases", nargs="*", help="--trainer: the cases whose name holds a word")
    p.add_argument("--repeats", type=int, default=1, help="--trainer --cases: rounds, alternated")
    p.add_argument("--decode-images", type=int, default=200, help="images per decoder row")
    p.add_argument("--workers", default="0,1,2,4", help="--pipeline worker counts")
    p.add_argument("--pipeline-steps", type=int, default=10)
    p.add_argument("--e2e-images", type=int, default=512, help="JPEGs in the folder")
    p.add_argument("--e2e-steps", type=int, default=60)
    p.add_argument("--before", default=None, help="--trainer: also the JPEG folder at COMMIT")
    benchlib.output_args(p)
    args = p.parse_args()
    args.workers = [int(w) for w in args.workers.split(",")]
    info = machine_info(args.machine, {"load1_start": load1()})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.decoders:
            rows += decoder_rows(args, Path(tmp))
        if args.pipeline:
            rows += pipeline_rows(args, Path(tmp))
        if args.formats:
            rows += format_rows(args, Path(tmp))
        if args.trainer or not (args.decoders or args.pipeline or args.formats):
            rows += trainer_rows(args, Path(tmp))
    info["load1_end"] = load1()
    result = {"machine": info, "command": benchlib.command_line(), "rows": rows}
    benchlib.save_result("input", info["name"], result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
