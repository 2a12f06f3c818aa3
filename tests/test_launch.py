"""jddp.launch: env wiring, output prefixing, fail-fast, signal forwarding, reaping, usage."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from jddp import launch
from jddp.launch import local
from tests.helpers import (
    kill_leftovers,
    pid_gone,
    run,
    start,
)

pytestmark = pytest.mark.serial  # launcher tests start processes and time their exits
PY = sys.executable

# Prepended to every child script: helpers to record the pid and wait for sibling files.
PRELUDE = """\
import os, signal, subprocess, sys, time
from pathlib import Path
RANK = int(os.environ["JDDP_PROCESS_ID"])
N = int(os.environ["JDDP_NUM_PROCESSES"])
TMP = Path(sys.argv[1])

def mark(name, text=""):
    p = TMP / name
    p.with_suffix(".tmp").write_text(text)
    p.with_suffix(".tmp").rename(p)

def wait_for(names, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not all((TMP / n).exists() for n in names):
        if time.monotonic() > deadline:
            sys.exit(99)
        time.sleep(0.02)

mark(f"pid{RANK}", str(os.getpid()))
"""


def child_cmd(tmp_path: Path, body: str) -> list[str]:
    """A ``python -c`` child command running PRELUDE + ``body`` with ``tmp_path`` as argv[1]."""
    return [PY, "-c", PRELUDE + textwrap.dedent(body), str(tmp_path)]


def launcher_argv(*flags: str) -> list[str]:
    return [PY, "-m", "jddp.launch", *flags]


def run_launcher(
    flags: list[str], cmd: list[str], env: dict[str, str] | None = None, timeout: float = 60
) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    proc = run(launcher_argv(*flags, "--", *cmd), env=env, timeout=timeout)
    return proc, time.monotonic() - t0


def read_pids(tmp_path: Path, names: list[str]) -> list[int]:
    return [int((tmp_path / n).read_text()) for n in names]


def wait_files(tmp_path: Path, names: list[str], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not all((tmp_path / n).exists() for n in names):
        assert time.monotonic() < deadline, f"timed out waiting for {names}"
        time.sleep(0.02)


def read_stderr_until(job: subprocess.Popen[str], text: str, timeout: float = 30.0) -> str:
    """Read ``job``'s stderr until it holds ``text``: what was read (``communicate()`` returns
    the rest). Raw reads under ``select``, so a line that never comes fails, never hangs."""
    assert job.stderr is not None
    fd, seen = job.stderr.fileno(), b""
    deadline = time.monotonic() + timeout
    while text.encode() not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {text!r} on stderr in {timeout} s: {seen.decode()[-2000:]}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            assert chunk, f"stderr closed before {text!r}: {seen.decode()[-2000:]}"
            seen += chunk
    return seen.decode()


def test_env_wiring_and_prefixed_output(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)
    env["XLA_FLAGS"] = "--xla_foo=1 --xla_force_host_platform_device_count=7"
    body = """
    e = os.environ
    print("id", e["JDDP_PROCESS_ID"], "n", e["JDDP_NUM_PROCESSES"],
          "local", e["JDDP_LOCAL_RANK"], "coord", e["JDDP_COORDINATOR_ADDRESS"])
    print("xla", e["XLA_FLAGS"])
    print("plat", e["JAX_PLATFORMS"], "unbuf", e["PYTHONUNBUFFERED"])
    print("on stderr", RANK, file=sys.stderr)
    sys.stdout.flush()
    os.write(1, b"\\xffraw\\n")  # undecodable byte -> U+FFFD
    sys.stdout.write("no newline")  # last line without "\\n" is still forwarded
    """
    cmd = child_cmd(tmp_path, body)
    proc, _ = run_launcher(["--nproc", "3", "--devices-per-proc", "2"], cmd, env=env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert all(line.startswith("[rank ") for line in out), out
    coords = set()
    for i in range(3):
        mine = [ln.removeprefix(f"[rank {i}] ") for ln in out if ln.startswith(f"[rank {i}] ")]
        ident = next(ln for ln in mine if ln.startswith("id "))
        fields = ident.split()
        assert fields[1:6:2] == [str(i), "3", str(i)]
        coords.add(fields[7])
        assert "xla --xla_foo=1 --xla_force_host_platform_device_count=2" in mine
        assert "plat cpu unbuf 1" in mine
        assert "no newline" in mine
        assert "\ufffdraw" in mine
    assert len(coords) == 1
    host, port = coords.pop().split(":")
    assert host == "localhost" and 0 < int(port) < 65536
    err = proc.stderr.splitlines()
    for i in range(3):
        assert f"[rank {i}] on stderr {i}" in err


def test_explicit_port_and_existing_jax_platforms_kept(tmp_path: Path) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cuda")
    env.pop("XLA_FLAGS", None)
    body = """
    e = os.environ
    print(e["JDDP_COORDINATOR_ADDRESS"], e["JAX_PLATFORMS"], e.get("XLA_FLAGS"))
    """
    proc, _ = run_launcher(
        ["--nproc", "1", "--port", "23456", "--devices-per-proc", "3"],
        child_cmd(tmp_path, body),
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        "[rank 0] localhost:23456 cuda --xla_force_host_platform_device_count=3\n"
    )


def test_no_devices_flag_leaves_xla_env_alone(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)
    env.pop("XLA_FLAGS", None)
    body = """
    print(os.environ.get("XLA_FLAGS"), os.environ.get("JAX_PLATFORMS"))
    """
    proc, _ = run_launcher(["--nproc", "2"], child_cmd(tmp_path, body), env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[rank 0] None None", "[rank 1] None None"]


def test_no_output_lost(tmp_path: Path) -> None:
    body = """
    for k in range(3000):
        print(f"line {k}")
        if k % 3 == 0:
            print(f"err {k}", file=sys.stderr)
    """
    proc, _ = run_launcher(["--nproc", "2"], child_cmd(tmp_path, body))
    assert proc.returncode == 0, proc.stderr
    for i in range(2):
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"[rank {i}] ")]
        assert lines == [f"[rank {i}] line {k}" for k in range(3000)]
        errs = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"[rank {i}] ")]
        assert errs == [f"[rank {i}] err {k}" for k in range(0, 3000, 3)]


def test_fail_fast_exit_code_and_no_survivors(tmp_path: Path) -> None:
    body = """
    if RANK == 0:
        # A grandchild in rank 0's process group: must be stopped too.
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        mark("grandchild", str(g.pid))
    if RANK == 1:
        wait_for([f"pid{r}" for r in range(N)] + ["grandchild"])
        print("failing", flush=True)
        sys.exit(3)
    time.sleep(600)
    """
    proc, elapsed = run_launcher(["--nproc", "3"], child_cmd(tmp_path, body))
    assert proc.returncode == 3, proc.stderr
    assert elapsed < 20
    assert "jddp.launch: rank 1 exited with code 3; stopping the other 2 processes" in (
        proc.stderr.splitlines()
    )
    assert "[rank 1] failing" in proc.stdout.splitlines()
    for pid in read_pids(tmp_path, ["pid0", "pid1", "pid2", "grandchild"]):
        assert pid_gone(pid), pid


def test_a_killed_rank_is_named_before_the_peer_it_took_down() -> None:
    """Seen exiting in one poll: the rank killed by a signal is the cause, the survivor whose
    all-reduce then failed (exit 1) follows (test_dead_peer_stops_the_job saw the survivor named
    alone, and "stopping the other 0 processes")."""
    from jddp.launch.supervise import failure_report

    got = failure_report([(0, 1), (1, -signal.SIGKILL)], alive=0)
    assert got == (
        "rank 1 killed by signal SIGKILL (then rank 0 exited with code 1); no other process is left"
    )
    assert (
        failure_report([(2, 3)], alive=1)
        == "rank 2 exited with code 3; stopping the other 1 process"
    )
    assert failure_report([(2, 3), (0, 4)], alive=2).startswith("rank 0 exited with code 4 (then")


def stall_line(rank: int, waited: str) -> str:
    """A rank's watchdog line (jddp.proc.watchdog), as the launcher reads it."""
    return (
        f"jddp: error: step 9 stalled: no progress for 6 s (dist.step_timeout_s=6); process "
        f"{rank} was waiting for {waited}; stopping without saving (exit 124); a rerun resumes "
        "from the newest checkpoint\n"
    )


