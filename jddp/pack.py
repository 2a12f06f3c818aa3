"""CLI: ``python -m jddp.pack SRC OUT``: write a data set's train and eval splits as a pack.

A pack (:mod:`jddp.data.pack_format`) is a few large ArrayRecord shards per split plus
``pack.json``; train from it with ``data.name=packed data.path=OUT``. Image folders keep each
file's bytes (``--max-side N`` re-encodes the images whose shorter side exceeds ``N``), and so do
Parquet and WebDataset shards (``SRC`` a folder, or a glob or brace pattern of shards);
CIFAR-10, MNIST and npz keep their raw pixels. Shards are written in parallel, each to a
temporary name and renamed once complete and verified; the manifest is written last, so an
interrupted pack never reads as complete, and rerunning the same command continues it.

Exit codes: 0 done; 2 bad command line, unknown source layout, or an ``OUT`` that holds
something else; 1 an unreadable image (without ``--skip-bad``) or any other failure; 75
stopped by SIGTERM, SIGHUP or SIGUSR1 and 130 by Ctrl-C (one line; the shards written are
kept, and rerunning the same command continues).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from jddp.cli import OneLineParser, run
from jddp.data.pack_format import MANIFEST
from jddp.data.pack_source import FORMATS
from jddp.data.pack_writer import pack
from jddp.errors import PREEMPTED, STOP_SIGNALS, ConfigError, JddpError

USAGE = (
    "python -m jddp.pack SRC OUT [--format imagefolder|cifar10|mnist|npz|parquet|webdataset] "
    "[--max-side N] "
    "[--quality Q] [--workers W] [--skip-bad] [--shard-mb MB]"
)


def positive_int(text: str) -> int:
    """argparse type: an int > 0."""
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


class PackStopped(JddpError):
    """A stop signal (SIGTERM, SIGHUP, SIGUSR1) ended the pack; a rerun continues it (exit 75,
    as a preempted training run)."""

    exit_code = PREEMPTED


def _stopped(signum: int, frame: object) -> None:
    raise PackStopped(
        f"pack: stopped by {signal.Signals(signum).name}; the shards written so far are kept: "
        "rerun the same command to continue"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    # Ctrl-C stays KeyboardInterrupt: "jddp: interrupted", 130
    previous = {sig: signal.signal(sig, _stopped) for sig in STOP_SIGNALS if sig != signal.SIGINT}

    def body(session: Any) -> int:
        del session
        parser = OneLineParser(prog="python -m jddp.pack", usage=USAGE, description=__doc__)
        parser.add_argument("src", metavar="SRC", help="the data set, as data.path reads it")
        parser.add_argument("out", metavar="OUT", help="the pack folder (new, empty or unfinished)")
        parser.add_argument("--format", choices=FORMATS, help="SRC's format (default: detected)")
        parser.add_argument(
            "--max-side",
            type=positive_int,
            help="re-encode images whose shorter side exceeds N to shorter side N (JPEG)",
        )
        parser.add_argument(
            "--quality", type=positive_int, default=90, help="JPEG quality of re-encoded images"
        )
        parser.add_argument(
            "--workers",
            type=positive_int,
            default=len(os.sched_getaffinity(0)),
            help="processes writing shards (default: the cores)",
        )
        parser.add_argument(
            "--skip-bad", action="store_true", help="skip (and count) unreadable images"
        )
        parser.add_argument(
            "--shard-mb", type=float, default=256.0, help="about this many MB of source per shard"
        )
        args = parser.parse_args(argv)
        if args.quality > 100:
            raise ConfigError(f"pack: --quality={args.quality} must be in 1..100")
        if not args.shard_mb > 0:
            raise ConfigError(f"pack: --shard-mb={args.shard_mb} must be positive")
        manifest, wrote = pack(
            Path(args.src),
            Path(args.out),
            args.format,
            args.max_side,
            args.quality,
            args.workers,
            args.skip_bad,
            args.shard_mb,
        )
        for name, split in manifest["splits"].items():
            skipped = len(split["skipped"])
            print(
                f"pack: {name}: {split['count']} examples in {len(split['shards'])} shard(s), "
                f"{split['reencoded']} re-encoded, {skipped} skipped"
                + (f" (first: {split['skipped'][0]})" if skipped else "")
            )
        if wrote:  # an already complete pack was said so on stderr, and nothing was written
            print(f"pack: wrote {str(Path(args.out) / MANIFEST)!r} (pack id {manifest['pack_id']})")
        return 0

    try:
        return run(body)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
