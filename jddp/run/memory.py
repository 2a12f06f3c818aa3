"""Memory you can read: what one device holds of the train state at rest, and what XLA's
analysis of the compiled train step says the step needs, logged once per run.

* ``mem/state_bytes_per_device``: parameters + optimizer state + model state + counters, the
  share one device holds between steps (all of it under ``dist.shard=none``; about 1/N of the
  split arrays under ``full``);
* ``mem/step_bytes_per_device``: XLA's memory analysis of the compiled step on one device:
  arguments + outputs + temporaries - aliased (the donated state's buffers reused for the new
  state are counted once). Read from the executable the first step compiled (looked up again
  with the same arguments, a cache hit: nothing compiles twice); None where the step is not
  one XLA program (``dist.backend=mpi``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jddp.errors import ConfigError
from jddp.fully_sharded import FullShardLayout
from jddp.layout import ReplicatedLayout, state_bytes_per_device
from jddp.mesh import DATA_AXIS
from jddp.sharded_update import ShardLayout

STATE_KEY = "mem/state_bytes_per_device"
STEP_KEY = "mem/step_bytes_per_device"


def step_bytes(compiled: Any) -> int | None:
    """Arguments + outputs + temporaries - aliased bytes of ``compiled`` (a
    ``jax.stages.Compiled``) per device, or None when XLA gives no analysis."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends have none: the figure is then unknown
        return None
    if stats is None:
        return None
    return int(
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
    )


def compiled_step_bytes(train_step: Any, state: Any, batch: Any) -> int | None:
    """:func:`step_bytes` of the program ``train_step`` runs on ``state`` and ``batch`` (live
    arrays of the shapes and layouts it ran on: JAX's jit cache returns the executable it
    compiled for them); None when the step is not one jitted program."""
    lower = getattr(getattr(train_step, "run", None), "lower", None)
    if lower is None:
        return None
    return step_bytes(lower(state, batch).compile())


def memory_fields(train_step: Any, state: Any, batch: Any) -> dict[str, int]:
    """The two ``mem/`` figures for metrics.jsonl (the step's only where known)."""
    fields = {STATE_KEY: state_bytes_per_device(state)}
    step = compiled_step_bytes(train_step, state, batch)
    if step is not None:
        fields[STEP_KEY] = step
    return fields


def bytes_at_rest(shapes: Any, layout: Any) -> int:
    """Bytes of the train state ``shapes`` (shape structs) one device holds under ``layout``:
    each split array's share, every other array whole."""
    total = 0
    for x, spec in zip(
        jax.tree.leaves(shapes), jax.tree.leaves(layout.state_specs(shapes)), strict=True
    ):
        nbytes = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        total += nbytes // layout.num_shards if DATA_AXIS in tuple(spec) else nbytes
    return total


def device_budget(configured: int | None, device: Any) -> int | None:
    """The bytes a device may give the train state: ``dist.device_memory_bytes``, else what
    the device reports as its limit (GPUs), else None (CPUs report none)."""
    if configured is not None:
        return configured
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def check_state_fits(shapes: Any, layout: Any, budget: int | None) -> None:
    """Refuse (:class:`ConfigError`, one line) a train state that needs more than ``budget``
    bytes per device at rest under ``layout``, naming what each ``dist.shard`` would need."""
    need = bytes_at_rest(shapes, layout)
    if budget is None or need <= budget:
        return
    kinds = (ReplicatedLayout, ShardLayout, FullShardLayout)
    each = ", ".join(
        f"{kind.kind} {mib(bytes_at_rest(shapes, kind(layout.mesh)))}" for kind in kinds
    )
    raise ConfigError(
        f"the train state needs {mib(need)} per device under dist.shard={layout.kind}, more "
        f"than the {mib(budget)} a device may hold (dist.device_memory_bytes, or the device's "
        f"own limit); per device on {layout.num_shards} devices: {each}: choose a layout that "
        "fits, more devices, or a smaller model"
    )


def mib(nbytes: float) -> str:
    """``nbytes`` in MiB, one decimal (GiB from 10 GiB on, KiB under 1 MiB)."""
    if nbytes >= 10 * 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    if nbytes < 2**20:
        return f"{nbytes / 2**10:.1f} KiB"
    return f"{nbytes / 2**20:.1f} MiB"


def memory_line(fields: dict[str, int], kind: str, split_share: float, devices: int) -> str:
    """The run's one line about memory, e.g. ``jddp: memory per device: state 10.2 MiB
    (dist.shard=full: 99.6% of its bytes split over 4 devices), step 31.0 MiB (XLA)``."""
    if kind == "none":
        how = "dist.shard=none: whole on every device"
    else:
        how = f"dist.shard={kind}: {split_share:.1%} of its bytes split over {devices} devices"
    step = fields.get(STEP_KEY)
    step_text = "unknown (not one XLA program)" if step is None else f"{mib(step)} (XLA's analysis)"
    return f"jddp: memory per device: state {mib(fields[STATE_KEY])} ({how}), step {step_text}"
