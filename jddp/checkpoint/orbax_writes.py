"""How orbax writes an array every device holds whole: small ones from one replica.

Orbax's replica-parallel save (its default except where ``JAX_PLATFORMS`` names a GPU) splits
each replicated array along a dimension and has every replica write its slice. Each slice is
cut on the device by an eager ``lax.slice_in_dim``, a program compiled for each distinct shape
in each process: a tiny ResNet's first save on 2 devices compiled 42 of them, 1.0 of the run's
4.7 CPU-s on the 2-core VM (jddp's tests start hundreds of such runs). Splitting pays where the
slice's bytes take longer to move and write than that compile, so jddp splits only slices of at
least :data:`MIN_SLICE_BYTES`: a large model's big kernels are still written in parallel, its
biases, norms and step counters by replica 0. What is written is the same either way.
"""

from __future__ import annotations

import jax
import orbax.checkpoint as ocp

# The smallest slice a replica writes on its own (orbax's ``min_slice_bytes_for_replica_
# parallel``; its default, None, splits arrays of any size).
MIN_SLICE_BYTES = 1 << 20

_ATTRIBUTE = "_min_slice_bytes_for_replica_parallel"  # ArrayHandler's, orbax 0.12.8


def split_only_large_arrays() -> None:
    """Have orbax's registered ``jax.Array`` handler split only slices of
    :data:`MIN_SLICE_BYTES` or more among the replicas. Left as it is where someone chose a
    threshold already, or where orbax's handler no longer has the setting."""
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if getattr(handler, _ATTRIBUTE, MIN_SLICE_BYTES) is None:
        # Set on the registered handler itself: registering a copy in its place would print
        # orbax's warning about a replaced handler in every process's output.
        setattr(handler, _ATTRIBUTE, MIN_SLICE_BYTES)
