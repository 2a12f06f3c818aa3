"""``experiments/bench.py --quick``: the benchmark runs end to end and writes valid JSON; the
tables of ``experiments/RESULTS.md`` are regenerated from results files.

Benchmarks are not timed unit tests: nothing here checks a speed, only that the pipeline works
and the file holds what a reader of the results looks up. Runs without torch (CI has none).
The RESULTS.md tests work on temporary copies: the real file is never written.
"""

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "experiments" / "bench.py"
PACKAGE = REPO / "experiments" / "throughput"  # what bench.py runs
REAL_RESULTS_MD = REPO / "experiments" / "RESULTS.md"
PACKAGE_NAME = "jddp_experiments_bench"


def _load_bench(module: str):
    """One module of the bench package (stdlib imports only), the package loaded from its path
    without putting experiments/ on sys.path."""
    if PACKAGE_NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            PACKAGE_NAME, PACKAGE / "__init__.py", submodule_search_locations=[str(PACKAGE)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = package  # its modules import each other relatively
        spec.loader.exec_module(package)
    return importlib.import_module(f"{PACKAGE_NAME}.{module}")


@pytest.fixture(scope="module")
def quick_json(tmp_path_factory):
    """One ``--quick`` run for every test of this module; the real RESULTS.md stays as it was."""
    out = tmp_path_factory.mktemp("bench") / "q.json"
    before = REAL_RESULTS_MD.read_bytes()
    cmd = [sys.executable, str(BENCH), "--quick", "--out", str(out), "--no-plot"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert REAL_RESULTS_MD.read_bytes() == before, "--quick must not touch RESULTS.md"
    return out


@pytest.mark.slow
def test_bench_quick_writes_json(quick_json):
    result = json.loads(quick_json.read_text())
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
    assert jddp["xla_flops_per_step"] > 0  # XLA's count, kept beside the analytic one
    assert jddp["img_per_s"] == pytest.approx(8 / jddp["median_step_s"])


@pytest.mark.slow
def test_results_md_tables_regenerated(quick_json, tmp_path, monkeypatch, capsys):
    md_mod, tables, cli = _load_bench("results_md"), _load_bench("tables"), _load_bench("cli")
    real_md = REAL_RESULTS_MD.read_bytes()
    quick = json.loads(quick_json.read_text())

    # A results folder as bench.py leaves it: one timed run (the quick run, relabelled), the quick
    # file itself, a --profile run, and other scripts' files, all but the first to be left out.
    results = tmp_path / "results"
    results.mkdir()
    timed = copy.deepcopy(quick)
    timed["method"]["quick"] = False
    timed["date_utc"] = "2026-01-02T00:00:00+00:00"  # tables are ordered by this date
    (results / "2026-01-02-box.json").write_text(json.dumps(timed))
    (results / "2026-01-02-box-quick.json").write_text(json.dumps(quick))
    profile = copy.deepcopy(timed)
    profile["method"]["profile"] = True
    for r in profile["records"]:
        for key in ("median_step_s", "p10_step_s", "p90_step_s", "img_per_s", "timed_steps"):
            r.pop(key, None)
    (results / "2026-01-02-box-profile.json").write_text(json.dumps(profile))
    (results / "2026-01-01-box-other.json").write_text(json.dumps({"benchmark": "overhead"}))
    (results / "allreduce-2026-01-02-box.json").write_text(json.dumps({"records": []}))

    # No markers yet: the block goes into the throughput section, before its first subsection.
    head = f"# Results\n\n## All-reduce\n\nText A.\n\n{md_mod.RESULTS_MD_SECTION}\n"
    middle = "\nHand-written notes.\n"
    tail = "\n### Extra runs\n\nMore notes.\n\n## Scaling model\n\nText B.\n"
    md = tmp_path / "RESULTS.md"
    md.write_text(head + middle + tail)
    assert md_mod.regenerate_results_md(results, md) is True
    text = md.read_text()
    begin, end = md_mod.RESULTS_MD_BEGIN, md_mod.RESULTS_MD_END
    assert text.count(begin) == 1 and text.count(end) == 1
    before, rest = text.split(begin)
    block, after = rest.split(end)
    assert before.rstrip() == (head + middle).rstrip()
    assert after.strip() == tail.strip()

    # One table, for the timed file only, its cells formatted as print_table formats them.
    assert block.count("#### ") == 1 and "#### `results/2026-01-02-box.json`" in block
    assert f"`{quick['command']}`" in block and quick["machine"]["git_commit"] in block
    rows = tables.markdown_table(timed["records"])
    assert rows[0].startswith("| config | dtype |") and len(rows) == 2 + len(timed["records"])
    for row, r in zip(rows[2:], timed["records"], strict=True):
        assert row in block
        cells = tables.record_cells(r)
        assert row.startswith(f"| {r['config']} | float32 | 1 | {cells['step']} |")
        assert f"| {r['img_per_s']:.1f} |" in row

    # Idempotent: the same inputs give the same file, and it is not rewritten.
    mtime = md.stat().st_mtime_ns
    assert md_mod.regenerate_results_md(results, md) is False
    assert md.read_text() == text and md.stat().st_mtime_ns == mtime

    # Text edited outside the markers survives; a new results file replaces the block's content.
    md.write_text(text.replace("Hand-written notes.", "Edited notes."))
    second = copy.deepcopy(timed)
    second["date_utc"] = "2026-01-03T00:00:00+00:00"
    (results / "2026-01-03-box.json").write_text(json.dumps(second))
    assert md_mod.regenerate_results_md(results, md) is True
    text2 = md.read_text()
    assert "Edited notes." in text2 and text2.endswith(tail.lstrip("\n"))
    block2 = text2.split(begin)[1].split(end)[0]
    assert block2.index("2026-01-02-box.json") < block2.index("2026-01-03-box.json")

    # The command line: --regenerate-results-md and --recompute regenerate, --no-results-md skips.
    common = _load_bench("common")
    monkeypatch.setattr(common, "RESULTS_DIR", results)
    monkeypatch.setattr(common, "RESULTS_MD", md)
    (results / "2026-01-03-box.json").unlink()
    timed_path = str(results / "2026-01-02-box.json")
    assert cli.main(["--no-results-md", "--no-plot", "--recompute", timed_path]) == 0
    assert md.read_text() == text2
    assert cli.main(["--regenerate-results-md"]) == 0
    assert md.read_text() == text.replace("Hand-written notes.", "Edited notes.")
    md.write_text(text2)
    assert cli.main(["--no-plot", "--recompute", timed_path]) == 0
    assert "2026-01-03-box.json" not in md.read_text()
    capsys.readouterr()

    # Broken markers: refuse rather than guess.
    md.write_text(head + begin + "\n" + tail)
    with pytest.raises(ValueError, match="markers"):
        md_mod.regenerate_results_md(results, md)
    assert REAL_RESULTS_MD.read_bytes() == real_md


def test_mpi_config_and_rank0_relay(monkeypatch, capsys):
    """``jddp-mpi-PxD`` parses to the MPI backend, and rank 0's command relay and reply gather
    work on a stand-in for mpi4py's communicator (no MPI run here: CI time is tight)."""
    import io

    specs, protocol = _load_bench("specs"), _load_bench("protocol")
    spec = specs.parse_config("jddp-mpi-2x1-pin", specs.Workload())
    assert (spec.backend, spec.mpi, spec.nproc, spec.per_proc) == ("mpi", True, 2, 1)
    assert spec.has("pin")
    assert not specs.parse_config("jddp-2x1", specs.Workload()).mpi
    assert not specs.parse_config("torch-ddp-2x1", specs.Workload()).mpi
    with pytest.raises(ValueError, match="jddp-mpi-PxD"):
        specs.parse_config("jddp-mpi-2", specs.Workload())

    class World:  # rank 0 of 2: send records what rank 1 gets, gather adds rank 1's message
        relayed: list = []

        def Get_rank(self):
            return 0

        def Get_size(self):
            return 2

        def send(self, obj, dest, tag):
            assert dest == 1
            self.relayed.append(obj)

        def gather(self, obj, root):
            return [obj, {**obj, "rank1": True}]

    monkeypatch.setattr(sys, "stdin", io.StringIO("run 2\n\nquit\nrun 1\n"))
    steps = iter([(0.5, 2.0), (0.25, 1.5)])
    protocol.serve(lambda: next(steps), None, lambda: {"extra": 1}, World())
    assert World.relayed == [["run", "2"], [], ["quit"]]  # stops at quit, blank lines relayed
    msgs = [json.loads(x[len(protocol.TAG) :]) for x in capsys.readouterr().out.splitlines()]
    assert msgs[0] == {"step_s": [0.5, 0.25], "loss": [2.0, 1.5]}
    assert msgs[1] == {**msgs[0], "rank1": True}
    assert msgs[2]["extra"] == 1 and msgs[3]["rank1"] and len(msgs) == 4

    # The driver gone (stdin closed): every rank is told to stop (None relayed).
    World.relayed = []
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    protocol.serve(None, None, None, World())
    assert World.relayed == [None]


def test_gpu_settings_flops_and_both_torch_ratios():
    """The GPU path, checked without a GPU (and without torch or jax): jddp workers do not
    preallocate the GPU, the peer there is torchvision's model with channels_last and
    cudnn.benchmark (``-compile``: torch.compile) while the CPU peer is unchanged, MFU comes from
    the analytic FLOP count with XLA's beside it, and jddp is compared with both PyTorch rows."""
    import argparse
    import os

    specs, runner = _load_bench("specs"), _load_bench("runner")
    torch_worker, results = _load_bench("torch_worker"), _load_bench("results")
    gpu = specs.Workload(
        model="resnet50",
        stem="imagenet",
        num_classes=1000,
        image_size=224,
        global_batch=256,
        dtype="bfloat16",
        platform="gpu",
    )
    no_profile = argparse.Namespace(profile=False)

    env = runner.worker_env(specs.parse_config("jddp-1x1", gpu), 0, 0, no_profile, "")
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" and env["JAX_PLATFORMS"] == "cuda"
    cpu_env = runner.worker_env(
        specs.parse_config("jddp-1x1", specs.Workload()), 0, 0, no_profile, ""
    )
    key = "XLA_PYTHON_CLIENT_PREALLOCATE"
    assert cpu_env.get(key) == os.environ.get(key)  # CPU: left as it is
    kept = {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".4"}
    runner.gpu_memory_env(kept)  # a user's own setting wins
    assert kept == {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".4"}

    with pytest.raises(ValueError, match="torch-ddp configs only"):
        specs.parse_config("jddp-1x1-compile", gpu)
    compiled = specs.parse_config("torch-ddp-1x1-compile", gpu)
    opts = torch_worker.peer_options({"work": vars(gpu), "threads": 1, "variant": compiled.variant})
    assert (opts["impl"], opts["channels_last"], opts["cudnn_benchmark"]) == (
        "torchvision",
        True,
        True,
    )
    assert opts["compile"] and opts["device"] == "cuda" and opts["dtype"] == "bfloat16"
    cpu_opts = torch_worker.peer_options({"work": vars(specs.Workload()), "threads": 2})
    assert (cpu_opts["impl"], cpu_opts["channels_last"], cpu_opts["compile"]) == (
        "own",
        False,
        False,
    )

    def rec(config, framework, procs, median, variant=None, xla=None):
        return {
            "config": config,
            "framework": framework,
            "dtype": "bfloat16",
            "processes": procs,
            "devices_per_process": 1,
            "variant": variant,
            "global_batch": 256,
            "median_step_s": median,
            "img_per_s": 256 / median,
            "xla_flops_per_step": xla,
        }

    records = [
        rec("jddp-1x1", "jddp", 1, 0.0466, xla=102.9e9),
        rec("torch-ddp-1x1", "torch", 1, 0.0643),
        rec("torch-ddp-1x1-compile", "torch", 1, 0.0451, variant="compile"),
    ]
    results.derive(records, {"bfloat16": 989e12}, {**vars(gpu)})
    jddp = records[0]
    assert jddp["model_flops_per_step"] / 1e12 == pytest.approx(6.28, rel=0.01)
    assert jddp["mfu"] == pytest.approx(6.28e12 / 0.0466 / 989e12, rel=0.01)  # ~13.6%
    assert jddp["xla_mfu"] == pytest.approx(102.9e9 / 0.0466 / 989e12)  # XLA's: ~0.2%
    assert jddp["ratio_vs"] == "torch-ddp-1x1"
    assert jddp["ratio_img_per_s"] == pytest.approx(0.0643 / 0.0466)  # 1.38x eager
    assert jddp["ratio_vs_compiled"] == "torch-ddp-1x1-compile"
    assert jddp["ratio_img_per_s_compiled"] == pytest.approx(0.0451 / 0.0466)  # 0.97x
    cells = _load_bench("tables").record_cells(
        {
            **jddp,
            "timed_steps": 1,
            "p10_step_s": 0.0466,
            "p90_step_s": 0.0466,
            "compile_s": 1.0,
            "first_step_s": 1.0,
            "maxrss_mib_per_process": [1000.0],
        }
    )
    assert cells["mfu"] == "13.6%" and cells["xla_mfu"] == "0.2%" and cells["ratio_c"] == "0.97"
