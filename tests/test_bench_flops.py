"""The analytic FLOP count that ``experiments/bench.py`` uses for MFU, against published numbers.

Fast and standard library only (no jax, no torch): ``experiments/throughput/flops.py`` is loaded
by its path.
"""

import importlib.util
from pathlib import Path

import pytest

FLOPS = Path(__file__).resolve().parent.parent / "experiments" / "throughput" / "flops.py"


@pytest.fixture(scope="module")
def flops():
    spec = importlib.util.spec_from_file_location("jddp_experiments_bench_flops", FLOPS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "model, stem, num_classes, image_size, published_gmac",
    [
        # torchvision's model table (its "GFLOPS" are multiply-accumulates), 224x224, 1000 classes
        ("resnet50", "imagenet", 1000, 224, 4.09),
        ("resnet18", "imagenet", 1000, 224, 1.81),
        # ResNet-18 with the CIFAR stem (3x3/1 conv, no max-pool), 32x32, 10 classes: 0.56 GMAC
        # (kuangliu/pytorch-cifar's ResNet18, the count thop and fvcore report)
        ("resnet18", "cifar", 10, 32, 0.56),
    ],
)
def test_forward_macs_match_published(flops, model, stem, num_classes, image_size, published_gmac):
    macs = flops.resnet_forward_macs(model, stem, 64, num_classes, image_size)
    assert macs / 1e9 == pytest.approx(published_gmac, rel=0.02)


def test_resnet50_train_step_is_6_3_tflop(flops):
    """3 x 4.1 GMAC x 2 x 256 = 6.3 TFLOP for a batch-256 ResNet-50 training step (issue 12)."""
    work = dict(
        model="resnet50",
        stem="imagenet",
        width=64,
        num_classes=1000,
        image_size=224,
        global_batch=256,
    )
    assert flops.train_step_flops(work) / 1e12 == pytest.approx(6.3, rel=0.01)
    # Linear in the batch; width scales the convolutions quadratically.
    assert flops.train_step_flops({**work, "global_batch": 128}) == flops.train_step_flops(work) / 2
    narrow = flops.resnet_forward_macs("resnet18", "cifar", 32, 10, 32)
    wide = flops.resnet_forward_macs("resnet18", "cifar", 64, 10, 32)
    assert wide / narrow == pytest.approx(4, rel=0.01)
    assert flops.train_step_flops({**work, "model": "vit"}) is None
