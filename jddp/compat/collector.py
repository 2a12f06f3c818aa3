"""Python's cyclic garbage collector in a process that traces JAX programs.

Building a model, tracing and lowering its steps and writing checkpoints allocate millions of
short-lived objects, and Python collects its youngest generation every 700 net allocations: in
the tests' tiny run (2 devices, 4 steps, warm compilation cache) ~665 collections took 0.47-0.51
of the main thread's 2.5-2.7 CPU-s, each walking objects about to die anyway. Collected every
50,000 allocations: 59 collections, 0.12-0.13 s; the whole process 0.93-0.95x its CPU
(``experiments/bench_gc.py``, 2-core VM, 2026-11-28; a 1,000-step ``jddp.fit`` of a small CNN
showed no difference beyond its noise). Cyclic garbage still goes, later; the older
generations keep their thresholds.
``JDDP_GC_DEFAULTS=0`` keeps Python's own settings.

No library's internals: a setting of the whole process. jddp's commands set it for good
(:func:`jddp.cli.run`), ``jddp.fit`` for its call only (:func:`collecting_less_often`). Goes
when a collection of the youngest generation stops costing that much (a Python whose collector
works differently, a JAX that allocates less while tracing): ``experiments/bench_gc.py`` says.
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
