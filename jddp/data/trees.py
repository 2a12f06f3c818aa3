"""Data of any task: sources whose batches are pytrees (dicts, tuples, nested) of arrays.

A custom task's data (``jddp.fit(loss=...)``, ``data.name=pkg.module:factory``) is, as the user
holds it, one of:

* a pytree of arrays sharing one leading example axis — a dict ``{"tokens": [N, T], "lengths":
  [N]}``, a tuple ``(x [N, D], y [N])``, nested, or a single array: :class:`ArrayTreeSource`;
* a list, or any random-access source (``len`` + ``[i]``, e.g. a grain ``MapDataset``), whose
  items are such pytrees *without* the leading axis: :class:`RecordTreeSource` (items stacked
  into batches);
* an iterator of batch pytrees, read once and concatenated (one that never ends is refused:
  :func:`~jddp.data.source.read_batches`);
* any object with ``get_batch(indices) -> batch pytree``, used as it is.

Every leaf must be a numeric array (bool, integer, float); 64-bit values become 32-bit, as JAX
holds them. A leaf that is no array, leaves of different leading sizes, or records of different
shapes are a :class:`~jddp.errors.DataConfigError` (exit 2) naming the leaf, e.g.
``train_data['tokens']``. Batch *k* is the same examples on every topology and after a resume,
as for images (:mod:`jddp.data.pipeline`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from jddp.data.source import as_index_array, read_batches
from jddp.errors import DataConfigError, DataError

__all__ = ["ArrayTreeSource", "RecordTreeSource", "as_tree_source", "example_spec"]


def leaf_name(who: str, path: Any) -> str:
    """``who`` followed by the leaf's path, e.g. ``train_data['tokens']``."""
    return who + jax.tree_util.keystr(path)


def _as_leaf(value: Any, name: str, per_example: bool) -> np.ndarray:
    """``value`` as a numeric numpy array in JAX's 32-bit dtypes, else a DataConfigError naming
    the leaf. ``per_example``: a leaf of one example (scalars allowed), else of a whole set."""
    if per_example and isinstance(value, bool | int | float | np.generic):
        value = np.asarray(value)
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        axis = "" if per_example else " with a leading example axis"
        raise DataConfigError(
            f"{name}: a {type(value).__name__} is not an array; every leaf must be a numeric "
            f"array{axis} (bool, int or float)"
        )
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":
        raise DataConfigError(
            f"{name}: dtype {array.dtype} is not numeric; every leaf must hold bool, int or "
            "float values"
        )
    if not per_example and array.ndim == 0:
        raise DataConfigError(
            f"{name}: a scalar has no example axis; every leaf needs shape [N, ...] (N examples)"
        )
    canonical = jax.dtypes.canonicalize_dtype(array.dtype)
    return array if array.dtype == canonical else array.astype(canonical)


def _spec(tree: Any, drop_leading: bool) -> Any:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape[1:] if drop_leading else x.shape, x.dtype), tree
    )


def _describe(spec: Any) -> str:
    flat, _ = jax.tree_util.tree_flatten_with_path(spec)
    return ", ".join(f"{jax.tree_util.keystr(p) or '.'} {x.dtype}{list(x.shape)}" for p, x in flat)


class ArrayTreeSource:
    """A pytree of arrays sharing a leading example axis (see the module docstring)."""

    def __init__(
        self, tree: Any, name: str = "data", who: str | None = None, allow_empty: bool = False
    ):
        who = who or name
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        if not flat:
            raise DataConfigError(f"{who}: no arrays (an empty {type(tree).__name__})")
        leaves = [_as_leaf(x, leaf_name(who, p), per_example=False) for p, x in flat]
        first = leaves[0].shape[0]
        for (path, _), leaf in zip(flat, leaves, strict=True):
            if leaf.shape[0] != first:
                raise DataConfigError(
                    f"{leaf_name(who, path)} has {leaf.shape[0]} examples but "
                    f"{leaf_name(who, flat[0][0])} has {first}: every leaf needs the same "
                    "leading (example) size"
                )
        if not leaves[0].shape[0] and not allow_empty:
            raise DataConfigError(f"{who}: no examples (leading size 0)")
        self.tree = jax.tree.unflatten(treedef, leaves)
        self.name = name
        self.example = _spec(self.tree, drop_leading=True)

    def __len__(self) -> int:
        """Number of examples."""
        return int(jax.tree.leaves(self.tree)[0].shape[0])

    def get_batch(self, indices: np.ndarray) -> Any:
        """The examples at ``indices``, every leaf gathered along its leading axis."""
        idx = as_index_array(indices, len(self), "ArrayTreeSource")
        return jax.tree.map(lambda x: x[idx], self.tree)

    def __repr__(self) -> str:
        """Stable description (no memory addresses: grain embeds it in its state)."""
        return (
            f"ArrayTreeSource(name={self.name!r}, n={len(self)}, example={_describe(self.example)})"
        )


