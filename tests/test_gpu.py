"""On a machine whose JAX has a GPU plugin: the trainer runs on the GPU end to end. Skipped
cleanly elsewhere (CI has no GPU); the rest of the suite forces the CPU (tests/conftest.py)."""

import importlib.util
import os

import pytest

from tests.helpers import TINY, read_metrics, run_python, with_overrides

GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm70_plugin")
HAS_GPU_PLUGIN = any(importlib.util.find_spec(p) for p in GPU_PLUGINS)

pytestmark = pytest.mark.skipif(not HAS_GPU_PLUGIN, reason="no JAX GPU plugin installed")


def gpu_env():
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


def test_trains_on_the_gpu_in_bfloat16(tmp_path):
    probe = run_python("-c", "import jax; print(jax.default_backend())", env=gpu_env())
    if probe.stdout.strip() not in ("gpu", "cuda", "rocm"):
        pytest.skip(f"a GPU plugin is installed but JAX sees no GPU ({probe.stdout.strip()})")
    wd = tmp_path / "run"
    args = with_overrides(TINY, "train.steps=4", "train.precision=bfloat16")
    out = run_python("-m", "jddp.train", f"workdir={wd}", *args, env=gpu_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done step=4" in out.stdout
    losses = [r["train/loss"] for r in read_metrics(wd) if "train/loss" in r]
    assert len(losses) == 4 and all(x > 0 for x in losses)
