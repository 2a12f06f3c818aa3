"""PyTorch DistributedDataParallel peer of jddp: same ResNet, same optimizer, synthetic data.

    .venv/bin/python experiments/peers/torch_ddp.py [--nproc 2] [--threads 1] [--pin] [--steps 8]
        [--dtype float32|bfloat16] [--model resnet18|...] [--device cpu|cuda] ...  (--help)

Needs ``experiments/requirements-bench.txt``. ``--nproc`` processes (or one ``torchrun``
worker), gloo on CPU, NCCL on CUDA. A step: ``zero_grad``, forward, cross-entropy, ``backward``
(DDP's bucketed all-reduce), ``SGD(lr=0.1, momentum=0.9, weight_decay=5e-4)`` = jddp's ``sgd``.
The model is written out here (no torchvision CPU build for this torch) as torchvision's layout
with jddp's options: ``cifar`` stem (3x3/1 conv, no max-pool), kaiming fan_out, last BN of each
block zeroed; ``--impl torchvision`` uses torchvision's. ``bfloat16``: ``torch.autocast`` around
forward and loss. One fixed random batch per rank; a step's time is the slowest rank's wall
time. Rank 0 prints one JSON line: per-step times, losses, every rank's ``ru_maxrss``.
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
def _conv(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)


class Block(nn.Module):
    """torchvision's BasicBlock (two 3x3 convs) or Bottleneck v1.5 (1x1, 3x3 with the stride,
    1x1 to 4x the planes), each conv followed by BatchNorm; a projection shortcut when the shape
    changes."""

    def __init__(self, cin: int, planes: int, stride: int, bottleneck: bool):
        super().__init__()
        cout = 4 * planes if bottleneck else planes
        if bottleneck:
            convs = [
                _conv(cin, planes, 1),
                _conv(planes, planes, 3, stride),
                _conv(planes, cout, 1),
            ]
        else:
            convs = [_conv(cin, planes, 3, stride), _conv(planes, planes, 3)]
        self.convs = nn.ModuleList(convs)
        self.bns = nn.ModuleList(nn.BatchNorm2d(c.out_channels) for c in convs)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(_conv(cin, cout, 1, stride), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns, strict=True)):
            x = bn(conv(x))
            x = self.relu(x + identity if i == len(self.convs) - 1 else x)
        return x


ARCHS = {
    "resnet10": (False, (1, 1, 1, 1)),
    "resnet18": (False, (2, 2, 2, 2)),
    "resnet50": (True, (3, 4, 6, 3)),
}


class ResNet(nn.Module):
    """torchvision ResNet with a ``cifar`` (3x3/1 conv, no max-pool) or ``imagenet`` stem."""

    def __init__(
        self, arch: str = "resnet18", num_classes: int = 10, stem: str = "cifar", width: int = 64
    ):
        super().__init__()
        bottleneck, sizes = ARCHS[arch]
        cifar = stem == "cifar"
        self.conv1 = _conv(3, width, 3) if cifar else _conv(3, width, 7, stride=2)
        self.maxpool = nn.Identity() if cifar else nn.MaxPool2d(3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        cin = width
        for i, n in enumerate(sizes):
            planes = width * 2**i
            layers = []
            for j in range(n):
                layers.append(Block(cin, planes, 2 if i > 0 and j == 0 else 1, bottleneck))
                cin = 4 * planes if bottleneck else planes
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
            if isinstance(m, Block):
                nn.init.zeros_(m.bns[-1].weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model(cfg: PeerConfig) -> tuple[nn.Module, str]:
    """The model of ``cfg.impl`` and a description of it: ``torchvision``'s
    (``zero_init_residual=True``; the ``cifar`` stem as CIFAR recipes adapt it) or, when that
    cannot be had (saying why), the one written out here."""
    why = f"base width {cfg.width}, not 64"
    if cfg.impl == "torchvision" and cfg.width == 64:
        try:
            import torchvision.models as tvm
        except (ImportError, RuntimeError) as e:  # RuntimeError: built for another torch
            why = f"not importable ({type(e).__name__}: {e})"
        else:
            model = getattr(tvm, cfg.model)(num_classes=cfg.num_classes, zero_init_residual=True)
            what = f"torchvision.models.{cfg.model}(zero_init_residual=True)"
            if cfg.stem == "cifar":
                model.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
                nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
                model.maxpool = nn.Identity()
                what += " with the CIFAR stem (conv1 3x3/1, no maxpool)"
            return model, what
    note = f"; torchvision's model not used: {why}" if cfg.impl == "torchvision" else ""
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
    """A joined DDP worker (:func:`init_process_group` first, or ``torchrun``): ``step()`` runs
    one timed training step and returns (seconds, loss)."""

    def __init__(self, cfg: PeerConfig):
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if cfg.global_batch % self.world:
            raise ValueError(f"global batch {cfg.global_batch} not divisible by {self.world}")
        self.device = torch.device("cpu")
        if cfg.device == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", self.rank)))
            torch.cuda.set_device(self.device)
            torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
            torch.set_float32_matmul_precision("high")  # TF32 for float32, as JAX's default
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        model, self.model_impl = build_model(cfg)
        self.memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
        model = model.to(self.device, memory_format=self.memory_format)
        ids = [self.device.index] if cfg.device == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        self.model = torch.compile(ddp) if cfg.compile else ddp
        self.opt = torch.optim.SGD(
            ddp.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
        gen = torch.Generator().manual_seed(cfg.seed + 1 + self.rank)
        local = cfg.global_batch // self.world
        shape = (local, 3, cfg.image_size, cfg.image_size)
        images = torch.randn(shape, generator=gen)
        labels = torch.randint(0, cfg.num_classes, (local,), generator=gen)
        self.images = images.to(self.device).contiguous(memory_format=self.memory_format)
        self.labels = labels.to(self.device)
        self.model.train()

    def step(self) -> tuple[float, float]:
        """One training step; returns (wall seconds on this rank, this rank's loss)."""
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        bf16 = self.cfg.dtype == "bfloat16"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
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
        return self._all_reduce(torch.tensor(values, dtype=torch.float64), dist.ReduceOp.MAX)

    def gather(self, value: float) -> list[float]:
        """``value`` from every rank, in rank order."""
        t = torch.zeros(self.world, dtype=torch.float64)
        t[self.rank] = value
        return self._all_reduce(t, dist.ReduceOp.SUM)

    def _all_reduce(self, t: torch.Tensor, op) -> list[float]:
        t = t.to(self.device)
        dist.all_reduce(t, op=op)
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
        rss = runner.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # MiB
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


def _spawned(local_rank: int, world: int, port: int, cfg, steps: int, warmup: int, pin: bool):
    if pin:
        os.sched_setaffinity(0, {local_rank % (os.cpu_count() or 1)})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world))  # fmt: skip
    _worker_main(cfg, steps, warmup)


def _worker_main(cfg: PeerConfig, steps: int, warmup: int) -> None:
    record = run_worker(cfg, steps, warmup)
    if record is not None:
        print(json.dumps(record), flush=True)


CHOICES = {"dtype": ["float32", "bfloat16"], "model": sorted(ARCHS), "stem": ["cifar", "imagenet"],
           "device": ["cpu", "cuda"], "impl": ["own", "torchvision"]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--pin", action="store_true", help="process i on CPU i")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    for name, default in asdict(PeerConfig()).items():  # --threads (intra-op, per process) ...
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, type=type(default), default=default, choices=CHOICES.get(name))
    a = p.parse_args(argv)
    cfg = PeerConfig(**{k: v for k, v in vars(a).items() if k in PeerConfig.__dataclass_fields__})
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: one worker
        return _worker_main(cfg, a.steps, a.warmup)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo: jddp
    from jddp.launch import find_free_port

    port = find_free_port()
    mp.spawn(_spawned, args=(a.nproc, port, cfg, a.steps, a.warmup, a.pin), nprocs=a.nproc)


if __name__ == "__main__":
    sys.exit(main())
