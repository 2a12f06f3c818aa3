"""CLI: ``python -m jddp.train --config FILE.yaml [key.sub=value ...]``.

Exit codes: 0 success; 2 bad config or command line (the message names the key);
75 preempted (SIGTERM/SIGUSR1/SIGINT/SIGHUP): a checkpoint was saved, rerun the same command to
continue;
1 any other failure, with a one-line cause on stderr.
"""

from __future__ import annotations

if __name__ == "__main__":  # the command: its stop signals kept from its first statement on
    from jddp.proc.signals import StopRequest

    _STOP: StopRequest | None = StopRequest()
    _STOP.install()  # (a signal while the libraries below load: stops at the first step)
else:
    _STOP = None

import argparse
import sys

from jddp import config as config_lib
from jddp.cli import OneLineParser, Session, run
from jddp.proc.lifeline import watch_launcher
from jddp.proc.signals import StopRequest  # noqa: F811 - as a library module too

USAGE = (
    "python -m jddp.train --config FILE.yaml [key.sub=value ...] [--print-config] "
    "[--allow-config-change] [--trust-code]"
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``--config``, ``--print-config`` and the ``key=value`` overrides."""
    parser = OneLineParser(
        prog="python -m jddp.train",
        usage=USAGE,
        description="Train a Flax NNX model data-parallel over all devices.",
        epilog=config_lib.help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML config file (sections as in --help below)")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parser.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume even if training keys differ from the checkpoint's config "
        "(= checkpoint.allow_config_change=true)",
    )
    parser.add_argument(
        "--trust-code",
        action="store_true",
        help="changes nothing here, accepted as evaluate and export take it: train imports only "
        "the pkg.module:factory names of the config you give (trusted, as a script is); a "
        "workdir's saved config is compared on resume, never imported, and "
        "checkpoint.init_from reads another run's weights, not its code",
    )
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, YAML-typed")
    return parser.parse_intermixed_args(argv)  # overrides before and after the flags


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    # Under ``python -m jddp.launch``: go when the launcher goes, even where PDEATHSIG is missing.
    watch_launcher()

    def body(session: Session) -> int:
        args = parse_args(argv)
        overrides = list(args.overrides)
        if args.allow_config_change:
            overrides.append("checkpoint.allow_config_change=true")
        cfg = config_lib.load(args.config, overrides)
        if args.print_config:
            print(config_lib.dump(cfg), end="")
            return 0
        config_lib.refuse_fit_run(cfg, "python -m jddp.train")
        job = session.start_jax(cfg.dist)  # before any computation
        from jddp.run.trainer import train_and_evaluate  # flax: after start_jax's version check

        train_and_evaluate(cfg, job=job, stop=stop)
        return 0

    # The stop signals are caught from here on (as the command, from its first statement): one
    # that arrives while JAX starts or the job assembles (seconds; under a launcher, until
    # every peer joined) stops the run at its first step with a checkpoint and exit 75, instead
    # of killing it (SIGTERM's default) with an exit code a requeueing job script does not read
    # as preemption.
    with _STOP or StopRequest() as stop:
        return run(body)


if __name__ == "__main__":
    sys.exit(main())
