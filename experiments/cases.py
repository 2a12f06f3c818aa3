"""Trainer cases: named override sets for ``python -m jddp.train``, run by
:func:`benchlib.run_trainer` (one process, ``jddp.launch`` or ``mpirun``).

Each is a list of ``key=value`` overrides (a case may start with ``--config FILE``);
:func:`case` adds or replaces overrides by key. Which script measures which case, and how, is in
``experiments/README.md``.
"""

from __future__ import annotations

# Every measured run: a constant learning rate, no progress bar, checkpoints saved in line.
COMMON = ["optim.schedule=constant", "log.progress=off", "checkpoint.async_save=false"]


def synthetic(
    model: str,
    stem: str,
    width: int,
    num_classes: int,
    image_size: int,
    global_batch: int,
    augment: str = "none",
    precision: str = "float32",
) -> list[str]:
    """A ResNet of ``jddp.models`` on in-memory synthetic uint8 images (the optimizer is jddp's
    default: SGD lr 0.1, momentum 0.9, L2 weight decay 5e-4 added to the gradient)."""
    return [
        f"model.name={model}", f"model.stem={stem}", f"model.width={width}",
        f"model.num_classes={num_classes}", "data.name=synthetic", f"data.image_size={image_size}",
        f"data.global_batch_size={global_batch}", f"data.augment={augment}",
        f"train.precision={precision}", *COMMON,
    ]  # fmt: skip


# The GPT of examples/lm_stdlib.py scaled to ~100M parameters (width 768, 14 layers, 12 heads,
# 128 bytes of context), with configs/lm_stdlib.yaml's AdamW: bench_memory.py's and bench_lm.py's.
GPT_100M = [
    "model.options.width=768",
    "model.options.layers=14",
    "model.options.heads=12",
]

CASES: dict[str, list[str]] = {
    # The GPU measurements: configs/imagenet_resnet50.yaml's model, batch and precision.
    "rn50-gpu": [
        *synthetic("resnet50", "imagenet", 64, 1000, 224, 256, precision="bfloat16"),
        "log.every_steps=1",
    ],
    # configs/cifar10_resnet18.yaml's model, batch, augmentation and precision (float32).
    "cifar-recipe": [
        *synthetic("resnet18", "cifar", 64, 10, 32, 128, "cifar"),
        "log.every_steps=50",
    ],
    # The GPU code paths on a CPU in seconds.
    "smoke": [
        *synthetic("resnet18", "cifar", 8, 10, 16, 16, precision="bfloat16"),
        "log.every_steps=1",
    ],
    # The README's default run.
    "digits": ["--config", "configs/digits.yaml", "log.progress=off"],
    # Tiny 2-process runs (soak_faults.py): the test suite's tiny run, global BatchNorm,
    # a checkpoint every 2 steps.
    "tiny": [
        "model.width=4",
        "data.name=synthetic",
        "data.image_size=8",
        "data.global_batch_size=16",
        "optim.schedule=constant",
        "optim.lr=0.05",
        "log.every_steps=1",
        "log.progress=off",
        "model.sync_batchnorm=true",
        "checkpoint.every_steps=2",
    ],  # fmt: skip
    # mpi vs xla on one GPU (gpu_session.py mpi): 8 rows per device, per-device BatchNorm, a
    # small lr, random-resized crops: the two reduction orders agree to ~1e-7 over 20 steps
    # (the MPI tests' run).
    "mpi-tiny": [
        "model.width=4",
        "data.name=synthetic",
        "data.image_size=8",
        "data.global_batch_size=32",
        "data.augment=imagenet",
        "data.workers=2",
        "optim.schedule=constant",
        "optim.lr=0.02",
        "log.every_steps=1",
        "log.progress=off",
    ],  # fmt: skip
}


def with_overrides(base: list[str], *overrides: str) -> list[str]:
    """``base`` then ``overrides``, without the base entries whose key an override sets (the CLI
    refuses a key given twice)."""
    keys = {o.split("=", 1)[0] for o in overrides if "=" in o}
    return [b for b in base if b.split("=", 1)[0] not in keys] + list(overrides)


def case(name: str, *overrides: str) -> list[str]:
    """The named case with ``overrides`` added (an override replaces the case's own)."""
    return with_overrides(CASES[name], *overrides)


def value(overrides: list[str], key: str) -> str:
    """The value an override list gives ``key``."""
    return next(o.split("=", 1)[1] for o in overrides if o.startswith(key + "="))
