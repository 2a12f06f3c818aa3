"""Periodic work of the run loop as small objects, each with its own period.

The loop (:mod:`jddp.run.loop`) calls ``hook(step, state)`` for every hook after every step; a hook
does its work when :meth:`Every.due` (the checkpoint hook: when the run's
:class:`~jddp.checkpoint.policy.SavePolicy` says). The throughput meter and the one-step-late
metrics reader live here too (the stop-signal flag in :mod:`jddp.proc.signals`), so the loop
itself is a dozen lines.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jddp.checkpoint import Checkpoints
from jddp.checkpoint.policy import SAVE_KEY, SavePolicy
from jddp.comm import Comm
from jddp.errors import DataError, NonFiniteLoss, ReplicasDiverged
from jddp.mesh import to_host
from jddp.metrics import Console, InputWait, MetricsLog
from jddp.proc.signals import FINISH_KEY, STOP_KEY
from jddp.state import TrainState
from jddp.step import (
    CLIPPED_KEY,
    LOSS_WEIGHT_KEY,
    NEGATIVE_WEIGHT_KEY,
    NONFINITE_KEY,
    pop_negative_weights,
)

Metrics = dict[str, jax.Array]


class Every:
    """Due after every ``every``-th optimizer step (0: never)."""

    def __init__(self, every: int):
        self.every = every

    def due(self, step: int) -> bool:
        """Whether the period ends at ``step``."""
        return self.every > 0 and step % self.every == 0


class ThroughputMeter:
    """Examples/s (and, with a weight unit, e.g. tokens/s), step time and input wait over
    windows of finished steps.

    A window starts when :meth:`restart` is called (after the compiling first step, after an
    eval) and ends at the step :meth:`end_window` is given; the first step, which compiles, is
    timed apart by :meth:`compiled`. Run totals give the summary's mean throughput. ``unit``
    names the examples in the rate's key, ``train/<unit>_per_s`` (``img`` for images,
    ``examples`` for any other task); ``weight_unit`` what a weighted loss's weights count
    (``log.weight_unit``): :meth:`count` adds each step's weight sum, reported as
    ``train/<weight_unit>_per_s``.
    """

    def __init__(
        self,
        global_batch_size: int,
        first_step: int,
        unit: str = "img",
        weight_unit: str | None = None,
    ):
        self.global_batch_size = global_batch_size
        self.rate_key = f"train/{unit}_per_s"
        self.weight_unit = weight_unit
        self.input_wait = InputWait()
        self.start_s = time.perf_counter()
        self.last_step = first_step + 1  # the step whose end ``start_s`` marks
        self.examples = 0
        self.seconds = 0.0
        self.window_weight = 0.0  # weight summed over the steps of the window
        self.weight = 0.0  # over every closed window

    def timed(self, batches: Iterable[Any]) -> Iterator[Any]:
        """The batch iterator, with the time spent waiting for each batch counted."""
        return self.input_wait.timed(batches)

    def compiled(self, metrics: Metrics) -> float:
        """Seconds since the meter started, once the first step's ``metrics`` are ready."""
        jax.block_until_ready(metrics)
        seconds = time.perf_counter() - self.start_s
        self.restart()
        return seconds

    def count(self, step: int, weight_sum: float) -> None:
        """Step ``step``'s loss weights, summed over the global batch (tokens, say); the
        compiling first step's are not timed, so not counted."""
        if step > self.last_step:
            self.window_weight += weight_sum

    def restart(self, last_step: int | None = None) -> None:
        """Start a new window now (after ``last_step``, if given)."""
        self.start_s = time.perf_counter()
        if last_step is not None:
            self.last_step = last_step
        self.input_wait.restart()
        self.window_weight = 0.0

    def end_window(self, step: int) -> dict[str, float]:
        """``train/<unit>_per_s``, ``train/step_time_s``, the input-wait fraction (and
        ``train/<weight_unit>_per_s``) of the window ending at ``step`` (empty when no step
        finished in it)."""
        done = step - self.last_step
        if done <= 0:
            return {}
        seconds = time.perf_counter() - self.start_s
        self.examples += done * self.global_batch_size
        self.seconds += seconds
        self.weight += self.window_weight
        out = {
            self.rate_key: done * self.global_batch_size / seconds,
            "train/step_time_s": seconds / done,
            InputWait.KEY: self.input_wait.end_window(seconds),
        }
        if self.weight_unit is not None:
            out[f"train/{self.weight_unit}_per_s"] = self.window_weight / seconds
        return out

    @property
    def examples_per_s(self) -> float:
        """Mean examples/s over every closed window of the run."""
        return self.examples / self.seconds if self.seconds else 0.0

    img_per_s = examples_per_s  # the name from when every example was an image

    @property
    def weight_per_s(self) -> float | None:
        """Mean loss weight/s (``weight_unit``/s) over every closed window; None without a
        weight unit."""
        if self.weight_unit is None:
            return None
        return self.weight / self.seconds if self.seconds else 0.0


