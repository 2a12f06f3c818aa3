"""Reading a run's checkpoints outside its own resume: ``python -m jddp.evaluate``,
``checkpoint.init_from`` and ``jddp.load`` on a damaged checkpoint, a checkpoint a live run's
rotation deleted, and a run folder that cannot be written."""

import runpy
import shutil
import signal
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

import jddp
from jddp.errors import CheckpointError
from tests.helpers import read_metrics, run_python, start

RUN = [
    "model.name=tests.user_models:tiny_mlp",
    "data.name=synthetic",
    "data.image_size=8",
    "data.global_batch_size=16",
    "log.progress=off",
]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One tiny run with checkpoints 2 and 4 (each test works on a copy)."""
    from jddp.run.trainer import train_and_evaluate

    workdir = tmp_path_factory.mktemp("reads") / "run"
    overrides = [*RUN, "train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep=3"]
    train_and_evaluate(jddp.load_config({"workdir": str(workdir)}, overrides))
    return workdir


@pytest.fixture
def run_copy(finished, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


def damage(workdir, step):
    """Truncate every array file of checkpoint ``step`` to 10 bytes."""
    files = [f for f in (workdir / "checkpoints" / str(step) / "state").rglob("*") if f.is_file()]
    arrays = [f for f in files if f.parent.name == "d"]
    assert arrays, files
    for f in arrays:
        f.write_bytes(f.read_bytes()[:10])


def evaluate_in_process(argv, capfd) -> tuple[int, str, str]:
    """``python -m jddp.evaluate ARGV`` in this process: exit code, stdout, stderr. (Exit 1
    skips the interpreter's teardown with ``os._exit``: here it is a plain exit.)"""
    capfd.readouterr()
    with (
        mock.patch.object(sys, "argv", ["jddp.evaluate", *argv]),
        mock.patch("jddp.cli.os._exit", side_effect=sys.exit),
    ):
        with pytest.raises(SystemExit) as stop:
            runpy.run_module("jddp.evaluate", run_name="__main__")
    out = capfd.readouterr()
    return stop.value.code, out.out, out.err


def test_a_damaged_checkpoint_in_evaluate_is_one_line_naming_it_and_the_intact_one(run_copy):
    damage(run_copy, 4)
    out = run_python("-m", "jddp.evaluate", "--workdir", str(run_copy), "--trust-code")
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
    (line,) = lines
    assert line.startswith(f"jddp: error: --workdir: checkpoint {run_copy}/checkpoints/4 is ")
    assert line.endswith(f"checkpoint {run_copy}/checkpoints/2 is intact: use --step 2")
    short = line.replace(str(run_copy), "RUN")  # the bound is on the words, not on tmp paths
    assert "/4 is damaged: " in line and len(short) < 450 and "tensorstore_spec" not in line
    assert not [r for r in read_metrics(run_copy) if r.get("eval/data")]  # nothing appended


def test_a_damaged_checkpoint_in_load_names_it_or_that_none_is_intact(run_copy):
    damage(run_copy, 4)
    with pytest.raises(CheckpointError, match=r"checkpoints/2 is intact: use step=2$"):
        jddp.load(run_copy, trust_code=True)
    assert jddp.load(run_copy, step=2, trust_code=True) is not None
    (run_copy / "checkpoints" / "2" / "manifest" / "metadata").write_text("garbage")
    with pytest.raises(CheckpointError) as failed:
        jddp.load(run_copy, step=2, trust_code=True)
    message = str(failed.value)
    assert f"checkpoint {run_copy}/checkpoints/2 is damaged: its manifest cannot be read" in message
    assert message.endswith(f"no other checkpoint in {run_copy}/checkpoints is intact")


def test_a_damaged_init_from_checkpoint_names_it_and_the_intact_one(run_copy, tmp_path):
    from jddp.run.trainer import train_and_evaluate

    damage(run_copy, 4)
    target = tmp_path / "warm"
    cfg = jddp.load_config(
        {"workdir": str(target)}, [*RUN, "train.steps=1", f"checkpoint.init_from={run_copy}"]
    )
    with pytest.raises(CheckpointError) as failed:
        train_and_evaluate(cfg)
    message = str(failed.value)
    assert "\n" not in message and len(message.replace(str(run_copy), "RUN")) < 450
    assert message.startswith(f"checkpoint.init_from: checkpoint {run_copy}/checkpoints/4 is ")
    assert message.endswith(f"use checkpoint.init_from={run_copy}/checkpoints/2")


def rotate_away_once(step_dir):
    """A ``jddp.eval_lib.reader`` that first deletes ``step_dir`` (a live run's rotation
    between evaluate's listing and its read)."""
    from jddp.checkpoint.find import reader

    def rotating_reader(directory):
        if step_dir.exists():
            shutil.rmtree(step_dir)
        return reader(directory)

    return mock.patch("jddp.eval_lib.reader", rotating_reader)


def test_evaluate_reads_the_newest_kept_checkpoint_when_rotation_deletes_its_pick(run_copy, capfd):
    with rotate_away_once(run_copy / "checkpoints" / "4"):
        code, out, err = evaluate_in_process(["--workdir", str(run_copy), "--trust-code"], capfd)
    assert code == 0, err
    assert "jddp: eval step=2 " in out
    assert read_metrics(run_copy)[-1]["step"] == 2


def test_evaluate_of_a_step_rotated_away_names_it_and_the_kept_ones(run_copy, capfd):
    with rotate_away_once(run_copy / "checkpoints" / "4"):
        code, out, err = evaluate_in_process(
            ["--workdir", str(run_copy), "--step", "4", "--trust-code"], capfd
        )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"jddp: error: --step: checkpoint {run_copy}/checkpoints/4 was ")
    assert "deleted while it was read" in lines[0]
    assert lines[0].endswith("the checkpoints now: 2")


