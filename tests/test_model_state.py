"""NNX models with mutable state other than BatchNorm: dropout RNG counters and custom variables
carry from step to step, differ per device where they should, and survive a resume."""

import json
import os
from pathlib import Path

import optax
import pytest
from flax import nnx

import jddp
from tests.helpers import data, fake_devices, read_losses, run_python
from tests.user_models import DropoutMLP

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("model_state_worker.py")


def run_worker(rate: float, accum: int) -> dict:
    env = fake_devices(2, {**os.environ, "PYTHONPATH": str(ROOT)})
    out = run_python(str(WORKER), str(rate), str(accum), env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.slow  # a worker process compiling on 2 fake devices
def test_dropout_masks_advance_and_differ_per_device(accum):
    got = run_worker(0.5, accum)
    two, one = got["two_devices"], got["one_device"]
    # One RNG draw and one call per micro-batch, carried from step to step.
    assert two["counts"] == [accum, 2 * accum, 3 * accum]
    assert two["calls"] == two["counts"]
    # lr is 0 and the batch is the same: only new dropout masks can change the loss.
    assert len(set(two["losses"])) == 3
    # Both devices see the same rows; equal masks would make the loss equal to one device's.
    assert two["losses"][0] != one["losses"][0]


@pytest.mark.slow  # a worker process compiling on 2 fake devices
def test_without_dropout_devices_agree():
    """The control for the test above: rate 0 draws nothing and the losses are equal."""
    got = run_worker(0.0, 1)
    assert got["two_devices"]["counts"] == [0, 0, 0]
    assert got["two_devices"]["calls"] == [1, 2, 3]
    assert got["two_devices"]["losses"] == [got["one_device"]["losses"][0]] * 3


def test_resume_continues_the_dropout_stream(tmp_path):
    """4 steps in one go == 2 steps, stop, resume to 4: bitwise equal losses, so the RNG counter
    (and the custom counter) came back from the checkpoint instead of restarting at 0."""

    def fit(workdir, steps):
        return jddp.fit(
            DropoutMLP(192, 2, nnx.Rngs(0)),
            optax.sgd(0.1),
            train_data=data(256),
            config={"workdir": str(workdir)},
            overrides=[
                f"train.steps={steps}",
                "data.global_batch_size=16",
                "checkpoint.every_steps=2",
                "log.every_steps=1",
                "log.progress=off",
                "checkpoint.async_save=false",
            ],
        )

    fit(tmp_path / "straight", 4)
    fit(tmp_path / "resumed", 2)
    result = fit(tmp_path / "resumed", 4)
    straight, resumed = read_losses(tmp_path / "straight"), read_losses(tmp_path / "resumed")
    assert result.step == 4
    assert [resumed[s] for s in (3, 4)] == [straight[s] for s in (3, 4)]
    # Restarting the stream would repeat step 1's masks at step 3 on the same weights.
    assert straight[3] != straight[1]