class StepReporter:
    """Reads each step's metrics one step late (so the device never waits for the host): logs a
    train line every ``log.every_steps`` (and at the last step, the step a stop signal ends the
    run at, and a non-finite step),
    raises :class:`NonFiniteLoss` under ``halt``, and says whether any process asked to stop.
    A weighted loss whose weights were negative, or summed to 0 over the global batch, stops
    the run (:class:`DataError`)."""

    def __init__(
        self,
        *,
        every: int,
        last_step: int,
        halt_on_nonfinite: bool,
        log: MetricsLog,
        meter: ThroughputMeter,
        progress: Any,
        checkpoints: Checkpoints,
        baseline_img_per_s: float | None = None,
        num_devices: int = 1,
    ):
        self.period = Every(every)
        self.last_step = last_step
        self.halt_on_nonfinite = halt_on_nonfinite
        self.log, self.meter, self.progress, self.checkpoints = log, meter, progress, checkpoints
        self.ideal_img_per_s = baseline_img_per_s and num_devices * baseline_img_per_s
        self.num_devices = num_devices  # logged as train/devices (an elastic restart shrinks it)
        self._clipped: list[float] = []  # train/clipped of the steps since the last line
        self.stop_kind: str | None = None  # preempt (a signal) or finish (a callback)
        self.saves: SavePolicy | None = None  # told the clock's save flag (every_minutes)

    def __call__(self, step: int, metrics: Metrics, stopping: bool = False) -> bool:
        """Report ``step``'s ``metrics``; whether a stop was requested. ``stopping``: the run
        stops (and saves) at ``step``, so it gets a line whatever ``log.every_steps`` says."""
        host = {k: float(v) for k, v in to_host(metrics).items()}
        asked = host.pop(SAVE_KEY, 0.0) > 0  # every process reads the same flag
        if self.saves is not None:
            self.saves.heard(step, asked)
        preempt, finish = host.pop(STOP_KEY, 0.0) > 0, host.pop(FINISH_KEY, 0.0) > 0
        stop_requested = preempt or finish
        if stop_requested:  # every process reads the same flags: the same kind of stop
            self.stop_kind = "preempt" if preempt else "finish"
        self._check_weights(step, host)
        if host[NONFINITE_KEY] and self.halt_on_nonfinite:
            kept = self.checkpoints.all_steps()
            last = self.checkpoints.directory / str(kept[-1]) if kept else "none"
            raise NonFiniteLoss(
                f"non-finite loss or gradient at step {step} (train.on_nonfinite=halt); the "
                f"update was not applied; last checkpoint: {last}"
            )
        if CLIPPED_KEY in host:  # logged as the share of steps clipped since the last line
            self._clipped.append(host.pop(CLIPPED_KEY))
        logged = bool(
            self.period.due(step) or step == self.last_step or host[NONFINITE_KEY] or stopping
        )
        if logged:
            if self._clipped:
                host[CLIPPED_KEY] = sum(self._clipped) / len(self._clipped)
                self._clipped = []
            host.update(self.meter.end_window(step))
            host["train/devices"] = self.num_devices
            rate = host.get(self.meter.rate_key)
            if self.ideal_img_per_s and rate is not None:
                host["train/scaling_efficiency"] = rate / self.ideal_img_per_s
            self.log.write(step, host)
        self.progress.train(step, host, logged)
        if logged:
            self.meter.restart(step)
        return stop_requested

    def _check_weights(self, step: int, host: dict[str, float]) -> None:
        """Pop the loss-weight flags of a weighted loss: refuse negative weights or a zero
        total; count the weights (``train/<weight_unit>``)."""
        metric = pop_negative_weights(host)  # a metric's weights: refused as the loss's
        if metric is not None:
            raise DataError(
                f"step {step}: metric {metric!r} returned negative weights (weights count what "
                "each example stands for: they must be >= 0); the run stops, its last "
                "checkpoint is kept"
            )
        negative = host.pop(NEGATIVE_WEIGHT_KEY, 0.0)
        mean_weight = host.pop(LOSS_WEIGHT_KEY, None)
        if mean_weight is None:
            return
        where = f"step {step}: the loss returned"
        if negative > 0:
            raise DataError(
                f"{where} negative weights (weights count what each example's loss stands for, "
                "e.g. its tokens: they must be >= 0); the run stops, its last checkpoint is kept"
            )
        total = mean_weight * self.meter.global_batch_size
        if not math.isfinite(total):  # not the zero-total hint: NaN is no padding
            raise DataError(
                f"{where} non-finite weights (their sum over the global batch of "
                f"{self.meter.global_batch_size} examples is {total:g}: a NaN or Inf weight in "
                "the data); the update was not applied"
            )
        if not total > 0:
            raise DataError(
                f"{where} weights that sum to {total:g} over the global batch of "
                f"{self.meter.global_batch_size} examples: the weighted mean loss is undefined "
                "(a batch of padding only?); the update was not applied"
            )
        self.meter.count(step, total)
        if self.meter.weight_unit is not None:
            host[f"train/{self.meter.weight_unit}"] = total