def test_evaluate_prints_its_result_when_metrics_jsonl_cannot_be_written(run_copy, capfd):
    metrics = run_copy / "metrics.jsonl"
    before = metrics.read_text()
    metrics.unlink()
    metrics.mkdir()  # unwritable, even for root (a read-only run folder: the same OSError)
    code, out, err = evaluate_in_process(["--workdir", str(run_copy), "--trust-code"], capfd)
    assert code == 0, err
    assert "jddp: eval step=4 eval/loss=" in out
    (warning,) = err.strip().splitlines()
    assert warning.startswith(f"jddp: warning: {metrics}: cannot append the result")
    metrics.rmdir()
    metrics.write_text(before)


def test_a_cut_save_is_cleaned_by_the_next_writer_only(run_copy):
    """A save cut short (kill -9, a stall, a full disk) leaves orbax's temporary folder: the run
    that next writes the workdir removes it; a reader (evaluate) leaves it, as it may be a live
    run's save in flight."""
    from jddp.checkpoint import Checkpoints
    from jddp.workdir import RunFolder

    cut = run_copy / "checkpoints" / "6.orbax-checkpoint-tmp"
    (cut / "state").mkdir(parents=True)
    folder = RunFolder(run_copy)
    reader = Checkpoints.of(folder, every_steps=0, keep=3, async_save=False, writes=False)
    reader.close()
    assert cut.is_dir()
    writer = Checkpoints.of(folder, every_steps=2, keep=3, async_save=False)
    writer.close()
    assert not cut.exists() and writer.all_steps() == [2, 4]


def wait_until_mapped(job, library: str, timeout_s: float = 120) -> None:
    """Return as soon as process ``job`` has mapped a shared object whose path holds ``library``
    (it is importing that extension now), polled every millisecond: a real moment, not a guess of
    how long start-up takes (0.3 s fell before jddp's first statement on a loaded machine)."""
    maps = Path(f"/proc/{job.pid}/maps")
    deadline = time.monotonic() + timeout_s
    while library not in maps.read_text():
        assert job.poll() is None, f"exited {job.returncode} first: {job.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"{library} not mapped in {timeout_s} s"
        time.sleep(0.001)


@pytest.mark.parametrize(
    "library",
    ["numpy/_core/_multiarray_umath", "jaxlib/_jax."],  # numpy imports; JAX starts (jaxlib)
    ids=["numpy-imports", "jax-starts"],
)
def test_ctrl_c_stops_evaluate_at_any_moment_in_one_line(finished, library):
    """While numpy and jddp import, or JAX starts (jaxlib's extension loads): exit 130 and one
    line (it printed a 40-line traceback from ``import jax``, was swallowed and exited 0, and
    under load a traceback from an import before the handler, which came after numpy)."""
    cmd = [sys.executable, "-m", "jddp.evaluate", "--workdir", str(finished), "--trust-code"]
    job = start(cmd, fresh=True)
    wait_until_mapped(job, library)
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 130, err[-2000:]
    assert err.strip().splitlines() == ["jddp: interrupted"], err[-2000:]


def test_a_resume_sets_aside_a_checkpoint_whose_config_is_damaged(run_copy, capfd):
    """The trainer's own resume reads the same way: an unreadable saved config is damage (the
    checkpoint is moved aside, the older one used), not a crash."""
    from jddp.run.trainer import train_and_evaluate

    (run_copy / "checkpoints" / "4" / "config" / "metadata").write_text("garbage")
    cfg = jddp.load_config({"workdir": str(run_copy)}, [*RUN, "train.steps=5"])
    result = train_and_evaluate(cfg)
    assert result.step == 5
    err = capfd.readouterr().err
    assert f"checkpoint {run_copy}/checkpoints/4 is damaged: its config cannot be read" in err
    assert [p.name.split("-")[0] for p in (run_copy / "checkpoints-damaged").iterdir()] == ["4"]


