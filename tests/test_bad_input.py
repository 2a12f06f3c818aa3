"""Bad input, table-driven: one line naming the key/file and what is allowed, exit 2 (config
or command line) or 1 (runtime), and the existing workdir's files untouched."""

import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

TINY = [
    "model.width=4",
    "data.name=synthetic",
    "data.image_size=8",
    "data.global_batch_size=16",
    "log.progress=off",
]


def train(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "jddp.train", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def snapshot(workdir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(workdir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(workdir.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A finished run's workdir plus a few bad data files."""
    root = tmp_path_factory.mktemp("bad")
    wd = root / "run"
    out = train(f"workdir={wd}", *TINY, "train.steps=2", "checkpoint.every_steps=1")
    assert out.returncode == 0, out.stderr[-2000:]
    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, (40, 8, 8, 3), dtype=np.uint8)
    y = rng.integers(0, 10, 40)
    np.savez(root / "ok.npz", x_train=x, y_train=y, x_test=x[:8], y_test=y[:8])
    np.savez(root / "labels12.npz", x_train=x, y_train=y + 3, x_test=x[:8], y_test=y[:8])
    np.savez(
        root / "shapes.npz",
        x_train=x,
        y_train=y,
        x_test=rng.integers(0, 255, (8, 10, 10, 3), dtype=np.uint8),
        y_test=y[:8],
    )
    data = (root / "ok.npz").read_bytes()
    (root / "truncated.npz").write_bytes(data[: len(data) // 2])
    (root / "bad.yaml").write_text("model: [unclosed\n")
    (root / "a_file").write_text("")
    return root, wd


CASES = [
    # (id, extra args, exit code, words that must appear in the one line)
    ("unknown key", ["optim.lrr=0.1"], 2, ["optim.lrr", "optim.lr"]),
    ("unknown section", ["trian.steps=3"], 2, ["trian.steps", "train.steps"]),
    ("wrong type", ["train.steps=abc"], 2, ["train.steps", "integer"]),
    ("negative batch", ["data.global_batch_size=-4"], 2, ["data.global_batch_size", "> 0"]),
    ("zero steps", ["train.steps=0"], 2, ["train.steps", "> 0"]),
    ("negative lr", ["optim.lr=-0.1"], 2, ["optim.lr", ">= 0"]),
    ("unknown model", ["model.name=resnet19"], 2, ["model.name", "resnet19", "resnet18"]),
    ("unimportable model", ["model.name=nope.models:net"], 2, ["model.name", "nope.models"]),
    ("unknown optimizer", ["optim.name=lamb"], 2, ["optim.name", "sgd, adamw"]),
    ("unknown data", ["data.name=imagenet"], 2, ["data.name", "imagefolder"]),
    ("unknown stem", ["model.stem=tiny"], 2, ["model.stem", "cifar, imagenet"]),
    ("bad progress", ["log.progress=maybe"], 2, ["log.progress", "auto, on, off"]),
    ("negative workers", ["data.workers=-1"], 2, ["data.workers=-1", ">= 0"]),
    ("unknown augment", ["data.augment=autoaug"], 2, ["data.augment", "none, cifar, imagenet"]),
    ("steps and epochs", ["train.steps=3", "train.epochs=2"], 2, ["train.steps", "train.epochs"]),
    ("accum not dividing", ["train.grad_accum_steps=3"], 2, ["grad_accum_steps=3", "16"]),
    ("batch > data", ["data.global_batch_size=4096"], 2, ["global_batch_size=4096", "1024"]),
    ("too many devices", ["dist.num_local_devices=8"], 2, ["dist.num_local_devices=8"]),
    (
        "bad process id",
        ["dist.coordinator_address=localhost:1", "dist.num_processes=2", "dist.process_id=3"],
        2,
        ["dist.process_id=3", "dist.num_processes=2"],
    ),
    ("mpi without mpirun", ["dist.backend=mpi"], 2, ["dist.backend=mpi", "mpirun -np N"]),
    (
        "missing data path",
        ["data.name=cifar10", "data.path={root}/nothing"],
        2,
        ["data.path", "nothing", "cifar-10-python.tar.gz"],
    ),
    ("no data path", ["data.name=mnist"], 2, ["data.path is required", "mnist"]),
    (
        "labels >= num_classes",
        ["data.name=npz", "data.path={root}/labels12.npz"],
        2,
        ["labels12.npz", "model.num_classes=10"],
    ),
    ("truncated npz", ["data.name=npz", "data.path={root}/truncated.npz"], 1, ["truncated.npz"]),
    (
        "image shape mismatch",
        ["data.name=npz", "data.path={root}/shapes.npz"],
        1,
        ["shapes.npz", "(8, 8, 3)", "(10, 10, 3)"],
    ),
    ("missing config file", ["--config", "{root}/none.yaml"], 2, ["none.yaml", "no such file"]),
    ("invalid YAML", ["--config", "{root}/bad.yaml"], 2, ["bad.yaml", "not valid YAML"]),
    ("unknown flag", ["--frobnicate"], 2, ["--frobnicate"]),
    ("unwritable workdir", ["workdir={root}/a_file/run"], 2, ["workdir", "a_file", "writable"]),
    (
        "other model's checkpoint",
        ["model.width=8"],
        2,
        ["checkpoints/2", "different model", "(4,)", "(8,)"],
    ),
]


@pytest.mark.parametrize("name, args, code, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input(files, name, args, code, words):
    root, wd = files
    before = snapshot(wd)
    args = [a.replace("{root}", str(root)) for a in args]
    has_workdir = any(a.startswith("workdir=") for a in args)
    out = train(*([] if has_workdir else [f"workdir={wd}"]), *TINY, "train.steps=4", *args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == code, out.stderr[-2000:]
    assert len(lines) == 1, out.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert snapshot(wd) == before  # nothing already written was touched


def test_enough_cases():
    assert len(CASES) >= 20


def test_workdir_of_a_live_run_is_refused_and_a_stale_lock_taken_over(files, tmp_path):
    root, wd = files
    lock = wd / ".jddp.lock"
    lock.write_text(f"{socket.gethostname()} {os.getpid()}\n")  # this test process is alive
    try:
        before = snapshot(wd)
        out = train(f"workdir={wd}", *TINY, "train.steps=4")
        assert out.returncode == 2
        assert f"pid {os.getpid()}" in out.stderr and "in use by a live run" in out.stderr
        assert snapshot(wd) == before
    finally:
        lock.unlink()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    other = tmp_path / "run"
    other.mkdir()
    (other / ".jddp.lock").write_text(f"{socket.gethostname()} {dead}\n")
    out = train(f"workdir={other}", *TINY, "train.steps=1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "taking over stale lock" in out.stderr and not (other / ".jddp.lock").exists()


def test_all_checkpoints_damaged_is_a_runtime_error(files, tmp_path):
    root, wd = files
    copy = tmp_path / "run"
    subprocess.run(["cp", "-r", str(wd), str(copy)], check=True)
    for step_dir in (copy / "checkpoints").iterdir():
        for f in (step_dir / "state").rglob("*"):
            if f.is_file() and f.parent.name == "d":
                f.write_bytes(f.read_bytes()[:10])
    out = train(f"workdir={copy}", *TINY, "train.steps=4")
    assert out.returncode == 1
    assert "no usable checkpoint" in out.stderr.strip().splitlines()[-1]
    # Only jddp's own lines: no tracebacks from reads still in flight when a restore failed.
    assert "Traceback" not in out.stderr
    assert all(line.startswith("jddp: ") for line in out.stderr.splitlines() if line.strip())


def _processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (the run and anything it started)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_corrupt_jpeg_in_worker_processes_stops_the_run(tmp_path):
    """A corrupt JPEG decoded in a worker process: exit 1, one line naming the file, and no
    worker process left behind."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 16), ("val", 2)):
        for i in range(n):
            folder = tmp_path / "imf" / split / f"c{i % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.jpg", quality=90)
    bad = tmp_path / "imf" / "train" / "c1" / "5.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    marker = f"JDDP_TEST_MARK={os.getpid()}-{tmp_path.name}"
    env = {**os.environ, "JDDP_TEST_MARK": marker.split("=", 1)[1]}
    out = train(
        f"workdir={tmp_path / 'run'}",
        *TINY,
        "data.name=imagefolder",
        f"data.path={tmp_path / 'imf'}",
        "data.workers=2",
        "data.worker_kind=process",
        "data.augment=imagenet",
        "train.steps=2",
        env=env,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1, out.stderr[-2000:]
    assert len(lines) == 1 and "5.jpg" in lines[0], out.stderr[-2000:]
    assert _processes_with(marker) == []
