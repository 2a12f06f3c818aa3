"""Writing a pack (:mod:`jddp.data.pack_format`): shards in parallel processes, each to a
temporary name renamed once complete and read back, then the manifest, so an interrupted pack
never reads as complete and rerunning the same command continues it (``OUT/.pack-partial/``)."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import signal
import sys
import uuid
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jddp.data.augment import square_box
from jddp.data.decode import decode_crop
from jddp.data.formats.shards import ShardExample
from jddp.data.pack_format import (
    MANIFEST,
    READER_OPTIONS,
    VERSION,
    WRITER_OPTIONS,
    encode_record,
    parse_record,
    shard_name,
)
from jddp.data.pack_source import detect_format, fingerprint, item_bytes, read_source
from jddp.errors import ConfigError, DataError
from jddp.proc import lifeline

PARTIAL = ".pack-partial"  # OUT/.pack-partial/: the plan and finished shards' notes

CHECK_SIZE = 8  # the decode check's output side: JPEGs decode at 1/8 scale, still parsed whole


@dataclass(frozen=True)
class Options:
    """What decides a pack's content (a rerun with other options is another pack)."""

    max_side: int | None
    quality: int
    skip_bad: bool
    shard_bytes: int


@dataclass(frozen=True)
class ShardTask:
    """One shard to write: the examples ``items`` of ``split`` (paths or arrays, with labels)."""

    out: str
    split: str
    file: str
    pack_id: bytes
    items: list[Any]  # image folders: (path, label); arrays: (array [H,W,C], label)
    options: Options


# ------------------------------------------------------------------------ writing one shard


def shrink_to_max_side(data: bytes, max_side: int, quality: int) -> bytes | None:
    """``data`` re-encoded as JPEG ``quality`` with its shorter side brought down to
    ``max_side`` (Lanczos, antialiased; grayscale stays grayscale), or None if that side is
    not larger than ``max_side`` (the file is then kept as it is)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        width, height = img.size
        short = min(width, height)
        if short <= max_side:
            return None
        scale = max_side / short
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        mode = "L" if img.mode in ("L", "1", "I;16", "I") else "RGB"
        small = img.convert(mode).resize(size, Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    small.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def image_payload(path: str | ShardExample, options: Options) -> tuple[bytes, bool]:
    """The bytes to store for the image at ``path`` (a file, or an example of a shard format)
    and whether they were re-encoded; checked with the trainer's decoder (:class:`DataError`
    naming the file, or the shard and row/member, if it cannot be read)."""
    from PIL import Image

    if isinstance(path, ShardExample):
        where = f"pack: cannot decode image of {path}"
        data = path.read()
    else:
        where = f"pack: cannot decode image {path!r}"
        data = Path(path).read_bytes()
    if not data:
        raise DataError(f"{where}: the file is empty (0 bytes)")
    smaller = None
    if options.max_side is not None:
        try:
            smaller = shrink_to_max_side(data, options.max_side, options.quality)
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
            raise DataError(f"{where}: {' '.join(str(err).split())}") from err
    payload = data if smaller is None else smaller
    decode_crop(payload, square_box, CHECK_SIZE, where)
    return payload, smaller is not None


def write_shard(task: ShardTask) -> dict[str, Any]:
    """Write, verify and publish one shard; returns its note for the manifest."""
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    out = Path(task.out)
    final, tmp = out / task.file, out / f"{task.file}.tmp"
    skipped: list[str] = []
    reencoded = written = 0
    writer = ArrayRecordWriter(str(tmp), WRITER_OPTIONS)
    try:
        for thing, label in task.items:
            if isinstance(thing, np.ndarray):
                payload: bytes | np.ndarray = thing
            else:
                try:
                    payload, again = image_payload(thing, task.options)
                except DataError as err:
                    if not task.options.skip_bad:
                        raise
                    skipped.append(f"{thing}: {str(err).split(': ', 1)[-1]}")
                    continue
                reencoded += again
            writer.write(encode_record(task.pack_id, label, payload))
            written += 1
    finally:
        writer.close()
    reader = ArrayRecordReader(str(tmp), READER_OPTIONS)
    try:
        if reader.num_records() != written:
            raise DataError(f"pack: {str(tmp)!r} reads back {reader.num_records()} of {written}")
        for r in range(written):  # every record reads back with its checksum
            parse_record(reader.read([r])[0], task.pack_id, f"pack: {str(tmp)!r} record {r}")
    finally:
        reader.close()
    note = {
        "file": task.file,
        "records": written,
        "bytes": tmp.stat().st_size,
        "reencoded": reencoded,
        "skipped": skipped,
    }
    write_json_atomic(out / PARTIAL / f"{task.file}.json", note)
    os.replace(tmp, final)  # the shard's final name appears only once it is complete
    return note


def write_json_atomic(path: Path, value: Any) -> None:
    """Write ``value`` as JSON to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)


