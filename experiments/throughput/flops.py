"""Analytic FLOPs of a ResNet training step, counted from the architecture (standard library
only; the same layout as ``jddp.models.resnet`` and torchvision's ResNet).

How they are counted:

* forward MACs of one example = the sum over every convolution of ``H_out x W_out x C_out x
  C_in x kH x kW`` (projection shortcuts included) plus ``in x out`` of the dense head;
  BatchNorm, ReLU, pooling, residual adds, the loss and the optimizer update are left out (well
  under 1% of the total for these networks);
* forward FLOPs = 2 x MACs (a multiply and an add);
* training step FLOPs = 3 x forward FLOPs x global batch (the backward pass counted as 2 x the
  forward: the input gradient and the weight gradient of every layer; the first convolution's
  input gradient, which no one computes, is counted too, as in the usual convention).

ResNet-50 at 224x224 (ImageNet stem): 4.09 GMAC per image forward, so a batch-256 step is
3 x 2 x 4.09e9 x 256 = 6.3 TFLOP.
"""

from __future__ import annotations

# depth -> (block kind, blocks per stage); stage i has width * 2**i channels (x4 out: bottleneck)
ARCHS = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet34": ("basic", (3, 4, 6, 3)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
    "resnet101": ("bottleneck", (3, 4, 23, 3)),
    "resnet152": ("bottleneck", (3, 8, 36, 3)),
}
COUNTING = (
    "analytic: 3 (forward + 2x backward) x 2 x forward MACs of the convolutions and the dense "
    "head x global batch (experiments/throughput/flops.py)"
)


def _out(size: int, kernel: int, stride: int) -> int:
    """Output size of a convolution or pooling padded by ``kernel // 2`` on each side."""
    return (size + 2 * (kernel // 2) - kernel) // stride + 1


def _block_macs(kind: str, size: int, cin: int, features: int, stride: int) -> tuple[int, int]:
    """(MACs of one residual block for one example, its output size)."""
    out = _out(size, 3, stride)
    if kind == "basic":
        cout = features
        macs = out * out * features * cin * 9 + out * out * features * features * 9
    else:  # bottleneck v1.5: 1x1 -> 3x3 (strided) -> 1x1 (x4)
        cout = 4 * features
        macs = size * size * features * cin  # 1x1, stride 1
        macs += out * out * features * features * 9
        macs += out * out * cout * features
    if stride != 1 or cin != cout:  # projection shortcut: strided 1x1
        macs += out * out * cout * cin
    return macs, out


def resnet_forward_macs(
    model: str, stem: str, width: int, num_classes: int, image_size: int, in_channels: int = 3
) -> int:
    """Multiply-accumulates of one example's forward pass (convolutions and the dense head)."""
    kind, stages = ARCHS[model]
    if stem == "imagenet":  # 7x7/2 conv, then a 3x3/2 max-pool (not counted)
        size = _out(image_size, 7, 2)
        macs = size * size * width * in_channels * 49
        size = _out(size, 3, 2)
    else:  # cifar: 3x3/1 conv, no max-pool
        size = image_size
        macs = size * size * width * in_channels * 9
    cin = width
    for i, blocks in enumerate(stages):
        features = width * 2**i
        for j in range(blocks):
            block, size = _block_macs(kind, size, cin, features, 2 if i > 0 and j == 0 else 1)
            macs += block
            cin = features * (1 if kind == "basic" else 4)
    return macs + cin * num_classes


def train_step_flops(workload: dict) -> float | None:
    """FLOPs of one training step of ``workload`` (a :class:`.specs.Workload` as a dict: model,
    stem, width, num_classes, image_size, global_batch); None for a model this does not know."""
    if workload.get("model") not in ARCHS:
        return None
    macs = resnet_forward_macs(
        workload["model"],
        workload.get("stem", "imagenet"),
        workload.get("width", 64),
        workload["num_classes"],
        workload["image_size"],
    )
    return 3 * 2 * macs * workload["global_batch"]
