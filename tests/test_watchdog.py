"""A rank that hangs while alive ends the job (``dist.step_timeout_s``) instead of hanging it:
every live rank prints one line naming the stalled step and what it waited for, exit 124, no
process is left, nothing partial is saved, and the rerun resumes from the newest checkpoint.

Two processes under ``jddp.launch`` train the tests' linear task (tests/user_tasks.py); process
1 hangs after a few steps in its input pipeline, inside the compiled step (a host callback), or
stopped by SIGSTOP."""

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import read_losses, run, run_pids, start, steps_saved, wait_for

# Not serial (run beside the other xdist worker): a stall is no progress for TIMEOUT_S while
# the other rank's steps take milliseconds, and these passed beside a second suite at load 8
# (2026-11-26). The one whose steps take 0.7x the timeout by design runs alone.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 6
TASK = [
    "model.name=tests.user_tasks:linear",
    "data.name=tests.user_tasks:stalling_data",
    "train.loss=tests.user_tasks:stalling_loss",
    "data.global_batch_size=16",
    "data.workers=0",
    "optim.schedule=constant",
    "optim.lr=0.01",
    "checkpoint.every_steps=2",
    "log.every_steps=1",
    "log.progress=off",
    f"dist.step_timeout_s={TIMEOUT_S}",
]


def launch(workdir, steps, *flags):
    return [
        *(sys.executable, "-m", "jddp.launch", "--nproc", "2", "--devices-per-proc", "1"),
        *flags,
        "--",
        *(sys.executable, "-m", "jddp.train", f"workdir={workdir}", f"train.steps={steps}"),
        *TASK,
    ]


def stalled_lines(err: str) -> dict[int, str]:
    """``{rank: its stall line}`` from the launcher's prefixed stderr."""
    lines = {}
    for line in err.splitlines():
        for rank in (0, 1):
            if line.startswith(f"[rank {rank}] jddp: error: step ") and "stalled" in line:
                lines[rank] = line
    return lines


def assert_nothing_left(workdir):
    """No process of the job is left, and no half-written checkpoint under a step's name (a
    save cut short leaves only orbax's temporary folder, which the rerun removes)."""
    assert wait_for(lambda: not run_pids(workdir), 10), run_pids(workdir)
    names = [p.name for p in (workdir / "checkpoints").iterdir()]
    assert all(n.isdigit() or ".orbax-checkpoint-tmp" in n for n in names), names


