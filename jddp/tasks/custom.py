"""Any task: the user's ``loss(model, batch)`` and ``metrics(model, batch)`` on any batch pytree.

``loss`` returns per-example losses ``[B]``, or ``(loss_B, weight_B)``, or ``(loss_B, weight_B or
None, metrics)`` where ``metrics`` is what ``metrics`` would return, computed from the same
forward pass; ``metrics`` returns ``{name: value_B}``, ``{name: (value_B, weight_B)}`` or
``{name: jddp.Metric(value_B, weight_B, reduce=...)}`` (a sum, max or min instead of a mean).
jddp turns them into exact weighted means (sums, extremes) over the global batch
(:mod:`jddp.weighted`).

Why metrics may come from the loss: a separate ``metrics`` function runs the model once more.
XLA merges that second forward pass with the loss's when the two compile to the same operations
(a small CNN: 1.0004x the FLOPs of the loss alone), but differentiation rewrites some of the
loss's (LayerNorm's variance, under ``jax.grad``), and then the training step pays a second
forward pass (the byte-level GPT of examples/lm_stdlib.py: 1.34x the FLOPs); returned by the
loss, metrics cost nothing.

What they return is checked when the step is traced (and before training, by
:func:`jddp.preflight.check_task`): a scalar, another shape, a non-float loss, a metric name
that clashes, each is a :class:`~jddp.errors.TaskError` naming the function and what is
expected.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jddp.errors import TaskError
from jddp.tasks import RESERVED_METRICS
from jddp.weighted import REDUCTIONS, TERM_MARK, Metric, Named

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
    integers and booleans are taken too (counts, correct predictions), as they are: a mean, max
    or min computes in floats, a sum of them adds as integers (:mod:`jddp.weighted`)."""
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
    return value


def value_and_weight(
    out: Any, rows: int, what: str, floating: bool
) -> tuple[jax.Array, jax.Array | None]:
    """``value_B`` or ``(value_B, weight_B)``, checked (see :func:`per_example`); a weight of
    None is no weight."""
    if isinstance(out, tuple):
        if len(out) != 2:
            raise TaskError(
                f"{what}: got a tuple of {len(out)}; expected values [{rows}] or a pair "
                f"(values [{rows}], weights [{rows}])"
            )
        value, weight = out
        value = per_example(value, rows, what, floating)
        if weight is None:
            return value, None
        return value, per_example(weight, rows, f"{what} (the weights)", False)
    return per_example(out, rows, what, floating), None


def as_metric(out: Any, rows: int, what: str) -> Metric:
    """One metric's ``value_B``, ``(value_B, weight_B)`` or :class:`~jddp.weighted.Metric`,
    checked (see :func:`per_example`), as a ``Metric``."""
    if isinstance(out, Metric):
        if out.reduce not in REDUCTIONS:
            raise TaskError(
                f"{what}: jddp.Metric(reduce={out.reduce!r}) is not a reduction jddp knows; use "
                f"one of {', '.join(REDUCTIONS)}"
            )
        value, weight = value_and_weight((out.values, out.weights), rows, what, False)
        return Metric(value, weight, out.reduce)
    return Metric(*value_and_weight(out, rows, what, False))


def named_metrics(out: Any, rows: int, where: str) -> Named:
    """A metrics dict ``{name: value_B | (value_B, weight_B) | jddp.Metric}``, checked: names,
    shapes, types."""
    if not isinstance(out, Mapping):
        raise TaskError(
            f"{where}: got a {type(out).__name__}; expected a dict "
            "{name: values [B]}, {name: (values [B], weights [B])} or {name: jddp.Metric(...)}"
        )
    named: Named = {}
    for name, value in out.items():
        check_metric_name(name, where)
        named[name] = as_metric(value, rows, f"{where}[{name!r}]")
    return named


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

    def loss_terms(self, model: Any, data: Any) -> tuple[jax.Array, jax.Array | None, Named]:
        """``loss(model, data)`` as ``(loss_B, weight_B or None, metrics it returned)``."""
        rows = rows_of(data)
        out = self.loss(model, data)
        metrics: Named = {}
        if isinstance(out, tuple) and len(out) == 3:
            out, returned = out[:2], out[2]
            metrics = named_metrics(returned, rows, f"{self.loss_name} (its metrics)")
        loss, weight = value_and_weight(out, rows, self.loss_name, True)
        return loss, weight, metrics

    def metric_terms(
        self, fresh_model: Callable[[], Any], data: Any, aux: Named, training: bool
    ) -> Named:
        """The metrics the loss returned (``aux``), then ``metrics(model, data)``'s, as
        ``{name: Metric}``."""
        if self.metrics is None:
            return aux
        more = named_metrics(self.metrics(fresh_model(), data), rows_of(data), self.metrics_name)
        both = set(aux) & set(more)
        if both:
            raise TaskError(
                f"{self.metrics_name}: metric {sorted(both)[0]!r} is returned by "
                f"{self.loss_name} too; name each metric once"
            )
        return {**aux, **more}


def check_metric_name(name: Any, where: str) -> None:
    """A metric's name: a non-empty string that is none of jddp's own keys."""
    if not isinstance(name, str) or not name.strip() or TERM_MARK in name:
        raise TaskError(
            f"{where}: metric name {name!r} is not allowed; use a non-empty string without "
            f"{TERM_MARK!r} (it is logged as train/<name> and eval/<name>)"
        )
    if name in RESERVED_METRICS:
        raise TaskError(
            f"{where}: metric name {name!r} clashes with jddp's own train/{name} or "
            f"eval/{name}; rename it (taken: {', '.join(sorted(RESERVED_METRICS))})"
        )
