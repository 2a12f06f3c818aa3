"""``python -m jddp.ray`` (jddp/launch/ray_cluster.py, jddp/launch/remote.py) on a real Ray cluster.

The module starts one head node here (``ray start --head --block``, 2 CPUs, its own temp folder
and port) and stops it at the end by signalling that ``ray start`` only: ``ray stop`` would end
every Ray cluster on the machine, other users' too. On it: a 2-worker x 2-device job of the
tiny config is killed with SIGKILL mid-run (one rank's ``jddp.train``; the job ends nonzero
naming the rank, nothing is left) and rerun: its 20 per-step losses equal those of
``python -m jddp.launch --nproc 2 --devices-per-proc 2`` bit for bit (the session's
``two_by_two`` run). Signals reach every rank; bad input is one line, exit 2."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from jddp.launch import find_free_port
from jddp.launch.ray_cluster import placement_shortfall
from tests.helpers import (
    TWO_BY_TWO,
    assert_losses_match,
    assert_resumed_bitwise,
    read_losses,
    read_metrics,
    run,
    run_pids,
    start,
    steps_saved,
    train_cmd,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")


def ray_cmd(*flags, command=None, workdir=None) -> list[str]:
    """``python -m jddp.ray FLAGS -- COMMAND`` (default: the 20-step tiny run in ``workdir``)."""
    command = command or train_cmd(workdir, *TWO_BY_TWO)
    return [sys.executable, "-m", "jddp.ray", *flags, "--", *command]


def _children(parent: int, name: str) -> list[int]:
    """Pids of ``parent``'s children whose command line contains ``name``."""
    out = run(["ps", "-ww", "-eo", "pid=,ppid=,args="]).stdout.splitlines()
    rows = [line.split(None, 2) for line in out]
    return [int(r[0]) for r in rows if len(r) == 3 and int(r[1]) == parent and name in r[2]]


