"""How checkpoints are written: arrays every device holds (jddp.compat.orbax_writes), and a
checkpoints folder that cannot be written, at the start and mid-run."""

import json
import os
from pathlib import Path

import pytest

from tests.helpers import (
    fake_devices,
    launch_cmd,
    read_losses,
    run,
    run_python,
    start,
    steps_saved,
    wait_for,
)

# Two devices holding the same arrays; the programs JAX lowers while each save runs.
_SAVE_TWICE = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jddp.checkpoint import Checkpoints
from jddp.state import TrainState

lowered = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **_: lowered.append(event)
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" else None)
whole = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P())

def state(params):
    params = jax.device_put(params, whole)
    return TrainState(step=jnp.int32(1), params=params, model_state={}, opt_state=(),
                      skipped_steps=jnp.int32(0))

small = {"kernel": np.full((3, 3, 16, 32), 0.5, np.float32), "bias": np.arange(32.0),
         "scale": np.ones(32, np.float32)}
large = {"kernel": np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512)}  # 2 MiB
counts = {}
for name, params in (("small", small), ("large", large)):
    ckpts = Checkpoints(sys.argv[1] + "/" + name, every_steps=1, keep=1, async_save=False,
                        damaged_directory=sys.argv[1] + "/damaged")
    saved = state(params)
    before = len(lowered)
    ckpts.save(1, saved, {})
    ckpts.wait()
    counts[name] = len(lowered) - before
    restored, _ = ckpts.restore_newest_good(saved)
    assert all(np.array_equal(restored.params[k], params[k]) for k in params), name
    ckpts.close()
