"""Memory you can read, and a run that cannot fit refused before it trains.

* ``mem/state_bytes_per_device``: parameters + optimizer state + model state + counters, the
  share one device holds between steps (all of it under ``dist.shard=none``; about 1/G of the
  split arrays under ``full``, G the group's devices);
* ``mem/step_bytes_per_device``: XLA's memory analysis of the compiled train step on one
  device: arguments + outputs + temporaries - aliased (the donated state's buffers reused for
  the new state are counted once); None where the step is not one XLA program
  (``dist.backend=mpi``).

Both are checked against what a device may hold (``dist.device_memory_bytes``, or a GPU's own
limit): the state at rest before anything is placed (:func:`check_state_fits`), the step
once it is compiled, before it first runs (:class:`StepMemory`; the step's first call reuses
that compilation). Each refusal is one line naming the figures under every ``dist.shard``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import NamedSharding

from jddp.errors import ConfigError
from jddp.shard import SHARD_CHOICES, make_layout
from jddp.shard.base import StateLayout
from jddp.shard.specs import bytes_held

STATE_KEY = "mem/state_bytes_per_device"
STEP_KEY = "mem/step_bytes_per_device"
BUDGET_KEYS = "dist.device_memory_bytes, or the device's own limit"


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
    """:func:`step_bytes` of the program ``train_step`` runs on ``state`` and ``batch`` (arrays,
    or shape structs with their shardings); None when the step is not one jitted program. With
    live arrays of the shapes and layouts a step ran on, JAX's caches return the executable it
    compiled for them."""
    lower = getattr(getattr(train_step, "run", None), "lower", None)
    if lower is None:
        return None
    return step_bytes(lower(state, batch).compile())


def device_budget(configured: int | None, device: Any) -> int | None:
    """The bytes a device may give the run: ``dist.device_memory_bytes``, else what the device
    reports as its limit (GPUs), else None (CPUs report none)."""
    if configured is not None:
        return configured
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def check_state_fits(shapes: Any, layout: StateLayout, budget: int | None) -> None:
    """Refuse (:class:`ConfigError`, one line) a train state that needs more than ``budget``
    bytes per device at rest under ``layout``, naming what each ``dist.shard`` would need."""
    need = layout.bytes_per_device(shapes)
    if budget is None or need <= budget:
        return
    each = ", ".join(
        f"{kind} {mib(make_layout(kind, layout.mesh).bytes_per_device(shapes))}"
        for kind in SHARD_CHOICES
    )
    raise ConfigError(
        f"the train state needs {mib(need)} per device under dist.shard={layout.kind}, more "
        f"than the {mib(budget)} a device may hold ({BUDGET_KEYS}); per device in groups of "
        f"{layout.group_size}: {each}: choose a layout that fits, more devices, or a smaller "
        "model"
    )


@dataclass
class StepMemory:
    """The train step's memory, read once it is compiled for the first batch and before it
    runs: logged, and checked against ``budget``. ``step_for(kind)``: the train step under
    another ``dist.shard`` (compiled only to say, in a refusal, what each would need)."""

    budget: int | None
    layout: StateLayout
    step_for: Callable[[str], Any]

    def first_step(self, train_step: Any, state: Any, batch: Any) -> dict[str, int]:
        """Compile ``train_step`` for ``state`` and ``batch`` (its first call reuses the
        compilation) and return the two ``mem/`` figures (the step's where known); raises
        :class:`ConfigError` when the step needs more than the budget."""
        fields = {STATE_KEY: bytes_held(state)}
        need = compiled_step_bytes(train_step, state, batch)
        if need is None:
            return fields
        fields[STEP_KEY] = need
        if self.budget is not None and need > self.budget:
            raise ConfigError(self._refusal(need, fields[STATE_KEY], state, batch))
        return fields

    def _refusal(self, need: int, at_rest: int, state: Any, batch: Any) -> str:
        each = []
        for kind in SHARD_CHOICES:
            other = need if kind == self.layout.kind else self._step_bytes(kind, state, batch)
            if other is not None:
                fits = " (fits)" if other <= self.budget else ""
                each.append(f"{kind} {mib(other)}{fits}")
        return (
            f"the train step needs {mib(need)} per device under dist.shard={self.layout.kind} "
            f"(XLA's analysis of the compiled step; its state at rest {mib(at_rest)}), more "
            f"than the {mib(self.budget)} a device may hold ({BUDGET_KEYS}); the step per "
            f"device under each dist.shard: {', '.join(each)}: choose one that fits, "
            "model.remat=blocks, a smaller per-device batch, or more devices"
        )

    def _step_bytes(self, kind: str, state: Any, batch: Any) -> int | None:
        """The step's bytes under ``dist.shard=kind``, compiled from shapes alone."""
        layout = make_layout(kind, self.layout.mesh)
        specs = layout.state_specs(state)
        shapes = jax.tree.map(
            lambda x, spec: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(layout.mesh, spec)
            ),
            state,
            specs,
        )
        try:
            return compiled_step_bytes(self.step_for(kind), shapes, batch)
        except Exception:  # noqa: BLE001 - a layout this run cannot build: not named
            return None


