"""``python -m jddp.pack`` and ``data.name=packed``: round trips against the sources they pack,
re-encoding, resume, refusals, bad images, damaged packs, and the determinism guarantees end to
end (topology invariance and bitwise resume with ``data.augment=imagenet``)."""

from __future__ import annotations

import io
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jddp.data import augment as aug
from jddp.data import pack_writer
from jddp.data.formats.packed import PackedSource
from jddp.data.pack_format import MANIFEST, encode_record, parse_record
from jddp.data.pipeline import HostBatches, eval_rows, host_iterator, train_rows
from jddp.data.registry import load_splits
from jddp.errors import DataConfigError, DataError
from tests.datafiles import (
    photo_folder,
    write_cifar_folder,
    write_jpeg_folder,
    write_mnist,
)
from tests.helpers import (
    QUICK,
    assert_losses_match,
    launch_cmd,
    read_losses,
    run,
    steps_saved,
    wait_for,
    with_overrides,
)


def pack(src: Path, out: Path, **kwargs) -> dict:
    """Pack in this process (one worker) with tiny shards: several shards per split; the
    manifest."""
    kwargs.setdefault("shard_mb", 0.002)
    return pack_writer.pack(src, out, **kwargs)[0]


def pack_cmd(*args: object) -> subprocess.CompletedProcess:
    """``python -m jddp.pack ARGS`` to the end."""
    return run([sys.executable, "-m", "jddp.pack", *map(str, args)], timeout=300)


def all_rows(source, fn) -> tuple[np.ndarray, np.ndarray]:
    return fn(source, np.arange(len(source)))


# ---------------------------------------------------------------------------- round trips
def test_image_pack_gives_the_image_folders_pixels(tmp_path):
    src = photo_folder(tmp_path / "imf")
    manifest = pack(src, tmp_path / "pack")
    assert len(manifest["splits"]["train"]["shards"]) > 1  # example i crosses shard bounds
    packed = load_splits("packed", str(tmp_path / "pack"), 16)
    folder = load_splits("imagefolder", str(src), 16)
    for get in (
        lambda s, i: s.get_batch(i),
        lambda s, i: train_rows(s, i, aug.example_keys(3, 1, i), "imagenet"),
        lambda s, i: eval_rows(s, i, "imagenet"),
    ):
        for p, f in ((packed.train, folder.train), (packed.eval, folder.eval)):
            got, want = all_rows(p, get), all_rows(f, get)
            np.testing.assert_array_equal(got[0], want[0])  # bitwise the same pixels
            np.testing.assert_array_equal(got[1], want[1])
    assert packed.train.classes == folder.train.classes == ["cat", "dog"]
    assert packed.train.num_classes == 2 and packed.train.image_shape == (16, 16, 3)
    np.testing.assert_array_equal(packed.train.mean, folder.train.mean)
    np.testing.assert_array_equal(packed.eval.std, folder.eval.std)
    # the records hold the files' bytes as they are, in the folder's order
    records = packed.train.records(np.arange(len(folder.train)))
    assert [r.payload for r, _ in records] == [f.read_bytes() for f in folder.train.files]
    assert "0x" not in repr(packed.train) and repr(packed.train) == repr(
        load_splits("packed", str(tmp_path / "pack"), 16).train
    )
    default = load_splits("packed", str(tmp_path / "pack"), None)
    assert default.train.image_shape == (224, 224, 3)
    with pytest.raises(DataConfigError, match="model.num_classes=1"):
        load_splits("packed", str(tmp_path / "pack"), 16, num_classes=1)


