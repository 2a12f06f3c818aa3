"""Shared pieces of the end-to-end tests: the tiny run and how to start and read it."""

import json
import subprocess
import sys
import time
from pathlib import Path

# A tiny run: ResNet-18 of width 4 on 8x8 synthetic images, constant lr, a line every step.
TINY = [
    "model.width=4",
    "data.name=synthetic",
    "data.image_size=8",
    "data.global_batch_size=16",
    "optim.schedule=constant",
    "optim.lr=0.05",
    "log.every_steps=1",
    "log.progress=off",
]
# Global-batch BatchNorm: results independent of the topology.
# Augmentation and host workers on: batch k must still be the same pixels on every topology and
# after a resume.
TINY_SYNC = [*TINY, "model.sync_batchnorm=true", "data.augment=cifar", "data.workers=2"]


def with_overrides(base, *overrides) -> list[str]:
    """``base`` then ``overrides``, dropping the base entries whose key an override sets (the CLI
    refuses a key given twice)."""
    keys = {o.split("=", 1)[0] for o in overrides if "=" in o}
    return [b for b in base if b.split("=", 1)[0] not in keys] + list(overrides)


def train_cmd(workdir, *overrides, base=TINY_SYNC) -> list[str]:
    """``python -m jddp.train workdir=... <base> <overrides>`` (an override replaces a base
    entry of the same key)."""
    return [
        sys.executable,
        "-m",
        "jddp.train",
        f"workdir={workdir}",
        *with_overrides(base, *overrides),
    ]


def launch_cmd(nproc, devices, workdir, *overrides, base=TINY_SYNC) -> list[str]:
    """The same under ``python -m jddp.launch --nproc N --devices-per-proc K``."""
    launcher = [sys.executable, "-m", "jddp.launch", "--nproc", str(nproc)]
    return [
        *launcher,
        "--devices-per-proc",
        str(devices),
        "--",
        *train_cmd(workdir, *overrides, base=base),
    ]


MPIRUN = str(Path(sys.executable).parent / "mpirun")  # PyPI MPICH's, next to the venv's python


def mpirun_cmd(nproc, workdir, *overrides, base=TINY_SYNC) -> list[str]:
    """The train command under ``mpirun -np N``."""
    return [MPIRUN, "-np", str(nproc), *train_cmd(workdir, *overrides, base=base)]


def assert_resumed_bitwise(out, workdir, straight, resumed: int, last_step: int) -> None:
    """``out`` (the rerun after a kill) resumed at ``resumed`` and then logged exactly the losses
    of the uninterrupted run in ``straight``, every step once."""
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"at step {resumed}" in out.stdout
    got, want = read_losses(workdir), read_losses(straight)
    assert sorted(got) == list(range(1, last_step + 1))
    for step in range(resumed + 1, last_step + 1):
        assert got[step] == want[step], step  # bitwise


def read_metrics(workdir) -> list[dict]:
    """Every line of ``workdir/metrics.jsonl``."""
    text = (Path(workdir) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def read_losses(workdir) -> dict[int, float]:
    """``{step: train/loss}`` of a run."""
    return {r["step"]: r["train/loss"] for r in read_metrics(workdir) if "train/loss" in r}


def steps_saved(workdir) -> list[int]:
    """Steps of the complete checkpoints in ``workdir/checkpoints``, oldest first."""
    d = Path(workdir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def wait_for(predicate, timeout_s: float) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def run_pids(workdir, exclude: int | None = None) -> list[int]:
    """Pids of the processes whose command line names ``workdir=<workdir>`` (the job's ranks)."""
    out = subprocess.run(["pgrep", "-f", f"workdir={workdir}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split() if int(p) != exclude]