@pytest.mark.parametrize(
    "where, waited_for",
    [
        ("input", "the next batch from the input pipeline"),
        # its own host callback, named (the peer waits in the all-reduce)
        ("model", "the step's results, held by a host callback of its own: _maybe_block ("),
    ],
)
def test_a_hung_rank_ends_the_job_in_one_line_per_rank(tmp_path, where, waited_for):
    workdir = tmp_path / where
    env = {**os.environ, "JDDP_TEST_STALL": where}
    start_s = time.monotonic()
    out = run(launch(workdir, 100_000), env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 124, out.stderr[-3000:]
    assert time.monotonic() - start_s < 150
    lines = stalled_lines(out.stderr)
    assert sorted(lines) == [0, 1], out.stderr[-3000:]
    assert f"dist.step_timeout_s={TIMEOUT_S}" in lines[0] and "exit 124" in lines[0]
    assert "process 0 was waiting for the step's results (its" in lines[0]  # the all-reduce
    assert f"process 1 was waiting for {waited_for}" in lines[1]
    # The launcher names the rank that stalled (every rank's watchdog fired and exited 124)
    (named,) = [x for x in out.stderr.splitlines() if x.startswith("jddp.launch: rank")]
    assert named.startswith(f"jddp.launch: rank 1 stalled, waiting for {waited_for}"), named
    assert_nothing_left(workdir)
    if where == "input":  # the rerun, no longer hanging, resumes from the newest checkpoint
        newest = steps_saved(workdir)[-1]
        steps = newest + 4
        again = run(launch(workdir, steps), cwd=ROOT, timeout=300)
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"at step {newest}" in again.stdout
        assert sorted(read_losses(workdir)) == list(range(1, steps + 1))  # each step once
        assert all(p.name.isdigit() for p in (workdir / "checkpoints").iterdir())


def test_the_launcher_restarts_a_job_whose_rank_stalled(tmp_path):
    """jddp.launch --max-restarts after a stall (exit 124): process 1 hangs once in its input
    pipeline; the group is restarted from the newest checkpoint and finishes: every step once,
    the losses those of an uninterrupted run bit for bit, nothing left."""
    workdir, straight = tmp_path / "run", tmp_path / "straight"
    env = {
        **os.environ,
        "JDDP_TEST_STALL": "input",
        "JDDP_TEST_STALL_ONCE": str(tmp_path / "stalled-once"),
    }
    out = run(launch(workdir, 14, "--max-restarts", "1", "--restart-delay", "0"), env=env,
              cwd=ROOT, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (restart,) = [line for line in out.stderr.splitlines() if "jddp.launch: restart" in line]
    # how rank 1 exited (rank 0's all-reduce fails as it exits: often seen in the same poll,
    # tests/test_launch.py), or rank 0's exit should its watchdog have fired 5 s before rank 1's
    assert restart.startswith(
        "jddp.launch: restart 1/1: rank 1 stalled, waiting for the next batch from the input "
        "pipeline ("
    ), restart
    exited = restart.split("pipeline (", 1)[1].split(")", 1)[0]
    assert exited in ("exited with code 124", "rank 0 exited with code 124"), restart
    assert restart.split(")", 1)[1].startswith("; resuming from step "), restart
    assert len(stalled_lines(out.stderr)) == 2  # the stall, said by each rank once
    assert sorted(read_losses(workdir)) == list(range(1, 15))  # each step once
    assert run(launch(straight, 14), cwd=ROOT, timeout=300).returncode == 0
    assert read_losses(workdir) == read_losses(straight)
    assert_nothing_left(workdir)


def test_a_stopped_rank_ends_the_job(tmp_path):
    """SIGSTOP: the stopped rank cannot speak; its peer names the step and stops, and the
    launcher takes the stopped one down."""
    workdir = tmp_path / "stopped"
    job = start(launch(workdir, 100_000), cwd=ROOT)
    metrics = workdir / "metrics.jsonl"
    assert wait_for(lambda: metrics.exists() and len(read_losses(workdir)) >= 4, 240)
    ranks = sorted(run_pids(workdir, exclude=job.pid))
    os.kill(ranks[-1], signal.SIGSTOP)
    _, err = job.communicate(timeout=180)
    assert job.returncode == 124, err[-3000:]
    lines = stalled_lines(err)
    assert list(lines) == [0], err[-3000:]
    assert (  # the stopped rank is the cause, though it cannot say so
        "jddp.launch: rank 1 stalled: its process is stopped (SIGSTOP or a debugger) (rank 0 "
        "exited with code 124); stopping the other 1 process"
    ) in err.splitlines(), err[-3000:]
    # Where the stop caught it: the step's all-reduce, or a checkpoint's barrier.
    assert "waiting for the step's results" in lines[0] or (
        "waiting for a checkpoint to be written" in lines[0]
    ), lines[0]
    assert_nothing_left(workdir)


def test_a_host_callback_still_running_is_named_as_its_own():
    """What a stalled rank's line says it waited for: the step's results, and when a host
    callback of its own still runs (the rank that stalled, not a peer waiting in the
    all-reduce), that callback by name and line."""
    import jax
    import jax.numpy as jnp

    from jddp.proc.watchdog import WAITING, waiting_for

    said = []

    def stuck_here(x):
        said.append(waiting_for("step"))

    jax.jit(lambda x: jax.debug.callback(stuck_here, x) or x)(jnp.float32(1)).block_until_ready()
    line = stuck_here.__code__.co_firstlineno + 1
    assert len(said) == 1 and said[0].startswith(f"{WAITING['callback']}: stuck_here ("), said
    assert said[0].endswith(f"test_watchdog.py:{line})"), said
    assert waiting_for("step") == WAITING["step"] and waiting_for("input") == WAITING["input"]


SLOW_BUT_MOVING = """
import sys, time
import jax, numpy as np, optax
from flax import nnx
import jddp
from tests.user_models import TinyMLP

PACE = float(sys.argv[1])  # seconds per batch and per step: 0.7 x dist.step_timeout_s


class SlowSource:
    image_shape, num_classes = (8, 8, 3), 10

    def __init__(self):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(64, 8, 8, 3)).astype(np.float32)
        self.y = rng.integers(0, 10, 64).astype(np.int32)

    def __len__(self):
        return 64

    def get_batch(self, indices):
        time.sleep(PACE)
        return self.x[indices], self.y[indices]


class SlowMLP(TinyMLP):
    def __call__(self, x):
        jax.debug.callback(lambda: time.sleep(PACE))
        return super().__call__(x)


evals = (np.zeros((16, 8, 8, 3), np.float32), np.zeros(16, np.int32))
jddp.fit(SlowMLP(192, 10, nnx.Rngs(0)), optax.sgd(0.1), SlowSource(), evals,
         config={"workdir": sys.argv[2]},
         overrides=["train.steps=3", "data.global_batch_size=16", "data.workers=0",
                    "data.prefetch_batches=0",
                    "log.progress=off", "log.every_steps=1",
                    f"dist.step_timeout_s={PACE / 0.7}"])
"""


def test_a_stop_signal_to_a_job_whose_step_hangs_exits_75_and_says_nothing_was_saved(tmp_path):
    """SIGTERM reaches the launcher while process 1's step hangs, and is forwarded: process 0
    waits in the step's all-reduce, its main thread blocked in JAX, where Python runs no
    signal handler. Its watchdog still learns of the signal (the wakeup fd) and every rank
    exits 75, so SLURM or the sbatch script requeues the job (it exited 124); each line says
    nothing was saved."""
    workdir = tmp_path / "run"
    env = {**os.environ, "JDDP_TEST_STALL": "model", "JDDP_TEST_STALL_SIGNAL": "SIGTERM"}
    out = run(launch(workdir, 100_000), env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 75, out.stderr[-3000:]
    lines = stalled_lines(out.stderr)
    assert sorted(lines) == [0, 1], out.stderr[-3000:]
    for rank, line in lines.items():
        assert "step 9 stalled: no progress for " in line, line
        assert f"(dist.step_timeout_s={TIMEOUT_S}); process {rank} was waiting for" in line
        assert line.endswith(
            "stopping without saving (exit 75, as SIGTERM asked); a rerun resumes from the "
            "newest checkpoint"
        ), line
    assert steps_saved(workdir) == [4, 6, 8]  # checkpoint.keep=3
    assert_nothing_left(workdir)


def test_a_run_whose_batches_and_steps_each_take_most_of_the_timeout_finishes(tmp_path):
    """Every batch and every step take 0.7 x dist.step_timeout_s (a slow input pipeline read
    in the loop's thread, data.prefetch_batches=0; a host callback in the step, which makes
    the dispatch synchronous on a CPU): the run moves and finishes, exit 0 (the watchdog timed
    from one step's results to the next's, a batch plus a step, and declared it stalled)."""
    # The timeout 10 s: 3 s of margin per batch and per step for the pieces around them (a
    # save, the eval's compile), enough beside the other workers' tests; not serial, as it
    # was with 1.5 s (27 s in which the machine's other worker idled, 2026-11-27).
    pace = 7.0
    out = run(
        [sys.executable, "-c", SLOW_BUT_MOVING, str(pace), str(tmp_path / "run")],
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "stalled" not in out.stderr
    assert len(read_losses(tmp_path / "run")) == 3


def test_python_m_jddp_evaluate_ends_a_hung_eval_in_one_line(tmp_path):
    """python -m jddp.evaluate had no watchdog: a hung eval waited for ever (or, with peers,
    died of JAX's heartbeat with a 42-line dump). Its eval batches now count as progress: one
    line naming what it waited for, exit 124."""
    workdir = tmp_path / "run"
    assert run(launch(workdir, 2)[8:], cwd=ROOT, timeout=300).returncode == 0  # one process
    env = {**os.environ, "JDDP_TEST_STALL": "eval"}  # the eval source hangs after one batch
    evaluate = [sys.executable, "-m", "jddp.evaluate", "--workdir", str(workdir), "--trust-code"]
    out = run([*evaluate, "dist.step_timeout_s=2"], env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 124, out.stderr[-3000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("jddp: error: step 2 stalled: no progress for ")
    assert "(dist.step_timeout_s=2); process 0 was waiting for an eval batch; stopping (exit " in (
        line
    ) and line.endswith("124); nothing was written")