def exhausted(error: BaseException) -> bool:
    """Whether ``error`` is XLA running out of a device's memory: a runtime error with the
    status ``RESOURCE_EXHAUSTED`` (XLA names the status only in the text)."""
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def out_of_memory(step: int, fields: dict[str, int] | None, layout: StateLayout, error: Any) -> str:
    """The one line of a step that ran out of device memory: what XLA could not allocate, what
    the step needs, and what would need less."""
    said = re.search(r"allocating (\d+) bytes", str(error))
    could_not = f"XLA could not allocate {mib(int(said.group(1)))}" if said else "XLA"
    fields = fields or {}
    need = fields.get(STEP_KEY)
    needs = (
        f"the step needs {mib(need)} per device ({STEP_KEY}, XLA's analysis), its state at rest "
        f"{mib(fields[STATE_KEY])}"
        if need is not None and STATE_KEY in fields
        else "the step's needs were not known yet (it had not compiled)"
    )
    others = " or ".join(f"dist.shard={k}" for k in ("full", "optimizer") if k != layout.kind)
    return (
        f"out of memory on a device at step {step} ({could_not}, RESOURCE_EXHAUSTED): {needs} "
        f"under dist.shard={layout.kind}; try {others}, model.remat=blocks, a smaller "
        "per-device batch (data.global_batch_size, train.grad_accum_steps) or more devices; "
        "dist.device_memory_bytes refuses a run that cannot fit before it trains"
    )


def mib(nbytes: float) -> str:
    """``nbytes`` in MiB, one decimal (GiB from 10 GiB on, KiB under 1 MiB)."""
    if nbytes >= 10 * 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    if nbytes < 2**20:
        return f"{nbytes / 2**10:.1f} KiB"
    return f"{nbytes / 2**20:.1f} MiB"


def memory_line(fields: dict[str, int], layout: StateLayout, split_share: float) -> str:
    """The run's one line about memory, e.g. ``jddp: memory per device: state 10.2 MiB
    (dist.shard=full: 99.6% of its bytes split over groups of 4 devices), step 31.0 MiB
    (XLA's analysis)``."""
    if layout.kind == "none":
        how = "dist.shard=none: whole on every device"
    else:
        groups = "" if layout.replicas == 1 else f" ({layout.replicas} replicas)"
        how = (
            f"dist.shard={layout.kind}: {split_share:.1%} of its bytes split over "
            f"{layout.group_size} devices{groups}"
        )
    step = fields.get(STEP_KEY)
    step_text = "unknown (not one XLA program)" if step is None else f"{mib(step)} (XLA's analysis)"
    return f"jddp: memory per device: state {mib(fields[STATE_KEY])} ({how}), step {step_text}"
