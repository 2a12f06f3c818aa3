"""ResNet-18/34/50/101/152 in Flax NNX (NHWC), matching torchvision v1.5.

The architecture follows ``torchvision.models.resnet``: BasicBlock for ResNet-18/34,
Bottleneck (expansion 4, stride on the 3x3 conv, "v1.5") for ResNet-50 and deeper,
bias-free convolutions each followed by BatchNorm, a 1x1 conv + BN projection shortcut
whenever the residual's shape changes, global average pooling and a Dense head. With the
``"imagenet"`` stem and 1000 classes the ``nnx.Param`` counts equal torchvision's.

Mixed precision: ``dtype`` is the compute dtype of the convolutions (e.g. bfloat16);
parameters are stored in ``param_dtype``. BatchNorm always normalizes and computes its
batch statistics in at least float32 (float64 under x64), the residual add
happens in that precision too, and activations are cast back to ``dtype`` between blocks. The
pooled features and the classifier head are float32, so logits are always float32.

Train/eval mode uses NNX's standard mechanism: ``model.train()`` / ``model.eval()``
toggle ``use_running_average`` on every ``nnx.BatchNorm``. The model only holds
``nnx.Param`` and ``nnx.BatchStat`` variables, so
``nnx.split(model, nnx.Param, nnx.BatchStat)`` returns exactly two states.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jddp.mesh import DATA_AXES
from jddp.models.units import rematerialise_blocks

__all__ = [
    "BasicBlock",
    "Bottleneck",
    "ResNet",
    "resnet10",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
]

Dtype = Any
ModuleDef = Callable[..., nnx.Module]

# torchvision's kaiming_normal_(mode="fan_out", nonlinearity="relu") for conv kernels.
_CONV_INIT = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")
_PAD1 = ((1, 1), (1, 1))
_PAD3 = ((3, 3), (3, 3))
_STEMS = ("imagenet", "cifar")


@jax.custom_jvp
def _stored(x: jax.Array) -> jax.Array:
    """``x`` as a value XLA:CPU stores instead of recomputing it in its consumers.

    XLA:CPU (jaxlib 0.10) duplicates a cheap elementwise producer into each fusion that
    consumes it, but not one holding an "expensive" op such as a division. So ``x`` is divided,
    element by element, by ``1 + 0 * x``: 1 exactly for every finite ``x``, which XLA cannot
    fold (``0 * x`` is NaN for an infinite ``x``), nor turn into a multiplication by a
    reciprocal as it does for a divisor broadcast from a scalar. The result is ``x`` bit for bit
    except that subnormals become zeros of their sign (XLA:CPU flushes them, as its
    convolutions do with their inputs anyway) and infinities NaN (the step is non-finite
    either way). The derivative is the identity (no division in the backward pass).
    """
    return x / (1 + 0 * x)


@_stored.defjvp
def _stored_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]):
    return _stored(primals[0]), tangents[0]


def _conv_of_stored_input(lhs: jax.Array, rhs: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
    """``lax.conv_general_dilated`` whose input, on CPU, is computed once and stored
    (:func:`_stored`).

    XLA:CPU computes a weight gradient as a convolution over the input with images and channels
    swapped, so it transposes the input first, and its fusion recomputes the elementwise chain
    that made the input (BatchNorm, ReLU, residual adds, several layers back) inside each
    transpose instead of reading it. Those transposes took 0.48 s of a 2.1 s ResNet-18-CIFAR
    step on one core, 0.14 s with the input stored (experiments/RESULTS.md, "Where the rest of
    the gap was"). Other platforms get the plain convolution (XLA:GPU computes weight gradients
    with cuDNN; this was neither needed nor measured there).
    """
    if jax.default_backend() == "cpu":
        lhs = _stored(lhs)
    return jax.lax.conv_general_dilated(lhs, rhs, *args, **kwargs)


def plain_convolutions(module: nnx.Module) -> nnx.Module:
    """``module`` (in place) with the convolutions of :func:`_conv_of_stored_input` made plain
    ``lax.conv_general_dilated`` again: the same values, without the division that only helps
    XLA:CPU's training step. For a program traced here to run elsewhere (an export: onnxruntime
    ran the ResNet-18 1.66x slower with it, 0.212 s vs 0.128 s for 32 images on the 2-core
    VM). Other modules are left as they are."""
    for _, layer in nnx.iter_modules(module):
        if getattr(layer, "conv_general_dilated", None) is _conv_of_stored_input:
            # any module holding it (checked above), nnx.Conv or not
            layer.conv_general_dilated = jax.lax.conv_general_dilated  # type: ignore[attr-defined]
    return module


class _ResidualBlock(nnx.Module):
    """A residual block: a branch of convolutions and BatchNorms plus the identity, or a
    projection when the shape changes; ReLU after the sum.

    Args:
      in_features: input channels.
      features: the block's width; it outputs ``expansion * features`` channels.
      strides: stride of the block's strided 3x3 conv.
      conv: partial ``nnx.Conv`` constructor (no bias, dtype and rngs bound).
      norm: partial ``nnx.BatchNorm`` constructor (momentum, epsilon, axis_name, rngs bound).
      zero_init_residual: initialise the branch's last BatchNorm scale to zero.
      dtype: compute dtype of the block output.
    """

    expansion: int

    def __init__(
        self,
        in_features: int,
        features: int,
        strides: int,
        *,
        conv: ModuleDef,
        norm: ModuleDef,
        zero_init_residual: bool,
        dtype: Dtype,
    ) -> None:
        out_features = features * self.expansion
        self.dtype = dtype
        last_scale = _last_scale_init(zero_init_residual)
        self._build_branch(in_features, features, out_features, strides, conv, norm, last_scale)
        self.downsample = _make_shortcut(in_features, out_features, strides, conv, norm)

    def _build_branch(self, in_features, features, out_features, strides, conv, norm, last_scale):
        raise NotImplementedError

    def branch(self, x: jax.Array) -> jax.Array:
        """The convolutions of the block (without the shortcut)."""
        raise NotImplementedError

    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the block to an NHWC batch."""
        residual = x if self.downsample is None else self.downsample(x)
        return nnx.relu(residual + self.branch(x)).astype(self.dtype)


