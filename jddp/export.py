"""CLI: ``python -m jddp.export --workdir W [--step N|best] --format stablehlo|onnx [--batch-size
B|dynamic] [--input-shape SHAPE] OUT``.

Writes the trained model of a run (its newest checkpoint, or ``--step``) for inference, in eval
mode, as one program of the arrays the model takes (for image classification: normalised
images, as ``jddp.load(W)``'s model takes them). The work is
:func:`jddp.export_lib.export_checkpoint`; the library call ``jddp.export(...)`` is
:func:`jddp.export_lib.export_model` (this module is run, not imported, as ``jddp.evaluate``).

Exit codes are those of train: 0 once written; 2 for bad input (no checkpoint in the workdir, a
``--step`` that does not exist, an unknown format, a bad batch size, OUT's folder missing,
inputs that cannot be told from the run: pass ``--input-shape``); 1 for any other failure (a
damaged checkpoint, a model the converter cannot express — the line names the operation —, an
export whose outputs differ from the model's); 130 for Ctrl-C: one line ``jddp: interrupted``
at any moment from this module's first statement on (as ``python -m jddp.evaluate``).
"""

from __future__ import annotations

from jddp.proc.interrupt import interrupts_exit

# The command's first statements: from here on Ctrl-C at any moment is one line and exit 130,
# before argparse, numpy and JAX load (a handler installed after numpy left a window in which
# SIGINT was a traceback). main() restores the previous handler (runs in-process, as in tests).
_CTRL_C = interrupts_exit().install() if __name__ == "__main__" else interrupts_exit()

import argparse  # noqa: E402 (after the handler, on purpose)
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

USAGE = (
    "python -m jddp.export --workdir W [--step N|best] --format stablehlo|onnx "
    "[--batch-size B|dynamic] [--input-shape SHAPE] [--ema] [--trust-code] OUT"
)


def _batch_size(text: str) -> int | None:
    """``--batch-size``: ``dynamic`` (None) or a positive int."""
    if text.strip().lower() == "dynamic":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'dynamic' nor a positive int")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``--workdir``, ``--step``, ``--format``, ``--batch-size``, ``--input-shape`` and OUT."""
    from jddp.cli import OneLineParser, checkpoint_step
    from jddp.export_lib import FORMATS

    parser = OneLineParser(
        prog="python -m jddp.export",
        usage=USAGE,
        description="Write the trained model of a run for inference (eval mode): StableHLO "
        "(jax.export) or ONNX (jax2onnx, checked in onnxruntime).",
    )
    parser.add_argument("--workdir", required=True, help="the run's folder")
    parser.add_argument(
        "--step",
        type=checkpoint_step,
        help="checkpoint step, or best (by checkpoint.monitor, a run with checkpoint.keep_best; "
        "default: the newest)",
    )
    parser.add_argument("--format", required=True, choices=FORMATS, help="what to write")
    parser.add_argument(
        "--batch-size",
        type=_batch_size,
        default=None,
        help="the batch the program takes: 'dynamic' (default: any) or a number",
    )
    parser.add_argument(
        "--input-shape",
        help="one example's shape, e.g. 32,32,3 (float32) or int32[128], when the run's data "
        "cannot tell it (default: read from the run's eval data)",
    )
    parser.add_argument(
        "--ema",
        action="store_true",
        help="export the parameters' moving average (a run with train.ema_decay)",
    )
    parser.add_argument(
        "--trust-code",
        action="store_true",
        help="import the pkg.module:factory names of the run's saved config (model, data, "
        "loss, metrics): their code runs, as a script's would; without it such a config is "
        "refused (exit 2). Built-in names need no consent",
    )
    parser.add_argument("out", metavar="OUT", help="the file to write")
    return parser.parse_args(argv)


def _check_out(out: Path) -> None:
    """OUT names a file in an existing folder (said before anything is loaded)."""
    from jddp.errors import ConfigError

    if out.is_dir():
        raise ConfigError(f"OUT: {out} is a folder; give the file to write")
    if not out.absolute().parent.is_dir():
        raise ConfigError(f"OUT: folder {out.absolute().parent} does not exist")
    if not os.access(out.absolute().parent, os.W_OK):  # said now, not after the export's work
        raise ConfigError(f"OUT: folder {out.absolute().parent} is not writable")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    with _CTRL_C:  # installed already when run as a command; also when main() is called
        argv = sys.argv[1:] if argv is None else argv
        from jddp.cli import run

        def body(session: object) -> int:
            args = parse_args(argv)
            out = Path(args.out)
            _check_out(out)
            from jddp.checkpoint.find import find_checkpoint

            find_checkpoint(args.workdir, args.step, "--workdir", "--step")  # before JAX starts
            from jddp.proc.versions import check_versions
            from jddp.proc.xla import apply_cpu_flags

            check_versions()
            apply_cpu_flags()
            from jddp.config import refuse_fit_run
            from jddp.eval_lib import run_config
            from jddp.imports import CODE_KEYS

            # The code the export imports: the model's; the data's and the task's unless
            # --input-shape gives the inputs. Refused before any of it is imported.
            imports = ("model.name",) if args.input_shape else CODE_KEYS
            cfg = run_config(Path(args.workdir), trust_code=args.trust_code, imports=imports)
            refuse_fit_run(cfg, "python -m jddp.export")
            from jddp.export_lib import describe_inputs, export_checkpoint

            exported, checkpoint, loaded = export_checkpoint(
                args.workdir,
                args.step,
                out,
                args.format,
                args.batch_size,
                args.input_shape,
                ema=args.ema,
                trust_code=args.trust_code,
            )
            print(describe_inputs(exported, checkpoint, loaded), flush=True)
            return 0

        return run(body)


if __name__ == "__main__":
    sys.exit(main())
