"""Every test runs JAX on the CPU, in this process and in every process it starts.

The tests simulate many devices with ``--xla_force_host_platform_device_count``, which only
adds CPU devices: on a machine whose JAX has CUDA, JAX would still pick the GPU (one device) and
multi-device tests would silently test something else. Subprocesses inherit the variable.

Four pytest-xdist workers run the suite on the CI's 2 cores (``-n 4 --dist loadfile`` in
pyproject.toml), one test file per worker at a time: most tests wait for jddp processes, a
kill's consequence, Ray or SLURM: with two workers the tests' own CPU filled 1.4 of the 2
cores on average (4db9e05), with four the machine was 1.9 busy (2026-11-27). Tests marked
``serial`` run alone: a serial test waits until the other workers' current tests end, and they
start nothing until it is done. Only tests with a bound on wall time are serial (the
launcher's promptness, input-wait fractions, a tracker's cost, a lost lock noticed in seconds):
tests that start several jddp processes or kill them wait for the run's own progress, not for a
moment on the clock, so they share the machine (on 2 cores a 2-process run beside another file's
compile once timed out in gloo's 30 s set-up, 2026-11-24; jddp now meets a step's devices while
it builds the mesh, tests/test_multiprocess.py). (Not ``--dist loadgroup``: with pytest 9.2 and
xdist 3.8.0 it ignored the groups.)
"""

import contextlib
import fcntl
import json
import os
import resource
import subprocess
import time
from importlib.metadata import version
from pathlib import Path

import pytest

os.environ["JAX_PLATFORMS"] = "cpu"
# A clean CI machine compiles ~110 distinct train and eval steps (its compilation cache is
# empty). LLVM at -O1 compiled them about twice as fast as XLA's -O2 (the tiny test config's
# step: 39 s -> 19 s on the 2-core VM), and -O0 faster still: the tiny 4-device run on an empty
# cache 10.2 -> 6.5 CPU-s, the whole cold suite's counted CPU 1,345 -> 1,209 s (15 min 0 s ->
# 13 min 13 s, 2026-11-27; an earlier trial on a warm cache had seen 0.96x). The tests' tiny
# models run about as fast; the few runs whose steps, not their compiles, take the CPU ask for
# -O1 (tests/helpers.py ``optimized_xla``: an example trained to its documented accuracy, the
# LARS convergence test; with them 1,029 s, 11 min 12 s cold). Training programs are the
# same XLA graphs, the same losses; jddp's own default (XLA's -O2) is untouched outside the tests.
# XLA:CPU's older loop-fusion emitters (``--xla_cpu_use_fusion_emitters=false``) compile a
# program in about half the time of the MLIR fusion emitters jaxlib 0.10 uses by default (the
# tiny test config's train and eval steps: XLA ~7.6 -> ~3.8 CPU-s, the tiny run's steps as fast;
# 2026-11-27, the 2-core VM) -- on a CI machine's empty cache the suite's compiles were 40% of
# its CPU. Only on the pinned jaxlib 0.10, where it was measured: XLA aborts on a flag it does
# not know, and a later jaxlib may drop this one.
# And one LLVM module per program instead of XLA:CPU's parallel codegen split: on 2 busy cores
# the split's threads only add work (the tiny run on an empty cache 6.07 -> 5.50 CPU-s, mean of
# 5 pairs, -O0, 2026-11-27). Tried and left out: XLA:CPU without its Eigen pool
# (``--xla_cpu_multi_thread_eigen=false``) saved a third of the tiny 2x2 run's CPU alone, but
# the suite took 8% more CPU with it: the larger example models lost their second thread.
# JDDP_TEST_AS_USERS_RUN=1 (CI's users lane, .ci/run users): none of these settings, and
# every command a new interpreter (tests/helpers.py): the tests as users run jddp.
AS_USERS_RUN = os.environ.get("JDDP_TEST_AS_USERS_RUN") == "1"
_TEST_XLA_FLAGS = {} if AS_USERS_RUN else {"xla_backend_optimization_level": "0"}
if version("jaxlib").startswith("0.10.") and not AS_USERS_RUN:  # read without importing JAX
    _TEST_XLA_FLAGS["xla_cpu_use_fusion_emitters"] = "false"
    _TEST_XLA_FLAGS["xla_cpu_parallel_codegen_split_count"] = "1"