def test_a_stall_names_the_rank_that_stalled_not_the_first_to_exit() -> None:
    """Every rank's watchdog fires when one rank stalls, its peers' too (they wait in the
    all-reduce), and each exits 124: the launcher names the rank that stalled, from what the
    ranks said (its own input pipeline or host callback; else the first watchdog to speak) or
    a rank found stopped (SIGSTOP: it says nothing), not the first seen exiting (under Ray:
    rank 0, sorted first; the leader's collective fails as its peer exits)."""
    from jddp.launch.supervise import Stalls, failure_report, first_cause
    from jddp.proc.watchdog import WAITING

    results, batch = WAITING["step"], WAITING["input"]
    stalls = Stalls()
    stalls.see(0, stall_line(0, results))
    stalls.see(1, stall_line(1, batch))
    stalls.see(1, "an unrelated line\n")
    assert stalls.culprit() == (1, f", waiting for {batch}")
    # Seen exiting in one poll (rank 0's all-reduce fails as rank 1 exits): rank 1's own exit
    # in brackets, rank 0's after it (it said "rank 0 exited with code 124" first, and the
    # launcher's restart line named rank 0's exit as rank 1's stall's)
    assert failure_report([(0, 124), (1, 124)], 0, stalls.culprit()) == (
        f"rank 1 stalled, waiting for {batch} (exited with code 124) (then rank 0 exited with "
        "code 124); no other process is left"
    )
    assert first_cause([(0, 124), (1, 124)], stalls.culprit()) == (
        f"rank 1 stalled, waiting for {batch} (exited with code 124)"
    )
    assert first_cause([(0, 124), (1, 1)], stalls.culprit()) == (  # its exit not the stall's
        f"rank 1 stalled, waiting for {batch} (rank 0 exited with code 124)"
    )
    assert first_cause([(1, 124)], stalls.culprit()) == (
        f"rank 1 stalled, waiting for {batch} (exited with code 124)"
    )
    held = f"{WAITING['callback']}: _maybe_block (tests/user_tasks.py:250)"
    callback = Stalls()
    for rank, waited in ((0, results), (1, held)):
        callback.see(rank, stall_line(rank, waited))
    assert callback.culprit() == (1, f", waiting for {held}")
    first = Stalls()  # nothing tells them apart: the first watchdog to speak
    for rank in (1, 0):
        first.see(rank, stall_line(rank, results))
    assert first.culprit() == (1, f", waiting for {results}")
    first.stopped(0)
    assert first_cause([(1, 124)], first.culprit()) == (
        "rank 0 stalled: its process is stopped (SIGSTOP or a debugger) (rank 1 exited with "
        "code 124)"
    )
    assert Stalls().culprit() is None
    assert first_cause([(1, 137)], (0, ", waiting")) == "rank 1 exited with code 137"


