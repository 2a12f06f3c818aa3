"""``experiments/bench.py --quick``: the benchmark runs end to end and writes valid JSON.

Benchmarks are not timed unit tests: nothing here checks a speed, only that the pipeline works
and the file holds what a reader of the results looks up. Runs without torch (CI has none).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_quick_writes_json(tmp_path):
    out = tmp_path / "q.json"
    cmd = [sys.executable, "experiments/bench.py", "--quick", "--out", str(out), "--no-plot"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    result = json.loads(out.read_text())
    assert result["benchmark"] == "train-throughput"
    assert result["method"]["quick"] is True
    assert result["failures"] == []
    assert result["date_utc"] and "--quick" in result["command"]
    machine = result["machine"]
    for key in ("name", "cpu_model", "cpu_count", "python", "versions", "git_commit"):
        assert key in machine, key
    assert machine["versions"]["jax"]

    records = {r["config"]: r for r in result["records"]}
    assert "jddp-1x1" in records
    for name, r in records.items():
        assert r["dtype"] == "float32", name
        assert r["global_batch"] == 8, name
        assert r["img_per_s"] > 0, name
        assert r["median_step_s"] > 0, name
        assert r["p10_step_s"] <= r["median_step_s"] <= r["p90_step_s"], name
        assert "compile_s" in r and r["first_step_s"] > 0, name
    jddp = records["jddp-1x1"]
    assert jddp["compile_s"] > 0
    assert jddp["model_flops_per_step"] > 0
    assert jddp["img_per_s"] == pytest.approx(8 / jddp["median_step_s"])
