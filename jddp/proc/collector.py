"""Python's cyclic garbage collector in a process that traces JAX programs.

Building a model, tracing and lowering its steps and writing checkpoints allocate millions of
short-lived objects, and Python collects its youngest generation every 700 net allocations:
~670 collections took 0.60 of the 4.9 CPU-s of the tests' tiny run (2 devices, 4 steps, warm
compilation cache; 0.62 of 13.6 CPU-s in ``examples/custom_cnn_digits.py``), each one walking
objects about to die anyway. With the youngest generation collected every 50,000 allocations
the same run took 7 collections and 0.12 CPU-s (the example 10 and 0.22; 2-core VM,
2026-11-28). Cyclic garbage still goes, later; the older generations keep their thresholds.
``JDDP_GC_DEFAULTS=0`` keeps Python's own settings.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

YOUNG_THRESHOLD = 50_000  # net allocations between two collections of the youngest generation


def collect_less_often() -> None:
    """Collect the youngest generation every :data:`YOUNG_THRESHOLD` allocations (never lowers a
    threshold set higher, never turns a collector switched off back on)."""
    if os.environ.get("JDDP_GC_DEFAULTS", "1") == "0":
        return
    young, middle, old = gc.get_threshold()
    if 0 < young < YOUNG_THRESHOLD:
        gc.set_threshold(YOUNG_THRESHOLD, middle, old)


@contextlib.contextmanager
def collecting_less_often() -> Iterator[None]:
    """:func:`collect_less_often` for the block (a library call in the user's process), the
    thresholds as they were after it."""
    before = gc.get_threshold()
    collect_less_often()
    try:
        yield
    finally:
        gc.set_threshold(*before)
