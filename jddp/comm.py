"""Gradient averaging backends: where gradients are averaged across devices and processes.

A backend is one swappable piece with two hooks the step calls:

* :meth:`average` runs *inside* the ``shard_map`` step and averages a pytree over the mesh
  axis ``data`` (``pmean``; NCCL on GPUs, gloo or in-process on CPUs);
* :meth:`compose` turns the two stages of a step, ``grads_stage`` (per-device forward/backward
  plus ``average``) and ``update_stage`` (the optimizer), into the callable step.

With ``xla`` the mesh spans every device of every process, so ``average`` is the global mean
and ``compose`` fuses both stages into one jitted program.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax

from jddp.mesh import DATA_AXIS

PyTree = Any
GradsStage = Callable[[PyTree, PyTree], tuple[PyTree, ...]]
UpdateStage = Callable[..., tuple[PyTree, PyTree]]


class Comm(Protocol):
    """What the step needs from a gradient-averaging backend."""

    name: str

    def average(self, tree: PyTree) -> PyTree:
        """Mean of ``tree`` over the ``data`` axis; called inside ``shard_map``."""
        ...

    def compose(self, grads_stage: GradsStage, update_stage: UpdateStage) -> Callable:
        """The step ``(state, batch) -> (state, metrics)`` from its two stages."""
        ...


class XlaComm:
    """All devices of all processes in one XLA program; ``pmean`` over ``data`` averages."""

    name = "xla"

    def average(self, tree: PyTree) -> PyTree:
        """``pmean`` over the ``data`` mesh axis (every device of every process)."""
        return jax.lax.pmean(tree, DATA_AXIS)

    def compose(self, grads_stage: GradsStage, update_stage: UpdateStage) -> Callable:
        """One jitted program; the train state buffers are donated."""

        def step(state: PyTree, batch: PyTree) -> tuple[PyTree, PyTree]:
            return update_stage(state, *grads_stage(state, batch))

        return jax.jit(step, donate_argnums=0)


def make_comm(backend: str) -> Comm:
    """The backend named by ``dist.backend``."""
    if backend == "xla":
        return XlaComm()
    raise ValueError(f"dist.backend: {backend!r} is not available; choose xla")
