"""Fault tolerance: exact resume after SIGKILL, resume on another topology, preemption,
damaged checkpoints, dead peers, non-finite losses, workdir locks."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (
    QUICK,
    TINY_SYNC,
    TWO_BY_TWO,
    assert_losses_match,
    kill_leftovers,
    launch_cmd,
    pid_gone,
    read_losses,
    read_metrics,
    run,
    run_pids,
    start,
    start_training,
    steps_saved,
    train_cmd,
    wait_for,
)

pytestmark = [pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]

cmd_train, cmd_launch = train_cmd, launch_cmd


@pytest.fixture
def straight(two_by_two):
    """2 processes x 2 devices, 20 steps, uninterrupted (shared with test_multiprocess)."""
    return two_by_two[0]


def test_the_launcher_restarts_a_group_whose_rank_was_killed(tmp_path, straight):
    """jddp.launch --max-restarts: kill -9 of one rank after the first checkpoint; the launcher
    stops the group, says so in one line, starts it again and the run resumes: every step
    logged once, the losses the uninterrupted run's bitwise, a restart row in metrics.jsonl;
    the restarted group compiled nothing (process 1 too loaded the step from the cache)."""
    wd = tmp_path / "run"
    args = cmd_launch(2, 2, wd, *TWO_BY_TWO)
    at = args.index("--nproc")
    args[at:at] = ["--max-restarts", "2", "--restart-delay", "0.5"]
    # JAX's own log of its persistent compilation cache, in every rank.
    env = {**os.environ, "JAX_DEBUG_LOG_MODULES": "jax._src.compiler"}
    job = start(args, start_new_session=True, env=env)
    assert wait_for(lambda: steps_saved(wd), 300), "no checkpoint appeared"
    ranks = run_pids(wd, exclude=job.pid)
    os.kill(max(ranks), signal.SIGKILL)  # one rank: its peer's collectives fail, the group ends
    killed = time.monotonic()

    def resumed_step_logged() -> bool:  # a train line past the restart row: training again
        rows = read_metrics(wd) if (wd / "metrics.jsonl").exists() else []
        marks = [r["step"] for r in rows if "restart" in r]
        return bool(marks) and any("train/loss" in r and r["step"] > marks[0] for r in rows)

    assert wait_for(lambda: resumed_step_logged() or job.poll() is not None, 300)
    lost_s = time.monotonic() - killed  # what a failure costs besides the steps redone
    out, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-3000:]
    restarts = [line for line in err.splitlines() if "jddp.launch: restart" in line]
    assert len(restarts) == 1 and restarts[0].startswith("jddp.launch: restart 1/2: rank "), err
    resumed_from = int(restarts[0].rsplit(" ", 1)[1])
    assert "killed by signal SIGKILL; resuming from step" in restarts[0]  # the cause, named
    got, want = read_losses(wd), read_losses(straight)
    assert sorted(got) == list(range(1, 21))  # each step once over the whole run
    assert_losses_match(got, want, range(1, 21), rel=0)
    rows = [r for r in read_metrics(wd) if "restart" in r]
    assert [(r["step"], r["restart"]) for r in rows] == [(resumed_from, 1)]
    assert f"at step {resumed_from}" in out
    # On CPUs JAX's cache keys differed between processes (jddp.proc.xla): the restarted rank 1
    # loads the step rank 0 wrote, as the group before it did.
    after = err.split(restarts[0], 1)[1].splitlines()
    hits = [line for line in after if "cache hit for 'jit_step'" in line]
    assert any(line.startswith("[rank 1]") for line in hits), err[-3000:]
    assert not [line for line in after if "MISS for 'jit_step'" in line], err[-3000:]
    print(f"\nkill -9 to the first resumed step logged: {lost_s:.1f} s (docs/distributed.md)")


POISONED = [
    "model.name=tests.user_tasks:linear",
    "data.name=tests.user_tasks:poisoned_data",
    "train.loss=tests.user_tasks:loss",
    "data.global_batch_size=16",
    "data.workers=0",
    "checkpoint.every_steps=2",
    "train.steps=20",
    "log.every_steps=1",
    "log.progress=off",
]


def test_the_launcher_does_not_burn_its_restarts_on_a_failure_that_repeats(tmp_path):
    """A NaN in step 5's batch (train.on_nonfinite=halt): the restarted group fails at step 5
    again with no checkpoint written since: one line says so and the launcher exits with the
    failure's code after 1 restart of 3 (a deterministic bug is not retried)."""
    wd = tmp_path / "run"
    args = cmd_launch(1, 1, wd, base=POISONED)  # (one process: the same decision, cheaper)
    at = args.index("--")
    args[at:at] = ["--max-restarts", "3", "--restart-delay", "0"]
    out = run(args)
    assert out.returncode == 1, out.stderr[-3000:]
    restarts = [line for line in out.stderr.splitlines() if "jddp.launch: restart" in line]
    assert len(restarts) == 1 and restarts[0].endswith("resuming from step 4"), out.stderr
    (loop,) = [line for line in out.stderr.splitlines() if " again after step " in line]
    assert loop.startswith("jddp.launch: rank 0 exited with code 1 again after step 4, with no "
                           "checkpoint since the last restart: not restarting"), loop  # fmt: skip
    assert sorted(read_losses(wd)) == [1, 2, 3, 4]  # each step once


