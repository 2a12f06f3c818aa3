"""The GPU session kit's pieces that can go wrong on a machine nobody can test on here:
``bench_xla``'s GPU mode drops XLA flag sets the installed XLA does not know (one would abort
the trainer at start-up), and the results record a commit where the tree has no ``.git``."""

import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
sys.path.insert(0, str(EXPERIMENTS))

import bench_xla  # noqa: E402
import benchlib  # noqa: E402


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
    record.write_text("abc1234 clean\n")
    assert benchlib.checkout() == ("abc1234", [], str(benchlib.GPU_COMMIT_FILE))
    record.write_text("abc1234 dirty\n")
    commit, dirty, source = benchlib.checkout()
    assert (commit, source) == ("abc1234", str(benchlib.GPU_COMMIT_FILE)) and dirty
    info = benchlib.machine_info("x")
    assert info["git_commit"] == "abc1234" and info["git_dirty"]
