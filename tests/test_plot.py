"""``python -m jddp.plot``: PNGs per metric, runs overlaid, skipped plots, exit codes."""

import json

import pytest

from tests.helpers import run_python

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_PLOTS = {"loss.png", "accuracy.png", "lr.png", "throughput.png"}


@pytest.fixture
def plot():
    """``jddp.plot``, imported by the tests that call it (matplotlib: not at collection)."""
    from jddp import plot

    return plot


def write_run(path, with_lr=True, junk=False):
    """A fake run folder with compile, train and eval lines (and malformed ones if ``junk``)."""
    path.mkdir(parents=True)
    lines = [json.dumps({"step": 1, "train/compile_s": 7.0})]
    for step in range(5, 55, 5):
        row = {
            "step": step,
            "train/loss": 2.0 / step,
            "train/accuracy": 1 - 1.0 / step,
            "train/img_per_s": 500.0 + step,
            "train/step_time_s": 0.25,
            "other/key": "x",
        }
        if with_lr:
            row["train/lr"] = 0.1
        lines.append(json.dumps(row))
    lines.append(
        json.dumps({"step": 55, "eval/loss": 0.18, "eval/accuracy": 0.94, "eval/count": 9})
    )
    if junk:
        lines += ["{not json", "[1, 2]", '{"train/loss": 1.0}', json.dumps({"step": 60})]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5000


def test_two_runs_default_out(tmp_path, capsys, plot):
    a = write_run(tmp_path / "a", junk=True)
    b = write_run(tmp_path / "b", with_lr=False)
    assert plot.main([str(a), str(b)]) == 0
    out_dir = a / "plots"
    assert {p.name for p in out_dir.iterdir()} == ALL_PLOTS
    for p in out_dir.iterdir():
        assert_png(p)
    printed = capsys.readouterr().out.splitlines()
    assert sorted(printed) == sorted(str(out_dir / n) for n in ALL_PLOTS)


def test_lr_skipped_only_when_no_run_has_it(tmp_path, plot):
    a = write_run(tmp_path / "a", with_lr=False)
    b = write_run(tmp_path / "b", with_lr=False)
    out = tmp_path / "out"
    written = plot.plot_runs([a, b], out)
    assert {p.name for p in written} == ALL_PLOTS - {"lr.png"}
    assert not (out / "lr.png").exists()


def test_colliding_names_use_path(tmp_path, plot):
    dirs = [tmp_path / "x" / "run", tmp_path / "y" / "run", tmp_path / "z" / "other"]
    assert plot._labels(dirs) == [str(dirs[0]), str(dirs[1]), "other"]


@pytest.mark.parametrize("case", ["no_dir", "no_file", "no_valid_line"])
def test_bad_workdir_exits_2(tmp_path, capsys, case, plot):
    good = write_run(tmp_path / "good")
    bad = tmp_path / "bad"
    expected = bad
    if case != "no_dir":
        bad.mkdir()
        expected = bad / "metrics.jsonl"
    if case == "no_valid_line":
        expected.write_text('garbage\n{"no_step": 1}\n')
    assert plot.main([str(good), str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert str(expected) in err
    assert not (tmp_path / "out").exists()


def test_module_entry_point(tmp_path):
    a = write_run(tmp_path / "a")
    out = tmp_path / "out"
    r = run_python("-m", "jddp.plot", str(a), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 4
    assert {p.name for p in out.iterdir()} == ALL_PLOTS
    assert_png(out / "loss.png")


def test_nonfinite_points_are_marked_and_reported(tmp_path, capsys, plot):
    """NaN/Inf values are drawn (an x at their steps: the PNG differs from the same run without
    those values) and reported, one line per series with the count and the first step."""
    clean = write_run(tmp_path / "clean" / "run")  # one name: one legend in both
    lines = (clean / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    for row in rows:
        if row["step"] in (20, 35):
            del row["train/loss"]
    rows.append({"step": 60})
    (clean / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    bad = tmp_path / "bad" / "run"
    bad.mkdir(parents=True)
    for row in rows:
        if row["step"] == 20:
            row["train/loss"] = float("nan")
        if row["step"] == 35:
            row["train/loss"] = float("inf")
        if row["step"] == 60:
            row["eval/loss"] = float("nan")
    text = "\n".join(json.dumps(r) for r in rows) + "\n"  # json writes NaN / Infinity
    assert "NaN" in text and "Infinity" in text
    (bad / "metrics.jsonl").write_text(text)

    assert plot.main([str(clean), "--out", str(tmp_path / "clean_out")]) == 0
    assert capsys.readouterr().err == ""
    assert plot.main([str(bad), "--out", str(tmp_path / "bad_out")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "jddp.plot: run train/loss: 2 non-finite (NaN/Inf) points, first at step 20 "
        "(marked x at the top of the plot)",
        "jddp.plot: run eval/loss: 1 non-finite (NaN/Inf) point, first at step 60 "
        "(marked x at the top of the plot)",
    ]
    for name in ("loss.png", "accuracy.png"):
        assert_png(tmp_path / "bad_out" / name)
    same = (tmp_path / "clean_out" / "accuracy.png").read_bytes()
    assert (tmp_path / "bad_out" / "accuracy.png").read_bytes() == same  # deterministic
    marked = (tmp_path / "bad_out" / "loss.png").read_bytes()
    assert marked != (tmp_path / "clean_out" / "loss.png").read_bytes()
