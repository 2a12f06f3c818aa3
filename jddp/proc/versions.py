"""Library versions that install together but do not work together (pip cannot tell).

Checked by the CLIs before JAX starts (``jddp.cli.Session.start_jax``), so a run says it in one
line instead of an ``AttributeError`` from deep inside flax.
"""

from __future__ import annotations

import re
from importlib import metadata

from jddp.errors import JddpError

# (jax at least, flax below, why): flax 0.12.8 and 0.12.9 call jax.experimental.hijax.HiPrimitive,
# which jax 0.11 no longer has; 0.12.10 trains (checked on CPU with jax 0.11.2: 0.12.8 and 0.12.9
# fail building a model, 0.12.10-0.12.12 train; the suite passes with 0.12.12).
CONFLICTS = (((0, 11), (0, 12, 10), "jax.experimental.hijax.HiPrimitive is gone in jax 0.11"),)


def _version(dist: str) -> tuple[int, ...] | None:
    try:
        text = metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
    parts = []
    for piece in text.split("."):
        leading = re.match(r"\d+", piece)  # "0rc1" -> 0; "dev3" ends the release part
        if leading is None:
            break
        parts.append(int(leading.group()))
        if leading.end() < len(piece):
            break
    return tuple(parts)


def check_versions() -> None:
    """Raise :class:`JddpError` (exit 1) naming the versions and the fix if the installed jax
    and flax are a known-broken pair."""
    jax_v, flax_v = _version("jax"), _version("flax")
    if jax_v is None or flax_v is None:
        return
    for jax_min, flax_below, why in CONFLICTS:
        if jax_v >= jax_min and flax_v < flax_below:
            need = ".".join(map(str, flax_below))
            raise JddpError(
                f"flax {metadata.version('flax')} does not work with jax "
                f"{metadata.version('jax')} ({why}): pip install 'flax>={need}'"
            )
