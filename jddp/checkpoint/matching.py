"""A model's arrays against saved ones (a checkpoint's or a pretrained file's), by name and
shape: what is missing or differs, said in one line, and the output layer of another class
count that may keep its fresh initialisation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from jddp.checkpoint.manifest import weight_leaves


def short_name(name: str) -> str:
    """A manifest name as users read it: ``params['out']['kernel']``."""
    return name.removeprefix(".").removesuffix(".value")


def mismatched_weights(
    saved: dict[str, tuple[int, ...]], weights: dict[str, Any]
) -> tuple[list[str], list[tuple[str, tuple, tuple]]]:
    """Arrays of ``weights`` the checkpoint lacks, and ``(name, saved, now)`` for every array
    whose shape differs (names as in the checkpoint's manifest)."""
    missing, differ = [], []
    for name, leaf in weight_leaves(weights):
        shape = tuple(leaf.shape)
        if name not in saved:
            missing.append(name)
        elif saved[name] != shape:
            differ.append((name, saved[name], shape))
    return missing, differ


def describe_mismatch(
    missing: list[str],
    differ: list[tuple[str, tuple, tuple]],
    unexpected: Sequence[str] = (),
    source: str = "the checkpoint",
) -> str:
    """One line naming (up to 5 of) each kind of mismatch: arrays ``missing`` from ``source``,
    arrays of ``source`` the model does not have (``unexpected``), and other shapes."""
    parts = []
    if missing:
        names = ", ".join(short_name(n) for n in missing[:5])
        parts.append(f"{len(missing)} arrays are not in {source} ({names})")
    if unexpected:
        names = ", ".join(short_name(n) for n in unexpected[:5])
        parts.append(f"{len(unexpected)} arrays of {source} are not in the model ({names})")
    if differ:
        names = ", ".join(
            f"{short_name(n)} {list(a)} there vs {list(b)} now" for n, a, b in differ[:5]
        )
        parts.append(f"{len(differ)} arrays have other shapes ({names})")
    return "; ".join(parts)


# Said when weights are refused for their shapes: the one difference init_from forgives.
HEAD_ONLY = "(only an output layer of another num_classes is re-initialised)"


def head_arrays(
    differ: list[tuple[str, tuple, tuple]], num_outputs: int | None
) -> list[str] | None:
    """The names of ``differ`` (``(name, saved shape, shape now)``) when they are all one
    output layer whose class dimension changed: one module's arrays, equal but for the last
    axis, which is now ``num_outputs`` (the model's logits). None otherwise, and always for a
    model without class logits (``num_outputs`` None: a custom task)."""
    if not differ or num_outputs is None:
        return None
    parents, pairs = set(), set()
    for name, saved, now in differ:
        if len(saved) != len(now) or saved[:-1] != now[:-1] or now[-1] != num_outputs:
            return None
        parents.add(name.removesuffix(".value").rsplit("[", 1)[0])
        pairs.add((saved[-1], now[-1]))
    return [name for name, *_ in differ] if len(parents) == 1 and len(pairs) == 1 else None


def head_to_keep(
    missing: list[str], differ: list[tuple[str, tuple, tuple]], num_outputs: int | None
) -> list[str] | None:
    """What a warm start keeps freshly initialised: ``[]`` when the saved weights fit the
    model, the output layer's names when only its class dimension differs
    (:func:`head_arrays`), None when they do not fit (arrays missing, other shapes)."""
    if missing:
        return None
    return head_arrays(differ, num_outputs) if differ else []


def head_note(differ: list[tuple[str, tuple, tuple]], head: list[str]) -> str:
    """``"; re-initialised <names> (class dimension A -> B)"`` for a kept-fresh ``head``, else
    ``""`` (the end of a warm start's line)."""
    if not head:
        return ""
    (_, before, now), *_ = differ
    names = ", ".join(short_name(n) for n in head)
    return f"; re-initialised {names} (class dimension {before[-1]} -> {now[-1]})"


def map_weights(fn: Callable[[str, Any], Any], weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` (``{"params": ..., "model_state": ...}``) with every leaf replaced by
    ``fn(name, leaf)``, names as :func:`jddp.checkpoint.weight_leaves` spells them."""
    out = {}
    for top in ("params", "model_state"):
        flat, treedef = jax.tree_util.tree_flatten_with_path(weights[top])
        leaves = [fn(f".{top}{jax.tree_util.keystr(p)}", x) for p, x in flat]
        out[top] = jax.tree_util.tree_unflatten(treedef, leaves)
    return out


def with_shapes(weights: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """``weights`` as shape/dtype structs, with the shape of each array named in ``shapes``."""
    return map_weights(
        lambda name, x: jax.ShapeDtypeStruct(shapes.get(name, x.shape), x.dtype), weights
    )