class BasicBlock(_ResidualBlock):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34); expansion 1, stride on
    the first conv."""

    expansion: int = 1

    def _build_branch(self, in_features, features, out_features, strides, conv, norm, last_scale):
        self.conv1 = conv(in_features, features, (3, 3), strides, padding=_PAD1)
        self.bn1 = norm(features)
        self.conv2 = conv(features, out_features, (3, 3), 1, padding=_PAD1)
        self.bn2 = norm(out_features, scale_init=last_scale)

    def branch(self, x: jax.Array) -> jax.Array:
        """conv-BN-ReLU, conv-BN."""
        return self.bn2(self.conv2(nnx.relu(self.bn1(self.conv1(x)))))


class Bottleneck(_ResidualBlock):
    """1x1 -> 3x3 -> 1x1 bottleneck block (ResNet-50/101/152), expansion 4, stride on the 3x3
    conv (v1.5)."""

    expansion: int = 4

    def _build_branch(self, in_features, features, out_features, strides, conv, norm, last_scale):
        self.conv1 = conv(in_features, features, (1, 1), 1, padding="VALID")
        self.bn1 = norm(features)
        self.conv2 = conv(features, features, (3, 3), strides, padding=_PAD1)
        self.bn2 = norm(features)
        self.conv3 = conv(features, out_features, (1, 1), 1, padding="VALID")
        self.bn3 = norm(out_features, scale_init=last_scale)

    def branch(self, x: jax.Array) -> jax.Array:
        """1x1 conv-BN-ReLU, 3x3 conv-BN-ReLU, 1x1 conv-BN."""
        y = nnx.relu(self.bn1(self.conv1(x)))
        y = nnx.relu(self.bn2(self.conv2(y)))
        return self.bn3(self.conv3(y))


class Downsample(nnx.Module):
    """Projection shortcut: strided 1x1 conv followed by BatchNorm."""

    def __init__(
        self, in_features: int, out_features: int, strides: int, conv: ModuleDef, norm: ModuleDef
    ) -> None:
        self.conv = conv(in_features, out_features, (1, 1), strides, padding="VALID")
        self.bn = norm(out_features)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Project ``x`` to the block's output shape."""
        return self.bn(self.conv(x))