def test_a_ranks_errors_about_its_lost_coordination_service_are_one_line() -> None:
    """Process 0 ended (its one line said why): a peer still alive prints JAX's page about the
    coordination service process 0 hosted; from its first line on the rank's lines are counted,
    and one line of the launcher's stands for them."""
    from jddp.launch.supervise import Aftermath

    lines = [
        "step 3 done\n",
        "E1129 01:53:52.430971 15447 coordination_service_agent.cc:289] Polled an error from "
        "coordination service (this can be an error from this or another task).\n",
        "F1129 01:53:52.431025 15447 client.h:80] Terminating process because the JAX "
        "distributed service detected fatal errors. ...\n",
        ':UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}\n',
        "jddp: error: ValueError: UNKNOWN: Gloo all-reduce failed: ... Connection closed by peer\n",
    ]
    quiet = Aftermath()
    assert [line for line in lines if quiet.show(line)] == ["step 3 done\n"]
    assert quiet.summary(1) == (
        "jddp.launch: rank 1: 4 lines of JAX's errors about the job's coordination service not "
        "shown: another process had ended (its own lines say why)\n"
    )
    assert Aftermath().summary(0) is None


def test_the_oom_kill_count_is_read_from_the_processs_memory_cgroup(tmp_path: Path) -> None:
    """cgroup v1 (the hierarchy with the memory controller: memory.oom_control), v2 (the 0::
    line: memory.events, also under unified/ on a hybrid), none to read: None."""
    from jddp.launch.oom import oom_kills

    root, cgroup = tmp_path / "sys", tmp_path / "cgroup"
    v1 = root / "memory" / "process_api" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    cgroup.write_text("9:name=systemd:/\n4:memory:/process_api/job\n1:cpu:/\n0::/\n")
    assert oom_kills(root, cgroup) == 3
    v2 = root / "user.slice" / "run"
    v2.mkdir(parents=True)
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n")
    cgroup.write_text("0::/user.slice/run\n")
    assert oom_kills(root, cgroup) == 1
    hybrid = root / "unified" / "session"
    hybrid.mkdir(parents=True)
    (hybrid / "memory.events").write_text("oom_kill 7\n")
    cgroup.write_text("0::/session\n")
    assert oom_kills(root, cgroup) == 7
    cgroup.write_text("4:memory:/elsewhere\n")
    assert oom_kills(root, cgroup) is None
    assert oom_kills(root, tmp_path / "missing") is None


def test_what_the_launcher_says_of_an_oom_kill_names_the_steps_bytes(tmp_path: Path) -> None:
    from jddp.launch.oom import oom_cause

    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text(
        '{"step": 1, "train/compile_s": 2.0, "mem/step_bytes_per_device": 12582912}\n'
        '{"step": 1, "train/loss": 2.3}\n'
    )
    assert oom_cause(1, ["python", "train.py", f"workdir={workdir}"]) == (
        "rank 1 was killed by the kernel's out-of-memory killer (SIGKILL); the step needs 12.0 "
        "MiB per device (mem/step_bytes_per_device); what needs less memory: dist.shard=full, "
        "model.remat=blocks, a smaller per-device batch (data.global_batch_size, "
        "train.grad_accum_steps)"
    )
    assert "; the step needs" not in oom_cause(0, ["python", "train.py"])


