"""The run loop and its hooks: periods, throughput windows, the one-step-late reader, and the
replica sync check wired into a real loop."""

import os

import jax.numpy as jnp
import pytest

from jddp.checkpoint.policy import SavePolicy
from jddp.errors import NonFiniteLoss
from jddp.proc.signals import STOP_KEY
from jddp.run.hooks import CheckpointHook, EvalHook, Every, StepReporter, ThroughputMeter
from jddp.step import NONFINITE_KEY
from tests.helpers import QUICK, fake_devices, run_python


def test_every_is_due_on_multiples_and_never_at_zero():
    assert [s for s in range(1, 10) if Every(3).due(s)] == [3, 6, 9]
    assert not any(Every(0).due(s) for s in range(1, 10))


class FakeClock:
    def __init__(self, monkeypatch):
        self.now = 100.0
        monkeypatch.setattr("jddp.run.hooks.time.perf_counter", lambda: self.now)


def test_throughput_windows_count_finished_steps(monkeypatch):
    clock = FakeClock(monkeypatch)
    meter = ThroughputMeter(global_batch_size=32, first_step=0)
    clock.now += 20.0  # the first step compiles
    assert meter.compiled({}) == 20.0
    clock.now += 3.0  # steps 2, 3, 4 take 1 s each
    window = meter.end_window(4)
    assert window["train/img_per_s"] == 32.0 and window["train/step_time_s"] == 1.0
    meter.restart(4)
    assert meter.end_window(4) == {}  # no step finished in this window
    clock.now += 2.0
    meter.end_window(6)
    assert meter.img_per_s == 32 * 5 / 5.0


class Recorder:
    def __init__(self):
        self.rows = []

    def write(self, step, values):
        self.rows.append((step, values))


class Bar:
    def train(self, step, host, logged):
        pass


class NoCheckpoints:
    directory = "ckpts"

    def all_steps(self):
        return []


def reporter(log, every=2, last=5, halt=True):
    meter = ThroughputMeter(8, 0)
    return StepReporter(
        every=every,
        last_step=last,
        halt_on_nonfinite=halt,
        log=log,
        meter=meter,
        progress=Bar(),
        checkpoints=NoCheckpoints(),
    )


def metrics(loss=1.0, nonfinite=0.0, stop=0.0):
    return {
        "train/loss": jnp.float32(loss),
        NONFINITE_KEY: jnp.float32(nonfinite),
        STOP_KEY: jnp.float32(stop),
    }


def test_reporter_logs_on_its_period_and_the_last_step_and_reads_stop_flags():
    log = Recorder()
    report = reporter(log)
    stops = [report(step, metrics(stop=float(step == 3))) for step in range(1, 6)]
    assert [s for s, _ in log.rows] == [2, 4, 5]
    assert stops == [False, False, True, False, False]
    assert STOP_KEY not in log.rows[0][1]


def test_reporter_halts_on_a_nonfinite_step_or_logs_it_under_skip():
    with pytest.raises(NonFiniteLoss, match="step 3"):
        reporter(Recorder())(3, metrics(loss=float("nan"), nonfinite=1.0))
    log = Recorder()
    reporter(log, halt=False)(3, metrics(loss=float("nan"), nonfinite=1.0))
    assert [s for s, _ in log.rows] == [3]


def test_eval_hook_skips_the_last_step_and_checkpoint_hook_follows_its_period():
    log, evaluated, saved = Recorder(), [], []
    hook = EvalHook(
        every=2,
        last_step=4,
        evaluate=lambda state: evaluated.append(state) or {"eval/loss": 0.0},
        log=log,
        meter=ThroughputMeter(8, 0),
    )
    for step in range(1, 5):
        hook(step, f"state{step}")
    assert evaluated == ["state2"]  # step 4 is the last: evaluated after the loop

    class Ckpts:
        def save(self, step, state, config):
            saved.append(step)

        def poll(self):
            pass

    ckpt = CheckpointHook(checkpoints=Ckpts(), policy=SavePolicy(every_steps=3), config={})
    for step in range(1, 8):
        ckpt(step, None)
    assert saved == [3, 6]


