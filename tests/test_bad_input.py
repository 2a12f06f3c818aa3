"""Bad input, table-driven: one line naming the key/file and what is allowed, exit 2 (config
or command line) or 1 (runtime), and the existing workdir's files untouched."""

import os
import shutil
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import QUICK, TINY, run_python, snapshot, with_overrides

pytestmark = pytest.mark.slow


def train(*args, env=None, cwd=None, fresh=False):
    return run_python("-m", "jddp.train", *args, env=env, cwd=cwd, timeout=300, fresh=fresh)


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
    (root / "latin1.yaml").write_bytes("optim:\n  name: sgd  # r\xe9glage\n".encode("latin-1"))
    (root / "twice.yaml").write_text("optim:\n  lr: 0.1\n  momentum: 0.8\n  lr: 0.2\n")
    (root / "confdir").mkdir()
    return root, wd


TASK = [
    "model.name=tests.user_tasks:linear",
    "data.name=tests.user_tasks:data",
    "train.loss=tests.user_tasks:loss",
    "workdir={root}/task",
]


def task(*overrides):
    """A custom task's overrides (tests/user_tasks.py, a fresh workdir), ``overrides`` winning."""
    return with_overrides(TASK, *overrides)


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
    (
        "a class as model.name",
        ["model.name=tests.user_models:TinyMLP"],
        2,
        ["model.name: tests.user_models:TinyMLP is called as fn(config=", "(in_features: int"],
    ),
    (
        "a factory returning None",
        ["model.name=tests.user_models:forgets_to_return"],
        2,
        ["forgets_to_return returned NoneType, not a flax.nnx.Module"],
    ),
    ("unknown optimizer", ["optim.name=lion"], 2, ["optim.name", "sgd, adamw, lars, lamb"]),
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
    ("config not UTF-8", ["--config", "{root}/latin1.yaml"], 2, ["latin1.yaml", "not UTF-8"]),
    ("config is a folder", ["--config", "{root}/confdir"], 2, ["confdir", "directory"]),
    (
        "duplicate YAML key",
        ["--config", "{root}/twice.yaml"],
        2,
        ["twice.yaml", "duplicate key 'optim.lr'", "lines 2 and 4"],
    ),
    ("override twice", ["optim.lr=0.1", "optim.lr=0.2"], 2, ["optim.lr", "0.1", "0.2", "twice"]),
    ("lr nan", ["optim.lr=nan"], 2, ["optim.lr", "finite", "nan"]),
    ("lr inf", ["optim.lr=inf"], 2, ["optim.lr", "finite", "inf"]),
    ("weight decay nan", ["optim.weight_decay=nan"], 2, ["optim.weight_decay", "finite"]),
    ("label smoothing nan", ["train.label_smoothing=nan"], 2, ["train.label_smoothing", "finite"]),
    ("baseline inf", ["log.baseline_img_per_s=.inf"], 2, ["log.baseline_img_per_s", "finite"]),
    ("adamw b1 = 1", ["optim.name=adamw", "optim.b1=1"], 2, ["optim.b1", "[0, 1)"]),
    ("adamw b2 < 0", ["optim.b2=-0.5"], 2, ["optim.b2", "[0, 1)"]),
    ("empty workdir", ["workdir="], 2, ["workdir", "empty"]),
    ("unknown flag", ["--frobnicate"], 2, ["--frobnicate"]),
    ("unwritable workdir", ["workdir={root}/a_file/run"], 2, ["workdir", "a_file", "writable"]),
    (
        "other model's checkpoint",
        ["model.width=8", "--allow-config-change"],
        2,
        ["checkpoints/2", "different model", "(4,)", "(8,)"],
    ),
    # A resume whose config changes the trajectory names each key and both values.
    ("changed model on resume", ["model.width=8"], 2, ["checkpoints/2", "model.width: 4 there"]),
    ("changed lr on resume", ["optim.lr=0.2"], 2, ["optim.lr: 0.05 there, 0.2 now"]),
    ("sgd to adamw", ["optim.name=adamw"], 2, ["optim.name: 'sgd' there, 'adamw' now"]),
    ("changed seed", ["train.seed=1"], 2, ["train.seed: 0 there, 1 now"]),
    ("fewer steps than done", ["train.steps=1"], 2, ["train.steps", "step 2", ">= 2"]),
    ("profile after the end", ["log.profile_steps=1:9"], 2, ["log.profile_steps='1:9'", "4"]),
    ("profile of no step", ["log.profile_steps=0:1"], 2, ["log.profile_steps", "b >= 2"]),
    (
        "sync BN under MPI",
        ["model.sync_batchnorm=true", "dist.backend=mpi"],
        2,
        ["model.sync_batchnorm=true", "dist.backend=xla"],
    ),
    (
        "wrong model output",
        ["model.name=tests.user_models:three_logits", "workdir={root}/other"],
        2,
        ["three_logits", "[2, 3]", "10 classes"],
    ),
    # A custom task from the command line (tests/user_tasks.py), in a fresh workdir.
    ("unimportable data factory", task("data.name=nope.data:fn"), 2, ["data.name", "nope.data"]),
    (
        "data factory returning an int",
        task("data.name=tests.user_tasks:bad_data"),
        2,
        ["data.name=tests.user_tasks:bad_data returned a int", "(train, eval)"],
    ),
    (
        "data leaves of different sizes",
        task("data.name=tests.user_tasks:ragged_data"),
        2,
        ["train_data['y'] has 90 examples", "train_data['w'] has 96"],
    ),
    (
        "a string leaf",
        task("data.name=tests.user_tasks:string_leaf_data"),
        2,
        ["train_data['name']", "a str is not an array"],
    ),
    ("unimportable loss", task("train.loss=tests.user_tasks:nope"), 2, ["train.loss", "nope"]),
    (
        "loss returning a scalar",
        task("train.loss=tests.user_tasks:scalar_loss"),
        2,
        ["train.loss=tests.user_tasks:scalar_loss", "scalar", "[16]"],
    ),
    (
        "metric named loss",
        task("train.metrics=tests.user_tasks:clashing_metrics"),
        2,
        ["train.metrics=tests.user_tasks:clashing_metrics", "'loss'", "clashes"],
    ),
    (
        "model factory that raises",
        task("model.name=tests.user_tasks:raising_model"),
        1,
        [
            "model.name=tests.user_tasks:raising_model raised RuntimeError: the factory's own bug",
            "(at user_tasks.py:",
        ],
    ),
    (
        "data factory that raises",
        task("data.name=tests.user_tasks:raising_data"),
        1,
        ["data.name=tests.user_tasks:raising_data raised KeyError: 'no such split'"],
    ),
    (
        "metric with an unknown reduction",
        task("train.metrics=tests.user_tasks:median_metrics"),
        2,
        [
            "train.metrics=tests.user_tasks:median_metrics['spread']",
            "reduce='median'",
            "mean, sum, max, min",
        ],
    ),
]