@pytest.fixture
def memory_cgroup(tmp_path: Path):
    """A child of this process's cgroup v1 memory cgroup, limited to 256 MiB (its processes
    get the kernel's OOM killer past it), removed after; skipped where none can be made."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        pytest.skip("no /proc/self/cgroup: not Linux")
    fields = [line.split(":", 2) for line in lines]
    mine = [path for _, controllers, path in fields if "memory" in controllers.split(",")]
    parent = Path("/sys/fs/cgroup/memory") / (mine[0].lstrip("/") if mine else "")
    if not mine or not (parent / "memory.oom_control").exists():
        pytest.skip("no cgroup v1 memory hierarchy here (the test makes a v1 memory cgroup)")
    group = parent / f"jddp-oom-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(256 * 2**20))
    except OSError as e:
        if group.exists():
            group.rmdir()
        pytest.skip(f"cannot make a memory cgroup under {parent} ({e.strerror}): needs root")
    try:
        yield group
    finally:
        deadline = time.monotonic() + 30
        while True:  # empty once its processes are reaped
            try:
                group.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def test_a_rank_killed_by_the_oom_killer_is_named_so(tmp_path: Path, memory_cgroup: Path) -> None:
    """A rank that allocates past its memory cgroup's limit is killed by the kernel's OOM
    killer (SIGKILL): the launcher said "killed by signal SIGKILL", as for a kill -9; it reads
    the cgroup's OOM-kill count and says which it was, with the step's bytes from the run's
    metrics.jsonl and what needs less. The launcher is put in the cgroup, its ranks with it."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text('{"step": 1, "mem/step_bytes_per_device": 12582912}\n')
    body = """
    if RANK == 1:
        import numpy as np
        wait_for(["pid0"])
        hog = np.ones(2**26)  # 512 MiB, past the cgroup's 256
    mark(f"ready{RANK}")
    time.sleep(600)
    """
    command = [
        *launcher_argv("--nproc", "2", "--"),
        *child_cmd(tmp_path, body),
        f"workdir={workdir}",
    ]
    shell = f'echo $$ > {memory_cgroup}/cgroup.procs && exec "$@"'
    proc = run(["sh", "-c", shell, "sh", *command], timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert (
        "jddp.launch: rank 1 was killed by the kernel's out-of-memory killer (SIGKILL); the step "
        "needs 12.0 MiB per device (mem/step_bytes_per_device); what needs less memory: "
        "dist.shard=full, model.remat=blocks, a smaller per-device batch (data.global_batch_size, "
        "train.grad_accum_steps); stopping the other 1 process"
    ) in proc.stderr.splitlines(), proc.stderr
    assert int((memory_cgroup / "memory.oom_control").read_text().split()[-1]) >= 1


def test_signal_death_is_reported(tmp_path: Path) -> None:
    body = """
    if RANK == 0:
        wait_for([f"pid{r}" for r in range(N)])
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
    """
    proc, elapsed = run_launcher(["--nproc", "2"], child_cmd(tmp_path, body))
    assert proc.returncode == 128 + signal.SIGKILL
    assert elapsed < 20
    assert "jddp.launch: rank 0 killed by signal SIGKILL; stopping the other 1 process" in (
        proc.stderr
    )
    for pid in read_pids(tmp_path, ["pid0", "pid1"]):
        assert pid_gone(pid), pid


def test_sigterm_ignoring_child_is_killed_after_kill_timeout(tmp_path: Path) -> None:
    body = """
    if RANK == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        mark("ignoring")
        time.sleep(600)
    wait_for(["ignoring", "pid1"])
    mark("failing")
    sys.exit(5)
    """
    proc, _ = run_launcher(["--nproc", "2", "--kill-timeout", "2"], child_cmd(tmp_path, body))
    failed_at = (tmp_path / "failing").stat().st_mtime
    assert proc.returncode == 5, proc.stderr
    assert "rank 0 exited with code 5" in proc.stderr
    took = time.time() - failed_at
    assert 1.8 <= took < 10, took  # waited for --kill-timeout, then SIGKILL
    (pid1,) = read_pids(tmp_path, ["pid1"])
    assert pid_gone(pid1)


def _start_and_wait_ready(
    tmp_path: Path, body: str, nproc: int, kill_timeout: str = "5"
) -> subprocess.Popen[str]:
    launcher = start(
        launcher_argv(
            "--nproc", str(nproc), "--kill-timeout", kill_timeout, "--", *child_cmd(tmp_path, body)
        )
    )
    try:
        wait_files(tmp_path, [f"ready{r}" for r in range(nproc)])
    except BaseException:
        launcher.kill()
        launcher.communicate()
        raise
    return launcher


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_launcher_is_forwarded(tmp_path: Path, sig: signal.Signals) -> None:
    body = """
    def handler(signum, frame):
        print("got", signal.Signals(signum).name, flush=True)
        sys.exit(0)
    if RANK == 0:
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        # A grandchild that default-dies: it shares rank 0's process group.
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        mark("grandchild", str(g.pid))
    print("ready", flush=True)
    mark(f"ready{RANK}")
    time.sleep(600)  # rank 1 default-dies on SIGTERM (or KeyboardInterrupt on SIGINT)
    """
    launcher = _start_and_wait_ready(tmp_path, body, nproc=2)
    t0 = time.monotonic()
    launcher.send_signal(sig)
    out, err = launcher.communicate(timeout=30)
    assert time.monotonic() - t0 < 4  # all children die promptly: no kill-timeout needed
    assert launcher.returncode == 128 + sig
    assert f"[rank 0] got {sig.name}" in out.splitlines()
    assert f"jddp.launch: received {sig.name}" in err
    assert "exited with code" not in err  # deaths after forwarding are not failures
    for pid in read_pids(tmp_path, ["pid0", "pid1", "grandchild"]):
        assert pid_gone(pid), pid


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGHUP], ids=["SIGUSR1", "SIGHUP"])
def test_a_preemption_signal_is_forwarded_and_the_ranks_75_returned(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """What SLURM's ``--signal=USR1@120`` and a closed terminal send: each rank gets it, saves
    (here: exits 75, as ``jddp.train`` does), and the launcher exits 75 too."""
    body = """
    def handler(signum, frame):
        print("got", signal.Signals(signum).name, flush=True)
        sys.exit(75)
    signal.signal(signal.SIGUSR1, handler)
    signal.signal(signal.SIGHUP, handler)
    mark(f"ready{RANK}")
    time.sleep(600)
    """
    launcher = _start_and_wait_ready(tmp_path, body, nproc=2)
    launcher.send_signal(sig)
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 75, err
    assert f"[rank 0] got {sig.name}" in out and f"[rank 1] got {sig.name}" in out
    assert f"jddp.launch: received {sig.name}; forwarding to 2 processes" in err


def test_ranks_saving_after_a_stop_signal_are_not_cut_off_by_the_kill_timeout(
    tmp_path: Path,
) -> None:
    """The ranks save at their next step, which may first need the rest of a compile (tens of
    seconds on a GPU): a forwarded stop signal is not escalated after --kill-timeout (for
    failures), only after a second signal or 120 s. (The launcher SIGKILLed them: 138.)"""
    body = """
    def handler(signum, frame):
        time.sleep(3)  # the rest of a compile, a step, the checkpoint
        print("saved", flush=True)
        sys.exit(75)
    signal.signal(signal.SIGUSR1, handler)
    mark(f"ready{RANK}")
    time.sleep(600)
    """
    launcher = _start_and_wait_ready(tmp_path, body, nproc=2, kill_timeout="1")
    launcher.send_signal(signal.SIGUSR1)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 75, err
    assert out.count("saved") == 2


def test_forwarding_holds_usr1_for_a_starting_rank_and_signals_only_the_groups_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In-process: a signal that arrives while a rank is being started goes to that rank alone
    (the others have it already: a second SIGINT would interrupt them without a checkpoint)."""
    launcher = local.Launcher(["true"], 3, kill_timeout=1.0)
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(launcher, "_signal_group", lambda pgid, sig: sent.append((pgid, sig)))
    monkeypatch.setattr(local, "catches", lambda pid, sig: pid != 12)  # 12 is still starting
    launcher.live_groups = {11, 12, 13}
    launcher.started_at = {11: time.monotonic(), 12: time.monotonic(), 13: 0.0}
    launcher.forward(signal.SIGINT, [13])
    assert sent == [(13, signal.SIGINT)]
    sent.clear()
    launcher.forward(signal.SIGUSR1)
    assert sorted(sent) == [(11, signal.SIGUSR1), (13, signal.SIGUSR1)]
    assert launcher.held == {12: signal.SIGUSR1}
    launcher.send_held()
    assert launcher.held == {12: signal.SIGUSR1}  # not caught yet, still young
    monkeypatch.setattr(local, "catches", lambda pid, sig: True)
    launcher.send_held()
    assert launcher.held == {} and sent[-1] == (12, signal.SIGUSR1)


def test_a_preemption_signal_waits_for_a_rank_that_is_still_starting(tmp_path: Path) -> None:
    """A rank in its first moments (Python starting, ``jddp.train`` not yet running) has no
    handler for SIGUSR1, whose default kills it with nothing saved (the launcher then exited
    138). The launcher holds the signal until the rank catches it: both save, exit 75. The ranks
    install their handler only once the launcher has the signal (not after a guessed 1.5 s)."""
    body = """
    mark(f"ready{RANK}")
    wait_for(["go"])  # still "importing": no handler yet
    def handler(signum, frame):
        print("got", signal.Signals(signum).name, flush=True)
        sys.exit(75)
    signal.signal(signal.SIGUSR1, handler)
    time.sleep(600)
    """
    launcher = _start_and_wait_ready(tmp_path, body, nproc=2)
    launcher.send_signal(signal.SIGUSR1)
    seen = read_stderr_until(launcher, "jddp.launch: received SIGUSR1; forwarding")
    (tmp_path / "go").touch()
    out, err = launcher.communicate(timeout=30)
    err = seen + err
    assert launcher.returncode == 75, err
    assert "[rank 0] got SIGUSR1" in out and "[rank 1] got SIGUSR1" in out


def test_a_second_ctrl_c_after_the_ranks_saved_and_exited_is_one_line_and_75(
    tmp_path: Path,
) -> None:
    """Ctrl-C, the ranks save and exit 75, and a second Ctrl-C as the launcher ends: it met
    Python's handler once the launcher's were put back (a KeyboardInterrupt traceback) or the
    interpreter's teardown, which restores the signal's default (killed: no line, exit -2; 4
    times in 8). Now, whenever it comes, the launcher's exit code, 75, and one line if it came
    before the launcher ended. Three times, the second Ctrl-C sent as soon as the launcher has
    reaped both ranks."""
    body = """
    def saved(signum, frame):
        time.sleep(0.3)  # the save
        sys.exit(75)
    signal.signal(signal.SIGINT, saved)
    mark(f"ready{RANK}")
    time.sleep(600)
    """
    for attempt in range(3):
        folder = tmp_path / str(attempt)
        folder.mkdir()
        launcher = _start_and_wait_ready(folder, body, nproc=2)
        ranks = read_pids(folder, ["pid0", "pid1"])
        launcher.send_signal(signal.SIGINT)
        seen = read_stderr_until(launcher, "jddp.launch: received SIGINT; forwarding")
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() for pid in ranks):  # until reaped
            assert time.monotonic() < deadline, "the ranks were not reaped"
            time.sleep(0.001)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=30)
        err = seen + err
        assert launcher.returncode == 75, err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        assert err.splitlines()[-1] in (
            "jddp.launch: received SIGINT again; killing all",  # while it still reaped them
            "jddp.launch: received SIGINT after every process ended; exiting with code 75",
            "jddp.launch: received SIGINT; forwarding to 2 processes",  # it had ended already
        ), err


def test_a_stop_signal_once_the_group_ended_is_said_with_the_exit_code(capfd) -> None:
    """What the launcher's handler says for a stop signal after its ranks ended (the command's
    process then ends at once with that code; in-process, as here, it only says it)."""
    # Python's own handler, or SIG_IGN where the suite started with Ctrl-C ignored (a job in
    # the background of a shell: it failed there when this compared with Python's)
    before = signal.getsignal(signal.SIGINT)
    with launch._SignalsBetweenStarts() as between:
        between.ended(75)
        signal.raise_signal(signal.SIGINT)
    assert capfd.readouterr().err == (
        "jddp.launch: received SIGINT after every process ended; exiting with code 75\n"
    )
    assert signal.getsignal(signal.SIGINT) is before  # put back


def test_a_stop_signal_another_thread_received_ends_the_delay_before_a_restart() -> None:
    """The kernel gives a process's signal to any of its threads; Python runs the handler on the
    main thread only once that thread is back from C. One a reader thread received while the
    main thread slept a restart's delay left the delay to run out (600 s in CI: the launcher
    looked hung); the delay now wakes on the signals' wakeup fd. Here the signal goes to a
    thread of this process once the main thread is inside the delay's wait."""
    main = threading.main_thread().ident

    def signal_this_thread_once_main_waits() -> None:
        while True:  # (what the main thread is doing, not a moment guessed)
            frame = sys._current_frames().get(main)
            while (
                frame is not None and frame.f_code is not launch._SignalsBetweenStarts.wait.__code__
            ):
                frame = frame.f_back
            if frame is not None:
                break
            time.sleep(0.001)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    with launch._SignalsBetweenStarts() as between:
        sender = threading.Thread(target=signal_this_thread_once_main_waits, daemon=True)
        sender.start()
        t0 = time.monotonic()
        woken = between.wait(600)
        waited_s = time.monotonic() - t0
        sender.join()
    assert woken and between.received == signal.SIGTERM
    assert waited_s < 300  # woken by the signal, not by the delay's end (which passes too)


