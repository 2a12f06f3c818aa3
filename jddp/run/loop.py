"""The run loop: steps, with the periodic work done by the run's hooks (:mod:`jddp.run.hooks`)."""

from __future__ import annotations

from jddp.data.loader import place_batch
from jddp.run.setup import Run
from jddp.state import TrainState


def train_loop(run: Run) -> tuple[TrainState, int, bool]:
    """Run steps ``run.start_step .. run.total_steps``; returns the final state, its step, and
    whether a stop signal (on any process) ended the loop early."""
    try:
        return _steps(run)
    finally:
        run.profiler.close()  # a trace the loop left open (a stop, an error) is still written


def _steps(run: Run) -> tuple[TrainState, int, bool]:
    state, step = run.state, run.start_step
    rows = run.layout.rows.stop - run.layout.rows.start
    batches = run.batches.iterate(step, run.total_steps, run.cfg.data.prefetch_batches)
    pending = None  # the previous step's (step, metrics): read one step late
    for batch in run.meter.timed(batches):
        with run.profiler.step(step + 1, state):
            flags = place_batch(run.stop.flags(rows), run.mesh, run.layout)
            state, metrics = run.train_step(state, {**batch, **flags})
        step += 1
        run.profiler.after(step, metrics)
        if step == run.start_step + 1:  # the first step compiles: timed apart
            run.log.write(step, {"train/compile_s": run.meter.compiled(metrics)})
        if pending is not None and run.reporter(*pending):
            # Every process saw the same flag at the same step. This step already ran and is
            # the one saved: its line goes into metrics.jsonl now (a resumed run starts after
            # it), so every step is logged once.
            run.reporter(step, metrics, stopping=True)
            run.progress.update(1)
            return state, step, True
        pending = (step, metrics)
        run.progress.update(1)
        for hook in run.hooks:
            hook(step, state)
    stopped = pending is not None and run.reporter(*pending)
    return state, step, stopped