class RecordTreeSource:
    """Random-access records, each an example pytree without the leading axis (see the module
    docstring); :meth:`get_batch` stacks them leaf by leaf."""

    def __init__(self, records: Any, name: str = "data", who: str | None = None):
        self.records = records
        self.name = name
        self.who = who or name
        if not len(records):
            raise DataConfigError(f"{self.who}: no examples (an empty {type(records).__name__})")
        _, first, self._treedef = self._record(0)
        self.example = _spec(jax.tree.unflatten(self._treedef, first), drop_leading=False)

    def _record(self, i: int) -> tuple[list[str], list[np.ndarray], Any]:
        """Record ``i``'s leaf names, leaves (numpy) and structure."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(self.records[i])
        if not flat:
            raise DataConfigError(f"{self.who}[{i}]: no arrays in this record")
        names = [leaf_name(f"{self.who}[{i}]", p) for p, _ in flat]
        leaves = [_as_leaf(x, n, per_example=True) for n, (_, x) in zip(names, flat, strict=True)]
        return names, leaves, treedef

    def __len__(self) -> int:
        """Number of examples."""
        return len(self.records)

    def get_batch(self, indices: np.ndarray) -> Any:
        """The records at ``indices`` stacked into one batch pytree."""
        idx = as_index_array(indices, len(self), "RecordTreeSource")
        rows = []
        want = jax.tree.leaves(self.example)
        for i in idx:
            names, leaves, treedef = self._record(int(i))
            if treedef != self._treedef:
                raise DataError(
                    f"{self.who}[{int(i)}]: its structure {treedef} differs from the first "
                    f"record's {self._treedef}; every record needs the same keys"
                )
            for name, leaf, spec in zip(names, leaves, want, strict=True):
                if leaf.shape != spec.shape:
                    raise DataError(
                        f"{name} has shape {list(leaf.shape)} but the first record's has "
                        f"{list(spec.shape)}: stacked into batches, every record's leaves need "
                        "the same shapes (pad them, and pass the lengths or a mask as another "
                        "leaf)"
                    )
            rows.append(leaves)
        stacked = [
            np.stack([row[k] for row in rows]).astype(spec.dtype, copy=False)
            for k, spec in enumerate(want)
        ]
        return jax.tree.unflatten(self._treedef, stacked)

    def __repr__(self) -> str:
        """Stable description (no memory addresses)."""
        return (
            f"RecordTreeSource(name={self.name!r}, n={len(self)}, "
            f"example={_describe(self.example)})"
        )


def example_spec(source: Any) -> Any:
    """The shapes and dtypes of one example of ``source`` (no leading axis): its ``example``,
    else read from its first example."""
    spec = getattr(source, "example", None)
    if spec is not None:
        return spec
    return _spec(source.get_batch(np.arange(1)), drop_leading=True)


def as_tree_source(
    data: Any, name: str = "data", *, label: str | None = None, allow_empty: bool = False
) -> Any:
    """User data of a custom task as a source of batch pytrees (see the module docstring);
    errors name ``label`` (default ``name``), e.g. ``train_data``. ``allow_empty``: arrays with
    no example are a source of length 0, not an error."""
    who = label or name
    if hasattr(data, "get_batch"):
        return data
    if isinstance(data, dict | tuple) or (hasattr(data, "shape") and hasattr(data, "dtype")):
        return ArrayTreeSource(data, name, who, allow_empty)
    if isinstance(data, list) or (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        return RecordTreeSource(data, name, who)
    if isinstance(data, Iterator):
        batches = read_batches(
            data, who, lambda i, b: ArrayTreeSource(b, name, f"{who} batch {i}").tree
        )
        if not batches:
            raise DataConfigError(f"{who}: no examples (the iterator gave no batch)")
        structures = {jax.tree.structure(b) for b in batches}
        if len(structures) > 1:
            raise DataConfigError(f"{who}: the batches differ in structure ({structures})")
        joined = jax.tree.map(lambda *xs: np.concatenate(xs), *batches)
        return ArrayTreeSource(joined, name, who)
    raise DataConfigError(
        f"{who}: a {type(data).__name__} is not data jddp can read; pass a dict or tuple of "
        "arrays with a leading example axis, a list or random-access source of examples, an "
        "iterator of batches, or an object with get_batch(indices)"
    )
