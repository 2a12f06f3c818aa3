"""Exact weighted means over the global batch and over every eval example.

A task reports per-example values ``x_B`` with optional weights ``w_B`` (a language model's
tokens per sequence, say); the result is ``Σ w·x / Σ w`` over the *global* batch (or the whole
eval set), the same on every topology. Averaging per-device means would be wrong as soon as
devices hold different total weights, and a padded eval batch would count its padding.

So every value travels as a pair: ``name`` holds ``Σ w·x / n`` and ``name~w`` holds ``Σ w / n``
(``n``: this device's rows), which any number of devices and micro-batches may *average*
(``pmean``, an MPI mean) without bias; :func:`divide` divides once, at the end. An unweighted
value has no ``~w`` partner and is the plain mean, so the unweighted path computes exactly what
it did before weights existed. Eval sums use the same pairing with plain sums
(:func:`masked_sums`) and are divided once on the host (:func:`divide` too).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

# {name: (value_B, weight_B or None)}: what a task returns per example (jddp.tasks)
Named = dict[str, tuple[Any, Any]]

WEIGHT_SUFFIX = "~w"


def weight_key(name: str) -> str:
    """The key of ``name``'s weight term."""
    return name + WEIGHT_SUFFIX


def _real(x: Any) -> Any:
    """``x`` as floats of at least float32 (booleans and integers become float32; float64 under
    ``jax_enable_x64`` stays float64)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return x.astype(jnp.float32)


def means(named: Named) -> dict[str, Any]:
    """Per-device terms to be averaged: ``name`` is ``Σ w·x / n`` and ``name~w`` is ``Σ w / n``
    (weighted), or ``name`` is the mean of ``x`` (unweighted)."""
    out = {}
    for name, (value, weight) in named.items():
        value = _real(value)
        if weight is None:
            out[name] = value.mean()
            continue
        weight = _real(weight)
        out[name] = (weight * value).mean()
        out[weight_key(name)] = weight.mean()
    return out


def masked_sums(named: Named, mask: Any) -> dict[str, Any]:
    """Eval terms to be summed over devices and batches: ``name`` is ``Σ m·w·x`` and ``name~w``
    is ``Σ m·w`` (``w`` = 1 when unweighted): padding rows (``m`` = 0) never count."""
    out = {}
    for name, (value, weight) in named.items():
        w = mask if weight is None else mask * _real(weight)
        out[name] = (w * _real(value)).sum()
        out[weight_key(name)] = w.sum()
    return out


def divide(terms: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(values, weights)``: each ``name`` with a ``name~w`` partner divided by it, the others
    as they are; ``weights`` holds the partners by name (what the values were divided by)."""
    weights = {k[: -len(WEIGHT_SUFFIX)]: v for k, v in terms.items() if k.endswith(WEIGHT_SUFFIX)}
    values = {
        k: (v / weights[k] if k in weights else v)
        for k, v in terms.items()
        if not k.endswith(WEIGHT_SUFFIX)
    }
    return values, weights
