"""How orbax writes: on CPU devices, each replica's share of an array every device holds is cut
on the host; after a failed save, its other writes are awaited.

Orbax's replica-parallel save (its default except where ``JAX_PLATFORMS`` names a GPU) splits
each replicated array along a dimension and has every replica write its slice. It cuts each
slice on the device by an eager ``lax.slice_in_dim``: a program traced, lowered and compiled for
each distinct shape in each process. A tiny ResNet's first save on 2 devices compiled 42 of
them, 1.0 of the run's 4.7 CPU-s on the 2-core VM, and a 2-process 2x2 run spent 2.1 of its
13 CPU-s there (jddp's tests start hundreds of such runs). A CPU device's buffer is host memory
already, so jddp cuts those slices with NumPy instead, no program compiled: the replicas write
the same shares of the same bytes as with orbax's slicing (an earlier way, leaving arrays under
1 MiB to replica 0, had process 0 write nearly all of a small model's checkpoint). Arrays on
accelerators are cut by orbax as before.

A save's first failed write (a full disk) surfaces while orbax's threads for its other writes
may still run; one that lands after jddp removed the failed save's temporary folder can
re-create it. That is the likely cause of a half-written save left behind once in ~12 runs
of tests/test_trust.py's full disk (a first save failing): :func:`wait_for_failed_writes`
waits for those threads before the folder is removed.

Both are used by :class:`jddp.checkpoint.Checkpoints` and rely on orbax 0.12's private modules
(``tests/test_compat.py`` fails when they change shape); where they moved, nothing is patched
and nothing awaited (orbax's own behaviour, slower or racier, not wrong).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import jax
import numpy as np

try:  # orbax 0.12's; where they moved or changed, orbax's own slicing stays, nothing is awaited
    from orbax.checkpoint._src.futures.future import _SignalingThread as CommitThread
    from orbax.checkpoint._src.serialization.replica_slices import ReplicaSlice
except ImportError:  # pragma: no cover - another orbax layout
    CommitThread = ReplicaSlice = None

_ORBAX_DATA = getattr(ReplicaSlice, "data", None)


def _on_cpu(array: Any) -> bool:
    devices = getattr(getattr(array, "sharding", None), "device_set", ())
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def _data(replica_slice: Any) -> Any:
    """``ReplicaSlice.data`` with a CPU device's slice cut on the host (orbax's otherwise)."""
    whole, cut = replica_slice.unsliced_data, replica_slice.slice_args
    if cut is None or not isinstance(whole, jax.Array) or not _on_cpu(whole):
        return _ORBAX_DATA(replica_slice)
    index = [slice(None)] * whole.ndim
    index[cut.axis] = slice(cut.start_index, cut.limit_index)
    # A single-device array orbax copies to the host next (as its own slice would be).
    return jax.device_put(np.asarray(whole)[tuple(index)], whole.sharding)


def cut_cpu_slices_on_host() -> None:
    """Have orbax cut the replicas' shares of arrays on CPU devices with NumPy (idempotent;
    nothing changes where orbax's ``ReplicaSlice`` is not the one this was written for).

    Replaces ``orbax.checkpoint._src.serialization.replica_slices.ReplicaSlice.data`` for the
    rest of the process (reads its fields ``unsliced_data`` and ``slice_args``, and
    ``SliceArgs``' ``start_index``, ``limit_index``, ``axis``). Goes when orbax cuts a host
    buffer's slices without compiling a program per shape: not yet in orbax's main of
    2026-08-19 (3ff7b24: ``jax.lax.slice_in_dim`` on the device)."""
    fields = getattr(ReplicaSlice, "__dataclass_fields__", {})
    if callable(_ORBAX_DATA) and {"unsliced_data", "slice_args"} <= fields.keys():
        _data.__wrapped__ = _ORBAX_DATA  # type: ignore[attr-defined] - orbax's, for inspect.unwrap
        ReplicaSlice.data = _data


def wait_for_failed_writes(timeout_s: float = 10.0) -> None:
    """Wait (at most ``timeout_s``) for orbax's commit threads still writing: called after a
    save failed, before its temporary folder is removed.

    Patches nothing; finds the threads by orbax's private class
    ``orbax.checkpoint._src.futures.future._SignalingThread``, whose ``join`` raises what the
    thread failed with (dropped here: the save reports its failure). Goes when orbax's failed save
    (or ``CheckpointManager.close``) waits for the save's other writes before it returns; not
    known to be fixed upstream."""
    if CommitThread is None:
        return
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if isinstance(thread, CommitThread):
            # Orbax's join raises what the thread failed with (its write hit the full disk the
            # save already reports: it had escaped that one line as a bare ValueError, twice in
            # full suites), or TimeoutError when it still runs at the deadline: waited, done.
            with contextlib.suppress(Exception):
                thread.join(max(0.0, deadline - time.monotonic()))
