"""What a step computes from a model and a batch: per-example losses and metrics, for any task.

A task is the one piece of training that knows what the batch and the model's outputs mean.
The step (:mod:`jddp.step`) hands it the model and this device's slice of the batch pytree and
gets back, per example, a loss (with an optional weight) and named metrics (each with an
optional weight); the step owns everything else (gradients, the exact weighted means over the
global batch, the optimizer, the collectives). Two tasks are built in:

* :class:`~jddp.tasks.custom.CustomTask`: the user's ``loss(model, batch)`` and
  ``metrics(model, batch)`` on any batch pytree (``jddp.fit(loss=..., metrics=...)``,
  ``train.loss``/``train.metrics`` on the command line);
* :class:`~jddp.tasks.classification.ClassificationTask`: images to logits, cross-entropy,
  accuracy (the built-in ResNets and the ``loss_fn(logits, labels)`` shorthand).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # no JAX import here at run time: the plot CLI reads RESERVED_METRICS
    from jddp.weighted import Named  # {name: Metric(value_B, weight_B or None, reduce)}

# What jddp itself logs under train/ and eval/: a task's metric may not take these names.
RESERVED_METRICS = frozenset(
    {
        "loss",
        "lr",
        "grad_norm",
        "param_norm",
        "skipped_steps",
        "nonfinite",
        "compile_s",
        "img_per_s",
        "examples_per_s",
        "step_time_s",
        "scaling_efficiency",
        "count",
        "data",
        "devices",
    }
)


class Task(Protocol):
    """Per-example losses and metrics of a model on a batch (this device's slice).

    ``kind``: ``"classification"`` or ``"custom"`` (recorded with checkpoints: ``jddp.predict``
    of a run feeds its inputs as the task did). ``example_unit``: what an example is called in
    throughput figures (``img`` for images, else ``examples``).
    """

    # Read-only: the built-in tasks are frozen dataclasses (a protocol's plain attribute
    # would ask for a settable one).
    @property
    def kind(self) -> str: ...

    @property
    def example_unit(self) -> str: ...

    def loss_terms(self, model: Any, data: Any) -> tuple[Any, Any, Any]:
        """``(loss_B, weight_B or None, aux)`` of ``model`` on ``data``; ``aux`` is handed to
        :meth:`metric_terms` (the built-in classification passes its logits)."""
        ...

    def metric_terms(
        self, fresh_model: Callable[[], Any], data: Any, aux: Any, training: bool
    ) -> Named:
        """``{name: Metric(value_B, weight_B or None, reduce)}``. ``fresh_model()`` is the model
        as the loss saw it, before its forward pass changed any state (its own changes are
        dropped)."""
        ...
