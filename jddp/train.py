"""CLI: ``python -m jddp.train --config FILE.yaml [key.sub=value ...]``.

Exit codes: 0 success; 2 bad config or command line (the message names the key);
75 preempted (SIGTERM/SIGUSR1): a checkpoint was saved, rerun the same command to continue;
1 any other failure, with a one-line cause on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys

from jddp import config as config_lib
from jddp import errors
from jddp.errors import ConfigError, JddpError, Preempted

USAGE = (
    "python -m jddp.train --config FILE.yaml [key.sub=value ...] [--print-config] "
    "[--allow-config-change]"
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # exit 2 with one line, as for config errors
        raise ConfigError(f"command line: {message} (usage: {USAGE})")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``--config``, ``--print-config`` and the ``key=value`` overrides."""
    parser = _Parser(
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
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, YAML-typed")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    # Under ``python -m jddp.launch``: go when the launcher goes, even where PDEATHSIG is missing.
    from jddp.lifeline import watch_launcher

    watch_launcher()
    job = None
    try:
        args = parse_args(argv)
        overrides = list(args.overrides)
        if args.allow_config_change:
            overrides.append("checkpoint.allow_config_change=true")
        cfg = config_lib.load(args.config, overrides)
        if args.print_config:
            print(config_lib.dump(cfg), end="")
            return 0
        # XLA reads XLA_FLAGS when its backends start: before jax.distributed or any compute.
        from jddp.xla_setup import apply_cpu_flags

        apply_cpu_flags()
        # Heavy imports only when training; jax.distributed must start before any computation.
        from jddp import distributed
        from jddp.trainer import train_and_evaluate

        job = distributed.initialize(cfg.dist)
        train_and_evaluate(cfg, job=job)
        return 0
    except Preempted:
        return errors.PREEMPTED  # every process saved and stops by itself
    except JddpError as e:
        print(f"jddp: error: {_one_line(e)}", file=sys.stderr)
        return _stop_peers(job, e.exit_code)
    except KeyboardInterrupt:
        print("jddp: interrupted", file=sys.stderr)
        return _stop_peers(job, errors.INTERRUPTED)
    except Exception as e:  # noqa: BLE001 - the CLI's contract is one line and exit 1
        print(f"jddp: error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return _stop_peers(job, errors.FAILURE)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _stop_peers(job, exit_code: int) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    if job is not None:
        sys.modules["jddp.distributed"].abort_job(job, exit_code)
    if exit_code == errors.FAILURE and "jax" in sys.modules:
        # After a runtime failure, skip interpreter teardown: background checkpoint threads
        # would print tracebacks after our one line, and jax.distributed's shutdown would wait
        # for peers that may be gone.
        os._exit(exit_code)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