DIVERGE = """
import sys
import jax
from jddp import config as config_lib
from jddp.comm import XlaComm
from jddp.errors import ReplicasDiverged
from jddp.proc.signals import StopRequest
from jddp.run.loop import train_loop
from jddp.run.setup import Parts, build_run
from jddp.workdir import RunFolder
from jddp.proc.xla import enable_compilation_cache

for check_every in (2, 0):  # with the check, then the same drift without it
    cfg = config_lib.load(None, [*sys.argv[2:], f"workdir={sys.argv[1]}/{check_every}",
                                 f"dist.check_sync_every={check_every}"])
    enable_compilation_cache(cfg.train.compilation_cache_dir)  # as train_and_evaluate does
    with StopRequest() as stop:
        run = build_run(cfg, XlaComm(), RunFolder(cfg.workdir), stop, Parts())
        leaves, treedef = jax.tree.flatten(run.state.params)
        shards = [s.data for s in leaves[0].addressable_shards]
        shards[1] = shards[1] + 1.0  # device 1's copy of the first parameter drifts
        leaves[0] = jax.make_array_from_single_device_arrays(
            leaves[0].shape, leaves[0].sharding, shards
        )
        run.state = run.state.replace(params=jax.tree.unflatten(treedef, leaves))
        try:
            _, step, _ = train_loop(run)
            print(f"check={check_every}: finished step={step}")
        except ReplicasDiverged as e:
            print(f"check={check_every}: caught: {e}")
        run.checkpoints.close()
"""


@pytest.mark.slow
def test_sync_check_stops_a_loop_whose_replicas_diverged(tmp_path):
    """With dist.check_sync_every=2 the loop stops at step 2; without it the same drifted run
    goes to the end unnoticed (so the check, not something else, catches it)."""
    args = [str(tmp_path), *QUICK, "train.steps=4"]
    out = run_python("-c", DIVERGE, *args, env=fake_devices(2), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "check=2: caught: replicas diverged at step 2" in out.stdout
    assert "check=0: finished step=4" in out.stdout


@pytest.mark.slow
def test_the_stop_step_is_logged_once_and_the_resumed_run_logs_the_rest(tmp_path, monkeypatch):
    """A stop signal arriving while step 3's batch is built: the loop notices it one step late
    (step 4 already ran), saves step 4, and step 4 has its line in metrics.jsonl; the rerun
    resumes after it: every step 1..8 logged exactly once."""
    import signal

    from jddp.api import load_config
    from jddp.errors import Preempted
    from jddp.proc.signals import StopRequest
    from jddp.run.trainer import train_and_evaluate
    from tests.helpers import read_metrics, steps_saved

    calls = []
    flags = StopRequest.flags

    def flags_signalling_at_step_3(self, rows):
        calls.append(rows)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGUSR1)  # handled by the run's StopRequest
        return flags(self, rows)

    monkeypatch.setattr(StopRequest, "flags", flags_signalling_at_step_3)
    cfg = [f"workdir={tmp_path}", *QUICK, "train.steps=8"]
    with pytest.raises(Preempted) as stopped:
        train_and_evaluate(load_config(None, cfg))
    assert stopped.value.step == 4 and steps_saved(tmp_path) == [4]
    logged = [r["step"] for r in read_metrics(tmp_path) if "train/loss" in r]
    assert logged == [1, 2, 3, 4]
    monkeypatch.setattr(StopRequest, "flags", flags)
    assert train_and_evaluate(load_config(None, cfg)).step == 8
    logged = [r["step"] for r in read_metrics(tmp_path) if "train/loss" in r]
    assert logged == list(range(1, 9))
