"""CLI: ``python -m jddp.evaluate --workdir W [--step N|best] [key=value ...]``.

Evaluates a checkpoint of a run on the configured eval split (overrides may change ``data.*``),
on any number of devices and processes (under ``python -m jddp.launch``, SLURM or mpirun, as
train), prints the result and appends it to ``W/metrics.jsonl``. The work is
:func:`jddp.eval_lib.evaluate_checkpoint`; the library call ``jddp.evaluate(...)`` is
:func:`jddp.eval_lib.evaluate_model` (this module is run, not imported: importing it would
bind ``jddp.evaluate`` to the module instead of that function).

Exit codes are those of train: 0 once the result is printed (a metrics.jsonl that cannot be
written is a warning), 2 for bad input (no checkpoint in the workdir, a ``--step`` that does not
exist or was deleted by a live run's rotation, a bad override), 1 for any other failure (a
damaged checkpoint: the line names it and the newest intact one), 130 for Ctrl-C: one line
``jddp: interrupted`` at any moment from this module's first statements on (while numpy, the
rest of jddp and JAX import, JAX starts, the checkpoint is read or evaluated). Not covered: the
milliseconds before them, Python's own start-up and ``jddp/__init__.py`` (which imports nothing
that takes time), where Ctrl-C is Python's default ``KeyboardInterrupt``.
"""

from __future__ import annotations

from jddp.proc.interrupt import interrupts_exit

# The command's first statements: from here on Ctrl-C at any moment is one line and exit 130,
# before argparse, numpy and JAX load (a handler installed after numpy left a window in which
# SIGINT was a traceback). main() restores the previous handler (runs in-process, as in tests).
_CTRL_C = interrupts_exit().install() if __name__ == "__main__" else interrupts_exit()

import argparse  # noqa: E402 (after the handler, on purpose)
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

USAGE = (
    "python -m jddp.evaluate --workdir W [--step N|best] [--ema] [--trust-code] [key.sub=value ...]"
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``--workdir``, ``--step`` and the ``key=value`` overrides."""
    from jddp.cli import OneLineParser, checkpoint_step

    parser = OneLineParser(
        prog="python -m jddp.evaluate",
        usage=USAGE,
        description="Evaluate a checkpoint of a run on its eval split (every example once): "
        "loss, top-1 and top-5 accuracy, printed and appended to WORKDIR/metrics.jsonl.",
    )
    parser.add_argument("--workdir", required=True, help="the run's folder")
    parser.add_argument(
        "--step",
        type=checkpoint_step,
        help="checkpoint step, or best (by checkpoint.monitor, a run with checkpoint.keep_best; "
        "default: the newest)",
    )
    parser.add_argument(
        "--ema",
        action="store_true",
        help="evaluate the parameters' moving average (a run with train.ema_decay), logged as "
        "eval_ema/...",
    )
    parser.add_argument(
        "--trust-code",
        action="store_true",
        help="import the pkg.module:factory names of the run's saved config (model, data, "
        "loss, metrics): their code runs, as a script's would; without it such a config is "
        "refused (exit 2). Built-in names need no consent",
    )
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. data.*")
    return parser.parse_intermixed_args(argv)  # overrides before and after the flags


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    with _CTRL_C:  # installed already when run as a command; also when main() is called
        argv = sys.argv[1:] if argv is None else argv
        from jddp.checkpoint.find import find_checkpoint
        from jddp.cli import Session, run
        from jddp.config import refuse_fit_run
        from jddp.eval_lib import evaluate_checkpoint, run_config

        def body(session: Session) -> int:
            args = parse_args(argv)
            cfg = run_config(Path(args.workdir), args.overrides, trust_code=args.trust_code)
            refuse_fit_run(cfg, "python -m jddp.evaluate")
            find_checkpoint(args.workdir, args.step, "--workdir", "--step")  # before JAX starts
            evaluate_checkpoint(
                cfg, args.workdir, args.step, session.start_jax(cfg.dist), ema=args.ema
            )
            return 0

        return run(body)


if __name__ == "__main__":
    sys.exit(main())
