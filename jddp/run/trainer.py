"""Train a config end to end: lock the run folder, build the run, loop, evaluate, save.

The data flow: :mod:`jddp.run.setup` builds everything from the config (mesh, data, model, state,
steps, outputs); :mod:`jddp.run.loop` runs the steps with the periodic work as hooks; this module
ties them together with the workdir lock, preemption and the end-of-run summary.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext
from dataclasses import dataclass

from flax import nnx

from jddp import config as config_lib
from jddp.checkpoint.resume import apply_resume_from, changed_keys
from jddp.comm import Comm, make_comm
from jddp.config import Config
from jddp.distributed import Job, current_job
from jddp.errors import ConfigError, EvalFailed, JddpError, NonFiniteLoss, Preempted, one_line
from jddp.imports import code_specs, names_code
from jddp.mesh import to_host
from jddp.metrics import Console, InputWait, describe_eval, nonfinite_eval
from jddp.preflight import check_same_config
from jddp.proc.signals import StopRequest
from jddp.proc.watchdog import StallWatchdog
from jddp.proc.xla import enable_compilation_cache
from jddp.run.callbacks import early_stop_keys
from jddp.run.hooks import LockCheck
from jddp.run.loop import train_loop
from jddp.run.setup import Parts, Run, build_run
from jddp.run.trackers import check_installed
from jddp.state import TrainState
from jddp.workdir import RunFolder, WorkdirLock

__all__ = ["Parts", "RunResult", "train_and_evaluate"]


@dataclass
class RunResult:
    """What a finished run reports: final step, final eval metrics, timing, checkpoint path,
    and ``model``: the trained module (the one given to :func:`jddp.fit`, updated in place, or
    the one the config built), in the mode training left it (call ``model.eval()`` to infer).

    ``skipped_steps``: steps of the whole run (resumed ones included) whose update was dropped
    for a non-finite loss or gradient (``train.on_nonfinite=skip``).

    ``input_wait_fraction``: the share of the timed train wall time (the first step, which
    compiles, and eval excluded) that process 0's loop spent blocked waiting for the next batch
    from the input pipeline.

    ``img_per_s``: mean examples/s of the timed steps (images, for image tasks; the same number
    as ``examples_per_s``). ``weight_per_s``: with ``log.weight_unit`` (tokens, say), the mean
    loss weight/s (tokens/s); None otherwise.
    """

    step: int
    eval: dict[str, float]
    wall_s: float
    img_per_s: float
    checkpoint_dir: str
    input_wait_fraction: float = 0.0
    model: nnx.Module | None = None
    skipped_steps: int = 0
    weight_per_s: float | None = None

    @property
    def examples_per_s(self) -> float:
        """Mean examples/s of the timed steps (``img_per_s`` under its task-neutral name)."""
        return self.img_per_s


def train_and_evaluate(
    cfg: Config,
    parts: Parts | None = None,
    job: Job | None = None,
    stop: StopRequest | None = None,
) -> RunResult:
    """Train ``cfg`` to its last step (resuming from ``workdir`` if allowed), evaluate, save.

    ``parts`` replaces the model, optimizer, data or loss that ``cfg`` names; ``job`` is what
    :func:`jddp.distributed.initialize` returned (default: the processes as they run now);
    ``stop`` is a :class:`StopRequest` already installed by the caller (default: one installed
    for the run), so a signal that arrived before this call still stops the run at its first
    step, with a checkpoint.
    Raises :class:`~jddp.errors.Preempted` after saving when a stop signal arrives,
    :class:`~jddp.errors.NonFiniteLoss` for a non-finite step under ``train.on_nonfinite=halt``,
    :class:`~jddp.errors.ConfigError` for bad input.
    """
    enable_compilation_cache(cfg.train.compilation_cache_dir)
    dist = cfg.dist
    comm = make_comm(
        job or current_job(dist), dist.backend, dist.grad_allreduce_dtype, dist.fuse_allreduce
    )
    check_same_config(comm, cfg)
    assert cfg.workdir is not None  # set by every config load (config.with_default_workdir)
    folder = RunFolder(cfg.workdir)
    lock = WorkdirLock(folder.lock_file)
    problem: ConfigError | None = None
    continues = False
    if comm.is_writer:
        try:
            check_installed(cfg.log.trackers)  # process 0 sends to them
            folder.prepare()
            lock.acquire()
        except ConfigError as e:
            problem = e
        if problem is None and not cfg.checkpoint.resume:
            continues = continues_preempted_run(folder, cfg)
            moved = None if continues else folder.set_aside_previous_run()
            if moved is not None:
                Console().say(
                    f"jddp: checkpoint.resume=false: the earlier run's outputs in this workdir "
                    f"were moved to {moved}"
                )
        if problem is None:
            try:  # the checkpoint it names becomes the newest: resumed as always
                apply_resume_from(folder, cfg, Console())
            except ConfigError as e:
                problem = e
    if not comm.agree(problem is None):
        lock.release()  # (held when checkpoint.resume_from was refused)
        raise problem or ConfigError(f"process 0 could not use workdir={cfg.workdir!r}")
    if comm.allgather_int(int(continues))[0]:  # process 0 decides for everyone
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=True))
    try:
        given_stop = stop is not None  # installed by the caller; else ours, for this run
        if stop is not None:
            stop.install()  # again: jax.distributed.initialize took SIGTERM since
        else:
            stop = StopRequest()
        watchdog = StallWatchdog(
            dist.step_timeout_s,
            dist.first_step_timeout_s,
            comm.process_index,
            stop_signal=stop.arrived,
        )
        with nullcontext(stop) if given_stop else stop, watchdog:
            wall_start = time.perf_counter()
            run = build_run(cfg, comm, folder, stop, parts or Parts(), watchdog)
            run.hooks.insert(0, LockCheck(lock))  # a no-op where the lock is not held
            run.trackers.start(run.tracked_config)
            try:
                return _finish(run, comm, wall_start, lock)
            except BaseException:
                run.watchdog.finished()  # failed already: the trackers' wait is no stall
                run.trackers.finish(status="failed")  # a no-op after a preemption's
                raise
    finally:
        lock.release()


def continues_preempted_run(folder: RunFolder, cfg: Config) -> bool:
    """Under ``checkpoint.resume=false``: whether the folder holds this same run, preempted and
    not finished since, which a rerun of the same command continues (``resume=false`` starts
    over only after an earlier finished run, or another config's)."""
    preempted = folder.preempted_run()
    if preempted is None:
        return False
    step, saved = preempted
    if changed_keys(saved, config_lib.to_dict(cfg)):
        return False
    Console().say(
        f"jddp: checkpoint.resume=false, but this workdir's run (same config) was preempted at "
        f"step {step}: continuing it"
    )
    return True


def _finish(run: Run, comm: Comm, wall_start: float, lock: WorkdirLock) -> RunResult:
    """Loop, then save (and stop, if preempted) or evaluate, save and summarise."""
    ckpts = run.checkpoints
    try:
        state, step, stopped = train_loop(run)
        run.progress.close()
        lock.verify()  # the last save only into a folder that is still this run's
        run.watchdog.waiting("checkpoint")
        ended_early = None  # why a callback ended the run (recorded: a rerun stays stopped)
        if stopped and run.reporter.stop_kind == "finish":  # a callback ended it: finished
            ended_early = run.stop.finish_reason or "a callback on process 0"
            run.console.say(f"jddp: stopped at step {step}: {ended_early}")
            stopped = False
        if stopped:
            run.saver.save(step, state)
            ckpts.close()
            comm.barrier()
            # Saved on every process: the trackers' bounded wait is no stall (a slow one said
            # "stalled ... stopping without saving" before the line saying it was saved).
            run.watchdog.finished()
            if comm.is_writer:
                run.folder.mark_preempted(step, run.config_dict)
            run.log.close()
            run.trackers.finish(checkpoint=str(ckpts.directory / str(step)), status="preempted")
            by = run.stop.signal_name or "signal on another process"
            run.console.say(
                f"jddp: preempted at step {step} ({by}); checkpoint "
                f"{ckpts.directory / str(step)} saved; rerun the same command to continue"
            )
            raise Preempted(step)
        check_some_step_counted(run, state, step)
        run.stop.finishing("final save and eval")
        # The final checkpoint before the final eval: an eval that fails (a corrupt image, OOM,
        # a kill) must not take the training with it.
        run.saver.save(step, state)  # (a no-op when the step's periodic save wrote it already)
        ckpts.close()
        comm.barrier()  # nobody leaves before rank 0's checkpoint is complete
        if comm.is_writer:
            run.folder.clear_preempted()
            if ended_early is not None:
                run.folder.mark_stopped(step, ended_early, early_stop_keys(run.cfg.train))
            elif run.stopped_early is None:  # trained on (to its last step)
                run.folder.clear_stopped()
    except NonFiniteLoss:
        ckpts.close()  # every process raised at the same step: finish the saves in flight
        raise
    except BaseException:
        if comm.process_count == 1:  # with peers gone, waiting on them could hang
            ckpts.close()
        raise
    skipped_steps = int(to_host(state.skipped_steps))
    check_skipped_fraction(run, skipped_steps, step)
    run.watchdog.progress()  # the final checkpoint is written
    run.watchdog.waiting("eval")
    eval_metrics = _final_eval(run, state, step)
    run.watchdog.finished()  # trained, saved, evaluated: the trackers' bounded wait is no stall
    run.log.close()
    result = RunResult(
        step=step,
        eval=eval_metrics,
        wall_s=time.perf_counter() - wall_start,
        img_per_s=run.meter.examples_per_s,
        checkpoint_dir=str(ckpts.directory / str(step)),
        input_wait_fraction=run.meter.input_wait.mean_fraction,
        model=run.trained_model(state),
        skipped_steps=skipped_steps,
        weight_per_s=run.meter.weight_per_s,
    )
    run.trackers.finish(done_fields(run, result), result.checkpoint_dir)  # before the last line
    _summarise(run, result)
    run.callbacks.end(result)
    return result


def _final_eval(run: Run, state: TrainState, step: int) -> dict[str, float]:
    """Evaluate the saved final state and log it; a failure says the training is saved and how
    to evaluate it again."""
    try:
        eval_metrics = run.evaluate(state)
    except Exception as e:  # noqa: BLE001 - whatever failed, the run's checkpoint is on disk
        cause = one_line(e) if isinstance(e, JddpError) else f"{type(e).__name__}: {one_line(e)}"
        saved = run.checkpoints.directory / str(step)
        # A config naming code is refused by the evaluate command without the flag.
        trust = " --trust-code" if any(names_code(v) for _, v in code_specs(run.cfg)) else ""
        again = (
            f"jddp.evaluate(jddp.load({str(saved)!r}, model=model), data), model built as "
            f"the one given to jddp.fit"
            if run.user_model is not None
            else f"python -m jddp.evaluate --workdir {run.folder.root}{trust}"
        )
        raise EvalFailed(
            f"the final eval failed ({cause}); the training is saved in checkpoint {saved}; "
            f"evaluate it again with: {again}"
        ) from e
    nonfinite = nonfinite_eval(eval_metrics)
    if nonfinite:  # not a result: exit 1, the training stays saved
        raise EvalFailed(
            f"the final eval gave {nonfinite} over {eval_metrics['eval/count']} eval examples "
            f"(NaN/Inf in the eval data or the weights, loss weights summing to 0, or a max/min "
            "metric over no rows); not "
            "logged; the training is saved in "
            f"checkpoint {run.checkpoints.directory / str(step)}"
        )
    if not run.log.logged(step, "eval/loss"):  # a rerun of a finished run logs it once
        run.log.write(step, eval_metrics)
    if run.best is not None:  # the final checkpoint, ranked with the others
        run.best.record(step, eval_metrics)
    return eval_metrics


def check_some_step_counted(run: Run, state: TrainState, step: int) -> None:
    """Under ``train.on_nonfinite=skip``, a run whose every step was skipped learned nothing:
    that is a failure, not a success."""
    ran = step - run.start_step
    skipped = int(to_host(state.skipped_steps)) - run.start_skipped_steps
    if ran > 0 and skipped == ran:
        raise NonFiniteLoss(
            f"all {ran} steps of this run (steps {run.start_step + 1}..{step}) had a non-finite "
            "loss or gradient and were skipped (train.on_nonfinite=skip): nothing was learned "
            "and nothing was saved"
        )


def check_skipped_fraction(run: Run, skipped_steps: int, step: int) -> None:
    """A run that dropped more than ``train.max_skipped_fraction`` of its updates failed, even
    though it reached its last step (its final checkpoint is saved already)."""
    limit = run.cfg.train.max_skipped_fraction
    if step > 0 and skipped_steps > limit * step:
        raise NonFiniteLoss(
            f"{skipped_steps} of {step} steps ({100 * skipped_steps / step:.0f}%) had a "
            f"non-finite loss or gradient and were skipped (train.on_nonfinite=skip), more than "
            f"train.max_skipped_fraction={limit}; the run failed; its checkpoint "
            f"{run.checkpoints.directory / str(step)} is saved"
        )


def done_fields(run: Run, result: RunResult) -> dict[str, float]:
    """The numbers of the ``jddp: done`` line, unrounded (for the run's trackers)."""
    ev, meter = result.eval, run.meter
    fields: dict[str, float] = {"step": result.step}
    weight_key = f"eval/{meter.weight_unit}"
    fields |= {k: v for k, v in ev.items() if isinstance(v, float) and k != weight_key}
    fields[meter.rate_key.removeprefix("train/")] = result.img_per_s
    if result.weight_per_s is not None:
        fields[f"{meter.weight_unit}_per_s"] = result.weight_per_s
    return fields | {"wall_s": result.wall_s, "skipped": result.skipped_steps}


def _summarise(run: Run, result: RunResult) -> None:
    ev, meter = result.eval, run.meter
    unit, weight_unit = run.progress.unit, meter.weight_unit
    rates = f"{result.img_per_s:.1f} {unit}/s"
    if result.weight_per_s is not None:
        rates += f", {result.weight_per_s:.0f} {weight_unit}/s"
    policy = run.cfg.train.on_nonfinite  # halt: a skipped step is one from before a resume
    processes = run.comm.process_count
    run.console.say(
        "jddp: summary\n"
        f"  steps          {run.start_step} -> {result.step} of {run.total_steps}\n"
        f"  eval           {describe_eval(ev, weight_unit)}\n"
        f"  skipped        {result.skipped_steps} of {result.step} steps (non-finite loss or "
        f"gradient, train.on_nonfinite={policy})\n"
        f"  throughput     {rates} on {run.num_devices} devices "
        f"({processes} process{'es' if processes != 1 else ''})\n"
        f"  input wait     {100 * result.input_wait_fraction:.2f}% of the timed step wall time "
        f"({InputWait.KEY}, mean over the run)\n"
        f"  wall time      {result.wall_s:.1f} s\n"
        f"  checkpoint     {result.checkpoint_dir}\n"
        f"  metrics        {run.folder.metrics_jsonl} (plots: python -m jddp.plot "
        f"{run.folder.root})"
    )
    # The task's eval means, accuracy first where there is one (as before tasks), then the loss.
    means = [k for k, v in ev.items() if isinstance(v, float) and k != f"eval/{weight_unit}"]
    means.sort(key=lambda k: (k != "eval/accuracy", k != "eval/loss"))
    rate_keys = f"{meter.rate_key.removeprefix('train/')}={result.img_per_s:.1f}"
    if result.weight_per_s is not None:
        rate_keys += f" {weight_unit}_per_s={result.weight_per_s:.1f}"
    run.console.say(
        f"jddp: done step={result.step} "
        + " ".join(f"{k}={ev[k]:.4f}" for k in means)
        + f" {rate_keys} wall_s={result.wall_s:.1f} checkpoint={result.checkpoint_dir} "
        f"skipped={result.skipped_steps}"
    )