def case_args(root: Path, wd: Path, args: list[str]) -> list[str]:
    """A case's whole command line: the tiny config, its own arguments, the shared workdir
    unless it names one."""
    args = [a.replace("{root}", str(root)) for a in args]
    has_workdir = any(a.startswith("workdir=") for a in args)
    args = with_overrides([*TINY, "train.steps=4"], *args)  # each key once on the command line
    return [*([] if has_workdir else [f"workdir={wd}"]), *args]


@pytest.mark.parametrize("name, args, code, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input(files, name, args, code, words):
    root, wd = files
    before = snapshot(wd)
    out = train(*case_args(root, wd, args))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == code, out.stderr[-2000:]
    assert len(lines) == 1, out.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert snapshot(wd) == before  # nothing already written was touched


@pytest.mark.parametrize("name", ["unknown optimizer", "changed lr on resume"])
def test_a_forked_command_gives_what_its_own_process_gives(files, name):
    """The tests' CLI server (tests/cli_server.py, which runs these cases) is ``python -m
    jddp.train``: a config check and a resume check (JAX started, the checkpoint read) print the
    same and exit the same as a process of its own."""
    root, wd = files
    args = case_args(root, wd, next(c[1] for c in CASES if c[0] == name))
    forked, fresh = train(*args), train(*args, fresh=True)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode,
        fresh.stdout,
        fresh.stderr,
    )


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
    dead = run_python("-c", "import os; print(os.getpid())").stdout.strip()
    other = tmp_path / "run"
    other.mkdir()
    (other / ".jddp.lock").write_text(f"{socket.gethostname()} {dead}\n")
    out = train(f"workdir={other}", *QUICK, "train.steps=1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "taking over stale lock" in out.stderr and not (other / ".jddp.lock").exists()


def test_all_checkpoints_damaged_is_a_runtime_error(files, tmp_path):
    root, wd = files
    copy = tmp_path / "run"
    shutil.copytree(wd, copy)
    for step_dir in (copy / "checkpoints").iterdir():
        for f in (step_dir / "state").rglob("*"):
            if f.is_file() and f.parent.name == "d":
                f.write_bytes(f.read_bytes()[:10])
    out = train(f"workdir={copy}", *TINY, "train.steps=4")
    assert out.returncode == 1
    assert "no usable checkpoint" in out.stderr.strip().splitlines()[-1]
    # Only jddp's own lines: no tracebacks from reads still in flight when a restore failed.
    foreign = [
        line for line in out.stderr.splitlines() if line.strip() and not line.startswith("jddp: ")
    ]
    assert foreign == [], out.stderr[-3000:]


def test_workdir_tilde_is_the_home_folder(tmp_path):
    """``workdir=~/x`` trains in ``$HOME/x`` (no folder named ``~``), and config.yaml says so."""
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    cache = f"train.compilation_cache_dir={os.path.expanduser('~/.cache/jddp/jax')}"  # warm
    out = train("workdir=~/x", *TINY, "train.steps=1", cache, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    saved = (tmp_path / "home" / "x" / "config.yaml").read_text()
    assert f"workdir: {tmp_path / 'home' / 'x'}\n" in saved
    assert not (tmp_path / "~").exists()


@pytest.fixture(params=["closes", "silent", "talks"])
def not_a_coordinator(request):
    """A TCP server on localhost that accepts and then closes, says nothing, or greets in
    another protocol; yields its port."""
    server = socket.create_server(("localhost", 0))
    conns = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conns.append(conn)
            if request.param == "closes":
                conn.close()
            elif request.param == "talks":
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n" * 4)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()
        for c in conns:
            c.close()


def test_coordinator_address_that_is_not_a_coordinator(files, not_a_coordinator):
    """Something answers TCP at dist.coordinator_address but is no JAX coordinator: exit 2 and
    one line naming the key and the address (not a C++ abort after dist.init_timeout_s)."""
    root, wd = files
    before = snapshot(wd)
    address = f"localhost:{not_a_coordinator}"
    dist = [f"dist.coordinator_address={address}", "dist.num_processes=2", "dist.process_id=1"]
    out = train(f"workdir={wd}", *TINY, "train.steps=4", *dist, "dist.init_timeout_s=20")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr[-2000:]
    assert len(lines) == 1, out.stderr
    assert "dist.coordinator_address" in lines[0] and address in lines[0], lines[0]
    assert snapshot(wd) == before


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
        *with_overrides(TINY, "data.name=imagefolder"),
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