def test_restarts_read_the_workdir_a_config_file_sets(tmp_path):
    """The run's workdir set in the --config file, not as workdir= on the command line: the
    launcher reads it as jddp.train resolves it, so its restart line says the step resumed from
    (it said "starting again from step 0" while the run resumed from step 4), the restart row
    is written, and the repeat at step 5 is refused (it restarted 3 times)."""
    wd = tmp_path / "run"
    config = tmp_path / "poisoned.yaml"
    sections: dict[str, list[str]] = {}
    for key, value in (item.split("=", 1) for item in POISONED):
        section, name = key.split(".")
        sections.setdefault(section, []).append(f"  {name}: {value}")
    text = "".join(f"{name}:\n" + "\n".join(keys) + "\n" for name, keys in sections.items())
    config.write_text(f"workdir: {wd}\n{text}")
    train = [sys.executable, "-m", "jddp.train", "--config", str(config)]
    launcher = [sys.executable, "-m", "jddp.launch", "--nproc", "1", "--devices-per-proc", "1"]
    out = run([*launcher, "--max-restarts", "3", "--restart-delay", "0", "--", *train])
    assert out.returncode == 1, out.stderr[-3000:]
    restarts = [line for line in out.stderr.splitlines() if "jddp.launch: restart" in line]
    assert len(restarts) == 1 and restarts[0].endswith("resuming from step 4"), out.stderr
    assert [line for line in out.stderr.splitlines() if " again after step " in line]
    assert [(r["step"], r["restart"]) for r in read_metrics(wd) if "restart" in r] == [(4, 1)]


def test_a_workdir_deleted_mid_run_is_not_restarted_and_its_aftermath_is_one_line(tmp_path):
    """The workdir removed under a 2-process job with --max-restarts: process 0 stops in one
    line (its metrics or its lock are gone); process 1, whose coordination service was on
    process 0, printed a page of JAX's errors about it (now one line of the launcher's, when
    it had any); and the group was restarted into a new workdir from step 0 (now: not
    restarting, said in the launcher's line)."""
    wd = tmp_path / "run"
    linear = [x for x in POISONED if not x.startswith(("data.name", "train.steps"))]
    # No save in flight as the folder goes (orbax then hangs in its commit: the watchdog's)
    args = cmd_launch(2, 1, wd, "data.name=tests.user_tasks:data", "train.steps=100000",
                      "checkpoint.every_steps=100000", base=linear)  # fmt: skip
    args[args.index("--") : args.index("--")] = ["--max-restarts", "2", "--restart-delay", "0"]
    job = start_training(args, wd, steps=3, cwd=ROOT)
    try:
        assert wait_for(lambda: shutil.rmtree(wd, ignore_errors=True) or not wd.exists(), 30)
        _, err = job.communicate(timeout=120)  # (it restarted into a new workdir, on and on)
    finally:
        if job.poll() is None:
            job.kill()  # its ranks die with it
            job.communicate()
    assert job.returncode == 1, err[-3000:]
    lines = err.splitlines()
    assert not [x for x in lines if "coordination_service" in x or "Terminating process" in x]
    (refused,) = [x for x in lines if "was deleted while it ran" in x]
    assert refused.startswith("jddp.launch: rank ") and refused.endswith(
        f"; the run's workdir {wd} was deleted while it ran: not restarting"
    ), refused
    assert not [x for x in lines if "jddp.launch: restart" in x] and not wd.exists()
    shown = [x for x in lines if x.startswith("[rank 1] ")]
    assert len(shown) <= 1, err[-3000:]  # its all-reduce's failure, or nothing


