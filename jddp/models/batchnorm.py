"""BatchNorm over fixed groups of rows, whatever the device count (``model.bn_group_size``).

Without ``model.sync_batchnorm`` each device normalises its own rows: the statistics, and so
the losses, depend on how many rows a device holds. A run restarted on fewer devices (an
elastic restart after a lost machine, a resume on another topology) would change its
mathematics from the restart on. Here every BatchNorm of the model, in training, normalises
fixed groups of ``G`` rows instead (``G``: the per-device micro-batch when the run started): a
device holding ``2G`` rows normalises each half apart, as two devices did. The running
statistics follow the mean over groups (and over devices: :mod:`jddp.step` averages the model
state), as they followed the mean over devices. With one group per device the step computes
what it always did.

:func:`group_batchnorms` applies it to any model by a class swap of its ``nnx.BatchNorm``
modules on the copy a train step merges (the built-in ResNets' and a user's alike); a
synchronised BatchNorm (``axis_name`` set: statistics over the global batch) is left as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import jax
import jax.numpy as jnp
from flax import nnx


class GroupedBatchNorm(nnx.BatchNorm):
    """``nnx.BatchNorm`` whose training statistics are per group of :attr:`group_rows` rows
    along the batch axis (0); each group normalised with its own mean and variance (computed
    as flax computes them: in at least float32, ``E[x^2] - E[x]^2`` clipped at 0). In eval,
    or with ``use_running_average``, exactly ``nnx.BatchNorm``."""

    group_rows: int = 0  # set on each instance by group_batchnorms

    def __call__(self, x, use_running_average=None, *, mask=None):
        running = use_running_average if use_running_average is not None else (
            self.use_running_average
        )  # fmt: skip
        rows, group = x.shape[0], self.group_rows
        if running or mask is not None or not group or group == rows or rows % group:
            return super().__call__(x, use_running_average, mask=mask)
        groups = rows // group
        feature_axes = {a % x.ndim for a in ((self.axis,) if isinstance(self.axis, int)
                                             else self.axis)}  # fmt: skip
        # the group axis in front; statistics over each group's rows and the other axes
        xg = x.reshape(groups, group, *x.shape[1:])
        axes = tuple(1 + a for a in range(x.ndim) if a not in feature_axes)
        stats_dtype = jnp.promote_types(self.dtype or x.dtype, jnp.float32)
        xf = xg.astype(stats_dtype)
        mean = xf.mean(axes, keepdims=True)
        var = jnp.maximum(0.0, (xf * xf).mean(axes, keepdims=True) - mean * mean)
        update = functools.partial(jnp.mean, axis=(0, *axes))  # the groups' mean, per feature
        self.mean[...] = jax.lax.stop_gradient(
            self.momentum * self.mean[...] + (1 - self.momentum) * update(mean)
        )
        self.var[...] = jax.lax.stop_gradient(
            self.momentum * self.var[...] + (1 - self.momentum) * update(var)
        )
        dtype = self.dtype or jnp.result_type(x, self.scale[...] if self.scale is not None else x)
        y = xg.astype(dtype) - mean.astype(dtype)
        mul = jax.lax.rsqrt(var + self.epsilon).astype(dtype)
        if self.scale is not None:
            mul = mul * self.scale[...].astype(dtype)
        y = y * mul
        if self.bias is not None:
            y = y + self.bias[...].astype(dtype)
        return y.reshape(x.shape)


_GROUPED: dict[type, type] = {nnx.BatchNorm: GroupedBatchNorm}  # a class -> its grouped one


def _grouped(cls: type) -> type | None:
    """The grouped class of a BatchNorm class: None for one with a call of its own (its own
    computation is left alone)."""
    if issubclass(cls, GroupedBatchNorm):
        return cls
    if cls.__call__ is not nnx.BatchNorm.__call__:
        return None
    if cls not in _GROUPED:
        metaclass: Callable[..., type] = type(cls)  # cls's, flax's (mypy calls no type(cls))
        _GROUPED[cls] = metaclass(
            cls.__name__, (GroupedBatchNorm, cls), {"__module__": cls.__module__}
        )
    return _GROUPED[cls]


def group_batchnorms(model: nnx.Module, group_rows: int | None) -> nnx.Module:
    """``model`` with each ``nnx.BatchNorm`` that normalises per device (no ``axis_name``)
    normalising groups of ``group_rows`` rows in training (:class:`GroupedBatchNorm`); nothing
    changes with ``group_rows`` None, for a synchronised BatchNorm, or for a subclass with a
    call of its own. The modules' classes change in place: call it on a model merged for one
    step, as the train step does."""
    if not group_rows:
        return model
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm) and module.axis_name is None:
            grouped = _grouped(type(module))
            if grouped is not None:
                module.__class__ = grouped
                cast(GroupedBatchNorm, module).group_rows = group_rows  # its class now
    return model