for _flag, _value in _TEST_XLA_FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}={_value}".strip()
# NumPy's OpenBLAS with one thread in every process of the suite: its other threads spin for a
# while after each BLAS call (the synthetic data's labels, the resize's einsum), on CI's 2
# busy cores: the tiny 2-device run 3.95 -> 3.82 and 4.06 -> 3.85 CPU-s (5 and 6 alternating
# pairs, 2026-11-28, the 2-core VM). The steps are XLA's, which does not use OpenBLAS.
if not AS_USERS_RUN:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Every program into the compilation cache, not only those compiling in 0.5 s or more
# (jddp/proc/xla.py): on an empty cache the suite's processes compiled ~3,700 small programs
# (a model's initialisation, eager ops), ~1,400 of them distinct -- ~60 CPU-s, two thirds of it
# compiling again what another process had compiled (2026-11-28, the 2-core VM).
if not AS_USERS_RUN:
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The workers' in-process tests trace as jddp's processes do, and their heaps grow over a
# session: the same collector settings (jddp/compat/collector.py).
from jddp.compat.collector import collect_less_often  # noqa: E402 - after the environment above

collect_less_often()


@pytest.fixture(scope="session", autouse=True)
def compilation_cache():
    """jddp's persistent compilation cache (``train.compilation_cache_dir``'s default) in this
    process from the first test on, as every ``python -m jddp.train`` the tests start uses it:
    a rerun of the suite loads the programs its tests compile in-process (a ResNet's train
    step: ~15 s of CPU on the 2-core VM) instead of compiling them again. (An in-process
    ``fit`` or ``evaluate`` turns it on for the rest of the process anyway: this way every
    test sees the same, whatever ran before it.)"""
    from jddp.config import load
    from jddp.proc.xla import enable_compilation_cache

    enable_compilation_cache(load(None).train.compilation_cache_dir)


