"""Every test runs JAX on the CPU, in this process and in every process it starts.

The tests simulate many devices with ``--xla_force_host_platform_device_count``, which only
adds CPU devices: on a machine whose JAX has CUDA, JAX would still pick the GPU (one device) and
multi-device tests would silently test something else. Subprocesses inherit the variable.

Two pytest-xdist workers run the suite (``-n 2`` in pyproject.toml), one test file per worker
at a time (the two files that share the ``two_by_two`` run go to one worker). Tests marked
``serial`` (several jddp processes, kills, timing) run alone: a serial test waits until the
other worker's current test ends, and the other worker starts nothing until it is done. On 2
cores a multi-process test beside another file's compile timed out in gloo's 30 s set-up
(2026-11-24), so those never share the machine.
"""

import fcntl
import os
from pathlib import Path

import pytest

os.environ["JAX_PLATFORMS"] = "cpu"

SHARED_RUN_FILES = {"test_fault_tolerance.py", "test_multiprocess.py"}  # use ``two_by_two``


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """One xdist group per test file (its module fixtures run once), the shared-run files in
    one group (the session fixture runs once)."""
    for item in items:
        name = Path(str(item.fspath)).name
        item.add_marker(pytest.mark.xdist_group("two_by_two" if name in SHARED_RUN_FILES else name))


class _Exclusive:
    """A readers-writer lock between the xdist workers over two lock files: each test holds
    ``rw`` shared, a serial test exclusively; ``gate`` keeps a waiting serial test from being
    overtaken by tests the other worker starts meanwhile."""

    def __init__(self, run_id: str):
        base = Path(os.environ.get("TMPDIR", "/tmp")) / f"jddp-pytest-{run_id}"
        self.gate = open(f"{base}.gate", "a+")  # noqa: SIM115 - held for the session
        self.rw = open(f"{base}.rw", "a+")  # noqa: SIM115

    def hold(self, serial: bool):
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        fcntl.flock(self.rw, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
        if not serial:
            fcntl.flock(self.gate, fcntl.LOCK_UN)

    def release(self):
        fcntl.flock(self.rw, fcntl.LOCK_UN)
        fcntl.flock(self.gate, fcntl.LOCK_UN)  # a no-op unless serial


_LOCK = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Set-up, call and tear-down of a serial test (its module fixtures included) run alone."""
    global _LOCK
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:  # one process: nothing runs beside anything
        return (yield)
    if _LOCK is None:
        _LOCK = _Exclusive(run_id)
    _LOCK.hold(item.get_closest_marker("serial") is not None)
    try:
        return (yield)
    finally:
        _LOCK.release()


@pytest.fixture(scope="session")
def two_by_two(tmp_path_factory):
    """The one 2 processes x 2 devices run that several modules compare with (2-process runs
    are the slowest thing CI does on 2 cores: share them): ``python -m jddp.launch --nproc 2
    --devices-per-proc 2`` of ``TINY_SYNC`` plus ``TWO_BY_TWO``, uninterrupted; its workdir
    (checkpoints 4, 8, ..., 20) and completed process."""
    from tests.helpers import TWO_BY_TWO, launch_cmd, run

    wd = tmp_path_factory.mktemp("two_by_two") / "run"
    out = run(launch_cmd(2, 2, wd, *TWO_BY_TWO))
    assert out.returncode == 0, out.stderr[-3000:]
    return wd, out