def test_max_side_reencodes_only_large_images(tmp_path):
    from sklearn.datasets import load_sample_images

    src = tmp_path / "imf"
    big = load_sample_images().images[0]  # 427 x 640
    for split in ("train", "val"):
        (src / split / "a").mkdir(parents=True)
        Image.fromarray(big).save(src / split / "a" / "big.jpg", quality=95)
        Image.fromarray(big[:40, :60]).save(src / split / "a" / "small.jpg", quality=95)
        Image.fromarray(big[:200, :40]).save(src / split / "a" / "thin.png")  # short side 40
    manifest = pack(src, tmp_path / "pack", max_side=64, quality=80)
    assert manifest["splits"]["train"]["reencoded"] == 1
    assert manifest["image_size"]["max_side"] == 64
    packed = load_splits("packed", str(tmp_path / "pack"), 32).train
    records = {Path(f).name: r for f, (r, _) in zip(
        sorted(p for p in (src / "train" / "a").iterdir()),
        packed.records(np.arange(3)),
        strict=True,
    )}  # fmt: skip
    with Image.open(io.BytesIO(records["big.jpg"].payload)) as img:
        assert img.format == "JPEG" and img.size == (96, 64)  # shorter side 427 -> 64
    assert records["small.jpg"].payload == (src / "train" / "a" / "small.jpg").read_bytes()
    assert records["thin.png"].payload == (src / "train" / "a" / "thin.png").read_bytes()
    # the re-encoded photo still looks like the photo
    folder = load_splits("imagefolder", str(src), 32).train
    got, want = packed.get_batch(np.arange(3))[0], folder.get_batch(np.arange(3))[0]
    np.testing.assert_array_equal(got[1:], want[1:])
    assert 0 < np.abs(got[0].astype(int) - want[0]).mean() < 12  # two lossy paths to 32 px


def write_npz(path: Path, dtype) -> None:
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (10, 6, 6, 3)).astype(dtype)
    np.savez(path, x_train=x, y_train=np.arange(10) % 4, x_test=x[:3], y_test=[0, 1, 3])


@pytest.mark.parametrize("fmt", ["cifar10", "mnist", "npz-uint8", "npz-float32"])
def test_array_packs_equal_the_in_memory_sources(tmp_path, fmt):
    name = fmt.split("-")[0]
    if fmt == "cifar10":
        write_cifar_folder(tmp_path / "src")
        src = tmp_path / "src"
    elif fmt == "mnist":
        write_mnist(tmp_path / "src", compress=True)
        src = tmp_path / "src"
    else:
        src = tmp_path / "d.npz"
        write_npz(src, fmt.split("-")[1])
    manifest = pack(src, tmp_path / "pack", shard_mb=0.0005)  # format detected
    assert manifest["identity"]["format"] == name
    for size in (None, 8):
        packed = load_splits("packed", str(tmp_path / "pack"), size)
        memory = load_splits(name, str(src), size)
        keys = aug.example_keys(0, 0, np.arange(len(memory.train)))
        for p, m in ((packed.train, memory.train), (packed.eval, memory.eval)):
            assert p.image_shape == m.image_shape and p.num_classes == m.num_classes
            # the pack keeps the train stats of the stored images; resized in memory at load,
            # the images' stats move (and so do float pixels, normalised with them)
            exact = size is None or m.images.dtype == np.uint8
            if size is None:
                np.testing.assert_array_equal(p.mean, m.mean)
                np.testing.assert_array_equal(p.std, m.std)
            for augment in ("none", "cifar", "imagenet"):
                k = keys[: len(m)]
                got, want = (train_rows(s, np.arange(len(m)), k, augment) for s in (p, m))
                assert got[0].dtype == want[0].dtype
                if exact:
                    np.testing.assert_array_equal(got[0], want[0])
                np.testing.assert_array_equal(got[1], want[1])


def test_packed_batches_are_the_same_for_any_workers(tmp_path):
    """Batch k is the same pixels with threads, processes (the source pickles; readers open in
    each process) or two hosts' halves."""
    write_jpeg_folder(tmp_path / "jpg", per_class=8, size=(30, 20))
    pack(tmp_path / "jpg", tmp_path / "pack")
    source = load_splits("packed", str(tmp_path / "pack"), 12).train
    host = HostBatches(source, 8, seed=5, rows=slice(0, 8), augment="imagenet")
    folder = load_splits("imagefolder", str(tmp_path / "jpg"), 12).train
    ref = [host(k)["images"] for k in range(3)]
    same = HostBatches(folder, 8, seed=5, rows=slice(0, 8), augment="imagenet")
    assert all(np.array_equal(r, same(k)["images"]) for k, r in enumerate(ref))
    for workers, kind in ((2, "thread"), (2, "process")):
        it = host_iterator(host, range(3), workers, kind)
        got = [b["images"] for b in it]
        assert all(np.array_equal(a, b) for a, b in zip(ref, got, strict=True)), kind
    halves = [HostBatches(source, 8, 5, slice(r, r + 4), "imagenet") for r in (0, 4)]
    for k in range(3):
        np.testing.assert_array_equal(np.concatenate([h(k)["images"] for h in halves]), ref[k])


