"""User code named in a config: ``"package.module:attribute"`` (a model or data factory, a loss,
a metrics function), imported when it is needed; a run folder's saved config names code someone
else wrote, imported only with the user's consent (:func:`refuse_untrusted`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

from jddp.errors import ConfigError


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


# The config keys whose ``"pkg.module:attribute"`` values jddp imports: a model, a data set, a
# custom task's loss and metrics. Built-in names (``resnet18``, ``digits``) have no colon.
CODE_KEYS = ("model.name", "data.name", "train.loss", "train.metrics")


def names_code(spec: object) -> bool:
    """Whether a config value is an import path (``"pkg.module:attribute"``), not a built-in
    name: importing it runs that module's code."""
    return isinstance(spec, str) and ":" in spec


def refuse_untrusted(
    where: str, specs: Iterable[tuple[str, object]], trust_code: bool = False
) -> None:
    """Refuse to import code named by a config someone else wrote (a run folder's saved config):
    unless ``trust_code``, the first ``(key, value)`` of ``specs`` that names code
    (:func:`names_code`) is a ``ConfigError`` naming ``where`` (the config), the key, the module
    and the flag that gives consent. Nothing is imported here."""
    if trust_code:
        return
    for key, spec in specs:
        if names_code(spec):
            module = str(spec).partition(":")[0]
            raise ConfigError(
                f"{where} names {key}={spec}: importing {module} runs its code; pass "
                "--trust-code (trust_code=True) if you trust this run folder"
            )


def code_specs(cfg: Any, keys: Iterable[str] = CODE_KEYS, given: Iterable[str] = ()) -> list:
    """``(key, value)`` of ``cfg`` (a :class:`~jddp.config.Config`) for each of ``keys`` but
    those in ``given`` (keys the user set, e.g. by a ``key=value`` override: theirs to trust)."""
    skip = {g.partition("=")[0].strip() for g in given}
    out = []
    for key in keys:
        if key in skip:
            continue
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        out.append((key, value))
    return out
