"""What is benchmarked: the workload, the presets and the configurations (``jddp-2x1-pin``, ...)
parsed into :class:`GroupSpec`. Standard library only."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DEFAULT_CONFIGS = "jddp-1x1,jddp-2x1,jddp-2x1-pin,torch-ddp-2x1,torch-ddp-2x1-pin"
NO_YNN_CONV_XLA_FLAG = "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution"
ONE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
# --quick: the smallest run that still goes through every stage (workers, rounds, JSON, plot).
QUICK_DEFAULTS = dict(
    configs="jddp-1x1,torch-ddp-1x1",
    dtypes="float32",
    rounds=1,
    steps_per_round=1,
    warmup=1,
    width=8,
    image_size=8,
    global_batch=8,
)
PRESETS = {
    "resnet18-cifar": dict(
        model="resnet18", stem="cifar", image_size=32, num_classes=10, global_batch=128
    ),
    "resnet50-imagenet": dict(
        model="resnet50", stem="imagenet", image_size=224, num_classes=1000, global_batch=256
    ),
}


@dataclass
class Workload:
    """What every configuration trains: model, input, batch, precision."""

    model: str = "resnet18"
    stem: str = "cifar"
    width: int = 64
    num_classes: int = 10
    image_size: int = 32
    global_batch: int = 128
    dtype: str = "float32"
    platform: str = "cpu"


@dataclass
class GroupSpec:
    """One configuration at one dtype: its processes and their environment."""

    name: str
    framework: str  # "jddp" | "torch"
    nproc: int
    per_proc: int  # jddp: devices per process; torch: CPU threads (GPU: 1 device)
    variant: str  # "" or "-"-joined suffixes: "pin", "1t", "noynnconv", "compile"
    work: Workload
    extra_env: dict[str, str] = field(default_factory=dict)
    backend: str = "xla"  # jddp's dist.backend: "xla" (jddp-PxD) | "mpi" (jddp-mpi-PxD)

    def has(self, suffix: str) -> bool:
        return suffix in self.variant.split("-")

    @property
    def mpi(self) -> bool:
        """Whether the ranks are started by ``mpirun`` (jddp's MPI backend)."""
        return self.framework == "jddp" and self.backend == "mpi"

    @property
    def key(self) -> str:
        return f"{self.name}/{self.work.dtype}"


CONFIG_RE = re.compile(
    r"^(jddp|jddp-mpi|torch-ddp)-(\d+)x(\d+)((?:-(?:1t|pin|noynnconv|compile))*)$"
)


def parse_config(name: str, work: Workload) -> GroupSpec:
    """``jddp-2x1``, ``jddp-mpi-2x1``, ``torch-ddp-2x1``, ``jddp-2x1-1t``, ... ->
    :class:`GroupSpec`."""
    m = CONFIG_RE.match(name)
    if not m:
        raise ValueError(
            f"bad config {name!r}: expected jddp-PxD, jddp-mpi-PxD or torch-ddp-PxT "
            "[-pin] [-1t] [-noynnconv] [-compile]"
        )
    fw = "torch" if m.group(1) == "torch-ddp" else "jddp"
    nproc, per, variant = int(m.group(2)), int(m.group(3)), m.group(4).strip("-")
    if nproc < 1 or per < 1:
        raise ValueError(f"bad config {name!r}: counts must be >= 1")
    if fw != "jddp" and {"1t", "noynnconv"} & set(variant.split("-")):
        raise ValueError(f"{name!r}: -1t and -noynnconv are XLA flags, for jddp configs only")
    if fw == "jddp" and "compile" in variant.split("-"):
        raise ValueError(f"{name!r}: -compile (torch.compile) is for torch-ddp configs only")
    if fw == "torch" and work.platform == "gpu" and per != 1:
        raise ValueError(f"{name!r}: on GPU each PyTorch process drives one GPU (use -Px1)")
    backend = "mpi" if m.group(1) == "jddp-mpi" else "xla"
    return GroupSpec(name, fw, nproc, per, variant, work, backend=backend)
