"""How orbax writes an array every device holds whole: in one process, small ones from one
replica.

Orbax's replica-parallel save (its default except where ``JAX_PLATFORMS`` names a GPU) splits
each replicated array along a dimension and has every replica write its slice. Each slice is
cut on the device by an eager ``lax.slice_in_dim``, a program compiled for each distinct shape
in each process: a tiny ResNet's first save on 2 devices compiled 42 of them, 1.0 of the run's
4.7 CPU-s on the 2-core VM (jddp's tests start hundreds of such runs). Splitting pays where the
slice's bytes take longer to move and write than that compile, so jddp splits only slices of at
least :data:`MIN_SLICE_BYTES`: a large model's big kernels are still written in parallel, its
biases, norms and step counters by replica 0. What is written is the same either way. Only in
a single process: across processes, a save that fails on one process alone (a full disk) left
its peers waiting in orbax's commit.
"""

from __future__ import annotations

import jax
import orbax.checkpoint as ocp

# The smallest slice a replica writes on its own (orbax's ``min_slice_bytes_for_replica_
# parallel``; its default, None, splits arrays of any size).
MIN_SLICE_BYTES = 1 << 20

_ATTRIBUTE = "_min_slice_bytes_for_replica_parallel"  # ArrayHandler's, orbax 0.12.8


def split_only_large_arrays() -> None:
    """In a single process, have orbax's registered ``jax.Array`` handler split only slices of
    :data:`MIN_SLICE_BYTES` or more among the replicas (its devices). Left as it is in a job of
    several processes, where someone chose a threshold already, or where orbax's handler no
    longer has the setting."""
    if jax.process_count() > 1:
        # Across processes every replica writes its share of every array: with small arrays
        # left to replica 0, a full disk failed process 0's save alone while process 1 waited
        # for it in orbax's commit, and the job stalled (exit 124) instead of saying the disk
        # was full (exit 1): soak_faults.py, 2026-11-27.
        return
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if getattr(handler, _ATTRIBUTE, MIN_SLICE_BYTES) is None:
        # Set on the registered handler itself: registering a copy in its place would print
        # orbax's warning about a replaced handler in every process's output.
        setattr(handler, _ATTRIBUTE, MIN_SLICE_BYTES)
