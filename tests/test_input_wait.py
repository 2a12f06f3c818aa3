"""``perf/input_wait_fraction``: the share of a logging window the loop spent blocked on input.

Presence and range on a tiny in-process run, its mean in the end-of-run summary, and a
deliberately slow loader showing up as waiting. (No speed claim is tested here; the measured
fraction of a real run is in ``experiments/bench_overhead.py`` and ``experiments/RESULTS.md``.)
"""

import time

import optax
import pytest
from flax import nnx

import jddp
from jddp.metrics import InputWait
from tests.helpers import data, read_metrics
from tests.user_models import TinyMLP

KEY = "perf/input_wait_fraction"


class SlowRecords:
    """A grain-style record source (``len`` + ``[i]``) that sleeps on every record."""

    def __init__(self, x, y, delay_s):
        self.x, self.y, self.delay_s = x, y, delay_s

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(self.delay_s)
        return self.x[i], int(self.y[i])


def fit(workdir, train_data, steps, *overrides):
    return jddp.fit(
        TinyMLP(192, 2, nnx.Rngs(0)),
        optax.sgd(0.1),
        train_data=train_data,
        eval_data=data(16, seed=1),
        config={"workdir": str(workdir)},
        overrides=[
            f"train.steps={steps}",
            "data.global_batch_size=16",
            "log.every_steps=2",
            "log.progress=off",
            *overrides,
        ],
    )


@pytest.mark.serial
def test_input_wait_fraction_is_logged_and_summarised(tmp_path, capsys):
    result = fit(tmp_path / "run", data(), 7)
    rows = [r for r in read_metrics(tmp_path / "run") if "train/loss" in r]
    logged = {r["step"]: r[KEY] for r in rows if KEY in r}
    # Every logged window after the first (compiling) step: steps 2, 4, 6 and the last, 7.
    assert sorted(logged) == [2, 4, 6, 7]
    assert all(0.0 <= v <= 1.0 for v in logged.values())
    assert all(KEY in r for r in rows if "train/img_per_s" in r)  # same windows as throughput
    assert 0.0 <= result.input_wait_fraction <= 1.0
    summary = capsys.readouterr().out.split("jddp: summary")[1]
    line = next(x for x in summary.splitlines() if x.strip().startswith("input wait"))
    assert f"{100 * result.input_wait_fraction:.2f}%" in line and KEY in line


@pytest.mark.serial
def test_a_slow_loader_shows_up_as_input_wait(tmp_path):
    x, y = data()
    # 16 records x 10 ms = at least 0.16 s to load a batch; a TinyMLP step takes milliseconds,
    # so once the prefetched batch is used up the loop mostly waits. data.workers=0: one loading
    # lane (host workers would load several batches at once and hide part of the wait).
    result = fit(
        tmp_path / "run", SlowRecords(x, y, 0.01), 8, "data.prefetch_batches=1", "data.workers=0"
    )
    rows = [r for r in read_metrics(tmp_path / "run") if KEY in r]
    assert rows[-1][KEY] > 0.5
    assert 0.2 < result.input_wait_fraction <= 1.0


def test_timed_counts_blocked_time_and_closes_the_source():
    closed = []

    def slow():
        try:
            for i in range(5):
                time.sleep(0.02)
                yield i
        finally:
            closed.append(True)

    wait = InputWait()
    start = time.perf_counter()
    for i in wait.timed(slow()):
        if i == 2:
            break
    wall = time.perf_counter() - start
    assert closed == [True]  # the loop's break stops the source (the prefetch thread) at once
    assert 3 * 0.02 <= wait.window_s <= wall
    assert 0.0 < wait.end_window(wall) <= 1.0
    assert wait.mean_fraction == wait.window_s / wall
    wait.restart()
    assert wait.window_s == 0.0
