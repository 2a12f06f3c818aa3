"""Moved to :mod:`jddp.proc.watchdog` (a process-level thread that ends the process); this name
is the same module, so ``from jddp.run.watchdog import StallWatchdog`` keeps working."""

import sys

from jddp.proc import watchdog

sys.modules[__name__] = watchdog