def _make_shortcut(
    in_features: int, out_features: int, strides: int, conv: ModuleDef, norm: ModuleDef
) -> Downsample | None:
    """Projection shortcut when the shape changes, else ``None`` (identity)."""
    if strides != 1 or in_features != out_features:
        return Downsample(in_features, out_features, strides, conv, norm)
    return None


def _last_scale_init(zero_init_residual: bool) -> nnx.initializers.Initializer:
    return nnx.initializers.zeros_init() if zero_init_residual else nnx.initializers.ones_init()


# The one table of architectures: depth name -> (block class, blocks per stage).
RESNET_CONFIGS: dict[str, tuple[type[BasicBlock] | type[Bottleneck], tuple[int, ...]]] = {
    "resnet10": (BasicBlock, (1, 1, 1, 1)),
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet34": (BasicBlock, (3, 4, 6, 3)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
    "resnet101": (Bottleneck, (3, 4, 23, 3)),
    "resnet152": (Bottleneck, (3, 8, 36, 3)),
}


class ResNet(nnx.Module):
    """Generic ResNet (NHWC) built from a block class and per-stage block counts.

    Args:
      block_cls: :class:`BasicBlock` or :class:`Bottleneck`.
      stage_sizes: number of blocks in each of the four stages.
      num_classes: size of the classifier head.
      stem: ``"imagenet"`` (7x7/2 conv + BN + ReLU + 3x3/2 max-pool) or ``"cifar"``
        (3x3/1 conv + BN + ReLU, no pooling).
      width: base channel width; stage ``i`` uses ``width * 2**i`` channels
        (times 4 at the output of a bottleneck block).
      sync_batchnorm: average BatchNorm batch statistics over ``axis_name`` (for use
        inside ``jax.shard_map``).
      axis_name: the mesh axes ``sync_batchnorm`` averages over (default: every device of
        jddp's step, :data:`jddp.mesh.DATA_AXES`).
      zero_init_residual: zero-initialise the last BatchNorm scale of each block.
      bn_momentum: decay of BatchNorm's running averages (Flax's convention:
        ``running = m * running + (1 - m) * batch``; PyTorch's ``momentum=0.1`` is 0.9).
      bn_epsilon: added to the variance before BatchNorm divides by its square root.
      in_channels: channels of the input images (3 for RGB, 1 for grayscale).
      dtype: compute dtype of convolutions (e.g. ``jnp.bfloat16``).
      param_dtype: storage dtype of parameters.
      rngs: NNX random streams (``params`` is used for initialisation).
    """

    def __init__(
        self,
        block_cls: type[BasicBlock] | type[Bottleneck],
        stage_sizes: Sequence[int],
        *,
        num_classes: int = 1000,
        stem: str = "imagenet",
        width: int = 64,
        sync_batchnorm: bool = False,
        axis_name: str | tuple[str, ...] = DATA_AXES,
        zero_init_residual: bool = True,
        bn_momentum: float = 0.9,
        bn_epsilon: float = 1e-5,
        in_channels: int = 3,
        dtype: Dtype = jnp.float32,
        param_dtype: Dtype = jnp.float32,
        remat: str = "none",
        rngs: nnx.Rngs,
    ) -> None:
        if stem not in _STEMS:
            raise ValueError(f"unknown stem {stem!r}; expected one of {_STEMS}")
        if remat not in REMAT_CHOICES:
            raise ValueError(f"unknown remat {remat!r}; expected one of {REMAT_CHOICES}")
        self.stem = stem
        self.dtype = dtype
        acc_dtype = jnp.promote_types(dtype, jnp.float32)
        self.acc_dtype = acc_dtype
        conv = functools.partial(
            nnx.Conv,
            conv_general_dilated=_conv_of_stored_input,
            use_bias=False,
            kernel_init=_CONV_INIT,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        norm = functools.partial(
            nnx.BatchNorm,
            use_running_average=False,
            momentum=bn_momentum,
            epsilon=bn_epsilon,
            dtype=acc_dtype,  # statistics and normalisation in at least float32
            param_dtype=param_dtype,
            # flax annotates one axis name; lax.pmean takes a tuple of them as well
            axis_name=axis_name if sync_batchnorm else None,  # type: ignore[arg-type]
            rngs=rngs,
        )
        if stem == "imagenet":
            self.conv1 = conv(in_channels, width, (7, 7), 2, padding=_PAD3)
        else:
            self.conv1 = conv(in_channels, width, (3, 3), 1, padding=_PAD1)
        self.bn1 = norm(width)

        blocks = []
        in_features = width
        for i, num_blocks in enumerate(stage_sizes):
            features = width * 2**i
            for j in range(num_blocks):
                strides = 2 if i > 0 and j == 0 else 1
                blocks.append(
                    block_cls(
                        in_features,
                        features,
                        strides,
                        conv=conv,
                        norm=norm,
                        zero_init_residual=zero_init_residual,
                        dtype=dtype,
                    )
                )
                in_features = features * block_cls.expansion
        self.blocks = nnx.List(blocks)
        self.fc = nnx.Linear(
            in_features, num_classes, dtype=acc_dtype, param_dtype=param_dtype, rngs=rngs
        )
        if remat == "blocks":  # each residual block's activations recomputed in the backward
            rematerialise_blocks(self)  # pass (the trainer does this for model.remat itself)
        stats_dtype = jnp.promote_types(param_dtype, jnp.float32)
        if stats_dtype != jnp.float32:  # nnx.BatchNorm always creates float32 running stats
            for _, module in nnx.iter_modules(self):
                if isinstance(module, nnx.BatchNorm):
                    module.mean.value = module.mean.value.astype(stats_dtype)
                    module.var.value = module.var.value.astype(stats_dtype)

    def __call__(self, x_BxHxWxC: jax.Array) -> jax.Array:
        """Map an NHWC image batch to float32 logits of shape ``(B, num_classes)``."""
        x = nnx.relu(self.bn1(self.conv1(x_BxHxWxC))).astype(self.dtype)
        if self.stem == "imagenet":
            x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=_PAD1)
        for block in self.blocks:
            x = block(x)
        x_BxD = jnp.mean(x.astype(self.acc_dtype), axis=(1, 2))
        return self.fc(x_BxD).astype(self.acc_dtype)


