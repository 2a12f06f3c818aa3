"""A disk that fills up during a checkpoint: one line naming the checkpoint, the run folder, the
free space and what a checkpoint needs; exit 1; the checkpoints before it intact and no
half-written save left; the rerun, once the disk has room, resumes from the newest of them.

The run's checkpoints folder is a small tmpfs the test mounts (root only: skipped where mount is
refused), linked from the run folder, as a separate checkpoint volume would be; the run's other
files (metrics.jsonl) stay on a disk with room, so the checkpoint is what finds the disk full."""

import subprocess
from pathlib import Path

import pytest

from tests.helpers import TINY, read_losses, run_python, steps_saved, with_overrides

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path):
    """A 1.5 MB tmpfs (a handful of the tiny run's checkpoints); unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_during_a_checkpoint(small_disk, tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "checkpoints").symlink_to(small_disk)
    args = with_overrides(TINY, "train.steps=30", "checkpoint.every_steps=1", "checkpoint.keep=30")
    out = run_python("-m", "jddp.train", f"workdir={workdir}", *args, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    intact = steps_saved(workdir)
    assert intact, lines[0]
    words = [
        f"checkpoint {workdir}/checkpoints/",
        "could not be written (No space left on device: ",
        f"{workdir}/checkpoints has ",
        " free, a checkpoint needs about ",
        f"the checkpoints before it are intact: {intact}",
    ]
    for word in words:
        assert word in lines[0], (word, lines[0])
    names = [p.name for p in (workdir / "checkpoints").iterdir()]
    assert all(name.isdigit() for name in names), names  # no half-written save left
    # Room again (the tmpfs grown in place): the same command resumes from the newest.
    subprocess.run(["mount", "-o", "remount,size=20m", str(small_disk)], check=True)
    again = run_python("-m", "jddp.train", f"workdir={workdir}", *args, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"at step {intact[-1]}" in again.stdout
    assert sorted(read_losses(workdir)) == list(range(1, 31))
    assert Path(workdir / "checkpoints" / "30").is_dir()
