"""Unit tests of the run's outputs: the run folder and its lock, the metrics log, checkpoints."""

import os

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jddp.checkpoint import Checkpoints
from jddp.checkpoint.policy import SavePolicy
from jddp.errors import CheckpointError, ConfigError
from jddp.mesh import make_mesh, to_host
from jddp.metrics import Console, MetricsLog, read_metrics
from jddp.run.trackers import Trackers
from jddp.state import create_train_state
from jddp.workdir import RunFolder, WorkdirLock
from tests.helpers import start
from tests.user_models import TinyMLP


def test_run_folder_owns_every_path(tmp_path):
    folder = RunFolder(tmp_path / "run")
    assert folder.prepare() == tmp_path / "run"
    names = {
        folder.config_yaml.name,
        folder.metrics_jsonl.name,
        folder.tensorboard.name,
        folder.checkpoints.name,
        folder.damaged_checkpoints.name,
        folder.profile.name,
        folder.lock_file.name,
    }
    assert len(names) == 7
    assert folder.checkpoints.is_absolute() and folder.checkpoints.parent == (tmp_path / "run")


def test_workdir_lock_refuses_a_live_owner_and_takes_over_a_dead_one(tmp_path):
    folder = RunFolder(tmp_path)
    lock = WorkdirLock(folder.lock_file)
    lock.acquire()
    assert folder.lock_file.exists()
    # The same file written by another live process (our parent) is refused.
    lock.release()
    assert not folder.lock_file.exists()
    host = os.uname().nodename
    folder.lock_file.write_text(f"{host} {os.getppid()} \n")
    with pytest.raises(ConfigError, match=f"pid {os.getppid()}"):
        WorkdirLock(folder.lock_file).acquire()
    # A process that has exited is stale: taken over.
    dead = start(["true"])
    dead.communicate()
    folder.lock_file.write_text(f"{host} {dead.pid} \n")
    other = WorkdirLock(folder.lock_file)
    other.acquire()
    assert folder.lock_file.read_text().split()[1] == str(os.getpid())
    other.release()


def test_metrics_log_drops_lines_after_the_resumed_step(tmp_path):
    folder = RunFolder(tmp_path)
    log = MetricsLog(folder)
    for step in (1, 2, 3):
        log.write(step, {"train/loss": np.float32(step), "eval/loss": float("nan")})
    log.close()
    trackers = Trackers.of(["tensorboard"], folder, 2, None, writer=True)  # the default
    trackers.start({})
    log = MetricsLog(folder, resume_step=2, sink=trackers)
    log.write(3, {"train/loss": 30.0})
    log.close()
    trackers.finish()
    rows = read_metrics(folder.root)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["train/loss"] == 30.0 and rows[0]["eval/loss"] == "nan"
    assert any(folder.tensorboard.iterdir())


def test_only_the_writer_writes_and_prints(tmp_path, capsys):
    folder = RunFolder(tmp_path / "r")
    log = MetricsLog(folder, writer=False)
    log.write(1, {"train/loss": 1.0})
    log.close()
    Console(enabled=False).say("hidden")
    Console(enabled=True).say("shown")
    assert not folder.metrics_jsonl.exists()
    assert capsys.readouterr().out == "shown\n"


@pytest.fixture
def state():
    mesh = make_mesh(jax.devices()[:1])
    _, st = create_train_state(TinyMLP(8 * 8 * 3, 4, nnx.Rngs(0)), optax.sgd(0.1), mesh)
    return st


def checkpoints(folder, keep=2, every=2):
    return Checkpoints.of(folder, every_steps=every, keep=keep, async_save=False)


def test_checkpoints_save_keep_and_restore_the_newest(tmp_path, state):
    folder = RunFolder(tmp_path)
    ckpts = checkpoints(folder)
    assert [s for s in range(1, 7) if SavePolicy(every_steps=2).due(s)] == [2, 4, 6]
    for step in (2, 4, 6):
        ckpts.save(step, state.replace(step=state.step + step), {"note": step})
    ckpts.close()
    ckpts = checkpoints(folder)
    assert ckpts.all_steps() == [4, 6]  # keep=2
    restored, step = ckpts.restore_newest_good(state)
    ckpts.close()
    assert step == 6 and int(to_host(restored.step)) == 6
    for a, b in zip(
        jax.tree.leaves(to_host(restored.params)),
        jax.tree.leaves(to_host(state.params)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_a_damaged_checkpoint_is_set_aside_and_the_older_one_used(tmp_path, state):
    folder = RunFolder(tmp_path)
    ckpts = checkpoints(folder, keep=3)
    for step in (2, 4):
        ckpts.save(step, state.replace(step=state.step + step), {})
    ckpts.close()
    for f in (folder.checkpoints / "4" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 100:
            f.write_bytes(b"\0" * f.stat().st_size)  # same size, wrong bytes
    ckpts = checkpoints(folder, keep=3)
    _, step = ckpts.restore_newest_good(state)
    ckpts.close()
    assert step == 2
    assert [p.name.split("-")[0] for p in folder.damaged_checkpoints.iterdir()] == ["4"]


def test_only_damaged_checkpoints_is_an_error_naming_the_folder(tmp_path, state):
    folder = RunFolder(tmp_path)
    ckpts = checkpoints(folder)
    ckpts.save(2, state, {})
    ckpts.close()
    (folder.checkpoints / "2" / "manifest").rename(folder.checkpoints / "2" / "gone")
    ckpts = checkpoints(folder)
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        ckpts.restore_newest_good(state)
    ckpts.close()


def test_a_checkpoint_of_another_model_is_refused_naming_an_array(tmp_path, state):
    folder = RunFolder(tmp_path)
    ckpts = checkpoints(folder)
    ckpts.save(2, state, {})
    ckpts.close()
    mesh = make_mesh(jax.devices()[:1])
    _, other = create_train_state(TinyMLP(8 * 8 * 3, 5, nnx.Rngs(0)), optax.sgd(0.1), mesh)
    ckpts = checkpoints(folder)
    with pytest.raises(ConfigError, match="different model.*out"):
        ckpts.restore_newest_good(other)
    ckpts.close()