class _Exclusive:
    """A readers-writer lock between the xdist workers over two lock files: each test holds
    ``rw`` shared, a serial test exclusively; ``gate`` keeps a waiting serial test from being
    overtaken by tests the other workers start meanwhile."""

    def __init__(self, run_id: str):
        base = Path(os.environ.get("TMPDIR", "/tmp")) / f"jddp-pytest-{run_id}"
        self.gate = open(f"{base}.gate", "a+")  # noqa: SIM115 - held for the session
        self.rw = open(f"{base}.rw", "a+")  # noqa: SIM115
        self.exclusive = False  # held for a serial test (kept across consecutive ones)

    def hold(self, serial: bool):
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        fcntl.flock(self.rw, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
        if not serial:
            fcntl.flock(self.gate, fcntl.LOCK_UN)
        self.exclusive = serial

    def release(self):
        fcntl.flock(self.rw, fcntl.LOCK_UN)
        fcntl.flock(self.gate, fcntl.LOCK_UN)  # a no-op unless serial
        self.exclusive = False

    def close(self):
        self.gate.close()
        self.rw.close()


_LOCK = None


def _serial(item) -> bool:
    return item is not None and item.get_closest_marker("serial") is not None


# The files whose tests take longest (wall and CPU seconds of their tests with four workers on
# the 2-core VM, an empty compilation cache, 2026-11-29, JDDP_TEST_USAGE), in the order the
# workers are to take them: the longest first, so that the suite does not end on one worker's
# long file while the others idle, and the files that mostly wait (a stall timeout, SLURM's
# requeue, Ray; their daemons' and tasks' CPU is not counted) between those that compute, so
# their waits overlap the others' work. (On 2026-11-29 three of the four workers waited in
# test_watchdog, test_slurm and test_ray for the suite's first ~5 minutes: the machine ~1.3
# cores busy; with test_watchdog last, 2026-11-27, its 150 s of timeouts ended the suite on one
# worker.) A hint only: a file not named here comes after them, in collection order.
LONGEST_FIRST = (
    "test_shard_update.py",  # 794 s wall, 328 s CPU
    "test_watchdog.py",  # 272 s, 89 s: timeouts
    "test_fault_tolerance.py",  # 321 s, 254 s
    "test_slurm.py",  # 307 s, 15 s: waits
    "test_api.py",  # 382 s, 150 s
    "test_ray.py",  # 286 s, 76 s: waits
    "test_examples_tasks.py",  # 351 s, 155 s
    "test_mpi.py",  # 275 s, 235 s
    "test_multiprocess.py",  # 275 s, 112 s
    "test_bad_input.py",  # 249 s, 80 s
    "test_export.py",  # 231 s, 58 s
    "test_step.py",  # 230 s, 62 s
    "test_shard_formats.py",  # 225 s, 95 s
    "test_models.py",  # 209 s, 81 s
    "test_optimizer.py",  # 204 s, 79 s
    "test_train_cli.py",  # 166 s, 46 s
    "test_recipes.py",  # 127 s, 51 s
    "test_best_checkpoints.py",  # 122 s, 62 s
    "test_pack.py",  # 84 s, 66 s
    "test_tasks.py",  # 107 s, 68 s (last, two 10 CPU-s tests ended a suite on one worker)
)


def pytest_collection_modifyitems(config, items):
    """The files with serial tests first, and in each of them its serial tests first: while
    they run, a serial test waits at most for a serial file's test, not for a minute-long
    compile or SLURM's requeue in another file; then :data:`LONGEST_FIRST`, then the rest.
    (With test_trust's serial tests in the file's middle, at ~130 s, the first waited ~43 s
    for test_slurm's requeue while the gate kept the two other workers from starting
    anything: three idle workers, in every suite of 2026-11-27.) pyproject.toml turns off
    xdist's own reordering (``--no-loadscope-reorder``: files with more tests first), which
    had put the serial files in the middle and SLURM's requeue wait at the very end (a560981:
    one worker idle for 134 s during test_watchdog's serial tests, and 141 s of SLURM ended
    the suite). xdist's ``--dist loadfile`` keeps each file's tests together on one worker,
    files in the order of their first test."""
    files_with_serial = {item.path for item in items if _serial(item)}
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def order(item):
        if item.path in files_with_serial:
            return (0, 0 if _serial(item) else 1)
        return (1, rank.get(item.path.name, len(rank)))

    items.sort(key=order)  # stable: each file's tests keep their order, serial ones first


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Set-up, call and tear-down of a serial test (its module fixtures included) run alone.

    A worker keeps the machine from one serial test to the next it runs (a serial file's
    tests): released in between, each would wait again for the other workers' current tests
    (up to minutes) while this worker idles."""
    global _LOCK
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:  # one process: nothing runs beside anything
        with _usage(item):
            return (yield)
    if _LOCK is None:
        _LOCK = _Exclusive(run_id)
    if not _LOCK.exclusive:
        _LOCK.hold(_serial(item))
    try:
        with _usage(item):
            return (yield)
    finally:
        if not (_serial(item) and _serial(nextitem)):
            _LOCK.release()


def pytest_sessionfinish(session, exitstatus):
    """A worker's lock files, held open for its session, closed at its end (else Python warns
    of two unclosed files as the worker exits)."""
    if _LOCK is not None:
        _LOCK.close()


@contextlib.contextmanager
def _usage(item):
    """With ``JDDP_TEST_USAGE=FILE``: one JSON line per test appended to FILE, its wall time
    and the CPU seconds of this process and of the processes it waited for (jddp runs, their
    ranks, the commands its CLI server forked; not Ray's or SLURM's daemons), set-up and
    tear-down included: what the suite's time goes to (CONTRIBUTING.md)."""
    path = os.environ.get("JDDP_TEST_USAGE")
    if not path:
        yield
        return
    from tests import helpers  # its CLI server's children are not this process's

    start, own, children = (time.time(), resource.getrusage(resource.RUSAGE_SELF),
                            resource.getrusage(resource.RUSAGE_CHILDREN))  # fmt: skip
    forked = helpers.forked_cpu_s
    try:
        yield
    finally:

        def cpu(now, before):
            return now.ru_utime + now.ru_stime - before.ru_utime - before.ru_stime

        row = {
            "test": item.nodeid,
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "-"),
            "serial": _serial(item),
            "start": round(start, 2),
            "wall_s": round(time.time() - start, 2),
            "cpu_s": round(cpu(resource.getrusage(resource.RUSAGE_SELF), own), 2),
            "children_cpu_s": round(
                cpu(resource.getrusage(resource.RUSAGE_CHILDREN), children)
                + helpers.forked_cpu_s
                - forked,
                2,
            ),
        }
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="session")
def two_by_two(tmp_path_factory):
    """The one 2 processes x 2 devices run that several modules compare with (2-process runs
    are the slowest thing CI does on 2 cores: share them): ``python -m jddp.launch --nproc 2
    --devices-per-proc 2`` of ``TINY_SYNC`` plus ``TWO_BY_TWO`` (and a trace of step 2),
    uninterrupted; its workdir
    (checkpoints 4, 8, ..., 20) and completed process. Made once per test session: under
    xdist the first worker to need it runs it, the other reads it (a lock file beside both
    workers' temporary folders)."""
    from tests.helpers import TWO_BY_TWO, failure_text, launch_cmd, run

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # common to the workers of this session
    wd, saved = shared / "two_by_two" / "run", shared / "two_by_two" / "out.json"
    with open(shared / "two_by_two.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not saved.exists():
            saved.parent.mkdir(exist_ok=True)
            out = run(launch_cmd(2, 2, wd, *TWO_BY_TWO, "log.profile_steps=2:3"))
            saved.write_text(json.dumps([out.args, out.returncode, out.stdout, out.stderr]))
    out = subprocess.CompletedProcess(*json.loads(saved.read_text()))
    assert out.returncode == 0, failure_text(out.stderr)
    return wd, out
