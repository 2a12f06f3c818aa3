"""Model zoo and registry for jddp.

``MODELS`` maps short names to model factories; :func:`get_model_factory` resolves a
registered name or an import path of the form ``"package.module:factory"``.
"""

from __future__ import annotations

from collections.abc import Callable

from jddp.imports import import_callable
from jddp.models.resnet import ResNet, resnet10, resnet18, resnet34, resnet50, resnet101, resnet152

__all__ = [
    "MODELS",
    "ResNet",
    "get_model_factory",
    "resnet10",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
]

MODELS: dict[str, Callable[..., ResNet]] = {
    "resnet10": resnet10,
    "resnet18": resnet18,
    "resnet34": resnet34,
    "resnet50": resnet50,
    "resnet101": resnet101,
    "resnet152": resnet152,
}


def get_model_factory(name: str) -> Callable:
    """Return the model factory registered as ``name`` or importable as ``"pkg.mod:attr"``.

    Args:
      name: a key of :data:`MODELS` (e.g. ``"resnet50"``) or ``"package.module:factory"``.

    Returns:
      The factory callable (called with keyword arguments such as ``num_classes`` and
      ``rngs``).

    Raises:
      ValueError: if ``name`` is not registered, cannot be imported, or is not callable.
    """
    if name in MODELS:
        return MODELS[name]
    allowed = ", ".join(sorted(MODELS))
    hint = f"expected one of [{allowed}] or 'package.module:factory'"
    if ":" not in name:
        raise ValueError(f"unknown model {name!r}; {hint}")
    try:
        return import_callable(name, "model factory")
    except ValueError as e:
        raise ValueError(f"{e}; {hint}") from e