# ---------------------------------------------------------------------------- the pack command
def shard_files(out: Path) -> list[Path]:
    return sorted(out.glob("*.array_record"))


def test_a_stop_signal_ends_a_pack_in_one_line_and_a_rerun_continues(tmp_path, monkeypatch, capfd):
    """SIGTERM to python -m jddp.pack: one line, exit 75, the shards written kept (it printed no
    jddp line); the same command again finishes the pack."""
    from jddp import pack as pack_cli

    write_jpeg_folder(tmp_path / "jpg", per_class=4, size=(30, 20))
    out = tmp_path / "pack"
    real = pack_writer.write_shard
    calls = []

    def signalled_at_the_third(task):  # the scheduler's SIGTERM, while the pack writes
        calls.append(task.file)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGTERM)
        return real(task)

    monkeypatch.setattr(pack_writer, "write_shard", signalled_at_the_third)
    argv = [str(tmp_path / "jpg"), str(out), "--workers", "1", "--shard-mb", "0.0005"]
    capfd.readouterr()
    assert pack_cli.main(argv) == 75
    assert capfd.readouterr().err.splitlines()[-1] == (
        "jddp: error: pack: stopped by SIGTERM; the shards written so far are kept: rerun the "
        "same command to continue"
    )
    assert len(shard_files(out)) == 2 and not (out / MANIFEST).exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back
    monkeypatch.setattr(pack_writer, "write_shard", real)
    assert pack_cli.main(argv) == 0 and (out / MANIFEST).exists()


