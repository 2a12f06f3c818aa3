"""PyTorch DistributedDataParallel peer of jddp: same ResNet, same optimizer, synthetic data.

    .venv/bin/python experiments/peers/torch_ddp.py [--nproc 2] [--threads 1] [--pin]
        [--steps 8] [--warmup 2] [--dtype float32|bfloat16] [--global-batch 128]
        [--model resnet18|resnet50] [--stem cifar|imagenet] [--image-size 32] [--width 64]
        [--num-classes 10] [--device cpu|cuda] [--channels-last] [--impl own|torchvision]
        [--compile] [--cudnn-benchmark]

(needs ``pip install -r experiments/requirements-bench.txt``). It starts ``--nproc`` processes
(``torch.multiprocessing``, torchrun's variables); under ``torchrun`` it is one worker. gloo on
CPU, NCCL on CUDA (one GPU per process). ``--pin``: process i on CPU i.

A step: ``zero_grad`` -> forward -> cross-entropy -> ``backward`` (DDP all-reduces gradient
buckets, overlapped with the backward pass) -> ``SGD.step``. The model is written out here
(torchvision has no CPU build for this torch): torchvision's ResNet layout with jddp's options
(``stem="cifar"``: 3x3/1 conv, no max-pool; BatchNorm momentum 0.1, eps 1e-5; kaiming_normal
fan_out; the last BN of each block zero-initialised). ``SGD(lr=0.1, momentum=0.9,
weight_decay=5e-4)`` = jddp's ``sgd``. ``--impl torchvision``: torchvision's model (what users
run on a GPU; the CIFAR stem as CIFAR recipes adapt it), falling back to the one here, saying
why. ``--compile``: ``torch.compile`` around the DDP model (compiled in the first step). On
CUDA float32 matmuls may use TF32, as JAX's default. ``bfloat16``: ``torch.autocast`` around
forward and loss (parameters, gradients, all-reduce stay float32, as in jddp).

Data: one fixed random batch per rank, reused; loading not timed. Timing: wall time of each
step (CUDA: synchronised); a step's time is the slowest rank's. Rank 0 prints one JSON line:
per-step times, losses, ``ru_maxrss`` of every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


# ------------------------------------------------------------------------------------- model
def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: two 3x3 convs, projection shortcut when the shape changes."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = _conv3x3(cin, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or cin != planes:
            self.downsample = nn.Sequential(_conv1x1(cin, planes, stride), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """torchvision's Bottleneck v1.5 (stride on the 3x3 conv), expansion 4."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1):
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = _conv1x1(cin, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, cout)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(_conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


ARCHS = {"resnet18": (BasicBlock, (2, 2, 2, 2)), "resnet50": (Bottleneck, (3, 4, 6, 3))}


class ResNet(nn.Module):
    """torchvision ResNet with a ``cifar`` (3x3/1 conv, no max-pool) or ``imagenet`` stem."""

    def __init__(
        self, arch: str = "resnet18", num_classes: int = 10, stem: str = "cifar", width: int = 64
    ):
        super().__init__()
        block, sizes = ARCHS[arch]
        if stem == "cifar":
            self.conv1 = nn.Conv2d(3, width, 3, stride=1, padding=1, bias=False)
            self.maxpool = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        cin = width
        for i, n in enumerate(sizes):
            planes = width * 2**i
            layers = []
            for j in range(n):
                layers.append(block(cin, planes, 2 if i > 0 and j == 0 else 1))
                cin = planes * block.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for m in self.modules():  # zero_init_residual=True, as jddp's default
            if isinstance(m, Bottleneck):
                nn.init.zeros_(m.bn3.weight)
            elif isinstance(m, BasicBlock):
                nn.init.zeros_(m.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _torchvision_resnet(cfg: PeerConfig) -> tuple[nn.Module | None, str]:
    """torchvision's ResNet for ``cfg`` (``zero_init_residual=True`` as jddp; the ``cifar`` stem
    as common CIFAR recipes adapt it: ``conv1`` a 3x3/1 conv, ``maxpool`` removed), or None and
    why not (torchvision missing or broken, a width it does not build)."""
    if cfg.model not in ARCHS:
        return None, f"torchvision: no {cfg.model!r} here"
    if cfg.width != 64:
        return None, f"torchvision's ResNet has base width 64, not {cfg.width}"
    try:
        import torchvision.models as tvm
    except (ImportError, RuntimeError) as e:  # RuntimeError: a torchvision built for another torch
        return None, f"torchvision not importable ({type(e).__name__}: {e})"
    model = getattr(tvm, cfg.model)(
        weights=None, num_classes=cfg.num_classes, zero_init_residual=True
    )
    what = f"torchvision.models.{cfg.model}(zero_init_residual=True)"
    if cfg.stem == "cifar":
        model.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
        model.maxpool = nn.Identity()
        what += " with the CIFAR stem (conv1 3x3/1, no maxpool)"
    return model, what


def build_model(cfg: PeerConfig) -> tuple[nn.Module, str]:
    """The model of ``cfg.impl`` and a description of it. ``torchvision`` falls back to the
    model written out here, saying why, when torchvision cannot provide it."""
    note = ""
    if cfg.impl == "torchvision":
        model, what = _torchvision_resnet(cfg)
        if model is not None:
            return model, what
        note = f"; torchvision's model not used: {what}"
    return ResNet(cfg.model, cfg.num_classes, cfg.stem, cfg.width), f"torch_ddp.ResNet{note}"


# ------------------------------------------------------------------------------------ runner
@dataclass
class PeerConfig:
    """One DDP run: model, batch, precision, device and threads."""

    model: str = "resnet18"
    stem: str = "cifar"
    width: int = 64
    num_classes: int = 10
    image_size: int = 32
    global_batch: int = 128
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 1
    channels_last: bool = False
    impl: str = "own"  # "own": the model written out above; "torchvision": torchvision's
    compile: bool = False  # torch.compile around the DDP model
    cudnn_benchmark: bool = False  # torch.backends.cudnn.benchmark (CUDA)
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    seed: int = 0


class DDPRunner:
    """A joined DDP worker: ``step()`` runs one timed training step and returns (seconds, loss).

    Call :func:`init_process_group` first (or run under ``torchrun``).
    """

    def __init__(self, cfg: PeerConfig):
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if cfg.global_batch % self.world:
            raise ValueError(f"global batch {cfg.global_batch} not divisible by {self.world}")
        if cfg.device == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if cfg.device == "cuda" and cfg.cudnn_benchmark:
            torch.backends.cudnn.benchmark = True
        if cfg.device == "cuda":  # TF32 for float32 matmuls too, as JAX's default precision
            torch.set_float32_matmul_precision("high")
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        model, self.model_impl = build_model(cfg)
        model = model.to(self.device)
        self.memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
        model = model.to(memory_format=self.memory_format)
        ids = [self.device.index] if cfg.device == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        self.model = torch.compile(ddp) if cfg.compile else ddp
        self.opt = torch.optim.SGD(
            ddp.parameters(),
            lr=cfg.lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
        )
        gen = torch.Generator().manual_seed(cfg.seed + 1 + self.rank)
        local = cfg.global_batch // self.world
        shape = (local, 3, cfg.image_size, cfg.image_size)
        images = torch.randn(shape, generator=gen)
        labels = torch.randint(0, cfg.num_classes, (local,), generator=gen)
        self.images = images.to(self.device).contiguous(memory_format=self.memory_format)
        self.labels = labels.to(self.device)
        self.autocast_dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else None
        self.model.train()

    def step(self) -> tuple[float, float]:
        """One training step; returns (wall seconds on this rank, this rank's loss)."""
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(
            self.device.type,
            dtype=self.autocast_dtype or torch.float32,
            enabled=self.autocast_dtype is not None,
        ):
            logits = self.model(self.images)
            loss = F.cross_entropy(logits.float(), self.labels)
        loss.backward()
        self.opt.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        return dt, float(loss.detach())

    def slowest(self, values: list[float]) -> list[float]:
        """Element-wise maximum over ranks of this rank's per-step ``values``."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.cfg.device == "cuda":
            t = t.to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.cpu().tolist()

    def gather(self, value: float) -> list[float]:
        """``value`` from every rank, in rank order."""
        t = torch.zeros(self.world, dtype=torch.float64)
        t[self.rank] = value
        if self.cfg.device == "cuda":
            t = t.to(self.device)
        dist.all_reduce(t)
        return t.cpu().tolist()


def set_threads(threads: int) -> None:
    """Intra-op threads of this process (inter-op pool: 1); call before any torch work."""
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already started (second call in the same process)
        pass


def init_process_group(device: str) -> None:
    """Join the group from torchrun-style variables: gloo on CPU, NCCL on CUDA."""
    dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")


def maxrss_mib() -> float:
    """Peak resident set size of this process (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_worker(cfg: PeerConfig, steps: int, warmup: int) -> dict | None:
    """Join, train ``warmup + steps`` steps, return the record on rank 0 (None elsewhere)."""
    set_threads(cfg.threads)
    init_process_group(cfg.device)
    try:
        runner = DDPRunner(cfg)
        times, losses = [], []
        for _ in range(warmup + steps):
            dt, loss = runner.step()
            times.append(dt)
            losses.append(loss)
        times = runner.slowest(times)
        rss = runner.gather(maxrss_mib())
        if runner.rank != 0:
            return None
        return {
            "config": asdict(cfg),
            "world_size": runner.world,
            "torch": torch.__version__,
            "model_impl": runner.model_impl,
            "torch_threads": torch.get_num_threads(),
            "warmup_s": times[:warmup],
            "step_s": times[warmup:],
            "loss_rank0": losses,
            "maxrss_mib": rss,
        }
    finally:
        dist.destroy_process_group()


def _spawned(
    local_rank: int, world: int, port: int, cfg: PeerConfig, steps: int, warmup: int, pin: bool
):
    if pin:
        os.sched_setaffinity(0, {local_rank % (os.cpu_count() or 1)})
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
    )
    record = run_worker(cfg, steps, warmup)
    if record is not None:
        print(json.dumps(record), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    p.add_argument("--pin", action="store_true", help="process i on CPU i")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--model", choices=sorted(ARCHS), default="resnet18")
    p.add_argument("--stem", choices=["cifar", "imagenet"], default="cifar")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--impl", choices=["own", "torchvision"], default="own")
    p.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
    p.add_argument("--cudnn-benchmark", action="store_true")
    a = p.parse_args(argv)
    cfg = PeerConfig(**{k: v for k, v in vars(a).items() if k in PeerConfig.__dataclass_fields__})
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: one worker
        record = run_worker(cfg, a.steps, a.warmup)
        if record is not None:
            print(json.dumps(record), flush=True)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo: jddp
    from jddp.launch import find_free_port

    port = find_free_port()
    mp.spawn(_spawned, args=(a.nproc, port, cfg, a.steps, a.warmup, a.pin), nprocs=a.nproc)


if __name__ == "__main__":
    sys.exit(main())
