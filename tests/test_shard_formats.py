"""Parquet (the Hugging Face Hub's layout) and WebDataset tar shards: the same pixels and labels as
the same files in an image folder, the shards found from folders, globs and brace patterns, the
same per-step losses on any topology and after a kill -9, damaged shards named in one line, a
custom task's numeric columns, and both accepted by ``python -m jddp.pack``."""

from __future__ import annotations

import io
import shutil
import signal
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from experiments.shard_writers import write_parquet_like_the_hub, write_webdataset
from jddp.data import augment as aug
from jddp.data.formats.shards import expand_braces, find_files, split_of
from jddp.data.formats.webdataset import INDEX_SUFFIX
from jddp.data.pipeline import eval_rows, train_rows
from jddp.data.registry import load_splits
from jddp.errors import ConfigError, DataConfigError, DataError
from tests.datafiles import photo_folder, write_jpeg_folder
from tests.helpers import (
    QUICK,
    assert_losses_match,
    assert_resumed_bitwise,
    failure_text,
    fake_devices,
    launch_cmd,
    read_losses,
    read_metrics,
    run,
    run_python,
    start,
    steps_saved,
    train_cmd,
    with_overrides,
)

WDS = "{train,val}-{000000..000001}.tar"


def shard_sets(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The photo folder of the pack tests as Parquet and WebDataset shards (2 per split, the
    Parquet in row groups of 3 rows): ``(folder, {format: data.path})``."""
    src = photo_folder(tmp_path / "imf")
    write_parquet_like_the_hub(src, tmp_path / "pq", shards=2, row_group_rows=3)
    write_webdataset(src, tmp_path / "wds", shards=2)
    return src, {"parquet": str(tmp_path / "pq"), "webdataset": str(tmp_path / "wds" / WDS)}


def test_shards_give_the_image_folders_pixels_and_labels(tmp_path):
    src, paths = shard_sets(tmp_path)
    folder = load_splits("imagefolder", str(src), 16)
    for name, path in paths.items():
        splits = load_splits(name, path, 16)
        for get in (
            lambda s, i: s.get_batch(i),
            lambda s, i: train_rows(s, i, aug.example_keys(3, 1, i), "imagenet"),
            lambda s, i: eval_rows(s, i, "imagenet"),
        ):
            for mine, theirs in ((splits.train, folder.train), (splits.eval, folder.eval)):
                rows = np.arange(len(theirs))[::-1]  # across shards and row groups, any order
                got, want = get(mine, rows), get(theirs, rows)
                np.testing.assert_array_equal(got[0], want[0])  # bitwise the same pixels
                np.testing.assert_array_equal(got[1], want[1])
        assert splits.train.num_classes == 2 and splits.train.image_shape == (16, 16, 3)
        np.testing.assert_array_equal(splits.train.mean, folder.train.mean)
        assert "0x" not in repr(splits.train)
    assert load_splits("parquet", paths["parquet"], 16).train.classes == ["cat", "dog"]  # the Hub's
    # the WebDataset index is cached beside each shard, and read back rather than rebuilt
    indexes = sorted((tmp_path / "wds").glob(f"*{INDEX_SUFFIX}"))
    assert len(indexes) == 4
    stamps = [p.stat().st_mtime_ns for p in indexes]
    load_splits("webdataset", paths["webdataset"], 16)
    assert [p.stat().st_mtime_ns for p in indexes] == stamps


def test_webdataset_json_labels_and_an_index_outside_a_read_only_folder(tmp_path, monkeypatch):
    src = photo_folder(tmp_path / "imf")
    write_webdataset(src, tmp_path / "wds", shards=1, label="json")
    want = load_splits("imagefolder", str(src), 8).train
    import jddp.data.formats.webdataset as wds

    real_mkstemp = wds.tempfile.mkstemp

    def read_only_beside_shards(prefix, suffix, dir):  # noqa: A002 - mkstemp's own name
        if Path(dir) == tmp_path / "wds":
            raise PermissionError(13, "Read-only file system", str(dir))
        return real_mkstemp(prefix=prefix, suffix=suffix, dir=dir)

    monkeypatch.setattr(wds.tempfile, "mkstemp", read_only_beside_shards)
    path = str(tmp_path / "wds" / "{train,val}-000000.tar")
    got = load_splits("webdataset", path, 8, index_dir=str(tmp_path / "run" / "data-index")).train
    np.testing.assert_array_equal(got.labels, want.labels)
    assert not list((tmp_path / "wds").glob(f"*{INDEX_SUFFIX}"))
    assert len(list((tmp_path / "run" / "data-index").glob(f"*{INDEX_SUFFIX}"))) == 2


def test_parquet_images_held_as_paths_are_read_and_a_missing_one_is_said_at_start(tmp_path):
    """datasets writes {"bytes": None, "path": ...} for images it did not embed: the files are
    read (the same pixels as the folder's); moved away, the source refuses at start, naming the
    row, the path and how to embed them (it was 'row 221 has no image' at that batch)."""
    import shutil

    src = photo_folder(tmp_path / "imf")
    write_parquet_like_the_hub(src, tmp_path / "pq", shards=2, row_group_rows=3, paths_only=True)
    folder = load_splits("imagefolder", str(src), 16)
    splits = load_splits("parquet", str(tmp_path / "pq"), 16)
    for mine, theirs in ((splits.train, folder.train), (splits.eval, folder.eval)):
        rows = np.arange(len(theirs))[::-1]
        got, want = mine.get_batch(rows), theirs.get_batch(rows)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    shutil.move(src, tmp_path / "moved")
    with pytest.raises(DataError, match=r"row 0: the image is not in the shard but a path, '.*imf"
                       r"/train/.*embed them \(datasets: ds.with_format\('arrow'\)"):  # fmt: skip
        load_splits("parquet", str(tmp_path / "pq"), 16)


def test_shard_patterns_and_split_names(tmp_path):
    assert expand_braces("s-{08..11}.tar") == ["s-08.tar", "s-09.tar", "s-10.tar", "s-11.tar"]
    assert expand_braces("{a,b}-{0..1}") == ["a-0", "a-1", "b-0", "b-1"]
    assert expand_braces("plain.tar") == ["plain.tar"]
    for name, want in (
        ("data/train-00000-of-00004.parquet", "train"),
        ("data/validation-00001-of-00002.parquet", "eval"),
        ("plain_text/test/0000.parquet", "eval"),
        ("imagenet-val-000049.tar", "eval"),
        ("imagenet-train-001281.tar", "train"),
        ("shard-000001.tar", None),
    ):
        assert split_of(Path(name)) == want, name
    for i in range(3):
        (tmp_path / f"s-{i}.tar").write_bytes(b"")
    assert [p.name for p in find_files(str(tmp_path / "s-*.tar"), (".tar",), "k", "")] == [
        "s-0.tar",
        "s-1.tar",
        "s-2.tar",
    ]
    with pytest.raises(DataConfigError, match=r"names '.*s-3.tar', which does not exist"):
        find_files(str(tmp_path / "s-{0..3}.tar"), (".tar",), "data.path", "")
    with pytest.raises(DataConfigError, match="data.path='.*x-\\*.tar' matches no file"):
        find_files(str(tmp_path / "x-*.tar"), (".tar",), "data.path", "")


def test_a_hub_folder_with_validation_and_test_evaluates_on_validation(tmp_path):
    """train/validation/test as the Hub writes them: validation is the eval split (they were
    merged); data.eval_path pointing at test is taken, and then data.path trains on its train
    split only (it was refused, the folder holding the eval shards too)."""
    from jddp.data.formats.shards import split_files

    hub = tmp_path / "data"
    hub.mkdir()
    for name in ("train-00000-of-00001", "validation-00000-of-00001", "test-00000-of-00001"):
        (hub / f"{name}.parquet").write_bytes(b"")
    train, evals = split_files("parquet", str(hub), None, (".parquet",), "")
    assert [p.name for p in train] == ["train-00000-of-00001.parquet"]
    assert [p.name for p in evals] == ["validation-00000-of-00001.parquet"]
    test = str(hub / "test-*.parquet")
    train, evals = split_files("parquet", str(hub), test, (".parquet",), "")
    assert [p.name for p in train] == ["train-00000-of-00001.parquet"]
    assert [p.name for p in evals] == ["test-00000-of-00001.parquet"]
    # train-* alone: refused as an image folder without val/ is (it evaluated on the train set)
    only_train = str(hub / "train-*.parquet")
    with pytest.raises(DataConfigError, match=r"only train shards \(train-\*\): no eval split"):
        split_files("parquet", only_train, None, (".parquet",), "")


@pytest.mark.slow
def test_a_custom_task_trains_on_the_numeric_columns(tmp_path):
    """A custom task's data as a Parquet table (a fixed-length list column, scalars, a string
    column left out) gives the very losses of the same arrays from a data factory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests import user_tasks

    for split, (n, seed) in (("train", (user_tasks.TRAIN, 0)), ("test", (user_tasks.EVAL, 1))):
        arrays = user_tasks.arrays(n, seed)
        table = pa.table(
            {
                "x": pa.array(list(arrays["x"]), pa.list_(pa.float32(), 4)),
                "y": arrays["y"],
                "w": arrays["w"],
                "note": [f"row {i}" for i in range(n)],
            }
        )
        (tmp_path / "pq").mkdir(exist_ok=True)
        pq.write_table(table, tmp_path / "pq" / f"{split}-00000-of-00001.parquet")
    task = [
        "model.name=tests.user_tasks:linear",
        "train.loss=tests.user_tasks:weighted_loss",
        "data.global_batch_size=16",
        "train.steps=6",
        "log.every_steps=1",
        "log.progress=off",
        "optim.schedule=constant",
        "optim.lr=0.01",
    ]
    root = Path(__file__).resolve().parent.parent
    outs = {}
    for name, data in (
        ("parquet", ["data.name=parquet", f"data.path={tmp_path / 'pq'}"]),
        ("factory", ["data.name=tests.user_tasks:data"]),
    ):
        cmd = train_cmd(tmp_path / name, *task, *data, base=[])
        out = run(cmd, env=fake_devices(2), cwd=root)
        assert out.returncode == 0, out.stderr[-3000:]
        outs[name] = out
    assert_losses_match(read_losses(tmp_path / "parquet"), read_losses(tmp_path / "factory"),
                        range(1, 7), rel=0)  # fmt: skip
    final = read_metrics(tmp_path / "parquet")[-1]
    assert final["eval/count"] == user_tasks.EVAL


# ---------------------------------------------------------------------------- end to end
E2E = [
    "data.augment=imagenet",
    "data.image_size=8",
    "train.steps=8",
    "checkpoint.every_steps=2",
    "checkpoint.keep=5",
]


@pytest.fixture(scope="module")
def e2e_shards(tmp_path_factory):
    """32 train + 4 eval JPEGs (and the two photos) as Parquet and WebDataset shards."""
    root = tmp_path_factory.mktemp("shards")
    write_jpeg_folder(root / "jpg", per_class=16, size=(20, 14))
    write_parquet_like_the_hub(root / "jpg", root / "pq", shards=3, row_group_rows=5)
    write_webdataset(root / "jpg", root / "wds", shards=3)
    return {
        "parquet": ["data.name=parquet", f"data.path={root / 'pq'}"],
        "webdataset": ["data.name=webdataset", f"data.path={root / 'wds' / '*.tar'}"],
    }


def killed_and_rerun(cmd, workdir, env) -> None:
    """Start ``cmd``, SIGKILL it once a checkpoint is complete and steps go on, rerun it."""
    job = start(cmd, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and job.poll() is None:
        metrics = workdir / "metrics.jsonl"
        if metrics.exists() and len(read_losses(workdir)) >= 3 and steps_saved(workdir):
            break
        time.sleep(0.01)
    job.send_signal(signal.SIGKILL)
    job.wait()
    assert job.returncode == -signal.SIGKILL and max(read_losses(workdir)) < 8, job.returncode
    return steps_saved(workdir)[-1]


@pytest.mark.slow
def test_any_topology_and_a_kill_give_the_same_losses(tmp_path, e2e_shards):
    """Parquet 1x2 and WebDataset 2x1 of the same files: the same per-step losses (batch k is the
    same images in either format and topology); each format killed with SIGKILL mid-run and rerun
    on the other's topology continues bitwise. (A small MLP, ``QUICK``: the formats' batches are
    what is tested.)"""
    runs = {}
    for name, (nproc, devices) in (("parquet", (1, 2)), ("webdataset", (2, 1))):
        wd = tmp_path / f"{name}-straight"
        out = run(
            launch_cmd(nproc, devices, wd, *with_overrides(e2e_shards[name], *E2E), base=QUICK)
        )
        assert out.returncode == 0, failure_text(out.stderr)
        runs[(nproc, devices)] = wd
    assert_losses_match(read_losses(runs[(2, 1)]), read_losses(runs[(1, 2)]), range(1, 9))
    for name, (nproc, devices) in (("webdataset", (1, 2)), ("parquet", (2, 1))):
        wd = tmp_path / f"{name}-killed"
        cmd = launch_cmd(nproc, devices, wd, *with_overrides(e2e_shards[name], *E2E), base=QUICK)
        resumed = killed_and_rerun(cmd, wd, env=None)
        out = run(cmd)
        assert_resumed_bitwise(out, wd, runs[(nproc, devices)], resumed, 8)


# ---------------------------------------------------------------------------- bad input
def _damage(tmp_path: Path, paths: dict[str, str], name: str, how: str) -> tuple[Path, str]:
    """Damage one shard of format ``name``; returns it and a word its line must hold."""
    if name == "webdataset":
        shard = tmp_path / "wds" / "train-000001.tar"
        data = shard.read_bytes()
        if how == "truncated":  # cut inside the last image
            with tarfile.open(shard) as tar:
                last = [m for m in tar.getmembers() if not m.name.endswith(".cls")][-1]
            shard.write_bytes(data[: last.offset_data + last.size // 2])
            return shard, f"is truncated: member {last.name!r}"
        if how == "missing label":
            with tarfile.open(shard) as tar:
                members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
            with tarfile.open(shard, "w") as tar:
                for m, blob in members:
                    if not m.name.endswith("000006.cls"):
                        tar.addfile(m, io.BytesIO(blob))
            return shard, "'train/000006' has no label member"
        if how == "label out of range":
            with tarfile.open(shard) as tar:
                members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
            with tarfile.open(shard, "w") as tar:
                for m, blob in members:
                    blob = b"7" if m.name.endswith("000006.cls") else blob
                    m.size = len(blob)
                    tar.addfile(m, io.BytesIO(blob))
            return shard, "example 'train/000006' holds label 7"
    import pyarrow as pa
    import pyarrow.parquet as pq

    shard = tmp_path / "pq" / "data" / "train-00001-of-00002.parquet"
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-200])
        return shard, "cannot be read"
    table = pq.read_table(shard)
    if how == "missing label":
        pq.write_table(table.drop_columns(["label"]), shard)
        return shard, "no column 'label'"
    if how == "schema":
        pq.write_table(table.set_column(1, "label", table.column("label").cast(pa.int32())), shard)
        return shard, "'label' is int32 but"
    if how == "label out of range":
        labels = table.column("label").to_pylist()
        labels[2] = 9
        pq.write_table(table.set_column(1, "label", pa.array(labels, pa.int64())), shard)
        return shard, "row 2 holds label 9, outside [0, 2)"
    raise AssertionError(how)


@pytest.mark.parametrize(
    "name,how",
    [
        ("parquet", "truncated"),
        ("parquet", "missing label"),
        ("parquet", "schema"),
        ("parquet", "label out of range"),
        ("webdataset", "truncated"),
        ("webdataset", "missing label"),
        ("webdataset", "label out of range"),
    ],
)
def test_a_damaged_shard_is_named_in_one_line(tmp_path, name, how):
    _, paths = shard_sets(tmp_path)
    shard, words = _damage(tmp_path, paths, name, how)
    with pytest.raises(DataError) as err:
        load_splits(name, paths[name], 8, num_classes=2)
    text = str(err.value)
    assert repr(str(shard)) in text and words in text and "\n" not in text, text


@pytest.mark.slow
def test_training_stops_in_one_line_on_bad_shards_and_keeps_its_checkpoints(tmp_path, e2e_shards):
    """A corrupt image inside a shard met mid-run: exit 1, one line naming the shard and the
    row/member, the checkpoints kept; an empty glob or a key another format owns: exit 2."""
    root = Path(e2e_shards["parquet"][1].split("=", 1)[1]).parent
    for name in ("parquet", "webdataset"):
        copy = tmp_path / name
        shutil.copytree(root / ("pq" if name == "parquet" else "wds"), copy)
        if name == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            shard = copy / "data" / "train-00002-of-00003.parquet"
            table = pq.read_table(shard)
            images = table.column("image").to_pylist()
            images[1]["bytes"] = images[1]["bytes"][:40] + b"\x00" * 200  # a cut JPEG
            pq.write_table(table.set_column(0, "image", pa.array(images, table.schema[0].type)),
                           shard)  # fmt: skip
            where, data = "row 1", ["data.name=parquet", f"data.path={copy}"]
        else:
            shard = copy / "train-000002.tar"
            raw = bytearray(shard.read_bytes())
            with tarfile.open(shard) as tar:
                member = next(m for m in tar.getmembers() if m.name.endswith(".jpeg"))
            raw[member.offset_data + 2 : member.offset_data + 240] = b"\x00" * 238
            shard.write_bytes(bytes(raw))
            stem = member.name.rsplit(".", 1)[0]
            where, data = f"example {stem!r}", ["data.name=webdataset", f"data.path={copy}/*.tar"]
        wd = tmp_path / f"run-{name}"
        out = run(train_cmd(wd, *with_overrides(data, *E2E, "data.workers=0"), base=[
            "model.width=4", "log.progress=off", "data.global_batch_size=16"]))  # fmt: skip
        lines = [x for x in out.stderr.strip().splitlines() if x.startswith("jddp: ")]
        assert out.returncode == 1, out.stderr[-3000:]
        assert len(lines) == 1 and str(shard) in lines[0] and where in lines[0], out.stderr
    empty = run(train_cmd(tmp_path / "e", "data.name=webdataset", f"data.path={tmp_path}/no-*.tar"))
    assert empty.returncode == 2 and "matches no file" in empty.stderr, empty.stderr[-2000:]
    other = run(train_cmd(tmp_path / "o", "data.name=synthetic", "data.label_key=cls"))
    assert other.returncode == 2 and "data.label_key applies to" in other.stderr, other.stderr


def test_pack_reads_parquet_and_webdataset(tmp_path):
    """``python -m jddp.pack`` takes both as SRC: the pack holds the same bytes, so the same
    pixels as the image folder."""
    from jddp.data import pack_writer

    src, paths = shard_sets(tmp_path)
    folder = load_splits("imagefolder", str(src), 16)
    for name, path in paths.items():
        out = tmp_path / f"pack-{name}"
        pack_writer.pack(Path(path) if name == "parquet" else path, out, fmt=name)
        packed = load_splits("packed", str(out), 16)
        for mine, theirs in ((packed.train, folder.train), (packed.eval, folder.eval)):
            rows = np.arange(len(theirs))
            np.testing.assert_array_equal(mine.get_batch(rows)[0], theirs.get_batch(rows)[0])
            np.testing.assert_array_equal(mine.get_batch(rows)[1], theirs.get_batch(rows)[1])


def test_pack_tells_a_single_webdataset_shard_from_cifar_by_what_it_holds(tmp_path):
    """One .tar given to jddp.pack was taken for CIFAR-10 by its name alone."""
    import tarfile

    from jddp.data.pack_source import detect_format
    from tests.datafiles import write_cifar_folder

    shard = write_webdataset(photo_folder(tmp_path / "imf"), tmp_path / "wds", shards=1)[0]
    assert detect_format(shard) == "webdataset"
    write_cifar_folder(tmp_path / "cifar" / "cifar-10-batches-py")
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "cifar" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    assert detect_format(archive) == "cifar10"
    (tmp_path / "broken.tar").write_bytes(b"not a tar")
    with pytest.raises(ConfigError, match="is not a readable tar file"):
        detect_format(tmp_path / "broken.tar")


def test_a_shard_rewritten_with_its_size_and_time_is_indexed_again(tmp_path):
    """A shard whose labels changed but whose size and modification time were kept (rsync -t,
    cp -p, a re-download): the cached index's content fingerprint no longer matches, so the
    shard is indexed again and the new labels are used (it trained on the stale ones)."""
    import os
    import tarfile

    from jddp.data.formats.webdataset import shard_index

    src = photo_folder(tmp_path / "imf")
    shard = write_webdataset(src, tmp_path / "wds", shards=1)[0]
    before, built = shard_index(shard, None, None, None)
    assert built and shard_index(shard, None, None, None)[1] is False  # cached, verified
    with tarfile.open(shard) as tar:
        first = next(m for m in tar.getmembers() if m.name.endswith(".cls"))
    stat = shard.stat()
    data = bytearray(shard.read_bytes())
    old = data[first.offset_data : first.offset_data + first.size]
    data[first.offset_data : first.offset_data + first.size] = b"1" if old == b"0" else b"0"
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # size and time as they were
    after, built = shard_index(shard, None, None, None)
    assert built  # indexed again
    assert after["labels"][0] != before["labels"][0]
    np.testing.assert_array_equal(after["labels"][1:], before["labels"][1:])


def test_a_gzip_compressed_shard_is_named_as_such(tmp_path):
    """A .tar.gz shard (common in the wild): one line saying it is gzip-compressed and what to
    do (it said 'not a tar file')."""
    import gzip

    from jddp.data.formats.tar import tar_members
    from jddp.errors import DataError

    src = photo_folder(tmp_path / "imf")
    shard = write_webdataset(src, tmp_path / "wds", shards=1)[0]
    packed = tmp_path / "train-000000.tar.gz"
    packed.write_bytes(gzip.compress(shard.read_bytes()))
    with pytest.raises(DataError, match="is gzip-compressed \\(.tar.gz\\): jddp reads"):
        tar_members(packed)


RACE = """
import io, sys, threading
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
from PIL import Image
from jddp.data.formats.parquet import ParquetSource
shard = sys.argv[1]
rng = np.random.default_rng(0)
images = []
for i in range(16):
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), np.uint8)).save(buf, "PNG")
    images.append(buf.getvalue())
rows = 4000
pq.write_table(pa.table({"image": [{"bytes": images[i % 16], "path": None} for i in range(rows)],
                         "label": pa.array([i % 2 for i in range(rows)], pa.int64())}),
               shard, row_group_size=4)
for attempt in range(3):
    source = ParquetSource([shard], 16, 2)
    def read(t):
        for i in range(t, rows, 32):
            source.payloads(np.asarray([i]))
    threads = [threading.Thread(target=read, args=(t,)) for t in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
print("read", rows // 4, "row groups")
"""


def test_input_threads_reading_one_shard_at_once_do_not_crash(tmp_path):
    """Eight threads reading different row groups of one shard through one ParquetSource, as
    the input pipeline's threads do: every read completes (pyarrow's reader shared between
    threads crashed a rank with SIGSEGV in ``read_row_group``; each thread now opens its own)."""
    out = run_python("-c", RACE, str(tmp_path / "train-00000-of-00001.parquet"), fresh=True,
                     timeout=300)  # fmt: skip
    assert out.returncode == 0, failure_text(out.stderr)
    assert out.stdout.split() == ["read", "1000", "row", "groups"]
