"""What a checkpoint's manifest holds: each state leaf's path, shape, dtype and CRC-32, and the
checks of a model against it (same leaves, same shapes)."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jddp.errors import ConfigError
from jddp.mesh import to_host
from jddp.state import TrainState


def manifest(state: TrainState) -> list[list[Any]]:
    """``[path, shape, dtype, crc32]`` of every leaf of ``state`` (values read on this host)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(to_host(state))
    return [_manifest_row(jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def _manifest_row(name: str, leaf: Any) -> list[Any]:
    arr = np.asarray(leaf, order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
    return [name, list(arr.shape), str(arr.dtype), zlib.crc32(arr.data)]


WEIGHT_PREFIXES = (".params", ".model_state")


def weight_leaves(weights: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(manifest name, leaf)`` of every leaf of ``{"params": ..., "model_state": ...}``."""
    out = []
    for top in ("params", "model_state"):
        flat, _ = jax.tree_util.tree_flatten_with_path(weights[top])
        out += [(f".{top}{jax.tree_util.keystr(path)}", leaf) for path, leaf in flat]
    return out


def weights_manifest(weights: dict[str, Any]) -> list[list[Any]]:
    """The manifest rows (as :func:`manifest` writes them) of ``weights``' host arrays."""
    return [_manifest_row(name, leaf) for name, leaf in weight_leaves(to_host(weights))]


def check_same_model(saved: list[list[Any]], like: TrainState, where: Path) -> None:
    """Raise ``ConfigError`` naming the first leaf whose path or shape differs from ``like``."""
    now = [(p, tuple(shape)) for p, shape, *_ in manifest_shapes(like)]
    before = [(p, tuple(shape)) for p, shape, *_ in saved]
    for (p_now, s_now), (p_before, s_before) in zip(now, before, strict=False):
        if p_now != p_before or s_now != s_before:
            raise ConfigError(
                f"checkpoint {where} was written for a different model: {p_before} has shape "
                f"{s_before} there but {p_now} has shape {s_now} now (use another workdir or "
                "checkpoint.resume=false)"
            )
    if len(now) != len(before):
        raise ConfigError(
            f"checkpoint {where} was written for a different model: {len(before)} state "
            f"arrays there, {len(now)} now (use another workdir or checkpoint.resume=false)"
        )


def manifest_shapes(state: TrainState) -> list[list[Any]]:
    """``[path, shape, dtype]`` of every leaf, without reading values."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return [[jax.tree_util.keystr(p), list(x.shape), str(x.dtype)] for p, x in flat]
