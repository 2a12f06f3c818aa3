"""jddp under a real SLURM (a one-node cluster on this machine: scripts/slurm_local.sh): srun
with 2 tasks equals one process, the sbatch template's preemption -> requeue -> resubmit path
resumes bitwise with every step logged once, and a task killed with SIGKILL ends the step.

Where ``srun`` is missing the module starts the cluster itself (``scripts/slurm_local.sh start``:
apt-get install slurm-wlm munge, ~50 s the first time) unless ``JDDP_SLURM_START=0``; where that
is not possible (no root, no apt) every test is skipped, saying why."""

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import (
    QUICK,
    THREADS_PROBE,
    assert_losses_match,
    read_losses,
    read_metrics,
    run,
    train,
    wait_for,
    with_overrides,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
SLURM_ENV = {**os.environ, "PYTHONPATH": str(REPO)}  # the tasks import this checkout's jddp


def _cluster_answers() -> bool:
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return out.returncode == 0 and any(s in out.stdout for s in ("idle", "mixed", "allocated"))


@pytest.fixture(scope="module")
def cluster():
    """A SLURM that answers, started here if need be (and then stopped after this module's
    tests: no daemon left behind); else skip with the reason."""
    if _cluster_answers():
        yield
        return
    if os.environ.get("JDDP_SLURM_START", "1") == "0":
        pytest.skip("no SLURM here (srun/sinfo missing or not answering) and JDDP_SLURM_START=0")
    script = str(REPO / "scripts" / "slurm_local.sh")
    out = subprocess.run(["bash", script, "start"], capture_output=True, text=True, timeout=600)
    try:
        if out.returncode != 0 or not _cluster_answers():
            why = out.stderr[-300:]
            pytest.skip(f"no SLURM here and scripts/slurm_local.sh start failed: {why}")
        yield
    finally:
        subprocess.run(["bash", script, "stop"], capture_output=True, text=True, timeout=120)
        # (a slurmd hung stopping, waiting on a step still ending, had kept the next suite's
        # cluster down: its SLURM tests skipped)
        daemons = ("slurmd", "slurmctld", "slurmstepd")
        left = [pid for name in daemons for pid in run(["pgrep", "-x", name]).stdout.split()]
        assert not left, f"SLURM daemons left after scripts/slurm_local.sh stop: {left}"


STEPS = 10
# What SLURM starts, stops and requeues is what this module tests, not the steps: the tests'
# tiny run around a small MLP (QUICK: its images, augmentation and host workers). Its step
# held ~0.3 s (QUICK's model, the same losses bit for bit): a signal sent once step 2 is logged
# lands before step 8 however fast the machine (at ~2 ms a step it came after the last step).
# Only the sbatch jobs, which are signalled mid-run, are paced: the pace is a scalar loop that
# burns a core per rank (the srun run trains the MLP itself).
PACED = "model.name=tests.user_models:held_mlp"


def srun_cmd(workdir, *overrides) -> list[str]:
    # --immediate: a node held by someone else's job fails the step in 2 minutes, saying so,
    # instead of "queued and waiting for resources" until the test's timeout
    return [
        "srun", "-N1", "-n2", "--cpus-per-task=1", "--wait=60", "--immediate=120",
        sys.executable, "-m", "jddp.train", f"workdir={workdir}",
        *with_overrides(QUICK, *overrides),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def straight(cluster, tmp_path_factory):
    """``srun -N1 -n2`` of the tiny run, STEPS steps, uninterrupted."""
    wd = tmp_path_factory.mktemp("srun") / "run"
    out = run(srun_cmd(wd, f"train.steps={STEPS}"), env=SLURM_ENV, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return wd, out


def test_srun_tasks_compute_on_the_cores_slurm_gave_them(cluster):
    """`srun -n2 --cpus-per-task=1` without CPU binding (task/none: both tasks may run on every
    core) and without --ntasks-per-node: each task still pins itself to one core of its own and
    XLA:CPU starts one compute thread; the input workers get the same share."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("needs 2 cores")
    out = run(["srun", "-N1", "-n2", "--cpus-per-task=1", "--immediate=120", "--label",
               sys.executable, "-c", THREADS_PROBE], env={**SLURM_ENV, "JAX_PLATFORMS": "cpu"},
              timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    tasks = dict(line.split(": ", 1) for line in out.stdout.strip().splitlines())
    assert sorted(tasks) == ["0", "1"], out.stdout
    seen = []
    for line in tasks.values():
        pinned, eigen, workers, affinity = line.split(maxsplit=3)
        assert (pinned, eigen, workers) == ("1", "1", "1"), out.stdout
        seen.append(affinity)
    assert seen[0] != seen[1], out.stdout


def test_srun_two_tasks_log_the_losses_of_one_process(straight, tmp_path):
    wd, out = straight
    one = tmp_path / "one"
    alone = train(one, f"train.steps={STEPS}", base=QUICK, env=SLURM_ENV)
    assert alone.returncode == 0, alone.stderr[-3000:]
    got, want = read_losses(wd), read_losses(one)
    assert sorted(got) == list(range(1, STEPS + 1))
    # 2 devices vs 1 (an MLP: no batch statistics): equal up to float32 summation order
    assert_losses_match(got, want, range(1, STEPS + 1))


def _job_state(job_id: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
    for field in out.stdout.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return "GONE"


def _sbatch(tmp_path, name, *overrides) -> str:
    config = tmp_path / "tiny.yaml"  # the defaults, as the srun run: QUICK does the rest
    config.write_text("train:\n  seed: 0\n")
    venv = str(Path(sys.executable).parents[1])
    args = with_overrides(QUICK, *overrides)
    cmd = ["sbatch", "--parsable", f"--job-name={name}", str(SBATCH), str(config), *args]
    out = subprocess.run(
        cmd, capture_output=True, text=True, cwd=tmp_path, env={**SLURM_ENV, "VENV": venv}
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def _wait_done(job_id: str, timeout_s: float) -> str:
    ended = ("COMPLETED", "FAILED", "CANCELLED", "GONE")
    assert wait_for(lambda: _job_state(job_id) in ended, timeout_s), (
        f"job {job_id} still {_job_state(job_id)} after {timeout_s} s"
    )
    return _job_state(job_id)


def test_sbatch_preempted_requeued_and_resubmitted_resumes_bitwise(straight, tmp_path):
    """The template as shipped: `scancel --signal=USR1` -> jddp saves, both tasks exit 75 -> the
    template requeues the job -> it resumes in the same run folder and finishes step 8; a new
    sbatch of the same name (train.steps=10) resumes from 8. Every step once in metrics.jsonl,
    the losses those of the uninterrupted srun run, bit for bit; one log with both attempts."""
    name = f"jddp-test-{uuid.uuid4().hex[:6]}"
    wd = tmp_path / "runs" / name
    job = _sbatch(tmp_path, name, "train.steps=8", PACED)
    metrics = wd / "metrics.jsonl"
    assert wait_for(lambda: metrics.exists() and len(read_losses(wd)) >= 2, 600), (
        f"no train lines; job {_job_state(job)}; log: {_log(tmp_path, name, job)[-2000:]}"
    )
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    assert _wait_done(job, 900) == "COMPLETED", _log(tmp_path, name, job)[-3000:]
    log = _log(tmp_path, name, job)
    assert "preempted (exit 75): requeueing" in log and "attempt 2" in log, log[-3000:]
    stopped = int(log.split("preempted at step ")[1].split()[0])
    assert 2 <= stopped < 8
    job2 = _sbatch(tmp_path, name, "train.steps=10", PACED)  # the same model: a resume
    assert _wait_done(job2, 900) == "COMPLETED", _log(tmp_path, name, job2)[-3000:]
    assert "at step 8" in _log(tmp_path, name, job2)
    steps = [r["step"] for r in read_metrics(wd) if "train/loss" in r]
    assert steps == list(range(1, STEPS + 1))  # every step once, the stop step included
    assert_losses_match(read_losses(wd), read_losses(straight[0]), range(1, STEPS + 1), rel=0)


def _log(folder, name, job_id) -> str:
    path = Path(folder) / f"{name}-{job_id}.out"
    return path.read_text() if path.exists() else f"(no {path})"


def test_a_task_killed_with_sigkill_ends_the_step(cluster, tmp_path):
    wd = tmp_path / "run"
    step = subprocess.Popen(srun_cmd(wd, "train.steps=100000"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=SLURM_ENV)  # fmt: skip
    metrics = wd / "metrics.jsonl"
    started = wait_for(lambda: step.poll() is not None
                       or (metrics.exists() and len(read_losses(wd)) >= 2), 600)  # fmt: skip
    assert started and step.poll() is None, step.communicate(timeout=60)[1][-2000:]
    ranks = [int(p) for p in subprocess.run(["pgrep", "-f", f"workdir={wd}"], capture_output=True,
             text=True).stdout.split() if int(p) != step.pid]  # fmt: skip
    ranks = [p for p in ranks if "jddp.train" in Path(f"/proc/{p}/cmdline").read_text()
             and "srun" not in Path(f"/proc/{p}/cmdline").read_text()]  # fmt: skip
    assert len(ranks) == 2, ranks
    start = time.monotonic()
    os.kill(max(ranks), signal.SIGKILL)
    _, err = step.communicate(timeout=180)
    assert step.returncode != 0
    assert "Killed" in err, err[-2000:]  # srun: "task N: Killed"
    assert time.monotonic() - start < 120
    assert wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in ranks), 30)


def test_srun_pmi2_runs_the_mpi_backend(straight, tmp_path):
    """PyPI's MPICH takes its ranks from SLURM's pmi2 plugin: `srun --mpi=pmi2` with
    dist.backend=mpi trains and logs the losses of the xla run."""
    wd = tmp_path / "run"
    cmd = srun_cmd(wd, f"train.steps={STEPS}", "dist.backend=mpi")
    cmd[1:1] = ["--mpi=pmi2"]
    out = run(cmd, env=SLURM_ENV, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    xla = tmp_path / "xla"
    ref = run(srun_cmd(xla, f"train.steps={STEPS}"), env=SLURM_ENV, timeout=900)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert_losses_match(read_losses(wd), read_losses(xla), range(1, STEPS + 1))