def test_second_signal_escalates_to_sigkill(tmp_path: Path) -> None:
    body = """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mark(f"ready{RANK}")
    time.sleep(600)
    """
    launcher = _start_and_wait_ready(tmp_path, body, nproc=2)
    t0 = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    # The second signal only once the launcher has taken the first (two pending SIGTERMs are
    # one): its line says so, where a guessed 0.3 s might not have.
    seen = read_stderr_until(launcher, "jddp.launch: received SIGTERM; forwarding")
    assert launcher.poll() is None  # children ignore SIGTERM; kill-timeout is 5 s
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=30)
    err = seen + err
    assert time.monotonic() - t0 < 4
    assert launcher.returncode == 128 + signal.SIGTERM
    assert "killing all" in err
    for pid in read_pids(tmp_path, ["pid0", "pid1"]):
        assert pid_gone(pid), pid


def test_grandchildren_of_successful_ranks_are_stopped(tmp_path: Path) -> None:
    body = """
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    mark(f"grandchild{RANK}", str(g.pid))
    print("done", flush=True)
    """
    proc, elapsed = run_launcher(["--nproc", "2"], child_cmd(tmp_path, body))
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 20
    for pid in read_pids(tmp_path, ["pid0", "pid1", "grandchild0", "grandchild1"]):
        assert pid_gone(pid), pid


