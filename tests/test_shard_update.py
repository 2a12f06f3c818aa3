"""``dist.shard_weight_update``: the sharded update takes the replicated update's steps.

In one process on 4 fake devices (``shard_update_worker.py``): SGD with gradient accumulation,
LAMB with a bfloat16 gradient reduction and LARS with per-layer trust ratios, each replicated
and sharded from the same start on the same batches, one batch holding a NaN; a LARS whose
trust ratios use each slice's own norms must fail the same comparison. Across real processes:
the shared 2 x 2 run's replicated checkpoint resumed sharded, and that run's sharded checkpoint
resumed replicated on 1 x 4. Checkpoints restore bitwise in either layout.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import optax
import pytest
from flax import nnx

import jddp
from jddp.errors import ConfigError
from tests.helpers import (
    TWO_BY_TWO,
    assert_losses_match,
    data,
    fake_devices,
    launch_cmd,
    read_losses,
    run,
    run_python,
)
from tests.user_models import TinyMLP

WORKER = Path(__file__).with_name("shard_update_worker.py")
CASES = {
    "sgd-accum": "optim.lr=0.05,train.grad_accum_steps=2",
    "lamb-bf16": "optim.name=lamb,optim.lr=0.01,optim.weight_decay=0.01,"
    "dist.grad_allreduce_dtype=bfloat16",
    "lars": "optim.name=lars,optim.lr=0.5,optim.decay_bn_and_bias=false",
}
BROKEN = "broken-lars"  # the LARS case with each slice's own norm in its trust ratios


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory):
    out = tmp_path_factory.mktemp("shard") / "out.json"
    cases = [f"{name}:{text}" for name, text in CASES.items()] + [f"{BROKEN}:{CASES['lars']}"]
    run_python(str(WORKER), "4", str(out), *cases, env=fake_devices(4), check=True)
    return json.loads(out.read_text())


def rel(got, want) -> float:
    got, want = np.asarray(got), np.asarray(want)
    return float(np.nanmax(np.abs(got - want) / np.maximum(np.abs(want), 1e-30)))


def rel_l2(got, want) -> float:
    got, want = np.asarray(got), np.asarray(want)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_update_takes_the_replicated_steps(four_devices, case):
    replicated, sharded = four_devices[case]["replicated"], four_devices[case]["sharded"]
    # the NaN batch's update is dropped on every device, its slices included
    assert sharded["nonfinite"] == replicated["nonfinite"] == [0, 0, 0, 1, 0]
    assert rel(sharded["loss"], replicated["loss"]) <= 1e-5
    for key in ("grad_norm", "param_norm"):  # norms over every slice
        assert rel(sharded[key], replicated[key]) <= 1e-5, key
    # the same update up to the order of additions (measured: bitwise for SGD, 1e-7 with the
    # trust ratios, whose norms add the slices' sums)
    tolerance = 1e-6
    assert rel_l2(sharded["params"], replicated["params"]) <= tolerance
    assert rel_l2(sharded["opt_state"], replicated["opt_state"]) <= tolerance
    # each device holds about a quarter of the optimizer state (the 10-class bias is whole)
    total = replicated["opt_bytes_total"]
    assert replicated["opt_bytes_per_device"] == total
    assert total / 4 < sharded["opt_bytes_per_device"] < total / 4 + 200
    assert "P(None, None, None, 'data')" in sharded["opt_specs"]  # conv1's (3, 3, 3, 8)
    assert sharded["params_replicated"]  # all-gathered for the next forward pass


def test_checkpoints_restore_in_either_layout(four_devices):
    """Checkpoints hold full-shape arrays: a sharded run's restores replicated and a
    replicated run's sharded, bitwise, in the layout asked for."""
    assert four_devices["round_trip"] == {"sharded->replicated": True, "replicated->sharded": True}


def test_trust_ratios_of_slices_are_caught(four_devices):
    """Without the psum of the slices' squared norms, LARS's trust ratios are per slice: the
    comparison above fails it."""
    broken, want = four_devices[BROKEN]["sharded"], four_devices["lars"]["replicated"]
    assert rel_l2(broken["params"], want["params"]) > 1e-4


@pytest.mark.serial
def test_resume_switching_the_key_and_the_topology(tmp_path, two_by_two):
    """The shared replicated 2 x 2 run's checkpoint 12 resumed with the key on (orbax reads
    each device's slice of the full-shape optimizer state): bitwise its losses (through gloo
    the gradients take the replicated step's all-reduce, then each device its slice: a
    reduce-scatter there would differ in the last bits, and corrupts large shares, jax issue
    40830); that run's sharded checkpoint 16 resumed with the key off on 1 x 4: to 1e-4
    (another topology may add in another order, as tests/test_multiprocess.py allows)."""
    reference, _ = two_by_two
    want = read_losses(reference)
    wd = tmp_path / "run"
    shutil.copytree(reference, wd, ignore=shutil.ignore_patterns("profile"))
    for step in (16, 20):
        shutil.rmtree(wd / "checkpoints" / str(step))
    out = run(launch_cmd(2, 2, wd, *TWO_BY_TWO, "dist.shard_weight_update=true"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "at step 12" in out.stdout
    assert_losses_match(read_losses(wd), want, range(13, 21), rel=0)

    shutil.rmtree(wd / "checkpoints" / "20")
    out = run(launch_cmd(1, 4, wd, *TWO_BY_TWO, "dist.shard_weight_update=false"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "at step 16" in out.stdout
    assert_losses_match(read_losses(wd), want, range(17, 21), rel=1e-4)


def test_refused_with_the_mpi_backend(tmp_path):
    out = run_python(
        "-m", "jddp.train", f"workdir={tmp_path}", "dist.backend=mpi",
        "dist.shard_weight_update=true", "--print-config",
    )  # fmt: skip
    assert out.returncode == 2
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith("jddp: error: dist.shard_weight_update=true needs dist.backend=xla")
    )


def test_refused_with_an_optimizer_given_to_fit(tmp_path):
    """An optax object may take norms per array (clipping, trust ratios): not split blindly."""
    with pytest.raises(ConfigError, match="dist.shard_weight_update=true needs the optim sec"):
        jddp.fit(
            TinyMLP(192, 2, nnx.Rngs(0)),
            optax.sgd(0.1),
            train_data=data(64),
            config={"workdir": str(tmp_path / "run")},
            overrides=["train.steps=1", "data.global_batch_size=16", "log.progress=off",
                       "dist.shard_weight_update=true"],
        )  # fmt: skip
