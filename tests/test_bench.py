"""The benchmark kit of ``experiments/``: ``bench.py --quick`` runs the trainer end to end and
writes what a reader looks up, the FLOP count read from ``jddp.models`` matches published
figures, and the GPU kit's pieces that nobody can run here behave.

Benchmarks are not timed unit tests: nothing here checks a speed. Runs without torch (CI has
none: the PyTorch peer is skipped by ``--quick``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
sys.path.insert(0, str(EXPERIMENTS))

import bench  # noqa: E402
import bench_xla  # noqa: E402
import benchlib  # noqa: E402


@pytest.mark.slow
def test_bench_quick_measures_through_the_trainer(tmp_path):
    out = tmp_path / "q.json"
    cmd = [sys.executable, str(EXPERIMENTS / "bench.py"), "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["method"]["quick"] is True and "--quick" in result["command"]
    for key in ("name", "cpu_model", "cpu_count", "versions", "git_commit"):
        assert key in result["machine"], key
    jddp = next(r for r in result["records"] if r["name"] == "jddp-1x1")
    assert jddp["timed_steps"] == 1 and jddp["global_batch"] == 8
    assert jddp["img_per_s"] == pytest.approx(8 / jddp["median_step_s"])
    assert jddp["first_step_s"] > 0 and jddp["model_flops_per_step"] > 0
    assert "jddp.train" in " ".join(jddp["runs"][0]["command"])  # the trainer measured itself
    assert "| jddp-1x1 | float32 | 1 |" in proc.stdout  # the printed table


@pytest.mark.parametrize(
    "model, stem, classes, size, published_gmac, params",
    [
        # torchvision's model table (its "GFLOPS" are multiply-accumulates), 224x224
        ("resnet50", "imagenet", 1000, 224, 4.09, 25_557_032),
        ("resnet18", "imagenet", 1000, 224, 1.81, 11_689_512),
        # the CIFAR stem at 32x32: 0.56 GMAC (kuangliu/pytorch-cifar's ResNet18, thop, fvcore)
        ("resnet18", "cifar", 10, 32, 0.56, 11_173_962),
    ],
)
def test_model_figures_match_published(model, stem, classes, size, published_gmac, params):
    figures = benchlib.model_figures(model, stem, 64, classes, size)
    assert figures["forward_macs"] / 1e9 == pytest.approx(published_gmac, rel=0.02)
    assert figures["params"] == params
    if model == "resnet50":  # issue 12's 6.3 TFLOP for a batch-256 training step
        assert benchlib.train_step_flops(figures, 256) / 1e12 == pytest.approx(6.3, rel=0.01)


def test_configs_and_ratios():
    spec = bench.parse_config("jddp-mpi-2x1-pin-xladefaults", "cpu")
    assert (spec["backend"], spec["nproc"], spec["variants"]) == ("mpi", 2, ["pin", "xladefaults"])
    env = bench.jddp_env(bench.parse_config("jddp-1x1-noynnconv-xladefaults", "cpu"), "cpu")
    assert bench.XLA_FLAGS["noynnconv"] in env["XLA_FLAGS"] and env["JDDP_XLA_DEFAULTS"] == "0"
    for bad in ("jddp-2", "torch-ddp-1x1-noynnconv", "jddp-1x1-compile"):
        with pytest.raises(ValueError):
            bench.parse_config(bad, "cpu")
    with pytest.raises(ValueError, match="one GPU"):
        bench.parse_config("torch-ddp-1x2", "gpu")
    spec = bench.parse_config("jddp-srun-2x1", "cpu")
    assert (spec["backend"], spec["launcher"], spec["nproc"]) == ("xla", "srun", 2)
    with pytest.raises(ValueError, match="one device per task"):
        bench.parse_config("jddp-srun-2x2", "cpu")
    assert benchlib.trainer_command(Path("w"), [], 2, launcher="srun")[:5] == [
        "srun", "-N1", "-n", "2", f"--cpus-per-task={max(1, len(os.sched_getaffinity(0)) // 2)}"
    ]  # fmt: skip

    def rec(name, step_s):
        return {**bench.parse_config(name, "cpu"), "dtype": "float32", "img_per_s": 256 / step_s}

    records = [rec("jddp-1x1", 0.0466), rec("torch-ddp-1x1", 0.0643)]
    records.append(rec("torch-ddp-1x1-compile", 0.0451))
    bench.add_ratios(records, "gpu")
    assert records[0]["ratio_vs"] == "torch-ddp-1x1"
    assert records[0]["ratio_img_per_s"] == pytest.approx(0.0643 / 0.0466)
    assert records[0]["ratio_img_per_s_compiled"] == pytest.approx(0.0451 / 0.0466)


def test_unknown_xla_flags_are_skipped_not_fatal():
    sets = [("defaults", ""), ("bogus", "--xla_gpu_jddp_no_such_flag=1")]
    keep, skipped = bench_xla.usable_flag_sets(sets, "cpu")
    assert keep == [("defaults", "")]  # no flags: kept without a probe
    assert [s["config"] for s in skipped] == ["bogus"] and skipped[0]["why"]


def test_commit_read_from_gpu_commit_without_git(tmp_path, monkeypatch):
    monkeypatch.setattr(benchlib, "REPO", tmp_path)  # not a git checkout
    assert benchlib.checkout() == (None, [], None)
    record = tmp_path / benchlib.GPU_COMMIT_FILE
    record.parent.mkdir()
    record.write_text("abc1234 dirty\n")
    commit, dirty, source = benchlib.checkout()
    assert (commit, source) == ("abc1234", str(benchlib.GPU_COMMIT_FILE)) and dirty
    assert benchlib.machine_info("x")["git_commit"] == "abc1234"
