"""The run loop: steps, with the periodic work done by the run's hooks (:mod:`jddp.run.hooks`)."""

from __future__ import annotations

from jddp.data.loader import place_batch
from jddp.errors import OutOfMemory
from jddp.run.memory import exhausted, memory_line, out_of_memory
from jddp.run.setup import Run
from jddp.state import TrainState


def train_loop(run: Run) -> tuple[TrainState, int, bool]:
    """Run steps ``run.start_step .. run.total_steps``; returns the final state, its step, and
    whether a stop signal (on any process) ended the loop early. A device out of memory is one
    line (:class:`~jddp.errors.OutOfMemory`) naming what the step needs."""
    where = _Where(run.start_step + 1)
    try:
        return _steps(run, where)
    except Exception as e:
        if exhausted(e):  # XLA's RESOURCE_EXHAUSTED, at any step's dispatch or results
            raise OutOfMemory(out_of_memory(where.step, where.memory, run.layout, e)) from e
        raise
    finally:
        run.profiler.close()  # a trace the loop left open (a stop, an error) is still written


class _Where:
    """The step the loop is at and the step's memory figures, for a failure's line."""

    def __init__(self, step: int) -> None:
        self.step, self.memory = step, None


def _steps(run: Run, where: _Where) -> tuple[TrainState, int, bool]:
    state, step = run.state, run.start_step
    rows = run.process_rows.rows.stop - run.process_rows.rows.start
    end = run.total_steps if run.end_step is None else run.end_step
    batches = run.batches.iterate(step, end, run.cfg.data.prefetch_batches)
    pending = None  # the previous step's (step, metrics): read one step late
    memory = None  # the mem/ figures, read as the first step compiles
    run.watchdog.waiting("input", step + 1)
    for batch in run.meter.timed(batches):
        # Progress is each piece of work as it completes: a batch that arrived, a step that
        # was dispatched (with synchronous dispatch its computation is done), a step's results
        # read. A run whose every batch and step take just under dist.step_timeout_s moves;
        # timing from one step's results to the next's summed a batch and a step and called it
        # stalled. A real hang is still one wait longer than the timeout.
        if run.watchdog.first_done:
            run.watchdog.progress()
        run.watchdog.waiting("step", step + 1)
        with run.profiler.step(step + 1, state):
            flags = {**run.stop.flags(rows), **run.saves.flags(rows)}
            flags = place_batch(flags, run.mesh, run.process_rows)
            batch = {**batch, **flags}
            where.step = step + 1
            if memory is None:  # compiled now (the call reuses it); a step too large: refused
                memory = where.memory = run.step_memory.first_step(run.train_step, state, batch)
            state, metrics = run.train_step(state, batch)
        if run.watchdog.first_done:
            run.watchdog.progress()
        step += 1
        run.profiler.after(step, metrics)
        if step == run.start_step + 1:  # the first step compiles: timed apart
            compile_s = run.meter.compiled(metrics)
            run.log.write(step, {"train/compile_s": compile_s, **memory})
            share = run.layout.split_share(state)
            run.console.say(memory_line(memory, run.layout, share))
            run.watchdog.progress(step_done=True)
        if pending is not None and _report(run, *pending):
            # Every process saw the same flag at the same step. This step already ran and is
            # the one saved: its line goes into metrics.jsonl now (a resumed run starts after
            # it), so every step is logged once.
            run.reporter(step, metrics, stopping=True)
            run.progress.update(1)
            return state, step, True
        pending = (step, metrics)
        run.progress.update(1)
        if run.saves.due(step):
            # The save waits for this step anyway: its line first, so that a run that dies
            # before the next step (a kill -9, a stall) has every step up to its newest
            # checkpoint logged, and its rerun, resuming there, logs each step once. (The
            # previous step's line, read above, told the policy of a save the clock asked for.)
            pending = None
            if _report(run, step, metrics):
                return state, step, True
        for hook in run.hooks:
            hook(step, state)
        run.watchdog.waiting("input", step + 1)
    stopped = pending is not None and _report(run, *pending)
    return state, step, stopped


def _report(run: Run, step: int, metrics: dict) -> bool:
    """Read and report step ``step``'s metrics (waiting for its results: progress for the
    watchdog once they are in); whether a stop was requested."""
    run.watchdog.waiting("step", step)
    stop_requested = run.reporter(step, metrics)
    run.watchdog.progress(step_done=True)
    return stop_requested
