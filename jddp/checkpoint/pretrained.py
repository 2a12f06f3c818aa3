"""Published ResNet weights onto a jddp ResNet: torchvision's and timm's state dicts, read from
``.safetensors`` (the ``safetensors`` package, no torch needed) or ``.pth``/``.pt``/``.bin``
(where torch is installed). (``jddp.load_pretrained``, ``checkpoint.init_from=FILE``.)

Which torchvision name each jddp array has, and its layout there, is model knowledge:
:mod:`jddp.models.torch_names`. BatchNorm's ``num_batches_tracked`` is not used. A state dict saved
from a DDP or compiled model (``module.`` or ``_orig_mod.`` before every name), or a training
checkpoint holding it under ``state_dict`` or ``model``, is read as well.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jddp.checkpoint.manifest import weight_leaves
from jddp.checkpoint.matching import (
    HEAD_ONLY,
    describe_mismatch,
    head_note,
    head_to_keep,
    map_weights,
    mismatched_weights,
)
from jddp.errors import CheckpointError, ConfigError, one_line
from jddp.models.torch_names import architecture, jddp_shape, to_jddp, torch_names, torch_shape
from jddp.state import split_model

__all__ = ["SUFFIXES", "is_pretrained_file", "load_pretrained", "pretrained_weights"]

SAFETENSORS = ".safetensors"
TORCH_PICKLES = (".pth", ".pt", ".bin")
SUFFIXES = (SAFETENSORS, *TORCH_PICKLES)
_PREFIXES = ("module.", "_orig_mod.")  # DistributedDataParallel, torch.compile
_NESTED = ("state_dict", "model")  # training checkpoints holding the state dict in a dict
_UNUSED = ".num_batches_tracked"  # PyTorch BatchNorm's step counter
Differ = list[tuple[str, tuple, tuple]]  # (name, shape in the file, shape now), jddp's layout
M = TypeVar("M", bound=nnx.Module)


def is_pretrained_file(path: str | Path) -> bool:
    """Whether ``path`` names a torchvision/timm weights file (by its suffix), not a jddp run."""
    return Path(path).suffix.lower() in SUFFIXES


def load_pretrained(path: str | Path, model: M) -> M:
    """Set ``model``'s parameters and BatchNorm statistics to a torchvision or timm ResNet's.

    Args:
      path: a ``.safetensors`` file (or ``.pth``/``.pt``/``.bin`` where torch is installed)
        holding a torchvision-named state dict: torchvision's ``resnet50`` weights, timm's
        ``resnet50.a1_in1k``, ...
      model: a jddp ResNet of the same architecture (e.g. ``jddp.models.resnet50(
        stem="imagenet", rngs=...)``); an output layer of another ``num_classes`` keeps its
        fresh initialisation, and a line on stdout says so.

    Returns:
      ``model``, its arrays replaced in place (train/eval mode unchanged).

    Raises:
      ConfigError: the file is missing, needs torch, or does not fit the model (one line naming
        the first missing and unexpected tensors, or a tensor and both shapes).
      CheckpointError: the file cannot be read.
    """
    _, params, model_state = split_model(model)
    fresh = {"params": params, "model_state": model_state}
    num_outputs = getattr(getattr(model, "fc", None), "out_features", None)
    weights, differ, head = pretrained_weights(path, fresh, num_outputs, "load_pretrained")
    weights = jax.tree.map(jnp.asarray, weights)
    nnx.update(model, weights["params"], weights["model_state"])
    if head:
        print(f"jddp: load_pretrained: loaded {path}{head_note(differ, head)}", flush=True)
    return model


def pretrained_weights(
    path: str | Path, fresh: dict[str, Any], num_outputs: int | None, key: str
) -> tuple[dict[str, Any], Differ, list[str]]:
    """The tensors of ``path`` in jddp's layout, in the structure and dtypes of ``fresh``
    (``{"params": ..., "model_state": ...}``): ``(weights, differ, head)``. ``head`` names the
    output layer kept fresh because only its class dimension (now ``num_outputs``) differs,
    ``differ`` its shapes. ``ConfigError`` naming ``key`` when the file does not fit."""
    tensors = read_tensors(Path(path), key)
    now = dict(weight_leaves(fresh))
    names = torch_names(now, key)
    saved = {
        name: jddp_shape(tensors[t].shape, now[name].shape)
        for name, t in names.items()
        if t in tensors
    }
    missing, differ = mismatched_weights(saved, fresh)
    known = set(names.values())
    unexpected = [t for t in tensors if t not in known and not t.endswith(_UNUSED)]
    head = head_to_keep(missing, differ, num_outputs)
    if head is None or unexpected:
        raise ConfigError(
            f"{key}: {path} does not fit this model: "
            + _describe(names, tensors, now, missing, differ, unexpected)
        )
    keep_fresh = set(head)

    def pick(name: str, leaf: Any) -> Any:
        if name in keep_fresh:
            return leaf
        return np.ascontiguousarray(to_jddp(tensors[names[name]]), dtype=leaf.dtype)

    return map_weights(pick, fresh), differ, head


def _describe(
    names: dict[str, str],
    tensors: dict[str, np.ndarray],
    now: Mapping[str, Any],
    missing: list[str],
    differ: Differ,
    unexpected: list[str],
) -> str:
    """:func:`describe_mismatch` in torchvision's names and shapes, and what would fit."""
    shapes = sorted(
        ((names[n], tuple(tensors[names[n]].shape), torch_shape(now[n].shape)) for n, *_ in differ),
        key=lambda row: _natural(row[0]),
    )
    text = describe_mismatch(
        sorted((names[n] for n in missing), key=_natural),
        shapes,
        sorted(unexpected, key=_natural),
        source="the file",
    )
    if shapes:
        text += f" {HEAD_ONLY}"
    file_arch, model_arch = architecture(tensors), architecture(names.values())
    if file_arch != model_arch:
        text += f" (the file holds a {file_arch}, this model is a {model_arch})"
    stem = [(there, here) for t, there, here in shapes if t == "conv1.weight"]
    if stem and stem[0][0][2:] == (7, 7) != stem[0][1][2:]:
        text += " (the file's conv1 is the 7x7 stem: model.stem=imagenet)"
    return text