def finished_note(out: Path, file: str) -> dict[str, Any] | None:
    """The note of shard ``file`` if it was completed by an earlier run, else None."""
    note_file = out / PARTIAL / f"{file}.json"
    if not (out / file).is_file() or not note_file.is_file():
        return None
    note = json.loads(note_file.read_text())
    return note if (out / file).stat().st_size == note["bytes"] else None


# ------------------------------------------------------------------------ the whole pack


def plan_shards(
    kind: str, splits: dict[str, Any], shard_bytes: int
) -> list[tuple[str, str, list[Any]]]:
    """``(split, file, items)`` of every shard: each split cut into about ``shard_bytes`` parts,
    in the source's order."""
    shards = []
    for name, split in splits.items():
        items = split["items"]
        total = sum(item_bytes(kind, item) for item in items)
        count = max(1, min(len(items), math.ceil(total / shard_bytes)))
        bounds = np.linspace(0, len(items), count + 1).round().astype(int)
        for s in range(count):
            file = shard_name(name, s, count)
            shards.append((name, file, items[bounds[s] : bounds[s + 1]]))
    return shards


def claim_out(out: Path, identity: dict[str, Any]) -> tuple[bytes, bool]:
    """The pack id to write ``out`` with, and whether the pack there is already complete.

    An empty or missing ``out`` starts a new pack; an unfinished or finished pack of the same
    source and options continues; anything else is refused (:class:`ConfigError`).
    """
    plan_file = out / PARTIAL / "plan.json"
    manifest_file = out / MANIFEST
    if manifest_file.is_file():
        manifest = json.loads(manifest_file.read_text())
        if manifest.get("identity") == identity:
            return bytes.fromhex(manifest["pack_id"]), True
    elif plan_file.is_file():
        plan = json.loads(plan_file.read_text())
        if plan.get("identity") == identity:
            return bytes.fromhex(plan["pack_id"]), False
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"pack: OUT {str(out)!r} is not empty and holds no unfinished pack of "
            f"{identity['source']!r} with these options: give an empty or new folder"
        )
    pack_id = uuid.uuid4().bytes
    (out / PARTIAL).mkdir(parents=True, exist_ok=True)
    write_json_atomic(plan_file, {"pack_id": pack_id.hex(), "identity": identity})
    return pack_id, False


