"""Exact reductions over the global batch and over every eval example: weighted means, sums,
maxima and minima.

A task reports per-example values ``x_B`` with optional weights ``w_B`` (a language model's
tokens per sequence, say) and, per metric, a reduction (:class:`Metric`; ``mean`` unless said).
The result is the same on every topology: ``mean`` is ``Σ w·x / Σ w`` over the *global* batch (or
the whole eval set), ``sum`` is ``Σ w·x``, ``max``/``min`` the largest/smallest ``x`` of the rows
whose weight is not 0. Averaging per-device means would be wrong as soon as devices hold
different total weights, and a padded eval batch would count its padding.

So every mean travels as a pair: ``name`` holds ``Σ w·x / n`` and ``name~w`` holds ``Σ w / n``
(``n``: this device's rows), which any number of devices and micro-batches may *average*
(``pmean``, an MPI mean) without bias; :func:`divide` divides once, at the end. An unweighted
mean has no ``~w`` partner and is the plain mean, so the unweighted path computes exactly what
it did before weights existed. The other reductions travel under ``name~sum``, ``name~max``,
``name~min`` and are combined by their own operation (:func:`split`: one collective per kind).
Eval sums use the same pairing with plain sums (:func:`masked_sums`), combined over batches by
:func:`combine` and divided once on the host (:func:`divide` too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

REDUCTIONS = ("mean", "sum", "max", "min")
# The collective over the mesh's ``data`` axis of each kind but the means (averaged in a train
# step, summed in an eval: the callers choose).
COLLECTIVE = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}
WEIGHT_SUFFIX = "~w"
TERM_MARK = "~"  # what no metric name may contain: it separates a term's name and its kind


@dataclass(frozen=True)
class Metric:
    """One metric's per-example values, with optional weights and how they combine over the
    global batch (and over every eval example): ``mean`` (``Σ w·x / Σ w``, the default),
    ``sum`` (``Σ w·x``: a count is a sum of ones; integer or boolean values with integer or no
    weights add as integers, int32 on the devices and int64 on the host), ``max`` or ``min``
    (over the rows whose weight is not 0: a weight masks; over no rows at all NaN, as a mean
    whose weights sum to 0, and so is a max of ``-inf`` values or a min of ``inf`` ones).
    Weights are never negative (one is refused as a negative loss weight is).

    A task's ``metrics`` returns ``{name: values_B | (values_B, weights_B) | jddp.Metric(...)}``,
    e.g. ``{"max_error": jddp.Metric(abs_error_B, reduce="max")}``.
    """

    values: Any
    weights: Any = None
    reduce: str = "mean"  # checked where jddp reads it (jddp.tasks.custom.as_metric), by name


jax.tree_util.register_dataclass(Metric, data_fields=["values", "weights"], meta_fields=["reduce"])

# {name: Metric}: what a task returns per example (jddp.tasks)
Named = dict[str, Metric]


def weight_key(name: str) -> str:
    """The key of ``name``'s weight term."""
    return name + WEIGHT_SUFFIX


def term_key(name: str, reduce: str) -> str:
    """The key under which ``name``'s values travel: the name itself for a mean, else
    ``name~sum``, ``name~max``, ``name~min``."""
    return name if reduce == "mean" else f"{name}{TERM_MARK}{reduce}"


def reduction_of(key: str) -> str:
    """The reduction a term's key travels under (a mean's weight term ``~w`` is a mean)."""
    _, mark, kind = key.rpartition(TERM_MARK)
    return kind if mark and kind in REDUCTIONS else "mean"


def _name_of(key: str) -> str:
    return key.rpartition(TERM_MARK)[0] if reduction_of(key) != "mean" else key


def _real(x: Any) -> Any:
    """``x`` as floats of at least float32 (booleans and integers become float32; float64 under
    ``jax_enable_x64`` stays float64)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return x.astype(jnp.float32)


def _integral(x: Any) -> bool:
    """Whether ``x`` (None: no weights) holds integers or booleans."""
    return x is None or jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_


def _count(x: Any) -> Any:
    """Integers or booleans as int32 (int64 stays int64 under ``jax_enable_x64``)."""
    return x.astype(jnp.int64 if x.dtype == jnp.int64 else jnp.int32)


def _sum(values: Any, weights: Any, mask: Any = None) -> Any:
    """``Σ w·x`` over the rows (``mask``: those where it is not 0). Integer or boolean values
    with integer, boolean or no weights add as integers (int32 on the devices): a count past
    float32's 2^24 keeps its digits. Else in floats of at least float32."""
    if _integral(values) and _integral(weights):
        terms = _count(values) if weights is None else _count(values) * _count(weights)
        if mask is not None:
            terms = jnp.where(mask != 0, terms, jnp.zeros((), terms.dtype))
        return terms.sum(dtype=terms.dtype)
    terms = _real(values) if weights is None else _real(weights) * _real(values)
    return (terms if mask is None else mask * terms).sum()


def _extreme(reduce: str, value: Any, counts: Any) -> Any:
    """The max (min) of ``value`` over the rows where ``counts`` (None: all rows)."""
    identity = _IDENTITY[reduce]
    if counts is not None:
        value = jnp.where(counts, value, jnp.asarray(identity, value.dtype))
    return value.max(initial=identity) if reduce == "max" else value.min(initial=identity)