def _natural(name: str) -> list[str | int]:
    """Sort key putting ``layer1.2`` before ``layer1.10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def read_tensors(path: Path, key: str) -> dict[str, Any]:
    """The state dict in file ``path`` as ``{torchvision name: numpy array}``."""
    if not path.is_file():
        raise ConfigError(f"{key}: {path}: no such file")
    if path.suffix.lower() == SAFETENSORS:
        return _read_safetensors(path, key)
    return _read_torch(path, key)


def _read_safetensors(path: Path, key: str) -> dict[str, np.ndarray]:
    try:
        from safetensors.numpy import load_file
    except ImportError:
        raise ConfigError(
            f"{key}: reading {path} needs the safetensors package: pip install safetensors"
        ) from None
    try:
        return state_dict_of(load_file(path), path, key)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises its own and OS errors
        raise CheckpointError(f"{key}: cannot read {path}: {one_line(e)}") from None


def _read_torch(path: Path, key: str) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise ConfigError(
            f"{key}: {path} is a PyTorch pickle, which needs torch to read: pip install torch, "
            "or convert it to .safetensors (safetensors.torch.save_file)"
        ) from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises anything
        raise CheckpointError(f"{key}: cannot read {path}: {one_line(e)}") from None
    return {name: _from_torch(t, torch) for name, t in state_dict_of(obj, path, key).items()}


def _from_torch(t: Any, torch: Any) -> np.ndarray:
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()  # numpy has no bfloat16


def state_dict_of(obj: Any, path: Path, key: str) -> dict[str, Any]:
    """The tensors of what a weights file holds: a state dict, or one under ``state_dict`` or
    ``model``; a ``module.``/``_orig_mod.`` prefix on every name removed."""
    if isinstance(obj, Mapping):
        nested = [obj[k] for k in _NESTED if isinstance(obj.get(k), Mapping)]
        obj = nested[0] if nested else obj
    tensors = (
        {k: v for k, v in obj.items() if hasattr(v, "shape")} if isinstance(obj, Mapping) else {}
    )
    if not tensors:
        raise ConfigError(f"{key}: {path} holds no state dict of tensors")
    for prefix in _PREFIXES:
        if all(k.startswith(prefix) for k in tensors):
            tensors = {k.removeprefix(prefix): v for k, v in tensors.items()}
    return tensors