def test_the_workdir_of_a_command_is_read_as_the_command_resolves_it(tmp_path, monkeypatch):
    """jddp.launch and jddp.ray read a jddp.train command's workdir from its config file and
    overrides (default runs/<config name>), another command's from its workdir= override;
    none where the config cannot be read (the command says why itself)."""
    from jddp.launch.restarts import workdir_of

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("train:\n  steps: 3\n")
    (tmp_path / "set.yaml").write_text("workdir: elsewhere/run\n")
    train = ["python", "-m", "jddp.train"]
    assert workdir_of([*train, "--config", "mine.yaml"]) == Path("runs/mine")
    assert workdir_of([*train, "--config=set.yaml", "train.steps=2"]) == Path("elsewhere/run")
    assert workdir_of([*train, "--config", "set.yaml", "workdir=/x"]) == Path("/x")
    assert workdir_of([*train, "train.steps=2"]) == Path("runs/default")
    assert workdir_of([*train, "--config", "missing.yaml"]) is None
    assert workdir_of([*train, "--config", "mine.yaml", "optim.lrr=1"]) is None
    assert workdir_of(["python", "script.py", "workdir=out"]) == Path("out")
    assert workdir_of(["python", "script.py"]) is None


def test_a_restart_budget_names_its_end_and_tells_a_loop_from_progress(tmp_path):
    """Restarts: refused for exits a restart cannot help (0, 2, 75, 130, a stop signal); used up
    with a line naming the last failure; a loop only when the same code comes back at the same
    step (within 2: lines are read a step late) with no checkpoint since."""
    from jddp.launch.restarts import Restarts

    (tmp_path / "checkpoints" / "4").mkdir(parents=True)

    def logged(step):
        with (tmp_path / "metrics.jsonl").open("a") as f:
            f.write(f'{{"step": {step}, "train/loss": 1.0}}\n')

    assert Restarts(0, tmp_path).refusal(1, None, "x") == ""  # none asked for
    budget = Restarts(2, tmp_path)
    assert [budget.refusal(code, None, "x") for code in (0, 2, 75, 130)] == [""] * 4
    assert budget.refusal(1, 15, "x") == ""  # the launcher itself was signalled
    logged(5)
    assert budget.refusal(137, None, "x") is None and budget.count == 1
    logged(12)  # progress (a later step): not a loop, though no checkpoint was written
    assert budget.refusal(137, None, "x") is None and budget.count == 2
    assert budget.refusal(137, None, "rank 1 died") == (
        "no restart left (--max-restarts 2); the last failure: rank 1 died"
    )
    loop = Restarts(5, tmp_path)
    assert loop.refusal(1, None, "rank 0 exited with code 1") is None
    logged(13)  # one step later, read late: the same step
    assert "again after step 13, with no checkpoint" in loop.refusal(1, None, "rank 0 ...")
    again = Restarts(5, tmp_path)
    assert again.refusal(1, None, "x") is None
    (tmp_path / "checkpoints" / "12").mkdir()  # a checkpoint since: progress, restart
    assert again.refusal(1, None, "x") is None
    empty = tmp_path / "empty"  # failing before any step, twice: the same
    start = Restarts(5, empty)
    assert start.refusal(1, None, "x") is None
    assert "x again before its first step" in start.refusal(1, None, "x")
    # No workdir= in the command (runs/<config name>): nothing to tell a loop by, so restarts;
    # nor is a lost machine or Ray actor a loop of the run's
    unknown, machines = Restarts(3, None), Restarts(3, empty)
    assert [unknown.refusal(1, None, "x") for _ in range(3)] == [None] * 3
    assert [machines.refusal(1, None, "x", may_loop=False) for _ in range(3)] == [None] * 3