def test_a_failed_read_leaves_nothing_that_reports_itself_later(run_copy, caplog):
    """A restore that fails leaves orbax's abandoned reads as garbage: futures holding the read
    error, never-awaited coroutines, in reference cycles. Collected at some later allocation,
    each printed a report between jddp's lines (tests/test_bad_input.py's all-damaged run failed
    on one in a fresh clone). jddp collects them when the read fails, silently; asyncio's
    reports of anything else still show."""
    import asyncio
    import gc
    import warnings

    from jddp.checkpoint import Checkpoints
    from jddp.errors import CheckpointDamaged
    from jddp.workdir import RunFolder

    def abandoned_read_error():
        """What a failed orbax read leaves: a failed future and a coroutine nobody awaited,
        each in a reference cycle (freed only by the cyclic collector)."""
        loop = asyncio.new_event_loop()
        future = loop.create_future()
        future.set_exception(ValueError("OUT_OF_RANGE: damaged"))
        future.cycle = future

        async def _get_array_metadatas():
            pass

        leftovers = [_get_array_metadatas(), loop]
        leftovers.append(leftovers)
        loop.close()
        raise ValueError("OUT_OF_RANGE: Error reading params")

    ckpts = Checkpoints.of(RunFolder(run_copy), every_steps=0, keep=3, async_save=False)
    gc.collect()
    with caplog.at_level("ERROR", logger="asyncio"), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointDamaged, match="cannot be restored"):
            ckpts._verified(4, abandoned_read_error, lambda value: [])
        gc.collect()  # a later collection finds nothing left to report
        assert [r.getMessage() for r in caplog.records] == []
        assert [str(w.message) for w in warned] == []
        # Outside a failed read, asyncio's reports are not jddp's to drop.
        loop = asyncio.new_event_loop()
        future = loop.create_future()
        future.set_exception(ValueError("the user's own"))
        future.cycle = future
        loop.close()
        del future
        gc.collect()
    assert len(caplog.records) == 1 and "the user's own" in caplog.text
    ckpts.close()


def test_checksums_are_the_same_in_any_layout_and_old_crc_manifests_still_verify(tmp_path):
    """A manifest's sum64 checksum is computed from the shards each process holds (no array is
    gathered) and equals the whole array's; a manifest written before it (CRC-32 of the whole
    array) still verifies, and a wrong CRC-32 is still damage."""
    import json
    import zlib

    import jax.numpy as jnp
    import numpy as np

    from jddp.checkpoint import Checkpoints
    from jddp.checkpoint.manifest import _mixed_sum, checksums
    from jddp.errors import CheckpointError
    from jddp.state import TrainState

    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    halves = [(w[:2], (slice(0, 2), slice(None))), (w[2:], (slice(2, 4), slice(None)))]
    by_rows = sum(_mixed_sum(x, index, w.shape) for x, index in halves) % 2**64
    assert checksums([w]) == [f"sum64:{by_rows:016x}"]
    w2 = w.copy()
    w2[1, 2] = np.nextafter(w2[1, 2], np.float32(100))  # one bit
    assert checksums([w2]) != checksums([w])

    state = TrainState(
        step=jnp.int32(1), params={"w": jnp.asarray(w)}, model_state={}, opt_state=(),
        skipped_steps=jnp.int32(0),
    )  # fmt: skip
    folder = tmp_path / "ckpts"
    ckpts = Checkpoints(folder, every_steps=1, keep=2, async_save=False,
                        damaged_directory=tmp_path / "damaged")  # fmt: skip
    ckpts.save(1, state, {})
    ckpts.wait()
    meta = folder / "1" / "manifest" / "metadata"
    saved = json.loads(meta.read_text())
    assert all(row[3].startswith("sum64:") for row in saved["leaves"])
    values = {".params['w']": w, ".step": np.int32(1), ".skipped_steps": np.int32(0)}
    for row in saved["leaves"]:  # as jddp wrote it before sum64
        row[3] = zlib.crc32(np.asarray(values[row[0]], order="C").data)
    meta.write_text(json.dumps(saved))
    restored, step = ckpts.restore_newest_good(state)
    assert step == 1 and np.array_equal(np.asarray(restored.params["w"]), w)
    saved["leaves"][0][3] += 1
    meta.write_text(json.dumps(saved))
    with pytest.raises(CheckpointError, match="all 1 are damaged"):
        ckpts.restore_newest_good(state)
    ckpts.close()
