"""Shared pieces of the end-to-end tests: the tiny run and how to start and read it."""

import json
import sys
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
TINY_SYNC = [*TINY, "model.sync_batchnorm=true"]


def train_cmd(workdir, *overrides, base=TINY_SYNC) -> list[str]:
    """``python -m jddp.train workdir=... <base> <overrides>``."""
    return [sys.executable, "-m", "jddp.train", f"workdir={workdir}", *base, *overrides]


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


def read_metrics(workdir) -> list[dict]:
    """Every line of ``workdir/metrics.jsonl``."""
    text = (Path(workdir) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def read_losses(workdir) -> dict[int, float]:
    """``{step: train/loss}`` of a run."""
    return {r["step"]: r["train/loss"] for r in read_metrics(workdir) if "train/loss" in r}
