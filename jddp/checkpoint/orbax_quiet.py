"""Keeping orbax's own reports of failures jddp reports itself off the terminal: a failed
background save's traceback, and the garbage a failed restore leaves (futures and coroutines
whose reports Python's garbage collector would print at a random later moment)."""

from __future__ import annotations

import gc
import logging
import sys
import warnings
from typing import Any


class _DropOrbaxErrors(logging.Filter):
    """Orbax logs a failed background save with its traceback (hundreds of lines) before the
    error reaches the caller; jddp reports that failure itself, as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


def quiet_orbax_errors() -> None:
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _DropOrbaxErrors) for f in logger.filters):
        logger.addFilter(_DropOrbaxErrors())


# asyncio's reports of abandoned work: a future or task whose exception nobody read, or a task
# collected while still pending. Logged (with a traceback) when the object is garbage-collected.
_ABANDONED_REPORTS = (
    "Task exception was never retrieved",
    "Future exception was never retrieved",
    "Task was destroyed but it is pending",
)

_collecting_abandoned = False  # set while collect_abandoned_reads() runs


class _DropAbandonedReadReports(logging.Filter):
    """asyncio's reports of a failed restore's leftovers (see :func:`collect_abandoned_reads`):
    every such report while they are collected, and orbax's own coroutines' at any time."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(_ABANDONED_REPORTS):
            return True
        return not (_collecting_abandoned or "/orbax/" in message)


def collect_abandoned_reads() -> None:
    """Garbage-collect what a failed checkpoint read left behind, now, without a word on stderr.

    When one array fails to read, orbax abandons its other reads: their futures (some holding
    the same read error), tasks and never-awaited coroutines become garbage in reference
    cycles. Python's cyclic collector finalises them whenever allocations next trigger it, and
    each then reports itself on stderr: asyncio logs "Future exception was never retrieved"
    with a traceback, Python warns "coroutine 'Store._get_array_metadatas' was never awaited".
    That moment fell anywhere in the run after the failed read, between jddp's own lines (in
    4 of 40 restores of a wholly damaged checkpoint in one process; tests/test_bad_input.py's
    all-damaged run failed on one such line in a fresh clone). Collected here, the reports all
    happen at once, inside this scope, where exactly these two kinds are dropped; every other
    warning and log record passes as before.
    """
    global _collecting_abandoned
    _collecting_abandoned = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="coroutine .* was never awaited", category=RuntimeWarning
            )
            gc.collect()
    finally:
        _collecting_abandoned = False


def silence_late_read_callbacks() -> None:
    """Keep stderr to jddp's own lines when a restore fails (installed before restoring).

    When one array of a checkpoint fails to read, orbax closes its event loop while tensorstore
    still has reads of the other arrays in flight; as those finish, their callbacks hit the
    closed loop and each reports ``RuntimeError: Event loop is closed`` as an unraisable
    exception (~150 tracebacks for a ResNet), interleaved with jddp's warning and error lines.
    Those reads belong to an attempt already judged damaged, so exactly that error is dropped;
    the attempt's other leftovers are collected by :func:`collect_abandoned_reads`.
    """
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _DropAbandonedReadReports) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(_DropAbandonedReadReports())
    previous = sys.unraisablehook
    if getattr(previous, "_jddp_filter", False):
        return

    def hook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        previous(unraisable)

    hook._jddp_filter = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
