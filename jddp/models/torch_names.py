"""The torchvision names of a jddp ResNet's arrays, their layout there, and which ResNet a set of
torchvision names is: what :mod:`jddp.checkpoint.pretrained` needs to load torchvision's and timm's
weights, kept beside the model (as big_vision's ``models/bit.py:load`` sits beside its model).

timm's classic ResNets (``resnet18``, ``resnet50``, ...) name their tensors as torchvision does.
Each jddp array has one torchvision name; its layout changes on the way in:

======================================  ===========================================  ==========
torchvision                             jddp                                         layout
======================================  ===========================================  ==========
``conv1.weight``                        ``params['conv1']['kernel']``                OIHW->HWIO
``bn1.weight``, ``bn1.bias``            ``params['bn1']['scale']``, ``['bias']``
``bn1.running_mean``, ``.running_var``  ``model_state['bn1']['mean']``, ``['var']``
``layer<s>.<j>.conv1.weight``           ``params['blocks'][k]['conv1']['kernel']``   OIHW->HWIO
``layer<s>.<j>.downsample.0``, ``.1``   ``['blocks'][k]['downsample']['conv']``, ``['bn']``
``fc.weight``, ``fc.bias``              ``params['fc']['kernel']``, ``['bias']``     (O,I)->(I,O)
======================================  ===========================================  ==========

``k`` counts blocks over all stages; a stage starts where the blocks' width changes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from jddp.errors import ConfigError
from jddp.models.resnet import RESNET_CONFIGS

__all__ = ["LEAF_NAMES", "architecture", "jddp_shape", "to_jddp", "torch_names", "torch_shape"]

LEAF_NAMES = {  # jddp's name of a layer's array -> torchvision's
    "kernel": "weight",
    "scale": "weight",
    "bias": "bias",
    "mean": "running_mean",
    "var": "running_var",
}
_DOWNSAMPLE: dict[str | int, int] = {"conv": 0, "bn": 1}  # torchvision's downsample.0, .1
_TO_JDDP = {4: (2, 3, 1, 0), 2: (1, 0)}  # jddp axis k is torchvision axis _TO_JDDP[ndim][k]


def torch_names(now: Mapping[str, Any], key: str) -> dict[str, str]:
    """``{jddp name: torchvision name}`` of every array in ``now`` (``{name: array}``, names as
    :func:`jddp.checkpoint.weight_leaves` spells them); ``ConfigError`` naming ``key`` for an
    array without one (not a jddp ResNet)."""
    keys = {name: _keys(name) for name in now}
    widths: dict[str | int, int] = {  # block index -> its width (its first conv's outputs)
        k[1]: now[name].shape[-1]
        for name, k in keys.items()
        if k[:1] == ("blocks",) and k[2:] == ("conv1", "kernel")
    }
    stage_of = _stages(widths)
    out = {}
    for name, (*modules, leaf) in keys.items():
        # a block's leaf is checked too (a block's unknown one was a KeyError, not this error)
        torch_leaf = LEAF_NAMES.get(leaf) if isinstance(leaf, str) else None
        in_block = modules[:1] == ["blocks"]
        if torch_leaf is None or (in_block and modules[1] not in stage_of):
            raise ConfigError(f"{key}: {name} has no torchvision name (a jddp ResNet is expected)")
        if in_block:
            stage, j = stage_of[modules[1]]
            modules = [f"layer{stage}", j, *modules[2:]]
        if "downsample" in modules:
            modules = [_DOWNSAMPLE.get(m, m) for m in modules]
        out[name] = ".".join(map(str, [*modules, torch_leaf]))
    return out


def _keys(name: str) -> tuple[str | int, ...]:
    """``".params['blocks'][0]['conv1']['kernel'].value"`` -> ``("blocks", 0, "conv1",
    "kernel")``."""
    return tuple(int(i) if i else s for s, i in re.findall(r"\['([^']*)'\]|\[(\d+)\]", name))


def _stages(widths: Mapping[str | int, int]) -> dict[str | int, tuple[int, int]]:
    """``{block index: (stage from 1, index in the stage)}``: a stage starts where the width
    changes."""
    out, stage, j, last = {}, 0, 0, None
    for k in sorted(widths):
        if widths[k] != last:
            stage, j, last = stage + 1, 0, widths[k]
        out[k] = (stage, j)
        j += 1
    return out


def _axes(ndim: int) -> tuple[int, ...]:
    """Which torchvision axis each jddp axis is: conv kernels OIHW -> HWIO, dense weights
    (out, in) -> (in, out), vectors as they are."""
    return _TO_JDDP.get(ndim, tuple(range(ndim)))


def to_jddp(a: np.ndarray) -> np.ndarray:
    """A torchvision tensor in jddp's layout."""
    return a.transpose(_axes(a.ndim))


def jddp_shape(shape: tuple[int, ...], now: tuple[int, ...]) -> tuple[int, ...]:
    """A torchvision tensor's shape in jddp's layout (as it is when its rank differs from the
    jddp array's ``now``: wrong either way)."""
    if len(shape) != len(now):
        return tuple(shape)
    return tuple(shape[i] for i in _axes(len(shape)))


def torch_shape(now: tuple[int, ...]) -> tuple[int, ...]:
    """A jddp array's shape in torchvision's layout."""
    out = [0] * len(now)
    for jddp_axis, torch_axis in enumerate(_axes(len(now))):
        out[torch_axis] = now[jddp_axis]
    return tuple(out)


def architecture(names: Iterable[str]) -> str:
    """The ResNet that torchvision tensor ``names`` belong to: ``"resnet50"``, or its blocks;
    names without any ResNet block are said to be no ResNet (not "a ResNet of stages none")."""
    blocks: dict[int, set[int]] = {}
    bottleneck = False
    for name in names:
        if m := re.match(r"layer(\d+)\.(\d+)\.", name):
            blocks.setdefault(int(m[1]), set()).add(int(m[2]))
            bottleneck |= ".conv3." in name
    sizes = tuple(len(blocks[s]) for s in sorted(blocks))
    if not sizes:
        return "model that is no torchvision ResNet (no layer<stage>.<block>.* tensors)"
    for arch, (block_cls, stage_sizes) in RESNET_CONFIGS.items():
        if stage_sizes == sizes and (block_cls.expansion == 4) == bottleneck:
            return arch
    kind = "Bottleneck" if bottleneck else "BasicBlock"
    return f"ResNet of {kind} stages {'-'.join(map(str, sizes)) or 'none'}"