def test_interrupted_pack_continues_and_never_reads_as_complete(tmp_path, monkeypatch):
    write_jpeg_folder(tmp_path / "jpg", per_class=4, size=(30, 20))
    out = tmp_path / "pack"
    real = pack_writer.write_shard
    calls = []

    def dies_on_the_third(task):
        calls.append(task.file)
        if len(calls) == 3:
            (out / f"{task.file}.tmp").write_bytes(b"half a shard")  # as a kill would leave it
            raise KeyboardInterrupt
        return real(task)

    monkeypatch.setattr(pack_writer, "write_shard", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        pack(tmp_path / "jpg", out)
    done = shard_files(out)
    assert len(done) == 2 and not (out / MANIFEST).exists()
    with pytest.raises(DataConfigError, match="unfinished pack"):
        load_splits("packed", str(out), 8)
    stamps = {p.name: p.stat().st_mtime_ns for p in done}
    monkeypatch.setattr(pack_writer, "write_shard", real)
    manifest = pack(tmp_path / "jpg", out)
    assert {p.name: p.stat().st_mtime_ns for p in done} == stamps  # kept, not rewritten
    assert sorted(out.iterdir()) == sorted([out / MANIFEST, *shard_files(out)])  # no leftovers
    resumed = load_splits("packed", str(out), 8)
    fresh_manifest = pack(tmp_path / "jpg", tmp_path / "fresh")
    fresh = load_splits("packed", str(tmp_path / "fresh"), 8)
    assert manifest["pack_id"] != fresh_manifest["pack_id"]
    for a, b in ((resumed.train, fresh.train), (resumed.eval, fresh.eval)):
        np.testing.assert_array_equal(all_rows(a, PackedSource.get_batch)[0],
                                      all_rows(b, PackedSource.get_batch)[0])  # fmt: skip
    # a rerun of a complete pack changes nothing
    assert pack(tmp_path / "jpg", out)["pack_id"] == manifest["pack_id"]


def test_pack_command_refuses_a_foreign_out_and_reports(tmp_path):
    write_jpeg_folder(tmp_path / "jpg", per_class=2, size=(24, 16))
    write_jpeg_folder(tmp_path / "other", per_class=3, size=(24, 16))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    out = pack_cmd(tmp_path / "jpg", tmp_path / "busy")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "busy" in out.stderr and "not empty" in out.stderr
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    ok = pack_cmd(tmp_path / "jpg", tmp_path / "pack", "--workers", 2, "--shard-mb", 0.001)
    assert ok.returncode == 0, ok.stderr
    assert "train: 4 examples in 4 shard(s)" in ok.stdout
    assert ok.stderr.count("written") == 8  # progress: a plain line per shard off a terminal
    for args in ((tmp_path / "jpg", "--max-side", 8), (tmp_path / "other",)):
        refused = pack_cmd(args[0], tmp_path / "pack", *args[1:])  # other options, other SRC
        assert refused.returncode == 2 and "not empty" in refused.stderr, refused.stderr
    assert load_splits("packed", str(tmp_path / "pack"), 8).train.num_classes == 2
    again = pack_cmd(tmp_path / "jpg", tmp_path / "pack", "--workers", 2, "--shard-mb", 0.001)
    assert again.returncode == 0 and "already holds this pack, complete" in again.stderr
    assert "wrote" not in again.stdout and "train: 4 examples" in again.stdout  # nothing written
    unknown = pack_cmd(tmp_path / "busy", tmp_path / "x")
    assert unknown.returncode == 2 and "--format" in unknown.stderr


def test_bad_images_stop_the_pack_or_are_skipped(tmp_path):
    write_jpeg_folder(tmp_path / "jpg", per_class=4, size=(24, 16))
    bad = tmp_path / "jpg" / "train" / "n00000001" / "2.JPEG"
    bad.write_bytes(bad.read_bytes()[:150])  # truncated
    empty = tmp_path / "jpg" / "train" / "n00000000" / "1.JPEG"
    empty.write_bytes(b"")
    stopped = pack_cmd(tmp_path / "jpg", tmp_path / "p1", "--workers", 2)
    err = stopped.stderr.strip().splitlines()[-1]
    assert stopped.returncode == 1, stopped.stderr
    assert err.startswith("jddp: error: pack: cannot decode image") and "empty" in err, err
    assert str(empty) in err and stopped.stderr.count("jddp: error") == 1
    assert not (tmp_path / "p1" / MANIFEST).exists()
    skipping = pack_cmd(tmp_path / "jpg", tmp_path / "p2", "--workers", 1, "--skip-bad")
    assert skipping.returncode == 0, skipping.stderr
    assert "train: 6 examples in 1 shard(s), 0 re-encoded, 2 skipped" in skipping.stdout
    manifest = json.loads((tmp_path / "p2" / MANIFEST).read_text())
    skipped = manifest["splits"]["train"]["skipped"]
    assert [s.split(":")[0] for s in skipped] == [str(empty), str(bad)]
    assert len(load_splits("packed", str(tmp_path / "p2"), 8).train) == 6


# ---------------------------------------------------------------------------- damaged packs
def test_records_carry_a_checksum_and_the_pack_id():
    pack_id, other = b"a" * 16, b"b" * 16
    record = encode_record(pack_id, 3, b"payload bytes")
    assert parse_record(record, pack_id, "w").payload == b"payload bytes"
    flipped = bytearray(record)
    flipped[-2] ^= 1
    with pytest.raises(DataError, match="w: CRC-32 mismatch"):
        parse_record(bytes(flipped), pack_id, "w")
    with pytest.raises(DataError, match="another pack"):
        parse_record(record, other, "w")
    array = np.arange(24, dtype=np.float32).reshape(2, 4, 3)
    np.testing.assert_array_equal(
        parse_record(encode_record(pack_id, 0, array), pack_id, "").payload, array
    )


def damage(out: Path, how: str, tmp_path: Path) -> Path:
    """Damage shard 1 of the train split of the pack ``out`` in place; returns that shard."""
    shard = sorted(out.glob("train-*.array_record"))[1]
    data = shard.read_bytes()
    if how == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    elif how == "missing":
        shard.unlink()
    elif how == "foreign":  # the same source packed again: same sizes, another pack id
        identity = json.loads((out / MANIFEST).read_text())["identity"]
        shard_mb = identity["options"]["shard_bytes"] / 1e6
        pack_writer.pack(Path(identity["source"]), tmp_path / "again", shard_mb=shard_mb)
        shutil.copy(tmp_path / "again" / shard.name, shard)
    elif how == "corrupt":  # one byte of the second record's payload
        second = load_splits("packed", str(out), 8).train.records(np.array([0, 1]))
        _, where = second[1]
        assert where.endswith("record 1")
        payload = second[1][0].payload
        at = data.find(payload[60:100])
        shard.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :])
    return shard


@pytest.mark.parametrize("how", ["truncated", "missing", "foreign"])
def test_damaged_shards_are_named_when_opened(tmp_path, how):
    write_jpeg_folder(tmp_path / "jpg", per_class=6, size=(24, 16))
    pack(tmp_path / "jpg", tmp_path / "pack", shard_mb=0.004)
    shard = damage(tmp_path / "pack", how, tmp_path)
    with pytest.raises(DataError) as err:
        load_splits("packed", str(tmp_path / "pack"), 8)
    text = str(err.value)
    assert repr(str(shard)) in text and "\n" not in text, text
    assert {"truncated": "truncated", "missing": "missing", "foreign": "record 0"}[how] in text