@pytest.mark.parametrize("nproc, devices", [(1, 4), (1, 1)])
def test_resume_on_another_topology(tmp_path, straight, nproc, devices):
    wd = tmp_path / "run"
    src = Path(straight) / "checkpoints" / "8"
    (wd / "checkpoints").mkdir(parents=True)
    shutil.copytree(src, wd / "checkpoints" / "8")
    out = run(cmd_launch(nproc, devices, wd, "train.steps=12"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "at step 8" in out.stdout
    got, want = read_losses(wd), read_losses(straight)
    assert_losses_match(got, want, range(9, 13))


# One signal end to end (every stop signal takes the same path: tests/test_trust.py checks
# that each one is recorded, and Ctrl-C end to end).
@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_preemption_saves_and_exits(tmp_path, sig):
    wd = tmp_path / "run"
    job = start_training(cmd_launch(2, 1, wd, "train.steps=100000", base=QUICK), wd, steps=3)
    ranks = run_pids(wd, exclude=job.pid)
    assert len(ranks) == 2
    start = time.monotonic()
    os.kill(max(ranks), sig)  # one rank only: the other must learn it through the step
    out, err = job.communicate(timeout=60)
    assert time.monotonic() - start < 30
    assert job.returncode == 75, err[-3000:]
    saved = steps_saved(wd)
    assert saved and "preempted at step" in out
    stopped = int(out.split("preempted at step ")[1].split()[0])
    assert saved[-1] == stopped
    if sig == signal.SIGTERM:  # the rerun (one process: cheaper) continues from there
        again = run(cmd_train(wd, f"train.steps={stopped + 2}", base=QUICK))
        assert again.returncode == 0 and f"at step {stopped}" in again.stdout


def _ranks_started(out: Path, wd: Path) -> bool:  # their interpreters starting, importing
    return len(run_pids(wd)) >= 3  # the launcher and its 2 ranks name the workdir


def _gloo_connected(out: Path, wd: Path) -> bool:
    return "[Gloo] Rank 1 is connected" in out.read_text()


def _set_up(out: Path, wd: Path) -> bool:  # config.yaml: written before the step compiles
    return (wd / "config.yaml").exists()


def _first_step(out: Path, wd: Path) -> bool:
    return (wd / "metrics.jsonl").exists() and len(read_losses(wd)) >= 1


def _saving(out: Path, wd: Path) -> bool:  # a save under way: its folder, final or temporary
    return (wd / "checkpoints").is_dir() and any((wd / "checkpoints").iterdir())


MOMENTS = {"rank-start": _ranks_started, "gloo": _gloo_connected, "set-up": _set_up,
           "first-step": _first_step, "save": _saving}  # fmt: skip


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_sigterm_at_any_moment_saves_and_exits_75(tmp_path, moment):
    """SIGTERM to the launcher at a moment gated by the run's own output: as the ranks start
    (before they catch it: the launcher holds it until they do; it killed them, exit 143), as
    their gloo connection is made, while the run is set up and its step compiles, after its
    first step, and while a checkpoint is written. Each time: the ranks stop at the same step
    and save it, rank 0 says so in one line, the launcher exits 75, no traceback. (The ResNet
    while the step compiles, that compile taking seconds; a small MLP at the other moments.)"""
    wd, out = tmp_path / "run", tmp_path / "out.txt"
    base = TINY_SYNC if moment == "set-up" else QUICK
    cmd = cmd_launch(2, 1, wd, "train.steps=100000", "checkpoint.every_steps=3", base=base)
    with open(out, "w") as sink:
        job = start(cmd, stdout=sink, stderr=subprocess.STDOUT)
        try:
            assert wait_for(lambda: MOMENTS[moment](out, wd) or job.poll() is not None, 300)
            assert job.poll() is None, out.read_text()[-3000:]
            job.send_signal(signal.SIGTERM)
            job.wait(timeout=180)
        finally:
            job.kill()
    text = out.read_text()
    assert job.returncode == 75, text[-3000:]
    assert "Traceback" not in text and "preemption" not in text.lower(), text[-3000:]
    stopped = [line for line in text.splitlines() if "jddp: preempted at step" in line]
    assert len(stopped) == 1 and stopped[0].startswith("[rank 0] jddp: preempted at step ")
    step = int(stopped[0].split("preempted at step ")[1].split()[0])
    assert "(SIGTERM)" in stopped[0] and steps_saved(wd)[-1] == step >= 1


SIGTERM_AFTER_JOINING = """
import os, signal, sys
from jddp.config import DistConfig
from jddp.distributed import initialize
seen = []
signal.signal(signal.SIGTERM, lambda *_: seen.append("SIGTERM"))  # as jddp.train's first
initialize(DistConfig(coordinator_address=sys.argv[1], num_processes=1, process_id=0))
os.kill(os.getpid(), signal.SIGTERM)
print(seen)
"""


def test_joining_the_job_leaves_sigterm_to_jddp(tmp_path):
    """jax.distributed.initialize installs JAX's own SIGTERM handler (its preemption service)
    over the one jddp installed first; a SIGTERM before jddp installed its own again was JAX's,
    logged and ignored. jddp joins with JAX's service off: the handler installed before joining
    still gets it."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    out = run([sys.executable, "-c", SIGTERM_AFTER_JOINING, f"localhost:{port}"],
              env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['SIGTERM']"


def test_dead_peer_stops_the_job(tmp_path):
    wd = tmp_path / "run"
    job = start_training(cmd_launch(2, 1, wd, "train.steps=100000", base=QUICK), wd, steps=2)
    ranks = run_pids(wd, exclude=job.pid)
    start = time.monotonic()
    os.kill(max(ranks), signal.SIGKILL)
    _, err = job.communicate(timeout=90)
    assert time.monotonic() - start < 60
    # Whichever is seen first names the failure: the launcher reaping the killed rank, or the
    # survivor's collective failing on the reset connection (seen in a CI-like run).
    assert job.returncode != 0
    assert "killed by signal SIGKILL" in err or (
        "Connection reset by peer" in err and "exited with code 1" in err
    ), err[-2000:]


def test_dead_peer_without_launcher_times_out(tmp_path):
    """Plain processes (no launcher): the survivor stops after dist.heartbeat_timeout_s."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    wd = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    common = [
        "train.steps=100000",
        f"dist.coordinator_address=localhost:{port}",
        "dist.num_processes=2",
        "dist.heartbeat_timeout_s=10",
    ]
    procs = [start(cmd_train(wd, *common, f"dist.process_id={i}", base=QUICK), env=env)
             for i in range(2)]  # fmt: skip
    assert wait_for(lambda: (wd / "metrics.jsonl").exists() and len(read_losses(wd)) >= 2, 300)
    killed_at = time.monotonic()
    procs[1].kill()
    try:
        procs[0].wait(timeout=90)
    finally:
        procs[0].kill()
    assert time.monotonic() - killed_at < 60
    assert procs[0].returncode != 0


@pytest.mark.slow
def test_training_ranks_die_with_a_sigkilled_launcher_and_the_rerun_resumes(
    tmp_path: Path,
) -> None:
    """kill -9 of ``jddp.launch`` under training: both ranks go within 10 s (PDEATHSIG), and
    the same command takes over their stale lock and resumes. (Not among test_launch.py's
    serial tests: SIGKILL needs no idle machine to land in 10 s, and its 8 s of training kept
    the other workers waiting at the suite's start.)"""
    wd = tmp_path / "run"
    cmd = launch_cmd(2, 1, wd, "train.steps=100000", "checkpoint.every_steps=1", base=QUICK)
    metrics = wd / "metrics.jsonl"
    logs = [tmp_path / f"{name}.log" for name in ("out1", "err1", "out2", "err2")]
    first = rerun = None
    try:
        with open(logs[0], "w") as out, open(logs[1], "w") as err:
            first = start(cmd, stdout=out, stderr=err)
        trained = lambda: metrics.exists() and metrics.read_text().strip() and steps_saved(wd)  # noqa: E731
        assert wait_for(trained, 300), logs[1].read_text()[-3000:]
        ranks = run_pids(wd, exclude=first.pid)
        assert len(ranks) == 2, ranks
        first.kill()  # kill -9: no chance to forward anything
        first.wait(timeout=30)
        t0 = time.monotonic()
        for pid in ranks:
            assert pid_gone(pid, timeout=max(0.0, 10 - (time.monotonic() - t0))), pid
        assert run_pids(wd) == []
        # The same command again: the ranks' lock is stale, so it is taken over and the run
        # resumes from the last checkpoint.
        with open(logs[2], "w") as out, open(logs[3], "w") as err:
            rerun = start(cmd, stdout=out, stderr=err)
        resumed = lambda: "resumed from" in logs[2].read_text() or rerun.poll() is not None  # noqa: E731
        assert wait_for(resumed, 300)
        assert rerun.poll() is None, logs[3].read_text()[-3000:]
        assert "in use by a live run" not in logs[3].read_text()
        rerun.terminate()  # forwarded: the ranks save and stop
        rerun.wait(timeout=110)  # before the launcher's own 120-s escalation
        assert "taking over stale lock" in logs[3].read_text()
        # SIGTERM reached jddp's handler, not only jax.distributed's (TSL's preemption notifier)
        assert rerun.returncode == 75, logs[3].read_text()[-3000:]
    finally:
        for p in (first, rerun):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        kill_leftovers(run_pids(wd))