class Progress:
    """Shards done, as a tqdm bar on a terminal and as plain lines otherwise."""

    def __init__(self, total_examples: int, shards: int) -> None:
        self.shards, self.done = shards, 0
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_examples, unit="img", desc="pack", file=sys.stderr)

    def update(self, note: dict[str, Any], examples: int, resumed: bool = False) -> None:
        """One more shard (``examples`` source examples) finished."""
        self.done += 1
        if self.bar is not None:
            self.bar.update(examples)
            return
        how = "already there" if resumed else "written"
        print(
            f"pack: shard {self.done}/{self.shards} {note['file']} {how}: {note['records']} "
            f"records, {note['bytes'] / 1e6:.1f} MB",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        """Finish the bar."""
        if self.bar is not None:
            self.bar.close()


def run_tasks(tasks: list[tuple[ShardTask, int]], workers: int, progress: Progress) -> None:
    """Write the shards of ``tasks`` over ``workers`` processes (in this one for 1)."""
    if workers <= 1 or len(tasks) <= 1:
        for task, examples in tasks:
            progress.update(write_shard(task), examples)
        return
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(
        min(workers, len(tasks)),
        mp_context=context,
        initializer=die_with_parent,
        initargs=(os.getpid(),),
    )
    with pool:
        try:
            pending = {pool.submit(write_shard, task): examples for task, examples in tasks}
            while pending:
                done, _ = wait(pending, return_when=FIRST_EXCEPTION)
                for future in done:
                    examples = pending.pop(future)
                    if future.exception() is not None:
                        raise future.exception()  # type: ignore[misc]
                    progress.update(future.result(), examples)
        except BaseException:  # a failed shard, Ctrl-C, a stop signal: no worker goes on
            workers = list((getattr(pool, "_processes", None) or {}).values())  # shutdown clears it
            pool.shutdown(wait=False, cancel_futures=True)
            for worker in workers:
                worker.terminate()  # its shard stays a temporary file: a rerun rewrites it
            raise


def die_with_parent(parent: int) -> None:
    """Pool worker start: SIGKILL this worker when the pack process dies (a killed pack must not
    leave workers writing into ``OUT`` behind it; a rerun continues the pack). Ctrl-C in a
    terminal reaches the workers too: they leave it to the pack process, which stops them
    (a traceback from each worker otherwise)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lifeline.die_with_parent(lifeline.load_prctl(), parent)


def pack(
    src: Path,
    out: Path,
    fmt: str | None = None,
    max_side: int | None = None,
    quality: int = 90,
    workers: int = 1,
    skip_bad: bool = False,
    shard_mb: float = 256.0,
) -> tuple[dict[str, Any], bool]:
    """Write the pack of ``src`` to ``out`` (continuing an unfinished one); returns its manifest
    and whether this call wrote it (False: ``out`` already held this pack, complete)."""
    src = Path(src).expanduser().resolve()
    out = Path(out).expanduser()
    fmt = fmt or detect_format(src)
    source = read_source(fmt, src)
    kind, splits = source["kind"], source["splits"]
    options = Options(
        max_side if kind == "encoded" else None,
        quality,
        skip_bad,
        max(1, int(shard_mb * 1e6)),
    )
    identity = {
        "format": fmt,
        "source": str(src),
        "options": {
            "max_side": options.max_side,
            "quality": options.quality if options.max_side else None,
            "skip_bad": skip_bad,
            "shard_bytes": options.shard_bytes,
        },
        "fingerprint": fingerprint(kind, splits),
    }
    pack_id, complete = claim_out(out, identity)
    if complete:
        print(f"pack: {str(out)!r} already holds this pack, complete", file=sys.stderr)
        shutil.rmtree(out / PARTIAL, ignore_errors=True)
        return json.loads((out / MANIFEST).read_text()), False
    shards = plan_shards(kind, splits, options.shard_bytes)
    progress = Progress(sum(len(s["items"]) for s in splits.values()), len(shards))
    notes: dict[str, dict[str, Any]] = {}
    todo = []
    for split, file, items in shards:
        note = finished_note(out, file)
        if note is not None:
            notes[file] = note
            progress.update(note, len(items), resumed=True)
        else:
            task = ShardTask(str(out), split, file, pack_id, items, options)
            todo.append((task, len(items)))
    try:
        run_tasks(todo, workers, progress)
    finally:
        progress.close()
    for _split, file, _ in shards:
        notes[file] = finished_note(out, file)  # type: ignore[assignment]
    manifest = build_manifest(pack_id, identity, source, shards, notes)
    write_json_atomic(out / MANIFEST, manifest)
    shutil.rmtree(out / PARTIAL, ignore_errors=True)
    return manifest, True


def build_manifest(
    pack_id: bytes,
    identity: dict[str, Any],
    source: dict[str, Any],
    shards: list[tuple[str, str, list[Any]]],
    notes: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """``pack.json``: what the pack holds and how it was made."""
    options = identity["options"]
    if source["kind"] == "encoded":
        stored = (
            "the original files"
            if options["max_side"] is None
            else f"the original files; shorter side > {options['max_side']} re-encoded as JPEG "
            f"quality {options['quality']} at shorter side {options['max_side']}"
        )
        size_policy = {"stored": stored, "max_side": options["max_side"], "default_size": 224}
    else:
        size_policy = {"stored": "raw pixels, lossless", "default_size": source["image_shape"][0]}
    splits: dict[str, Any] = {}
    for name, split in source["splits"].items():
        mine = [notes[file] for s, file, _ in shards if s == name]
        splits[name] = {
            "from": split["from"],
            "count": sum(n["records"] for n in mine),
            "source_count": len(split["items"]),
            "reencoded": sum(n["reencoded"] for n in mine),
            "skipped": [entry for n in mine for entry in n["skipped"]],
            "shards": [{k: n[k] for k in ("file", "records", "bytes")} for n in mine],
        }
    manifest = {
        "format": "jddp-pack",
        "version": VERSION,
        "pack_id": pack_id.hex(),
        "identity": identity,
        "record": "ArrayRecord; see jddp/data/pack_format.py (header: magic, CRC-32, pack id, "
        "label, kind, dtype, shape; then the payload)",
        "kind": source["kind"],
        "classes": source["classes"],
        "num_classes": source["num_classes"],
        "mean": source["mean"],
        "std": source["std"],
        "image_size": size_policy,
        "splits": splits,
    }
    if source["kind"] == "raw":
        manifest["image_shape"] = source["image_shape"]
        manifest["dtype"] = source["dtype"]
    return manifest