class EvalHook(Every):
    """Evaluate every ``every`` steps before the last (the last step is evaluated anyway);
    each result goes to ``metrics.jsonl`` and to ``on_eval(step, metrics)`` (the run's record
    of its best checkpoints)."""

    def __init__(
        self,
        *,
        every: int,
        last_step: int,
        evaluate: Callable[[TrainState], dict],
        log: MetricsLog,
        meter: ThroughputMeter,
        progress: Any = None,
        watchdog: Any = None,
        on_eval: Callable[[int, dict], None] | None = None,
    ):
        super().__init__(every)
        self.last_step, self.evaluate, self.log, self.meter = last_step, evaluate, log, meter
        self.progress, self.watchdog, self.on_eval = progress, watchdog, on_eval

    def __call__(self, step: int, state: TrainState) -> None:
        if self.due(step) and step < self.last_step:
            if self.watchdog is not None:
                self.watchdog.waiting("eval")
            metrics = self.evaluate(state)
            self.log.write(step, metrics)
            if self.on_eval is not None:
                self.on_eval(step, metrics)
            if self.progress is not None:
                self.progress.eval(step, metrics)
            self.meter.restart(step)  # eval time is not train throughput


class CheckpointHook:
    """Save (in the background) when the run's :class:`SavePolicy` says, and at the end
    (:meth:`save`, the trainer's final save and a stop signal's)."""

    def __init__(
        self,
        *,
        checkpoints: Checkpoints,
        policy: SavePolicy,
        config: dict[str, Any],
        watchdog: Any = None,
    ):
        self.checkpoints, self.policy, self.config = checkpoints, policy, config
        self.watchdog = watchdog

    def __call__(self, step: int, state: TrainState) -> None:
        self.checkpoints.poll()  # a save in flight that is complete now: on_checkpoint
        if self.policy.due(step):
            self.save(step, state)

    def save(self, step: int, state: TrainState) -> bool:
        """Start saving ``state`` as ``step``; whether a save started (not when the step is
        saved already, nor on a process that writes none)."""
        if self.watchdog is not None:
            self.watchdog.waiting("checkpoint")  # the save before waits for its disk
        started = self.checkpoints.save(step, state, self.config)
        self.policy.saved(step)
        if self.watchdog is not None:
            self.watchdog.progress()
        return started


