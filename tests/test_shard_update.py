"""``dist.shard`` optimizer and full: the split layouts take the replicated update's steps.

In one process on 4 fake devices (``shard_update_worker.py``): SGD with gradient accumulation,
LAMB with a bfloat16 gradient reduction and LARS with per-layer trust ratios, each replicated,
with the optimizer state split and fully sharded, from the same start on the same batches, one
batch holding a NaN; a LARS whose
trust ratios use each slice's own norms must fail the same comparison. Across real processes:
the shared 2 x 2 run's replicated checkpoint resumed sharded, and that run's sharded checkpoint
resumed replicated on 1 x 4. Checkpoints restore bitwise in either layout.
"""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jddp
from jddp.errors import ConfigError
from tests.helpers import (
    TINY,
    TWO_BY_TWO,
    assert_losses_match,
    data,
    fake_devices,
    launch_cmd,
    read_losses,
    run,
    run_python,
    with_overrides,
)
from tests.user_models import TinyMLP

WORKER = Path(__file__).with_name("shard_update_worker.py")
CASES = {
    # with an EMA of the parameters (its warm-up decays: 0.1, 0.18, 0.25, -, 0.36)
    "sgd-accum": "optim.lr=0.05,train.grad_accum_steps=2,train.ema_decay=0.6",
    "lamb-bf16": "optim.name=lamb,optim.lr=0.01,optim.weight_decay=0.01,"
    "dist.grad_allreduce_dtype=bfloat16",
    "lars": "optim.name=lars,optim.lr=0.5,optim.decay_bn_and_bias=false",
    # global-norm clipping, every finite step clipped: over every slice alike
    "sgd-clip": "optim.lr=0.5,optim.clip_grad_norm=0.01",
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
@pytest.mark.slow
def test_sharded_update_takes_the_replicated_steps(four_devices, case):
    replicated, sharded = four_devices[case]["replicated"], four_devices[case]["sharded"]
    # the NaN batch's update is dropped on every device, its slices included
    assert sharded["nonfinite"] == replicated["nonfinite"] == [0, 0, 0, 1, 0]
    assert sharded["clipped"] == replicated["clipped"]  # the global norm over every slice
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


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_fully_sharded_takes_the_replicated_steps(four_devices, case):
    """dist.shard=full: each parameter gathered where used, its gradient reduce-scattered, the
    update on slices: the replicated run's losses, norms and final state; parameters and
    optimizer state at rest about a quarter per device."""
    replicated, full = four_devices[case]["replicated"], four_devices[case]["full"]
    if "bfloat16" in CASES[case]:  # the reduce-scatter is the gathers' transpose: float32
        assert full["refused"].startswith("dist.grad_allreduce_dtype=bfloat16 with dist.shard=")
        return
    assert full["nonfinite"] == replicated["nonfinite"] == [0, 0, 0, 1, 0]
    assert full["clipped"] == replicated["clipped"]
    if "clip_grad_norm" in CASES[case]:  # every finite step clipped (norms 0.05-0.3)
        assert replicated["clipped"] == [1, 1, 1, 0, 1]
    assert rel(full["loss"], replicated["loss"]) <= 1e-5
    for key in ("grad_norm", "param_norm"):
        assert rel(full[key], replicated[key]) <= 1e-5, key
    assert rel_l2(full["params"], replicated["params"]) <= 1e-6
    assert rel_l2(full["opt_state"], replicated["opt_state"]) <= 1e-6
    assert not full["params_replicated"]
    assert "P(None, None, None, 'data')" in full["param_specs"]  # conv1's kernel, split
    assert replicated["state_bytes_per_device"] == replicated["state_bytes_total"]
    # a quarter, plus the whole 10-class bias, BatchNorm statistics and counters
    assert full["state_bytes_per_device"] < replicated["state_bytes_total"] / 4 + 400
    # gloo's path (processes on CPUs): the same steps; the 7 split arrays cross in one
    # all-gather and their gradients in one all-reduce buffer (XLA:CPU had split a packed
    # psum's transpose into one all-reduce operand, one gloo call, per array: 0.2 s of a
    # 4-layer GPT's 0.5 s step)
    gloo = four_devices[case]["full-gloo"]
    assert rel(gloo["loss"], replicated["loss"]) <= 1e-5
    assert rel_l2(gloo["params"], replicated["params"]) <= 1e-6
    assert [n for op, n in gloo["collectives"] if op == "all-gather"] == [1]
    assert max(n for op, n in gloo["collectives"] if op == "all-reduce") < 7


@pytest.mark.slow
def test_the_ema_follows_the_parameters_in_every_layout(four_devices):
    """train.ema_decay: after each update ema += (1 - d_n) (params - ema), d_n the warmed-up
    decay min(0.6, (1 + n) / (10 + n)); the dropped (NaN) update leaves it too. Split like the
    parameters' optimizer state (optimizer) or like the parameters (full), the same values."""
    runs = four_devices["sgd-accum"]
    replicated = runs["replicated"]
    per_step = [np.asarray(p) for p in replicated["params_per_step"]]
    want = per_step[0]
    for n, params in enumerate(per_step[1:]):
        if replicated["nonfinite"][n]:
            assert np.array_equal(params, per_step[n])  # the update was dropped
            continue
        decay = np.float32(min(0.6, (1 + n) / (10 + n)))
        want = want + (1 - decay) * (params - want)
    assert rel_l2(replicated["ema"], want) <= 1e-6
    assert rel_l2(replicated["ema"], replicated["params"]) > 1e-3  # it lags them
    for label in ("sharded", "full", "full-gloo"):
        assert rel_l2(runs[label]["ema"], replicated["ema"]) <= 1e-6, label
        assert "P(None, None, None, 'data')" in runs[label]["ema_specs"], label
    assert replicated["ema_specs"] == ["P()"]


@pytest.mark.slow
def test_the_gpt_example_with_dropout_takes_the_same_steps_fully_sharded():
    """A transformer (embeddings, learned positions, attention, LayerNorm) with dropout and 2
    micro-batches on 4 devices: dist.shard=full's losses are none's (measured: bitwise); a
    wider one's fully sharded step holds a fraction of its parameters' bytes in temporaries;
    a model meeting each case of jddp.gather_at_use takes the same steps too."""
    out = run_python(str(WORKER.with_name("gpt_layout_worker.py")), env=fake_devices(4))
    assert out.returncode == 0, out.stderr[-3000:]
    losses = json.loads(out.stdout.strip().splitlines()[-1])
    assert rel(losses["full"], losses["none"]) <= 1e-5
    assert len(set(losses["none"])) == 6  # each step its own loss
    # each parameter gathered where its module runs, and again in that module's backward
    # pass: the step never holds the whole gathered model. Measured (jax 0.10.2, XLA:CPU):
    # temporaries 6.0 MB for 13.2 MB of parameters; 16.3 MB when every parameter was gathered
    # as the step began, 16.8 when XLA:CPU merges the second gathers into the first
    memory = losses["memory"]
    assert memory["temp_bytes"] < 0.6 * memory["param_bytes"], memory
    # a tied table read by the head outside the embedding's call, BatchNorm's statistics, a
    # call (of a module that is not a pytree) with a keyword flag that sows and returns a
    # non-array, dropout, a parameter of the root itself
    edges = losses["edges"]
    assert rel(edges["full"], edges["none"]) <= 1e-5  # measured: bitwise
    assert edges["bound"] == ["BatchNorm", "Embed", "Tagged"]  # each gathered in its own call


@pytest.mark.slow
def test_checkpoints_restore_in_every_layout(four_devices):
    """Checkpoints hold full-shape arrays: a checkpoint of any dist.shard layout restores in
    any other, bitwise, in the layout asked for."""
    layouts = ("replicated", "sharded", "full", "full-gloo")
    assert four_devices["round_trip"] == {
        f"{a}->{b}": True for a in layouts for b in layouts if a != b
    }


@pytest.mark.slow
def test_trust_ratios_of_slices_are_caught(four_devices):
    """Without the psum of the slices' squared norms, LARS's trust ratios are per slice: the
    comparison above fails it."""
    broken, want = four_devices[BROKEN]["sharded"], four_devices["lars"]["replicated"]
    assert rel_l2(broken["params"], want["params"]) > 1e-4


@pytest.mark.slow
def test_resume_switching_the_layout_and_the_topology(tmp_path, two_by_two):
    """The shared replicated 2 x 2 run's checkpoint 12 resumed fully sharded (orbax reads each
    device's slice of the full-shape arrays): its losses to 1e-5 (through gloo each gathered
    parameter's gradient is all-reduced, then sliced: a reduce-scatter there corrupts large
    shares, jax issue 40830); that run's checkpoint 16 resumed fully sharded by one process
    of 4 devices: to 1e-4 (another topology may add in another order, as
    tests/test_multiprocess.py allows; 1 x 4, not 4 x 1: the same change of process count,
    3 fewer processes to start on CI's 2 cores). The switch said once; the
    older spelling: test_the_older_spelling_and_bad_values."""
    reference, _ = two_by_two
    want = read_losses(reference)
    wd = tmp_path / "run"
    shutil.copytree(reference, wd, ignore=shutil.ignore_patterns("profile"))
    for step in (16, 20):
        shutil.rmtree(wd / "checkpoints" / str(step))
    out = run(launch_cmd(2, 2, wd, *TWO_BY_TWO, "dist.shard=full"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "at step 12" in out.stdout
    assert out.stdout.count("jddp: dist.shard=full now, none when the checkpoint was") == 1
    assert "dist.shard=full: " in out.stdout  # the memory line says what share is split
    assert_losses_match(read_losses(wd), want, range(13, 21), rel=1e-5)
    # the fully sharded run's checkpoint, read on this process's one device: its arrays whole
    loaded = nnx.state(jddp.load(wd), nnx.Param)
    reference_model = nnx.state(jddp.load(reference), nnx.Param)
    shapes = jax.tree.map(np.shape, (loaded, reference_model))
    assert shapes[0] == shapes[1]
    assert all(x.is_fully_addressable for x in jax.tree.leaves(loaded))

    shutil.rmtree(wd / "checkpoints" / "20")
    out = run(launch_cmd(1, 4, wd, *TWO_BY_TWO, "dist.shard=full"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "at step 16" in out.stdout
    assert "when the checkpoint was written" not in out.stdout  # the same layout: no word
    assert_losses_match(read_losses(wd), want, range(17, 21), rel=1e-4)


@pytest.mark.slow
def test_a_state_too_large_for_the_budget_trains_fully_sharded(tmp_path):
    """Two processes whose devices may each hold 60 kB of train state (dist.device_memory_bytes;
    on a GPU the device's own limit): a small MLP's AdamW state (76.3 KiB per device whole) is
    refused with one line naming the bytes, before anything is placed; fully sharded over the
    two devices (38.1 KiB each) it trains."""
    model = ["model.name=tests.user_models:tiny_mlp", "optim.name=adamw", "train.steps=2",
             "dist.device_memory_bytes=60000"]  # fmt: skip
    out = run(launch_cmd(2, 1, tmp_path / "none", *model, "dist.shard=none"))
    assert out.returncode == 2, out.stderr[-2000:]
    assert (
        "jddp: error: the train state needs 76.3 KiB per device under dist.shard=none, more than "
        "the 58.6 KiB a device may hold" in out.stderr
    ), out.stderr[-2000:]
    assert "full 38.1 KiB" in out.stderr
    assert not (tmp_path / "none" / "checkpoints").exists()
    out = run(launch_cmd(2, 1, tmp_path / "full", *model, "dist.shard=full"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "jddp: memory per device: state 38.1 KiB (dist.shard=full: " in out.stdout
    assert len(read_losses(tmp_path / "full")) == 2


@pytest.mark.slow
def test_a_model_built_differently_per_process_is_refused(tmp_path):
    """Under a split layout each process places its slices of its own copy: a factory seeded
    per process would train a mix; refused in one line, exit 2, nothing trained."""
    model = ["model.name=tests.user_models:per_process_mlp", "train.steps=1"]
    out = run(launch_cmd(2, 1, tmp_path / "run", *model, "dist.shard=full"))
    assert out.returncode == 2, out.stderr[-2000:]
    assert (
        "jddp: error: dist.shard=full: the model's initial parameters differ between processes "
        "(process 0's are not those of process 1)" in out.stderr
    ), out.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_a_device_count_that_divides_nothing_is_one_warning(tmp_path):
    """7 devices split none of a width-4 ResNet-18's arrays (kernels 3x3 by 4..32 channels,
    5 classes): one warning line, and the run trains with everything whole."""
    out = run_python(
        "-m", "jddp.train", f"workdir={tmp_path / 'run'}",
        *with_overrides(TINY, "data.global_batch_size=14", "model.num_classes=5"),
        "train.steps=1", "dist.shard=full", env=fake_devices(7),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    warnings = [line for line in out.stdout.splitlines() if "warning: dist.shard" in line]
    assert warnings == [
        "jddp: warning: dist.shard=full: no array of the train state has an axis 7 devices "
        "divide: every device holds all of it (0.0% split)"
    ]


@pytest.mark.parametrize("key", ["dist.shard=full", "dist.shard_weight_update=true"])
def test_refused_with_the_mpi_backend(tmp_path, key):
    out = run_python(
        "-m", "jddp.train", f"workdir={tmp_path}", "dist.backend=mpi", key, "--print-config",
    )  # fmt: skip
    assert out.returncode == 2
    kind = "full" if "full" in key else "optimizer"
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith(f"jddp: error: dist.shard={kind} needs dist.backend=xla")
    )


def test_the_older_spelling_and_bad_values():
    """dist.shard_weight_update (before dist.shard) still loads; dist.shard wins over it; an
    unknown value names the choices."""
    assert jddp.load_config(overrides=["dist.shard_weight_update=true"]).dist.shard == "optimizer"
    assert jddp.load_config(overrides=["dist.shard_weight_update=false"]).dist.shard == "none"
    both = ["dist.shard_weight_update=true", "dist.shard=full"]
    assert jddp.load_config(overrides=both).dist.shard == "full"
    with pytest.raises(ConfigError, match="dist.shard: .*none.*optimizer.*full"):
        jddp.load_config(overrides=["dist.shard=zero3"])
    with pytest.raises(ConfigError, match="dist.shard_weight_update: expected true or false"):
        jddp.load_config(overrides=["dist.shard_weight_update=2"])


@pytest.mark.parametrize("kind", ["optimizer", "full"])
def test_refused_with_an_optimizer_given_to_fit(tmp_path, kind):
    """An optax object may take norms per array (clipping, trust ratios): not split blindly."""
    with pytest.raises(ConfigError, match=f"dist.shard={kind} needs the optim section's"):
        jddp.fit(
            TinyMLP(192, 2, nnx.Rngs(0)),
            optax.sgd(0.1),
            train_data=data(64),
            config={"workdir": str(tmp_path / "run")},
            overrides=["train.steps=1", "data.global_batch_size=16", "log.progress=off",
                       f"dist.shard={kind}"],
        )  # fmt: skip