# After the saves, orbax's shares of an array: each of the 2 replicas (devices) writes half
# of it, as before.
from orbax.checkpoint._src.serialization import replica_slices
kernel = jax.device_put(large["kernel"], whole)
shares = replica_slices.get_replica_slices(kernel, 0, True).replica_slices
before = len(lowered)
halves = [np.asarray(share.data()) for share in shares]
counts |= {"share_rows": [len(h) for h in halves], "share_programs": len(lowered) - before}
assert np.array_equal(np.concatenate(halves), large["kernel"])
print(json.dumps({"devices": jax.device_count(), **counts}))
"""


def test_replicated_arrays_on_cpu_are_split_between_replicas_without_compiling(tmp_path):
    """Orbax's replicas each write a slice of an array they all hold, cut by a program compiled
    per shape (a tiny ResNet's first save: 42 programs, a fifth of its run's CPU): on CPU
    devices jddp cuts them with NumPy. Each of the 2 replicas still holds its half of a 2 MiB
    array (so every process writes a share, and a full disk fails them all), no save lowers
    a program, and both saves restore equal."""
    out = run_python("-c", _SAVE_TWICE, str(tmp_path), env=fake_devices(2))
    assert out.returncode == 0, out.stderr[-3000:]
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["devices"] == 2
    assert counts["share_rows"] == [512, 512], counts
    assert counts == {**counts, "share_programs": 0, "small": 0, "large": 0}, counts


def test_room_for_a_checkpoint_is_the_newest_ones_size_else_the_states_bytes(tmp_path, monkeypatch):
    """Before a save: enough room is what the newest checkpoint takes on disk (the state's
    bytes before the first); short of it, the phrase names the folder, free and needed bytes."""
    import shutil
    from collections import namedtuple

    from jddp.checkpoint import room

    usage = namedtuple("usage", "total used free")
    free = {"bytes": 300 * 1024}
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(1 << 30, 0, free["bytes"]))
    assert room.shortfall(tmp_path, [], state_bytes=200 * 1024) is None
    assert room.shortfall(tmp_path, [], state_bytes=400 * 1024) == (
        f": {tmp_path} has 300 KiB free, a checkpoint needs more than 400 KiB (the training "
        "state's bytes)"
    )
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "data").write_bytes(b"x" * 320 * 1024)
    need = room.disk_bytes(tmp_path / "2")
    assert need >= 320 * 1024
    assert room.shortfall(tmp_path, [2], state_bytes=100) == (
        f": {tmp_path} has 300 KiB free, a checkpoint needs about {room.size_text(need)} (the size "
        "of checkpoint 2)"
    )
    free["bytes"] = need
    assert room.shortfall(tmp_path, [2], state_bytes=100) is None
    # A file system that reports no size (some FUSE mounts): unknown, no save refused.
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(0, 0, 0))
    assert room.shortfall(tmp_path, [2], state_bytes=100) is None


# The custom task (tests/user_tasks.py), its train batches after step 2 waiting for a file.
GATED = [
    "model.name=tests.user_tasks:linear",
    "data.name=tests.user_tasks:gated_data",
    "train.loss=tests.user_tasks:loss",
    "data.global_batch_size=16",
    "data.workers=0",
    "log.every_steps=1",
    "log.progress=off",
    "dist.step_timeout_s=120",  # a hang (the bug) ends as a stall, not the test's timeout
]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "jddp: error:" in line]


@pytest.fixture
def read_only(tmp_path):
    """``read_only(folder)``: bind-mount ``folder`` read-only onto itself (unmounted after the
    test). Tests run as root, which ignores permission bits (chmod stops nothing); a read-only
    mount binds root too (EROFS). Skipped where mounts are not allowed."""
    mounted = []

    def make(folder: Path) -> None:
        for args in (["--bind", folder, folder], ["-o", "remount,bind,ro", folder]):
            made = run(["mount", *map(str, args)])
            if made.returncode != 0:
                pytest.skip(f"cannot bind-mount read-only here: {made.stderr.strip()}")
            mounted.append(folder)

    yield make
    for folder in reversed(mounted):
        run(["umount", "-l", str(folder)])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["a file", "a read-only mount"])
def test_an_unwritable_checkpoints_folder_is_refused_before_training(tmp_path, how, read_only):
    """The checkpoints folder is a regular file (what binds root everywhere) or a read-only
    mount: every rank of a 2-process job stops at the start, exit 2, process 0 naming the
    folder and why. It had trained to the last step, then hung in orbax's first save (one rank
    a raw TimeoutError, the other silent until the step timeout)."""
    wd = tmp_path / "run"
    checkpoints = wd / "checkpoints"
    wd.mkdir()
    if how == "a file":
        checkpoints.write_text("not a folder")
        said = f"its checkpoints folder {checkpoints} is not a folder (a file is there)"
    else:
        checkpoints.mkdir()
        read_only(checkpoints)
        said = f"its checkpoints folder {checkpoints} is not writable (Read-only file system)"
    out = run(launch_cmd(2, 1, wd, *GATED, "train.steps=4", base=[]), timeout=300)
    lines = error_lines(out.stderr)
    assert out.returncode == 2, out.stderr[-3000:]
    assert sorted(line.split("]")[0] for line in lines) == ["[rank 0", "[rank 1"], out.stderr
    (first,) = [line for line in lines if line.startswith("[rank 0]")]
    assert said in first, first
    assert not (wd / "metrics.jsonl").exists()  # nothing trained, nothing written
    if how == "a file":
        assert checkpoints.read_text() == "not a folder"


@pytest.mark.slow
def test_a_checkpoints_folder_made_read_only_mid_run_stops_every_rank_in_one_line(
    tmp_path, read_only
):
    """Checkpoint 2 is written, then the folder turns read-only (the steps after 2 wait for
    that: tests/user_tasks.py GatedSource): the save of step 4 is refused on both ranks
    together before any of it is written, one line each naming the folder and the OS error,
    exit 1; checkpoint 2 stays, and once the folder is writable again the same command
    resumes from it."""
    wd, gate = tmp_path / "run", tmp_path / "go"
    command = launch_cmd(2, 1, wd, *GATED, "train.steps=6", "checkpoint.every_steps=2", base=[])
    env = {**os.environ, "JDDP_TEST_GATE": str(gate)}
    job = start(command, env=env)
    try:
        first = wd / "checkpoints" / "2"
        assert wait_for(lambda: first.is_dir() or job.poll() is not None, 300), "no checkpoint 2"
        read_only(wd / "checkpoints")
        gate.touch()
        _, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    lines = error_lines(err)
    assert job.returncode == 1, err[-3000:]
    assert sorted(line.split("]")[0] for line in lines) == ["[rank 0", "[rank 1"], err[-3000:]
    for line in lines:
        assert (
            f"checkpoint {wd}/checkpoints/4 could not be written (Read-only file system: "
            f"{wd}/checkpoints); the checkpoints before it are intact: [2]"
        ) in line, line
    assert steps_saved(wd) == [2]
    run(["umount", "-l", str(wd / "checkpoints")])
    again = run(command, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "at step 2" in again.stdout and sorted(read_losses(wd)) == list(range(1, 7))


def saved_at_step_2(tmp_path):
    """Asynchronous ``Checkpoints`` under ``tmp_path`` that saved a tiny state as step 2."""
    import jax.numpy as jnp

    from jddp.checkpoint import Checkpoints
    from jddp.state import TrainState

    ckpts = Checkpoints(tmp_path / "checkpoints", keep=2, async_save=True,
                        damaged_directory=tmp_path / "damaged")  # fmt: skip
    state = TrainState(step=jnp.int32(2), params={"w": jnp.ones(3)}, model_state={},
                       opt_state=(), skipped_steps=jnp.int32(0))  # fmt: skip
    assert ckpts.save(2, state, {})
    ckpts.wait()
    return ckpts


def test_a_save_failing_only_as_orbax_closes_is_the_checkpoints_one_line(tmp_path, monkeypatch):
    """orbax's ``CheckpointManager.close`` waits for the background commit again and raises
    what it failed with: a save's failure that surfaces only there is the same one line as at
    ``wait``, naming the checkpoint and its cause, not the error's own text."""
    from jddp.errors import CheckpointError

    ckpts = saved_at_step_2(tmp_path)
    close = ckpts._manager.close

    def close_failing() -> None:
        close()
        raise ValueError(
            'RESOURCE_EXHAUSTED: Error writing "params.w/0" in OCDBT database at local file '
            f'"{tmp_path}/checkpoints/2.orbax-checkpoint-tmp/d/0": No space left on device'
        )

    monkeypatch.setattr(ckpts._manager, "close", close_failing)
    with pytest.raises(CheckpointError) as raised:
        ckpts.close()
    said = str(raised.value)
    assert said.startswith(f"checkpoint {tmp_path}/checkpoints/2 could not be written (No space ")
    assert "OCDBT" not in said and said.endswith("the checkpoints before it are intact: none")
    ckpts.close()  # again after the failure: only releases