class LockCheck:
    """Every ``every_s`` seconds (checked after a step): stop the run when its workdir lock was
    removed or taken (:meth:`jddp.workdir.WorkdirLock.verify`); before the step's saves."""

    def __init__(self, lock: Any, every_s: float = 1.0):
        self.lock, self.every_s = lock, every_s
        self.last_s = time.monotonic()

    def __call__(self, step: int, state: TrainState) -> None:
        now = time.monotonic()
        if now - self.last_s >= self.every_s:
            self.last_s = now
            self.lock.verify()


class SyncCheck(Every):
    """``dist.check_sync_every``: stop the run when replicas hold different parameters."""

    def __init__(self, every: int, comm: Comm):
        super().__init__(every)
        self.comm = comm

    def __call__(self, step: int, state: TrainState) -> None:
        if self.due(step):
            check_replicas_in_sync(self.comm, state, step)


def check_replicas_in_sync(comm: Comm, state: TrainState, step: int) -> None:
    """Raise :class:`ReplicasDiverged` unless every device of every process holds the same
    parameters. Cheap: one float32 checksum per local device copy, compared across processes.
    Under ``dist.shard=full`` a split parameter has no replicas (each device holds its own
    slice): the arrays kept whole are compared.
    """
    leaves = [x for x in jax.tree.leaves(state.params) if x.is_fully_replicated]
    copies = len(leaves[0].addressable_shards) if leaves else 1

    def checksum(copy: int) -> float:
        total = 0.0
        for leaf in leaves:
            data = leaf.addressable_shards[copy].data
            total += float(jnp.sum(data.astype(jnp.float32), dtype=jnp.float32))
        return total

    local = {checksum(copy) for copy in range(copies)}
    mine = int(np.float64(max(local)).view(np.int64)) if len(local) == 1 else -1
    everyone = comm.allgather_int(mine)
    if len(local) != 1 or len(set(everyone)) != 1:
        raise ReplicasDiverged(
            f"replicas diverged at step {step}: parameter checksums differ between devices or "
            f"processes ({sorted(local)} here); the run is stopped (dist.check_sync_every)"
        )


class Profiler:
    """``log.profile_steps='a:b'``: a ``jax.profiler`` trace of steps a..b-1 (numbered as in
    metrics.jsonl), each step's dispatch marked with its number (``StepTraceAnnotation``, the
    steps of TensorBoard's profile plugin)."""

    def __init__(self, steps: str | None, folder: Path, console: Console):
        self.range = tuple(int(x) for x in steps.split(":")) if steps else None
        self.folder, self.console = folder, console
        self.first: int | None = None  # the first traced step, while tracing
        self.last = 0  # the last step dispatched while tracing

    def step(self, step: int, state: TrainState) -> contextlib.AbstractContextManager:
        """Wrap the dispatch of ``step``. The trace starts at the first step in a..b-1 (also
        after a resume inside the range) once the device has finished the steps before it:
        dispatch is asynchronous, and their work would otherwise land in the trace."""
        if self.range and self.first is None and self.range[0] <= step < self.range[1]:
            jax.block_until_ready(state)
            jax.profiler.start_trace(str(self.folder))
            self.first = step
        if self.first is None:
            return contextlib.nullcontext()
        self.last = step
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after(self, step: int, metrics: Metrics) -> None:
        """Stop once step ``b - 1`` has finished."""
        if self.first is not None and step >= self.range[1] - 1:
            jax.block_until_ready(metrics)
            jax.profiler.stop_trace()
            self.console.say(f"jddp: profile of steps {self.first}..{step} in {self.folder}")
            self.first = None

    def close(self) -> None:
        """Write a trace the loop left open (it ended inside a..b-1: a stop signal, an error)."""
        if self.first is None:
            return
        first, self.first = self.first, None
        try:
            jax.profiler.stop_trace()
        except Exception as e:  # an error already on its way out matters more than the trace
            self.console.say(f"jddp: warning: the profile of steps {first}.. was lost ({e})")
            return
        self.console.say(
            f"jddp: profile of steps {first}..{self.last} (the run ended there) in {self.folder}"
        )
