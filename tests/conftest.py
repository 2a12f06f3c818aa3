"""Every test runs JAX on the CPU, in this process and in every process it starts.

The tests simulate many devices with ``--xla_force_host_platform_device_count``, which only
adds CPU devices: on a machine whose JAX has CUDA, JAX would still pick the GPU (one device) and
multi-device tests would silently test something else. Subprocesses inherit the variable.
"""

import os

import pytest

os.environ["JAX_PLATFORMS"] = "cpu"


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
