"""Any task: the user's ``loss(model, batch)`` and ``metrics(model, batch)`` on any batch pytree.

``loss`` returns per-example losses ``[B]``, or ``(loss_B, weight_B)``; ``metrics`` returns
``{name: value_B}`` or ``{name: (value_B, weight_B)}``. jddp turns them into exact weighted means
over the global batch (:mod:`jddp.weighted`). What they return is checked when the step is
traced (and before training, by :func:`jddp.preflight.check_task`): a scalar, another shape, a
non-float loss, a metric name that clashes, each is a :class:`~jddp.errors.TaskError` naming the
function and what is expected.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jddp.errors import TaskError
from jddp.tasks import RESERVED_METRICS, Named
from jddp.weighted import WEIGHT_SUFFIX

LossFn = Callable[[Any, Any], Any]
MetricsFn = Callable[[Any, Any], Mapping[str, Any]]


def rows_of(data: Any) -> int:
    """The leading (example) size of a batch pytree."""
    return jax.tree.leaves(data)[0].shape[0]


def _shape(value: Any) -> str:
    return str(list(value.shape)) if hasattr(value, "shape") else type(value).__name__


def per_example(value: Any, rows: int, what: str, floating: bool) -> jax.Array:
    """``value`` as one number per example (``[rows]``), else a :class:`TaskError` saying what
    ``what`` returned and what is expected. ``floating``: only floating dtypes (losses); else
    integers and booleans are taken too (counts, correct predictions) as float32."""
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TaskError(
            f"{what}: got a {type(value).__name__}; expected an array of shape [{rows}] (one "
            "value per example of this device's batch)"
        )
    if value.shape != (rows,):
        hint = (
            " (a scalar: return one value per example, not their mean; jddp takes the exact "
            "weighted mean over the global batch)"
            if value.shape == ()
            else ""
        )
        raise TaskError(
            f"{what}: got shape {_shape(value)}{hint}; expected shape [{rows}] (one value per "
            "example of this device's batch)"
        )
    if jnp.issubdtype(value.dtype, jnp.floating):
        return value
    if floating or not (
        jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(value.dtype, jnp.bool_)
    ):
        kinds = "a floating dtype" if floating else "a number per example (float, int or bool)"
        raise TaskError(f"{what}: got dtype {value.dtype}; expected {kinds}")
    return value.astype(jnp.float32)


def value_and_weight(
    out: Any, rows: int, what: str, floating: bool
) -> tuple[jax.Array, jax.Array | None]:
    """``value_B`` or ``(value_B, weight_B)``, checked (see :func:`per_example`)."""
    if isinstance(out, tuple):
        if len(out) != 2:
            raise TaskError(
                f"{what}: got a tuple of {len(out)}; expected values [{rows}] or a pair "
                f"(values [{rows}], weights [{rows}])"
            )
        value, weight = out
        return (
            per_example(value, rows, what, floating),
            per_example(weight, rows, f"{what} (the weights)", False),
        )
    return per_example(out, rows, what, floating), None


@dataclass(frozen=True)
class CustomTask:
    """The user's ``loss`` and optional ``metrics`` (see the module docstring). ``loss_name``
    and ``metrics_name`` say where they came from in errors (``train.loss=pkg.mod:fn``, or
    ``the loss given to jddp.fit``)."""

    loss: LossFn
    metrics: MetricsFn | None = None
    loss_name: str = "loss"
    metrics_name: str = "metrics"
    kind: str = "custom"
    example_unit: str = "examples"

    def loss_terms(self, model: Any, data: Any) -> tuple[jax.Array, jax.Array | None, None]:
        """``loss(model, data)`` as ``(loss_B, weight_B or None, None)``."""
        rows = rows_of(data)
        loss, weight = value_and_weight(self.loss(model, data), rows, self.loss_name, True)
        return loss, weight, None

    def metric_terms(
        self, fresh_model: Callable[[], Any], data: Any, aux: Any, training: bool
    ) -> Named:
        """``metrics(model, data)`` as ``{name: (value_B, weight_B or None)}`` (none without
        a metrics function)."""
        if self.metrics is None:
            return {}
        out = self.metrics(fresh_model(), data)
        if not isinstance(out, Mapping):
            raise TaskError(
                f"{self.metrics_name}: got a {type(out).__name__}; expected a dict "
                "{name: values [B]} or {name: (values [B], weights [B])}"
            )
        rows = rows_of(data)
        named: Named = {}
        for name, value in out.items():
            check_metric_name(name, self.metrics_name)
            named[name] = value_and_weight(value, rows, f"{self.metrics_name}[{name!r}]", False)
        return named


def check_metric_name(name: Any, where: str) -> None:
    """A metric's name: a non-empty string that is none of jddp's own keys."""
    if not isinstance(name, str) or not name.strip() or WEIGHT_SUFFIX in name:
        raise TaskError(
            f"{where}: metric name {name!r} is not allowed; use a non-empty string without "
            f"{WEIGHT_SUFFIX!r} (it is logged as train/<name> and eval/<name>)"
        )
    if name in RESERVED_METRICS:
        raise TaskError(
            f"{where}: metric name {name!r} clashes with jddp's own train/{name} or "
            f"eval/{name}; rename it (taken: {', '.join(sorted(RESERVED_METRICS))})"
        )
