"""What a checkpoint's manifest holds: each state leaf's path, shape, dtype and checksum, and the
checks of a model against it (same leaves, same shapes).

The checksum (``"sum64:<hex>"``) is the same whatever the array's layout over devices and
processes: the sum, mod 2**64, of a bijective mix of each element's bits with its flat index.
Each process adds the elements of the shards it holds (one copy of each), so an array split
over processes (``dist.shard=full``) is checked without any process gathering it; the partial
sums of such arrays cross processes in one small all-gather. Manifests written before it hold
a CRC-32 of the whole array (an int), still verified as such.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jddp.errors import ConfigError
from jddp.mesh import to_host
from jddp.state import TrainState

_M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F)
_M3, _M4 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _mixed_sum(values: np.ndarray, index: tuple, shape: tuple[int, ...]) -> int:
    """Sum (mod 2**64) of the mixed (bits, flat index) of the elements of ``values``, the part
    ``index`` (a tuple of slices) of an array of ``shape``."""
    values = np.asarray(values)
    bits = values.view(_UNSIGNED[values.dtype.itemsize]).astype(np.uint64)
    flat = np.zeros((), np.uint64)
    stride = 1
    for axis in reversed(range(len(shape))):
        start, stop, _ = index[axis].indices(shape[axis]) if index else (0, shape[axis], 1)
        along = np.arange(start, stop, dtype=np.uint64) * np.uint64(stride)
        flat = flat + along.reshape([-1] + [1] * (len(shape) - 1 - axis))
        stride *= shape[axis]
    with np.errstate(over="ignore"):
        h = (bits * _M1) ^ (flat * _M2)
        h ^= h >> np.uint64(31)
        h *= _M3
        h ^= h >> np.uint64(29)
        h *= _M4
        h ^= h >> np.uint64(32)
        return int(np.sum(h, dtype=np.uint64))


def _local_sum(leaf: Any) -> tuple[int, bool]:
    """This process's part of ``leaf``'s checksum sum, and whether other processes hold parts
    of it (then the parts are added across processes)."""
    if not isinstance(leaf, jax.Array):
        arr = np.asarray(leaf)
        return _mixed_sum(arr, (), arr.shape), False
    if leaf.is_fully_replicated:
        return _mixed_sum(np.asarray(leaf.addressable_data(0)), (), leaf.shape), False
    total = 0
    for shard in leaf.addressable_shards:
        if shard.replica_id == 0:  # one copy of each part counts
            total += _mixed_sum(np.asarray(shard.data), shard.index, leaf.shape)
    return total % 2**64, not leaf.is_fully_addressable


def checksums(leaves: list[Any]) -> list[str]:
    """``"sum64:<hex>"`` of each of ``leaves`` (arrays of any layout, or host arrays); a
    collective when any array spans processes (every process must call it then)."""
    parts = [_local_sum(leaf) for leaf in leaves]
    spanning = [i for i, (_, spans) in enumerate(parts) if spans]
    sums = [s for s, _ in parts]
    if spanning:
        from jax.experimental import multihost_utils

        # as uint32 halves: without jax_enable_x64 a 64-bit array would be cut to 32 bits
        mine = np.array([sums[i] for i in spanning], np.uint64).view(np.uint32)
        every = np.asarray(multihost_utils.process_allgather(mine), np.uint32)
        every = np.ascontiguousarray(every.reshape(-1, 2 * len(spanning))).view(np.uint64)
        added = every.sum(axis=0, dtype=np.uint64)
        for i, total in zip(spanning, added, strict=True):
            sums[i] = int(total)
    return [f"sum64:{s % 2**64:016x}" for s in sums]


def manifest(state: TrainState, saved: dict[str, list[Any]] | None = None) -> list[list[Any]]:
    """``[path, shape, dtype, checksum]`` of every leaf of ``state`` (see the module
    docstring: no array is gathered). ``saved``: the rows of a manifest to compare with, by
    path: where one holds a CRC-32 (written before ``sum64``), that leaf's row does too."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return _rows([(jax.tree_util.keystr(path), leaf) for path, leaf in flat], saved or {})


def _rows(named: list[tuple[str, Any]], saved: dict[str, list[Any]]) -> list[list[Any]]:
    sums = checksums([leaf for _, leaf in named])
    rows = []
    for (name, leaf), checksum in zip(named, sums, strict=True):
        old = saved.get(name)
        if old is not None and isinstance(old[3], int):  # a CRC-32 of the whole array
            arr = np.asarray(to_host(leaf), order="C")  # (ascontiguousarray: 0-d would be 1-d)
            checksum = zlib.crc32(arr.data)
        rows.append([name, list(np.shape(leaf)), str(np.dtype(leaf.dtype)), checksum])
    return rows


WEIGHT_PREFIXES = (".params", ".model_state")
EMA_PREFIX = ".ema_params"  # train.ema_decay: the parameters' moving average, named as they are


def weight_leaves(weights: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(manifest name, leaf)`` of every leaf of ``{"params": ..., "model_state": ...}`` (or
    of another of the state's fields, e.g. ``ema_params``, in place of ``params``)."""
    out = []
    for top in weights:
        flat, _ = jax.tree_util.tree_flatten_with_path(weights[top])
        out += [(f".{top}{jax.tree_util.keystr(path)}", leaf) for path, leaf in flat]
    return out


def weights_manifest(
    weights: dict[str, Any], saved: dict[str, list[Any]] | None = None
) -> list[list[Any]]:
    """The manifest rows (as :func:`manifest` writes them) of ``weights``' arrays."""
    return _rows(weight_leaves(weights), saved or {})


def check_same_model(saved: list[list[Any]], like: TrainState, where: Path) -> None:
    """Raise ``ConfigError`` naming the first leaf whose path or shape differs from ``like``;
    when the weights match and only the optimizer state differs, say so (another optimizer)."""
    now = [(p, tuple(shape)) for p, shape, *_ in manifest_shapes(like)]
    before = [(p, tuple(shape)) for p, shape, *_ in saved]

    def weights(rows: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
        return [r for r in rows if not r[0].startswith(".opt_state")]

    def optimizer(rows: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
        return [r for r in rows if r[0].startswith(".opt_state")]

    if weights(now) == weights(before) and optimizer(now) != optimizer(before):
        raise ConfigError(
            f"checkpoint {where} holds another optimizer's state ({len(optimizer(before))} "
            f"arrays, e.g. {_first(optimizer(before))}; this run's optimizer has "
            f"{len(optimizer(now))}, e.g. {_first(optimizer(now))}): resume with the optimizer "
            "it was written with (optim.name, or the optax object given to jddp.fit), start "
            "from its weights in a new workdir (checkpoint.init_from), or start over "
            "(checkpoint.resume=false)"
        )
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


def _first(rows: list[tuple[str, tuple]]) -> str:
    return f"{rows[0][0]} {rows[0][1]}" if rows else "none"


def manifest_shapes(state: TrainState) -> list[list[Any]]:
    """``[path, shape, dtype]`` of every leaf, without reading values."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return [[jax.tree_util.keystr(p), list(x.shape), str(x.dtype)] for p, x in flat]
