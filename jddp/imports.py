"""User code named in a config: ``"package.module:attribute"`` (a model or data factory, a loss,
a metrics function), imported when it is needed."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def import_callable(spec: str, what: str = "function") -> Callable:
    """The callable ``spec`` names, ``"package.module:attribute"`` (``attribute`` may be dotted).

    Raises ``ValueError`` (one line naming ``spec`` and the cause) when it is malformed, cannot
    be imported, lacks the attribute or is not callable.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"malformed {what} path {spec!r}: expected 'package.module:{what}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} for {what} {spec!r}: {e}") from e
    found = module
    try:
        for part in attr.split("."):
            found = getattr(found, part)
    except AttributeError as e:
        raise ValueError(
            f"module {module_name!r} has no attribute {attr!r} ({what} {spec!r})"
        ) from e
    if not callable(found):
        raise ValueError(f"{what} {spec!r} is not callable (a {type(found).__name__})")
    return found