def test_a_save_failing_while_its_other_writes_run_is_the_checkpoints_one_line(
    tmp_path, monkeypatch
):
    """A full disk during a save: the wait raises its first failed write while orbax's threads
    for its other writes still run; before the failed save's folder is removed they are
    awaited, and their own failures (orbax's ``join`` raises them) stay the save's one line
    (a bare ``ValueError: RESOURCE_EXHAUSTED ...`` had escaped it, twice in full suites)."""
    from jddp.errors import CheckpointError
    from tests.helpers import failing_commit

    ckpts = saved_at_step_2(tmp_path)
    ckpts._saving = 4  # a second save in flight, whose first write failed (below)

    def first_write_failed() -> None:
        raise ValueError('RESOURCE_EXHAUSTED: Error writing "params.w/0": No space left on device')

    monkeypatch.setattr(ckpts._manager, "wait_until_finished", first_write_failed)
    other_write = failing_commit(0.5)  # still writing as the wait raises
    with pytest.raises(CheckpointError) as raised:
        ckpts.wait()
    assert not other_write.is_alive()  # awaited before the folder was removed
    said = str(raised.value)
    assert said.startswith(f"checkpoint {tmp_path}/checkpoints/4 could not be written (No space ")
    assert said.endswith("the checkpoints before it are intact: [2]"), said
    ckpts.close()  # after the failure: only releases
