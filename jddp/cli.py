"""What the command-line entry points share: one-line usage errors (exit 2), the start of JAX
(jddp's XLA flags, then the distributed job), and the mapping of every failure to one line on
stderr and its exit code (:mod:`jddp.errors`)."""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
from collections.abc import Callable
from typing import Any

from jddp import errors
from jddp.compat.collector import collect_less_often
from jddp.errors import ConfigError, JddpError, Preempted, one_line
from jddp.proc import watchdog
from jddp.proc.cores import size_cpu_threads
from jddp.proc.versions import check_versions
from jddp.proc.xla import apply_cpu_flags


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are a :class:`ConfigError` (one line, exit 2)."""

    def error(self, message: str) -> None:
        raise ConfigError(f"command line: {message} (usage: {self.usage})")


def checkpoint_step(text: str) -> int | str:
    """``--step``: a checkpoint's step, or ``best`` (the run's best by ``checkpoint.monitor``,
    recorded with ``checkpoint.keep_best``)."""
    if text.strip().lower() == "best":
        return "best"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a step number nor best") from None


class Session:
    """One CLI invocation: holds the job once JAX has started, so a failure can stop peers."""

    def __init__(self) -> None:
        self.job: Any = None

    def start_jax(self, dist_cfg: Any) -> Any:
        """A known-broken jax/flax pair stops here in one line; then jddp's XLA flags (read when
        XLA's backends start), then join the job."""
        check_versions()
        apply_cpu_flags()
        size_cpu_threads(dist_cfg.cpu_threads)
        from jddp import distributed  # imports jax: only now, after the checks and the flags

        self.job = distributed.initialize(dist_cfg)
        return self.job


def run(body: Callable[[Session], int]) -> int:
    """``body(session)``'s exit code, or the exit code of what it raised, after one line on
    stderr (``Preempted``: every process saved and stops by itself, nothing to print)."""
    # A crash in native code (XLA, a data-loading extension) then leaves the Python stacks of
    # every thread on stderr instead of a bare "killed by SIGSEGV".
    faulthandler.enable(all_threads=True)
    collect_less_often()  # before JAX's imports: they too allocate for the collector to walk
    session = Session()
    try:
        return body(session)
    except Preempted:
        return errors.PREEMPTED
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - one line and an exit code
        if watchdog.FIRED.is_set():  # the stall was said in one line: this is its aftermath
            os._exit(watchdog.fired_exit_code())  # (a collective failing as a peer exits)
        if isinstance(e, JddpError):
            print(f"jddp: error: {one_line(e)}", file=sys.stderr)
            return stop_peers(session.job, e.exit_code)
        if isinstance(e, KeyboardInterrupt):
            print("jddp: interrupted", file=sys.stderr)
            return stop_peers(session.job, errors.INTERRUPTED)
        print(f"jddp: error: {type(e).__name__}: {one_line(e)}", file=sys.stderr)
        return stop_peers(session.job, errors.FAILURE)


def stop_peers(job: Any, exit_code: int) -> int:
    """Take the job's other processes down where they would otherwise wait (MPI), then return
    ``exit_code``; after a runtime failure or Ctrl-C, skip the interpreter's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    if job is not None:
        sys.modules["jddp.distributed"].abort_job(job, exit_code)
    if exit_code in (errors.FAILURE, errors.INTERRUPTED) and "jax" in sys.modules:
        # Background checkpoint threads would print tracebacks after our one line, and
        # jax.distributed's shutdown would wait for peers that may be gone; after Ctrl-C, the
        # teardown of XLA and input threads interrupted mid-work could crash (SIGSEGV).
        os._exit(exit_code)
    return exit_code