def means(named: Named) -> dict[str, Any]:
    """Per-device terms of a train step: a mean's ``name`` is ``Σ w·x / n`` and ``name~w`` is
    ``Σ w / n`` (weighted), or ``name`` is the mean of ``x`` (unweighted); ``name~sum`` is
    ``Σ w·x``, ``name~max`` and ``name~min`` this device's extremes (see :func:`split` for how
    each kind combines over devices)."""
    out = {}
    for name, metric in named.items():
        value, weight, reduce = _real(metric.values), metric.weights, metric.reduce
        weight = None if weight is None else _real(weight)
        key = term_key(name, reduce)
        if reduce in ("max", "min"):
            out[key] = _extreme(reduce, value, None if weight is None else weight != 0)
        elif reduce == "sum":
            out[key] = _sum(metric.values, metric.weights)
        elif weight is None:
            out[key] = value.mean()
        else:
            out[key] = (weight * value).mean()
            out[weight_key(name)] = weight.mean()
    return out


def masked_sums(named: Named, mask: Any) -> dict[str, Any]:
    """Eval terms to be combined over devices and batches (:func:`combine`): a mean's ``name``
    is ``Σ m·w·x`` and ``name~w`` is ``Σ m·w`` (``w`` = 1 when unweighted); a sum's ``Σ m·w·x``;
    a max or min over the rows where ``m·w`` is not 0: padding rows (``m`` = 0) never count."""
    out = {}
    for name, metric in named.items():
        value, reduce = _real(metric.values), metric.reduce
        w = mask if metric.weights is None else mask * _real(metric.weights)
        key = term_key(name, reduce)
        if reduce in ("max", "min"):
            out[key] = _extreme(reduce, value, w != 0)
        elif reduce == "sum":
            out[key] = _sum(metric.values, metric.weights, mask)
        else:
            out[key] = (w * value).sum()
            out[weight_key(name)] = w.sum()
    return out


def split(terms: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``terms`` grouped by how they combine: ``{"mean": ..., "sum": ..., "max": ..., "min":
    ...}`` (only the kinds present), so each kind takes one collective (``pmean`` for the means
    of a train step, ``psum`` for eval sums; ``psum``, ``pmax``, ``pmin`` for the others)."""
    groups: dict[str, dict[str, Any]] = {}
    for key, value in terms.items():
        groups.setdefault(reduction_of(key), {})[key] = value
    return groups


def merge(groups: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The terms of :func:`split`'s groups in one dict again."""
    return {k: v for group in groups.values() for k, v in group.items()}


def combine(a: dict[str, Any], b: dict[str, Any], xp: Any = jnp) -> dict[str, Any]:
    """Two sets of terms as one (two micro-batches, two eval batches): added, but maxima and
    minima kept (``xp``: ``jax.numpy`` in a step, ``numpy`` on the host)."""
    ops = {"max": xp.maximum, "min": xp.minimum}
    return {k: ops.get(reduction_of(k), xp.add)(a[k], b[k]) for k in a}


def scale_means(terms: dict[str, Any], factor: float) -> dict[str, Any]:
    """The mean terms times ``factor`` (``1/k`` after adding ``k`` micro-batches' terms); the
    sums, maxima and minima as they are."""
    return {k: v * factor if reduction_of(k) == "mean" else v for k, v in terms.items()}


def divide(terms: dict[str, Any], xp: Any = jnp) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(values, weights)``: each mean ``name`` with a ``name~w`` partner divided by it, the
    other terms under their metric's name, as they are but for a max or min over no rows
    (still its identity, ``-inf`` or ``inf``): NaN; ``weights`` holds the partners by name (what
    the values were divided by). ``xp``: ``jax.numpy`` in a step, ``numpy`` on the host."""
    weights = {k[: -len(WEIGHT_SUFFIX)]: v for k, v in terms.items() if k.endswith(WEIGHT_SUFFIX)}
    values = {}
    for key, value in terms.items():
        if key.endswith(WEIGHT_SUFFIX):
            continue
        name, kind = _name_of(key), reduction_of(key)
        if kind in _IDENTITY:
            value = xp.where(value == _IDENTITY[kind], xp.nan, value)
        values[name] = value / weights[name] if key == name and name in weights else value
    return values, weights


_IDENTITY = {"max": -jnp.inf, "min": jnp.inf}  # what a max or min over no rows stays


def host_term(value: Any) -> Any:
    """A step's term on the host, for adding over batches and processes: an integer sum as
    ``numpy.int64`` (past 2^31 over an eval's batches), anything else as ``numpy.float64``."""
    value = np.asarray(value)
    return np.int64(value) if np.issubdtype(value.dtype, np.integer) else np.float64(value)


def host_number(value: Any) -> int | float:
    """A host term as a Python ``int`` (an integer sum) or ``float``."""
    return int(value) if np.issubdtype(np.asarray(value).dtype, np.integer) else float(value)


def identity(kind: str) -> float:
    """What combining terms of ``kind`` starts from (:func:`combine`): 0 for means and sums,
    ``-inf`` for maxima, ``inf`` for minima."""
    return _IDENTITY.get(kind, 0.0)