@pytest.fixture(scope="module")
def cluster():
    """A one-node Ray cluster of 2 CPUs: ``.address``, ``.start_s``, ``.actors()`` (the pids of
    its ``RankProcess`` actors)."""
    pytest.importorskip("ray")
    temp = tempfile.mkdtemp(prefix="jddp-ray-", dir="/tmp")  # short: Ray's socket paths
    port = find_free_port()
    env = {
        **os.environ,
        "AUTOSCALER_METRIC_PORT": str(find_free_port()),  # default 44217: fixed, shared
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    log = Path(temp) / "start.log"
    began = time.monotonic()
    with open(log, "w") as out:
        head = subprocess.Popen(
            [RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1"]
            + ["--port", str(port), "--num-cpus", "2", "--include-dashboard=false"]
            + ["--object-store-memory", str(100 << 20), "--disable-usage-stats"]
            + ["--temp-dir", temp],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        if not wait_for(lambda: "Ray runtime started" in log.read_text(), 90):
            pytest.fail(f"the Ray head did not start: {log.read_text()[-2000:]}")
        start_s = time.monotonic() - began
        (raylet,) = _children(head.pid, "raylet")
        yield SimpleNamespace(
            address=f"127.0.0.1:{port}",
            start_s=start_s,
            actors=lambda: _children(raylet, "ray::RankProcess"),
        )
    finally:
        head.send_signal(signal.SIGTERM)  # the head drains and stops what it started
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        left = [p for p in run(["pgrep", "-f", temp]).stdout.split()]
        for pid in left:
            os.kill(int(pid), signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"processes of the Ray cluster left after its stop: {left}"


def _rank_of(pid: int) -> int | None:
    """The ``JDDP_PROCESS_ID`` a process was started with (None: not a rank)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"JDDP_PROCESS_ID="):
            return int(item.split(b"=", 1)[1])
    return None


@pytest.mark.slow
def test_a_killed_job_ends_and_its_rerun_resumes_bitwise_as_jddp_launch(
    cluster, two_by_two, tmp_path
):
    straight, _ = two_by_two
    workdir = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": cluster.address}  # the address from Ray's variable
    flags = ["--num-workers", "2", "--devices-per-proc", "2"]
    began = time.monotonic()
    job = start(ray_cmd(*flags, "--kill-timeout", "3", workdir=workdir), env=env, cwd=ROOT)

    def mid_way() -> bool:
        return 4 in steps_saved(workdir) and len(read_losses(workdir)) >= 5

    ready = wait_for(lambda: job.poll() is not None or mid_way(), 300)
    ranks = {_rank_of(p): p for p in run_pids(workdir, exclude=job.pid)}
    assert ready and job.poll() is None and set(ranks) == {0, 1}, (job.poll(), ranks)
    mid_way_s = time.monotonic() - began
    os.kill(ranks[1], signal.SIGKILL)
    killed = time.monotonic()
    out, err = job.communicate(timeout=60)
    end_s = time.monotonic() - killed
    assert job.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert max(read_losses(workdir)) < 20, "the job was not killed mid-way"
    failure = [line for line in err.splitlines() if line.startswith("jddp.ray: rank")]
    assert failure and failure[0].startswith("jddp.ray: rank 1 killed by signal SIGKILL"), err
    assert end_s < 20, f"the job took {end_s:.1f} s to end after the kill"
    assert wait_for(lambda: not run_pids(workdir) and not cluster.actors(), 15), (
        run_pids(workdir),
        cluster.actors(),
    )
    resumed = steps_saved(workdir)[-1]

    again = run(ray_cmd(*flags, workdir=workdir), env=env, cwd=ROOT)
    assert "[rank 0] jddp: done step=20" in again.stdout, again.stderr[-3000:]
    assert_resumed_bitwise(again, workdir, straight, resumed, 20)
    # Steps 1..resumed of the killed job and the rest of the rerun: jddp.launch's, bit for bit.
    assert_losses_match(read_losses(workdir), read_losses(straight), range(1, 21), rel=0)
    print(
        f"\nRay head started in {cluster.start_s:.1f} s; step 5 after {mid_way_s:.1f} s; "
        f"the killed job ended {end_s:.1f} s after the kill"
    )


SIGNAL_PROBE = """
import os, signal, sys, time
def stop(signum, frame):
    print("rank", os.environ["JDDP_PROCESS_ID"], "got", signal.Signals(signum).name, flush=True)
    sys.exit(75)
signal.signal(signal.SIGINT, stop)  # Ray workers ignore and block it: reset for ranks
print("ready", *(os.environ[k] for k in ("JDDP_PROCESS_ID", "JDDP_NUM_PROCESSES",
      "JDDP_LOCAL_RANK", "JDDP_CPU_THREADS", "JDDP_COORDINATOR_ADDRESS", "JDDP_PROBE")),
      os.getcwd(), flush=True)
print("to stderr", file=sys.stderr, flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_ranks_are_wired_and_a_signal_reaches_every_rank(cluster, tmp_path):
    probe = ["python", "-c", SIGNAL_PROBE]  # 'python': the actor's interpreter
    flags = ["--num-workers", "2", "--address", cluster.address, "--env", "JDDP_PROBE=x"]
    with open(tmp_path / "out", "w") as stdout:
        job = start(ray_cmd(*flags, command=probe), cwd=tmp_path, stdout=stdout)
        assert wait_for(lambda: (tmp_path / "out").read_text().count("ready") == 2, 60)
        job.send_signal(signal.SIGINT)  # Ctrl-C
        _, err = job.communicate(timeout=60)
    out = (tmp_path / "out").read_text().splitlines()
    assert job.returncode == 75, err  # every rank exited 75: the driver too
    assert "jddp.ray: received SIGINT; forwarding to 2 processes" in err
    assert "[rank 0] to stderr" in err and "[rank 1] to stderr" in err
    header = [line for line in err.splitlines() if " coordinator " in line]
    coordinator = header[0].rsplit(" ", 1)[1]  # rank 0's node, a port free there
    for rank in (0, 1):
        # rank, world, local rank (one node), cores (--cpus-per-worker 1), --env, the folder
        want = f"[rank {rank}] ready {rank} 2 {rank} 1 {coordinator} x {tmp_path}"
        assert want in out, (want, out)
        assert f"[rank {rank}] rank {rank} got SIGINT" in out


@pytest.mark.slow
def test_a_lost_actor_ends_the_job_and_its_rank(cluster, tmp_path):
    """As when a node goes: the actor holding rank 0 is killed; its rank dies with it."""
    sleeper = ["python", "-c", "import time; print('up', flush=True); time.sleep(61)"]
    with open(tmp_path / "out", "w") as stdout:
        job = start(
            ray_cmd("--num-workers", "2", "--address", cluster.address, command=sleeper),
            stdout=stdout,
        )
        assert wait_for(lambda: (tmp_path / "out").read_text().count("up") == 2, 60)
        os.kill(cluster.actors()[0], signal.SIGKILL)
        _, err = job.communicate(timeout=30)
    assert job.returncode == 1, err
    assert "Ray actor died" in err and "stopping the other 1 process" in err
    assert wait_for(
        lambda: not cluster.actors() and not run(["pgrep", "-f", "time.sleep(61)"]).stdout, 10
    )


@pytest.mark.slow
def test_a_command_that_cannot_start_is_one_line(cluster):
    out = run(ray_cmd("--num-workers", "2", "--address", cluster.address, command=["no-such-cmd"]))
    assert out.returncode == 127, out.stderr  # as a shell says
    assert "cannot start 'no-such-cmd': [Errno 2] No such file or directory" in out.stderr
    assert wait_for(lambda: not cluster.actors(), 10)


@pytest.mark.slow
def test_more_workers_than_the_cluster_holds_is_one_line(cluster):
    began = time.monotonic()
    out = run(
        ray_cmd(
            "--num-workers",
            "3",
            "--address",
            cluster.address,
            "--placement-timeout",
            "2",
            command=["python", "-c", "pass"],
        )
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        "jddp.ray: error: cannot place 3 workers of 1 CPU (PACK): they need 3 CPU in all, "
        "the cluster has 2 CPU"
    )
    assert time.monotonic() - began < 30
    assert wait_for(lambda: not cluster.actors(), 10)


def test_no_cluster_at_the_address_is_one_line_at_once():
    began = time.monotonic()
    address = f"127.0.0.1:{find_free_port()}"
    out = run(ray_cmd("--num-workers", "2", "--address", address, command=["true"]))
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"jddp.ray: error: no Ray cluster at --address {address}")
    assert time.monotonic() - began < 20


def test_without_ray_the_error_names_the_extra(tmp_path):
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    out = run(ray_cmd("--num-workers", "2", command=["true"]), env=env, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("jddp.ray: error: Ray is not installed here")
    assert "pip install 'jddp[ray]'" in out.stderr and len(out.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--num-workers", "0"], "--num-workers must be >= 1, got 0"),
        (["--num-workers", "2", "--cpus-per-worker", "0"], "--cpus-per-worker must be > 0"),
        (
            ["--num-workers", "2", "--gpus-per-worker", "1", "--devices-per-proc", "2"],
            "--devices-per-proc (fake CPU devices) and --gpus-per-worker exclude each other",
        ),
        (["--num-workers", "2", "--env", "A B"], "--env 'A B': expected NAME or NAME=VALUE"),
        (["--num-workers", "2", "--placement-strategy", "X"], "--placement-strategy"),
        (
            ["--num-workers", "2", "--min-workers", "3"],
            "--min-workers must be between 1 and --num-workers 2, got 3",
        ),
        (["--num-workers", "2", "--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    ],
)
def test_bad_flags_are_one_line(flags, says):
    out = run(ray_cmd(*flags, command=["true"]))
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert says in out.stderr


def test_no_command_is_one_line():
    out = run([sys.executable, "-m", "jddp.ray", "--num-workers", "2"])
    assert out.returncode == 2 and "no command given after '--'" in out.stderr


class _ScriptedActor:
    """A ``RankProcess`` actor that answers each poll with the next of ``polls`` (the last one
    again once they run out); ``ray.get`` of its refs is the identity (:class:`_NoRay`)."""

    def __init__(self, polls):
        self.polls, self.signals = list(polls), []
        self.poll = SimpleNamespace(remote=self._next)
        self.signal = SimpleNamespace(remote=self.signals.append)

    def _next(self):
        return self.polls.pop(0) if len(self.polls) > 1 else self.polls[0]


class _NoRay:
    @staticmethod
    def get(ref, timeout=None):
        return ref


def test_a_killed_rank_seen_after_its_peers_failure_is_named_as_the_cause(monkeypatch, capsys):
    """Under load rank 1's SIGKILL can reach the driver a few polls after rank 0's failed
    all-reduce (exit 1), and rank 1's output after its exit: the line and the exit code name
    the kill, and every line is relayed. (Polls, not the clock, order it: the settling wait
    ends once no rank runs.)"""
    from jddp.launch import ray_job

    monkeypatch.setattr(ray_job, "_POLL_INTERVAL", 0.0)
    monkeypatch.setattr(ray_job, "_SETTLE_S", 3600.0)
    running = ([], None, False)
    peer = _ScriptedActor(
        [running, ([("stderr", "Gloo all-reduce failed: Connection reset by peer\n")], 1, True)]
    )
    killed = _ScriptedActor(
        [running, running, running, ([], -9, False), ([("stdout", "a last line\n")], -9, True)]
    )
    job = ray_job.RayJob(
        _NoRay, None, ["true"], cpus=1, gpus=0, devices_per_proc=None, env={}, kill_timeout=3
    )
    job.ranks = [ray_job._Rank(peer, "10.0.0.1", "a"), ray_job._Rank(killed, "10.0.0.2", "b")]
    assert job.wait() == 128 + signal.SIGKILL
    out, err = capsys.readouterr()
    said = [line for line in err.splitlines() if line.startswith("jddp.ray: ")]
    assert said == [
        "jddp.ray: rank 1 killed by signal SIGKILL (then rank 0 exited with code 1); "
        "no other process is left (rank 1: node 10.0.0.2 (b), pid None)"
    ], err
    assert "[rank 0] Gloo all-reduce failed" in err and out == "[rank 1] a last line\n"


def test_importing_jddp_does_not_import_ray():
    code = "import sys, jddp, jddp.ray, jddp.launch.remote; print('ray' in sys.modules)"
    assert run([sys.executable, "-c", code], check=True).stdout.strip() == "False"


@pytest.mark.parametrize(
    "bundle, count, strategy, says",
    [
        ({"CPU": 1}, 2, "PACK", None),
        (
            {"CPU": 1, "GPU": 4},
            2,
            "PACK",
            "they need 2 CPU, 8 GPU in all, the cluster has 8 CPU, 6 GPU",
        ),
        ({"CPU": 1, "GPU": 3}, 2, "SPREAD", "no node has 1 CPU, 3 GPU"),
        ({"CPU": 2}, 2, "STRICT_SPREAD", "STRICT_SPREAD needs 2 such nodes, the cluster has 1"),
        ({"CPU": 3}, 2, "STRICT_PACK", "STRICT_PACK needs one node with 6 CPU, none has"),
    ],
)
def test_placement_shortfall_names_what_is_missing(bundle, count, strategy, says):
    nodes = [{"CPU": 4, "GPU": 2}, {"CPU": 4, "GPU": 2}, {"CPU": 0, "GPU": 2}]
    if strategy == "STRICT_SPREAD":
        nodes = [{"CPU": 4}, {"CPU": 1}]
    assert placement_shortfall(bundle, count, strategy, nodes) == says


def _start_node(cluster, log: Path) -> subprocess.Popen:
    """A second node of 2 CPUs joining ``cluster`` (its own process group, to be killed whole as
    a lost machine is); returned once it runs."""
    with open(log, "w") as out:
        node = subprocess.Popen(
            [RAY, "start", "--address", cluster.address, "--block", "--node-ip-address"]
            + ["127.0.0.1", "--num-cpus", "2", "--object-store-memory", str(100 << 20)]
            + ["--disable-usage-stats"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
            start_new_session=True,
        )
    if not wait_for(lambda: "block forever" in log.read_text() or node.poll() is not None, 90):
        os.killpg(node.pid, signal.SIGKILL)
        pytest.fail(f"the second Ray node did not start: {log.read_text()[-2000:]}")
    return node


@pytest.mark.slow
def test_a_lost_node_restarts_the_job_on_the_workers_left_with_the_same_losses(
    cluster, two_by_two, tmp_path
):
    """Elastic (--max-restarts, --min-workers): 2 workers of 2 CPUs and 2 devices, one on each
    of two nodes; the second node is killed mid-run (its raylet, its actor and the rank on it):
    the job restarts by itself on the 1 worker Ray can still place, resumes from the newest
    checkpoint and finishes (exit 0); train/devices shows 4 then 2, every step is logged once,
    and the losses are those of the uninterrupted 2 x 2 run (jddp.launch's) within 1e-5."""
    straight, _ = two_by_two
    node = _start_node(cluster, tmp_path / "node.log")
    workdir = tmp_path / "run"
    flags = ["--num-workers", "2", "--min-workers", "1", "--cpus-per-worker", "2"]
    flags += ["--devices-per-proc", "2", "--max-restarts", "1", "--restart-delay", "0"]
    flags += ["--kill-timeout", "3", "--address", cluster.address]
    try:
        job = start(ray_cmd(*flags, workdir=workdir), cwd=ROOT)
        ready = wait_for(lambda: job.poll() is not None or 4 in steps_saved(workdir), 300)
        assert ready and job.poll() is None, job.communicate()[1][-3000:]
        (raylet,) = _children(node.pid, "raylet")
        doomed = _children(raylet, "ray::RankProcess")  # the node's actor: its rank dies with it
        os.killpg(node.pid, signal.SIGKILL)
        for pid in doomed:
            os.kill(pid, signal.SIGKILL)
        out, err = job.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGKILL)
        node.wait()
    assert job.returncode == 0, err[-3000:]
    (restart,) = [line for line in err.splitlines() if "restart 1/1" in line]
    assert "Ray actor died" in restart and restart.endswith("on 1 worker of 2"), restart
    assert "[rank 0] jddp: done step=20" in out
    rows = read_metrics(workdir)
    resumed = next(r["step"] for r in rows if "restart" in r)
    devices = [(r["step"], r["train/devices"]) for r in rows if "train/loss" in r]
    assert [step for step, _ in devices] == list(range(1, 21))  # every step once
    assert [n for _, n in devices] == [4] * resumed + [2] * (20 - resumed), devices
    assert 4 <= resumed < 20
    assert_losses_match(read_losses(workdir), read_losses(straight), range(1, 21), rel=1e-5)


def test_an_elastic_restart_takes_the_largest_count_that_splits_the_batch(tmp_path):
    """From N down to M, the counts whose devices split the global batch and its micro-batches;
    the batch is the command's own resolved config."""
    from jddp.launch.elastic import batch_of, worker_counts

    assert worker_counts(4, 1, 2, (48, 1)) == [4, 3, 2, 1]
    assert worker_counts(4, 1, 2, (32, 1)) == [4, 2, 1]  # 3 x 2 devices do not split 32
    assert worker_counts(4, 2, 2, (32, 4)) == [4, 2]  # 32 / (4 x 2) = 4 rows: 4 micro-batches
    assert worker_counts(4, 3, 2, (32, 1)) == [4]
    assert worker_counts(3, 1, 1, None) == [3, 2, 1]  # not a jddp.train command: any count
    command = train_cmd(tmp_path / "run", *TWO_BY_TWO, "train.grad_accum_steps=2")
    assert batch_of(command) == (16, 2)
    assert batch_of(["python", "my_script.py"]) is None