# ---------------------------------------------------------------------------- end to end
E2E = ["data.augment=imagenet", "data.image_size=8", "train.steps=8", "checkpoint.every_steps=4"]


@pytest.fixture(scope="module")
def packed_run(tmp_path_factory):
    """A pack of 32 tiny JPEGs (4 train shards) and one uninterrupted 1 process x 2 devices run
    of 8 steps on it (checkpoints 4, 8). The runs here train a small MLP (``QUICK``): what is
    tested is the pack's batches, not the model."""
    root = tmp_path_factory.mktemp("packed")
    write_jpeg_folder(root / "jpg", per_class=16, size=(20, 14))
    pack(root / "jpg", root / "pack", shard_mb=0.003)
    wd = root / "straight"
    out = run(packed_cmd(1, 2, wd, root / "pack"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert steps_saved(wd) == [4, 8]
    return root, wd


def packed_cmd(nproc: int, devices: int, workdir: Path, pack_dir: Path, *more: str) -> list[str]:
    """``jddp.launch`` of QUICK's run with the e2e overrides on ``pack_dir``, then ``more``
    (replacing entries of the same key)."""
    overrides = with_overrides(["data.name=packed", f"data.path={pack_dir}", *E2E], *more)
    return launch_cmd(nproc, devices, workdir, *overrides, base=QUICK)


@pytest.mark.slow
def test_packed_topology_invariance_and_bitwise_resume(tmp_path, packed_run):
    root, straight = packed_run
    want = read_losses(straight)
    two = run(packed_cmd(2, 1, tmp_path / "two", root / "pack"))
    assert two.returncode == 0, two.stderr[-3000:]
    assert_losses_match(read_losses(tmp_path / "two"), want, range(1, 9))
    wd = tmp_path / "resumed"
    (wd / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "4", wd / "checkpoints" / "4")
    out = run(packed_cmd(1, 2, wd, root / "pack", "data.workers=0"))
    assert out.returncode == 0 and "at step 4" in out.stdout, out.stderr[-3000:]
    assert_losses_match(read_losses(wd), want, range(5, 9), rel=0)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["corrupt", "truncated", "foreign"])
def test_damaged_pack_stops_training_in_one_line(tmp_path, packed_run, how):
    root, straight = packed_run
    pack_dir = tmp_path / "pack"
    shutil.copytree(root / "pack", pack_dir)
    shard = damage(pack_dir, how, tmp_path)
    wd = tmp_path / "run"
    shutil.copytree(straight / "checkpoints", wd / "checkpoints")
    out = run(packed_cmd(1, 2, wd, pack_dir, "train.steps=12"))
    lines = [line for line in out.stderr.strip().splitlines() if "jddp: error" in line]
    assert out.returncode == 1, out.stderr[-3000:]
    assert len(lines) == 1 and str(shard) in lines[0] and "record" in lines[0], out.stderr
    assert steps_saved(wd) == [4, 8]  # nothing lost


@pytest.mark.slow
def test_killed_pack_leaves_no_worker_and_the_rerun_finishes(tmp_path):
    write_jpeg_folder(tmp_path / "jpg", classes=2, per_class=60, size=(500, 375))
    out = tmp_path / "pack"
    args = [sys.executable, "-m", "jddp.pack", tmp_path / "jpg", out, "--max-side", 64]
    job = subprocess.Popen([*map(str, args), "--workers", "2", "--shard-mb", "0.5"])
    assert wait_for(lambda: len(shard_files(out)) >= 1, 120), "no shard was finished"
    workers = [int(p) for p in Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()]
    job.kill()
    job.wait()
    assert not (out / MANIFEST).exists() and len(shard_files(out)) < 42
    assert wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in workers), 10), workers
    done = {p.name: p.stat().st_mtime_ns for p in shard_files(out)}
    rerun = pack_cmd(*args[3:], "--workers", 2, "--shard-mb", 0.5)
    assert rerun.returncode == 0, rerun.stderr
    assert rerun.stderr.count("already there") == len(done)
    assert {n: (out / n).stat().st_mtime_ns for n in done} == done
    assert not list(out.glob("*.tmp")) and len(load_splits("packed", str(out), 8).train) == 120
