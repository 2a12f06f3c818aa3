"""Every test runs JAX on the CPU, in this process and in every process it starts.

The tests simulate many devices with ``--xla_force_host_platform_device_count``, which only
adds CPU devices: on a machine whose JAX has CUDA, JAX would still pick the GPU (one device) and
multi-device tests would silently test something else. Subprocesses inherit the variable.
"""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