def test_missing_command_exits_127(tmp_path: Path) -> None:
    proc, _ = run_launcher(["--nproc", "2"], [str(tmp_path / "does-not-exist")])
    assert proc.returncode == 127
    assert "cannot start" in proc.stderr


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--nproc", "2"], "'--'"),
        (["--nproc", "2", "--"], "'--'"),
        (["--nproc", "0", "--", "true"], "--nproc"),
        (["--nproc", "-1", "--", "true"], "--nproc"),
        (["--nproc", "x", "--", "true"], "--nproc"),
        (["--", "true"], "--nproc"),
        (["--nproc", "2", "--devices-per-proc", "0", "--", "true"], "--devices-per-proc"),
        (["--nproc", "2", "--port", "70000", "--", "true"], "--port"),
        (["--nproc", "2", "--kill-timeout", "-1", "--", "true"], "--kill-timeout"),
        (["--nproc", "2", "true"], "'--'"),
    ],
)
def test_usage_errors(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert launch.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("jddp.launch: error: ")
    assert needle in lines[0]


def test_usage_error_via_module_entry_point() -> None:
    proc = run(launcher_argv("--nproc", "0", "--", "true"), timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "jddp.launch: error: --nproc must be >= 1, got 0"


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert launch.main(["--help"]) == 0
    assert "--devices-per-proc" in capsys.readouterr().out


def test_helpers() -> None:
    assert launch.merge_xla_flags(None, 4) == "--xla_force_host_platform_device_count=4"
    assert (
        launch.merge_xla_flags("--a=1 --xla_force_host_platform_device_count=8 --b", 2)
        == "--a=1 --b --xla_force_host_platform_device_count=2"
    )
    assert launch.describe_exit(3) == "exited with code 3"
    assert launch.describe_exit(-9) == "killed by signal SIGKILL"
    assert launch.exit_code_for(-15) == 143 and launch.exit_code_for(7) == 7
    env = launch.child_env({"JAX_PLATFORMS": "tpu"}, rank=2, nproc=4, port=1234, devices_per_proc=1)
    assert env["JDDP_COORDINATOR_ADDRESS"] == "localhost:1234"
    assert (env["JDDP_PROCESS_ID"], env["JDDP_LOCAL_RANK"], env["JDDP_NUM_PROCESSES"]) == (
        "2",
        "2",
        "4",
    )
    assert env["JAX_PLATFORMS"] == "tpu" and env["PYTHONUNBUFFERED"] == "1"
    port = launch.find_free_port()
    assert 0 < port < 65536


def test_children_die_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    """kill -9 of the launcher cannot forward anything: the ranks must still go (PDEATHSIG),
    also a rank that ignores SIGTERM."""
    body = """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mark(f"ready{RANK}")
    time.sleep(600)
    """
    launcher = _start_and_wait_ready(tmp_path, body, nproc=2)
    pids = read_pids(tmp_path, ["pid0", "pid1"])
    try:
        launcher.kill()
        launcher.communicate(timeout=30)
        for pid in pids:
            assert pid_gone(pid, timeout=10), f"rank pid {pid} outlived its launcher"
    finally:
        kill_leftovers(pids)


def test_rank_watches_its_launcher_where_pdeathsig_is_missing(tmp_path: Path) -> None:
    """The fallback for systems without prctl: ``watch_launcher()`` in a rank ends it once its
    parent changes. Here the rank's parent is a plain process (no PDEATHSIG) that is killed."""
    rank = (
        "import sys, time; from jddp.launch import watch_launcher; watch_launcher(0.1); "
        "print('watching', flush=True); time.sleep(600)"
    )
    parent = f"""
import os, subprocess, sys, time
env = dict(os.environ, JDDP_LAUNCHER_PID=str(os.getpid()))
child = subprocess.Popen([sys.executable, "-c", {rank!r}], env=env, stdout=subprocess.PIPE)
print(child.pid, child.stdout.readline().decode().strip(), flush=True)
time.sleep(600)
"""
    proc = start([PY, "-c", parent], stderr=None)
    child = None
    try:
        pid, said = proc.stdout.readline().split()
        child = int(pid)
        assert said == "watching"
        proc.kill()
        proc.wait(timeout=30)
        assert pid_gone(child, timeout=10), "the rank outlived its parent"
    finally:
        proc.kill()
        proc.wait()
        if child is not None:
            kill_leftovers([child])


def test_watch_launcher_is_off_without_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JDDP_LAUNCHER_PID", raising=False)
    assert launch.watch_launcher() is None
    assert launch.child_env({}, rank=0, nproc=1, port=1)["JDDP_LAUNCHER_PID"] == str(os.getpid())


def test_rank_behind_a_forking_wrapper_dies_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    """``bash -c "cmd; ..."`` forks: PDEATHSIG ends bash, and the rank's own watch
    (``watch_launcher``, as ``python -m jddp.train`` runs it) ends the rank."""
    body = """
    from jddp.launch import watch_launcher
    watch_launcher(0.1)
    mark(f"ready{RANK}")
    time.sleep(600)
    """
    wrapped = ["bash", "-c", '"$@"; exit $?', "bash", *child_cmd(tmp_path, body)]
    launcher = start(launcher_argv("--nproc", "2", "--", *wrapped))
    try:
        wait_files(tmp_path, ["ready0", "ready1"])
        pids = read_pids(tmp_path, ["pid0", "pid1"])
        launcher.kill()
        launcher.communicate(timeout=30)
        for pid in pids:
            assert pid_gone(pid, timeout=10), f"rank pid {pid} outlived its launcher"
    finally:
        launcher.kill()
        launcher.communicate()
        kill_leftovers(read_pids(tmp_path, [p.name for p in tmp_path.glob("pid[01]")]))


def _open_for_writing_once_read(fifo: Path, timeout: float = 60) -> int:
    """The write end of ``fifo`` as soon as a process opens it for reading (one blocked in
    ``open`` counts: until then ``O_NONBLOCK`` says ENXIO)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


@pytest.mark.parametrize("flags", [[], ["--spawn"]], ids=["default", "older-spawn-flag"])
def test_a_rank_is_a_new_interpreter_with_its_id_in_its_environment(
    tmp_path: Path, flags: list[str]
) -> None:
    """Every rank is a new interpreter (as torchrun starts its workers): ``ps`` shows its
    command, and the environment it started with holds its rank (``/proc/PID/environ``, where
    tools look); ``--spawn``, which used to ask for this, is still taken. A bad config is one
    line and exit 2. The rank is caught while it opens its config, a named pipe the test then
    writes. (The launcher a new interpreter too: one the tests' CLI server forked forks its
    ranks in turn, tests/forked.py.)"""
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    rank_command = [PY, "-m", "jddp.train", "--config", str(fifo)]
    launcher = start(launcher_argv("--nproc", "1", *flags, "--", *rank_command), fresh=True)
    try:
        writer = _open_for_writing_once_read(fifo)
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text()
        (rank,) = [int(pid) for pid in children.split()]
        shown = Path(f"/proc/{rank}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        assert [word.decode() for word in shown] == rank_command
        started_with = Path(f"/proc/{rank}/environ").read_bytes().split(b"\0")
        assert b"JDDP_PROCESS_ID=0" in started_with and b"JDDP_NUM_PROCESSES=1" in started_with
        os.write(writer, b"no_such_section: 1\n")
        os.close(writer)
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
        launcher.communicate()
    assert launcher.returncode == 2, err
    assert err.splitlines() == [
        "[rank 0] jddp: error: unknown config key 'no_such_section'; see --help for every key",
        "jddp.launch: rank 0 exited with code 2; no other process is left",
    ]


def test_a_stop_signal_between_restarts_is_one_line_and_75(tmp_path: Path) -> None:
    """A SIGTERM while no rank runs (here the delay before a restart; likewise the launcher's
    own start) ends the launcher at once in one line, exit 75: it was the signal's default,
    killed without a word, or the delay slept through first."""
    crash = [PY, "-c", "import sys; sys.exit(3)"]
    flags = ["--nproc", "1", "--max-restarts", "1", "--restart-delay", "600"]
    launcher = start(launcher_argv(*flags, "--", *crash))
    seen = read_stderr_until(launcher, "jddp.launch: restart 1/1:")
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 75, seen + err
    assert err.splitlines() == ["jddp.launch: received SIGTERM with no process running; stopped"]