REMAT_CHOICES = ("none", "blocks")


def _factory(name: str, description: str) -> Callable[..., ResNet]:
    block_cls, stage_sizes = RESNET_CONFIGS[name]

    def factory(**kwargs: Any) -> ResNet:
        return ResNet(block_cls, stage_sizes, **kwargs)

    # The keyword arguments of ResNet after block_cls and stage_sizes, for help() and IDEs.
    params = list(inspect.signature(ResNet.__init__).parameters.values())[3:]
    factory.__signature__ = inspect.Signature(params, return_annotation=ResNet)  # type: ignore[attr-defined]
    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = f"{description} See :class:`ResNet` for the arguments."
    return factory


resnet10 = _factory("resnet10", "ResNet-10 (BasicBlock, stages 1-1-1-1).")
resnet18 = _factory("resnet18", "ResNet-18 (BasicBlock, stages 2-2-2-2).")
resnet34 = _factory("resnet34", "ResNet-34 (BasicBlock, stages 3-4-6-3).")
resnet50 = _factory("resnet50", "ResNet-50 (Bottleneck, stages 3-4-6-3).")
resnet101 = _factory("resnet101", "ResNet-101 (Bottleneck, stages 3-4-23-3).")
resnet152 = _factory("resnet152", "ResNet-152 (Bottleneck, stages 3-8-36-3).")
