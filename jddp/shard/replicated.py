"""``dist.shard=none``: every array of the train state whole on every device; the gradients
all-reduced, every device applying the whole update."""

from __future__ import annotations

from typing import Any

from jddp.shard import specs as specs_lib
from jddp.shard.base import Objective, PyTree, StateLayout, replicated_gradients


class Replicated(StateLayout):
    """Everything ``P()``: parameters, optimizer state, model state and counters."""

    kind = "none"

    def state_specs(self, state: PyTree) -> PyTree:
        """Every array whole."""
        return specs_lib.whole_specs(state)

    def grad_specs(self, params: PyTree) -> PyTree:
        """Whole mean gradients on every device."""
        return specs_lib.whole_specs(params)

    def gradients(
        self, objective: Objective, params: PyTree, shapes: PyTree, comm: Any
    ) -> tuple[PyTree, Any]:
        """At whole parameters, per device."""
        return replicated_gradients(objective, params)

    def mean(self, grads: PyTree, shapes: PyTree, comm: Any) -> PyTree:
        """The all-reduce (``comm.average_grads``)."""
        return comm.average_grads(grads)
