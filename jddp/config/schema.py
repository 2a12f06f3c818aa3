"""The config's schema: one dataclass per YAML section, every key with its default and a
one-line meaning (``python -m jddp.train --help`` prints them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal

from jddp.data.augment import Augment
from jddp.data.pipeline import WorkerKind
from jddp.data.registry import DATA_NAMES
from jddp.shard import ShardKind

# A key's range, in its field's metadata: validate() checks every bounded key in one loop (the
# message reads "<key>: must be <range>, got <value>"), --help and docs/config.md show it. An
# optional key's null is not checked.
POSITIVE, NON_NEGATIVE, UNIT, BELOW_ONE = "> 0", ">= 0", "in [0, 1]", "in [0, 1)"
IN_RANGE: dict[str, Callable[[Any], bool]] = {
    POSITIVE: lambda v: v > 0,
    NON_NEGATIVE: lambda v: v >= 0,
    UNIT: lambda v: 0 <= v <= 1,
    BELOW_ONE: lambda v: 0 <= v < 1,
}


def _f(default: Any, help: str, *, bound: str | None = None) -> Any:
    metadata = {"help": help} if bound is None else {"help": help, "range": bound}
    if isinstance(default, (dict, list)):  # a fresh mapping or list per config
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelConfig:
    name: str = _f(
        "resnet18",
        "resnet10|resnet18|resnet34|resnet50|resnet101|resnet152, or 'pkg.module:factory' "
        "(called as fn(config=<model section>, dtype=<compute dtype>, rngs=nnx.Rngs))",
    )
    num_classes: int = _f(10, "number of output classes", bound=POSITIVE)
    stem: Literal["cifar", "imagenet"] = _f(
        "cifar", "cifar: 3x3 conv, no max-pool (small images); imagenet: 7x7/2 conv + max-pool"
    )
    width: int = _f(
        64, "base channel width of the first stage (64 is the standard ResNet)", bound=POSITIVE
    )
    sync_batchnorm: bool = _f(
        False, "average BatchNorm batch statistics across all devices (global-batch BN)"
    )
    bn_group_size: int | None = _f(
        None,
        "rows each BatchNorm normalises together in training, whatever the device count "
        "(a device holding two groups normalises each apart); null: each device's "
        "micro-batch when the run started, kept when it resumes on fewer devices (an elastic "
        "restart), so the losses stay the same; unused with model.sync_batchnorm",
        bound=POSITIVE,
    )
    zero_init_residual: bool = _f(
        True,
        "start the last BatchNorm scale of each residual block at 0, so each block starts as "
        "the identity (Goyal et al. 2017); false: at 1",
    )
    bn_momentum: float = _f(
        0.9,
        "BatchNorm running-average decay, in [0, 1): running = m * running + (1 - m) * batch "
        "(Flax's convention: PyTorch's momentum=0.1 is 0.9 here)",
        bound=BELOW_ONE,
    )
    bn_epsilon: float = _f(1e-5, "BatchNorm's epsilon, added to the variance (> 0)", bound=POSITIVE)
    remat: Literal["none", "blocks"] = _f(
        "none",
        "activation rematerialisation: blocks (each block of the model, a module held in a list "
        "of modules: a ResNet's residual blocks, a transformer's layers, keeps only its inputs "
        "and recomputes its activations in the backward pass: less memory, about one more "
        "forward pass of compute, the same losses; any model, jddp.fit's too; one that holds "
        "no list of modules is refused)",
    )
    options: dict = _f(
        {},
        "free-form keys for a 'pkg.module:factory' model, which gets them in its config "
        "(e.g. model.options.depth=4)",
    )


@dataclass
class DataConfig:
    name: str = _f(
        "digits",
        "data set: "
        + "|".join(DATA_NAMES)
        + ", or 'pkg.module:factory' for a custom task's data (called as fn(config=<data "
        "section>, seed=train.seed), returning (train, eval) in any form jddp.fit takes)",
    )
    path: str | None = _f(
        None,
        "file or folder of the data set (cifar10, mnist, npz, imagefolder, packed); parquet "
        "and webdataset: a folder, glob or brace pattern of shards ('s-{000000..000146}.tar')",
    )
    eval_path: str | None = _f(
        None,
        "parquet/webdataset: the eval shards (null: the shards of data.path named "
        "validation|val|test, beside those named train)",
    )
    image_key: str | None = _f(
        None,
        "parquet: the image column (null: image); webdataset: the image extension "
        "(null: jpg|jpeg|png|webp)",
    )
    label_key: str | None = _f(
        None,
        "parquet: the integer label column (null: label); webdataset: the label member's "
        "extension, or json:FIELD (null: cls, else json's label)",
    )
    global_batch_size: int = _f(
        128, "examples per optimizer step over all devices and processes", bound=POSITIVE
    )
    image_size: int | None = _f(
        None,
        "resize images to this side length (null: the format's own size: native for array "
        "data sets (digits, mnist, cifar10, npz, array packs), 224 for encoded images "
        "(imagefolder, parquet, webdataset, image packs), said in the run's first lines)",
        bound=POSITIVE,
    )
    prefetch_batches: int = _f(
        2, "batches placed on the devices ahead of the running step", bound=NON_NEGATIVE
    )
    augment: Augment = _f(
        "none",
        "training augmentation: none | cifar (4-pixel zero pad, random crop, flip) | imagenet "
        "(random-resized crop 8-100%, aspect 3/4-4/3, + flip; eval: 1.14x resize, centre crop)",
    )
    workers: int | None = _f(
        None,
        "host workers decoding/augmenting batches ahead (null: the cores available divided "
        "among this machine's processes; 0: none, the placement thread does it)",
    )
    worker_kind: WorkerKind = _f(
        "thread", "thread (numpy/Pillow release the GIL) | process (grain mp_prefetch)"
    )
    options: dict = _f(
        {},
        "free-form keys for a 'pkg.module:factory' data set, which gets them in its config "
        "(e.g. data.options.seq_len=128)",
    )


@dataclass
class OptimConfig:
    name: Literal["sgd", "adamw", "lars", "lamb"] = _f(
        "sgd",
        "sgd (with momentum, L2) | adamw | lars (optax.lars: momentum + per-layer trust ratio, "
        "for large batches) | lamb (optax.lamb: Adam + per-layer trust ratio)",
    )
    lr: float = _f(
        0.1, "peak learning rate (before linear scaling, see lr_scaling)", bound=NON_NEGATIVE
    )
    momentum: float = _f(
        0.9, "momentum of sgd and lars (nesterov off); unused by adamw/lamb", bound=BELOW_ONE
    )
    nesterov: bool = _f(False, "use Nesterov momentum with sgd and lars")
    weight_decay: float = _f(
        5e-4,
        "weight decay (L2 added to the gradient for sgd/lars, decoupled for adamw/lamb)",
        bound=NON_NEGATIVE,
    )
    decay_bn_and_bias: bool = _f(
        True,
        "apply weight decay to BatchNorm scales/biases and all biases too; false: only to "
        "kernels (1-D parameters excluded, and from lars's trust ratio; NVIDIA/MLPerf recipes)",
    )
    trust_coefficient: float = _f(
        0.001, "lars: trust coefficient (eta of You et al. 2017)", bound=NON_NEGATIVE
    )
    b1: float = _f(0.9, "adamw/lamb beta1", bound=BELOW_ONE)
    b2: float = _f(0.999, "adamw/lamb beta2", bound=BELOW_ONE)
    schedule: Literal["constant", "cosine"] = _f(
        "cosine", "constant|cosine (decays to 0 at the last step)"
    )
    warmup_steps: int = _f(
        0, "linear warmup from 0 to the peak lr over this many steps", bound=NON_NEGATIVE
    )
    lr_scaling: Literal["none", "linear"] = _f(
        "none", "linear: peak lr = lr * global_batch_size / base_batch_size (Goyal et al. 2017)"
    )
    base_batch_size: int = _f(
        256, "reference batch size of the linear lr-scaling rule", bound=POSITIVE
    )
    clip_grad_norm: float | None = _f(
        None,
        "clip the averaged gradient to this global L2 norm (over the whole model, before the "
        "optimizer, also one given to jddp.fit; the same on every topology and dist.shard); "
        "train/grad_norm is logged before clipping, train/clipped is the share of steps "
        "clipped since the last line (null: off)",
        bound=POSITIVE,
    )


@dataclass
class TrainConfig:
    steps: int | None = _f(
        None, "optimizer steps to run (exclusive with epochs; default 1 epoch)", bound=POSITIVE
    )
    epochs: float | None = _f(
        None, "epochs to run, converted to steps (exclusive with steps)", bound=POSITIVE
    )
    seed: int = _f(0, "seed of parameter init and of the data order", bound=NON_NEGATIVE)
    eval_every_steps: int = _f(0, "evaluate every k steps (0: only at the end)", bound=NON_NEGATIVE)
    grad_accum_steps: int = _f(1, "micro-batches accumulated per optimizer step", bound=POSITIVE)
    early_stop_metric: str | None = _f(
        None,
        "stop when this eval key (e.g. eval/loss) has not improved for early_stop_patience "
        "evals in a row (train.eval_every_steps sets how often): saved, evaluated, exit 0; "
        "null: off",
    )
    early_stop_patience: int = _f(
        3, "evals without improvement before early stopping (>= 1)", bound=POSITIVE
    )
    early_stop_mode: Literal["min", "max"] = _f("min", "early stopping: min or max is better")
    early_stop_min_delta: float = _f(
        0.0,
        "early stopping: an improvement must beat the best by more than this (>= 0)",
        bound=NON_NEGATIVE,
    )
    ema_decay: float = _f(
        0.0,
        "keep an exponential moving average of the parameters (ema = d*ema + (1-d)*params "
        "after each update, in the train state and its checkpoints, laid out like the "
        "parameters under any dist.shard); every eval also reports eval_ema/<metric>; "
        "jddp.load/predict/evaluate/export read it with ema=True (--ema). 0: off",
        bound=BELOW_ONE,
    )
    ema_warmup: bool = _f(
        True,
        "the EMA's decay at update n is min(ema_decay, (1+n)/(10+n)) (TensorFlow's "
        "num_updates warm-up), so early weights fade fast; false: ema_decay from the first step",
    )
    precision: Literal["float32", "bfloat16"] = _f(
        "float32",
        "compute dtype of the built-in models and of model.name factories (their dtype=); "
        "parameters and BatchNorm statistics stay float32 (a model given to jddp.fit computes "
        "in the dtype it was built with: bfloat16 is refused there)",
    )
    label_smoothing: float = _f(0.0, "label smoothing of the cross-entropy loss", bound=BELOW_ONE)
    loss: str | None = _f(
        None,
        "'pkg.module:function' for a custom task: loss(model, batch) -> per-example losses [B] "
        "or (losses [B], weights [B]); the objective is the weighted mean over the global "
        "batch (null: image classification, softmax cross-entropy)",
    )
    metrics: str | None = _f(
        None,
        "'pkg.module:function' for a custom task: metrics(model, batch) -> {name: values [B]} "
        "or {name: (values [B], weights [B])} (weighted means) or {name: jddp.Metric(values, "
        "weights, reduce='sum'|'max'|'min')}, logged as train/<name> and eval/<name>",
    )
    compilation_cache_dir: str | None = _f(
        "~/.cache/jddp/jax",
        "JAX's persistent compilation cache: a restarted run loads its compiled step instead "
        "of compiling it again (null: off)",
    )
    on_nonfinite: Literal["halt", "skip"] = _f(
        "halt",
        "a step with a non-finite loss/gradient: halt (error, exit 1, last checkpoint kept) or "
        "skip (drop that update on every replica; counted in train/skipped_steps)",
    )
    max_skipped_fraction: float = _f(
        0.1,
        "under on_nonfinite=skip: a run that skipped a larger share of its steps fails (exit 1, "
        "after saving its final checkpoint), in [0, 1]",
        bound=UNIT,
    )


@dataclass
class DistConfig:
    backend: Literal["xla", "mpi"] = _f(
        "xla",
        "xla: XLA collectives over all devices; mpi: pmean locally + mpi4jax across processes",
    )
    num_local_devices: int | None = _f(
        None, "devices of each process to use (null: all)", bound=POSITIVE
    )
    coordinator_address: str | None = _f(
        None, "host:port of process 0 for jax.distributed (null: from the launcher/cluster)"
    )
    num_processes: int | None = _f(
        None, "processes in the job (null: from the launcher/cluster)", bound=POSITIVE
    )
    process_id: int | None = _f(
        None, "this process's index (null: from the launcher/cluster)", bound=NON_NEGATIVE
    )
    grad_allreduce_dtype: Literal["float32", "bfloat16"] = _f(
        "float32", "dtype in which gradients are sent for averaging (bfloat16 halves the bytes)"
    )
    fuse_allreduce: bool | None = _f(
        None,
        "average all gradients (and BatchNorm statistics) of a step in one all-reduce per "
        "dtype instead of one per tensor; null: on for CPUs (and mpi's MPI stage), off for "
        "GPUs, whose XLA combines all-reduces itself",
    )
    shard: ShardKind = _f(
        "none",
        "how the train state is laid out over the devices: none (everything whole on every "
        "device); optimizer (the optimizer state split over a group's devices, ZeRO-1); full "
        "(parameters, gradients and optimizer state split, each parameter gathered where its "
        "module runs, ZeRO-3/FSDP); the same losses either way, with any optimizer",
    )
    shard_group: Literal["all", "process"] | int = _f(
        "all",
        "over how many devices dist.shard optimizer|full splits the state: all (every device "
        "of every process), process (each process's devices: hybrid sharding, the processes "
        "holding replicas; gathers stay within a machine, the gradients cross machines once), "
        "or N devices (a divisor of the device count, within a process or whole processes); "
        "dist.backend=mpi needs process; unused with dist.shard=none",
    )
    check_sync_every: int = _f(
        0,
        "every k steps verify (checksum) that all replicas hold the same parameters (0: off)",
        bound=NON_NEGATIVE,
    )
    cpu_threads: int | None = _f(
        None,
        "CPU: cores each process computes on (XLA's thread pool; the process is pinned to "
        "them); null: its CPU affinity divided among this machine's processes (under srun at "
        "most --cpus-per-task)",
        bound=POSITIVE,
    )
    init_timeout_s: int = _f(
        300, "seconds to wait for all processes to join at start", bound=POSITIVE
    )
    heartbeat_timeout_s: int | None = _f(
        None,
        "seconds without a heartbeat after which a peer counts as dead and the job stops "
        "(JAX's coordination service; it ends every process with a dump, not one line); null: "
        "60 past the longer of dist.step_timeout_s and dist.first_step_timeout_s, so that a "
        "rank hung while alive is said by its peers' watchdogs first (100 when step_timeout_s "
        "is null)",
        bound=POSITIVE,
    )
    step_timeout_s: float | None = _f(
        600.0,
        "seconds without progress (a step done, an eval batch, a checkpoint) after which every "
        "process stops with one line saying what it waited for, exit 124, nothing saved "
        "(a rank hung while alive; null: no limit once the first step is done)",
        bound=POSITIVE,
    )
    first_step_timeout_s: float | None = _f(
        1800.0,
        "the same until the first step is done (restoring, loading the data, compiling; "
        "python -m jddp.evaluate: its first batch); null: no limit before it",
        bound=POSITIVE,
    )
    device_memory_bytes: int | None = _f(
        None,
        "memory one device may give the run, in bytes: a train state that needs more at rest "
        "is refused in one line before anything is placed, a train step that needs more "
        "(XLA's analysis of the compiled step) before it first runs, each naming what every "
        "dist.shard would need (null: the device's own limit where it reports one, a GPU's; "
        "none on CPUs)",
        bound=POSITIVE,
    )


@dataclass
class CheckpointConfig:
    every_steps: int = _f(
        0,
        "save every k steps (0: by checkpoint.every_minutes, and at the end); the final step is "
        "always saved",
        bound=NON_NEGATIVE,
    )
    every_minutes: float | None = _f(
        30.0,
        "while every_steps is 0: save when this many minutes have passed since the last save "
        "(decided at the same step on every process), so a killed run loses minutes, not the "
        "run (null or 0: only at the end)",
        bound=NON_NEGATIVE,
    )
    keep: int = _f(3, "newest checkpoints kept", bound=POSITIVE)
    keep_best: int = _f(
        0,
        "also keep the best k checkpoints by checkpoint.monitor, beside the newest "
        "checkpoint.keep (every eval step is then saved; needs train.eval_every_steps > 0); "
        "0: off",
        bound=NON_NEGATIVE,
    )
    monitor: str = _f(
        "eval/loss",
        "the eval key that ranks checkpoints (checkpoint.keep_best, checkpoint.resume_from=best, "
        "--step best, jddp.load(W, step='best')); checked against the run's eval keys before "
        "training",
    )
    mode: Literal["min", "max"] = _f("min", "checkpoint.monitor: min or max is better")
    resume: bool = _f(True, "continue from the newest checkpoint in workdir/checkpoints")
    resume_from: int | str | None = _f(
        None,
        "resume from this checkpoint instead of the newest: STEP (one of this workdir's), best "
        "(its best by checkpoint.monitor) or PATH (a checkpoint folder, or a run's workdir: its "
        "newest); this workdir's newer checkpoints are moved to workdir/previous/; applied "
        "once (a rerun with the same value continues from the newest); null: the newest",
    )
    async_save: bool = _f(True, "write checkpoints in the background while training goes on")
    allow_config_change: bool = _f(
        False,
        "resume even if model/data/optim/train keys differ from the checkpoint's config "
        "(refused otherwise, naming the keys); also --allow-config-change",
    )
    init_from: str | None = _f(
        None,
        "start a new run (step 0, fresh optimizer) from the params and model state of another "
        "run (its workdir or one checkpoint folder) or from a torchvision/timm ResNet's weights "
        "(FILE.safetensors, or FILE.pth with torch installed); a head of another num_classes "
        "is re-initialised; ignored when workdir holds a checkpoint to resume",
    )
    init_from_ema: bool = _f(
        False,
        "checkpoint.init_from reads that run's EMA of the parameters (its train.ema_decay) "
        "instead of its parameters",
    )


@dataclass
class LogConfig:
    every_steps: int = _f(10, "write a train line to metrics.jsonl every k steps", bound=POSITIVE)
    progress: Literal["auto", "on", "off", "lines"] = _f(
        "auto",
        "auto: a progress bar on a terminal, else plain lines on stdout (step, epoch, loss, lr, "
        "img/s, ETA every log.every_steps; evals; epoch ends)|on (bar)|off|lines",
    )
    profile_steps: str | None = _f(
        None, "'a:b': write a jax.profiler trace of steps a..b-1 to workdir/profile (TensorBoard)"
    )
    weight_unit: str | None = _f(
        None,
        "what a weighted loss's weights count (e.g. tokens): train lines add train/<unit> (per "
        "global batch) and train/<unit>_per_s, evals eval/<unit> (null: not reported)",
    )
    baseline_img_per_s: float | None = _f(
        None,
        "measured img/s of ONE device at the same per-device batch; when set, train lines "
        "report train/scaling_efficiency = img_per_s / (devices x baseline)",
        bound=POSITIVE,
    )
    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = _f(
        ["tensorboard"],
        "where process 0 also sends every metrics.jsonl value, the config and the final result: "
        "tensorboard (workdir/tensorboard), mlflow (MLFLOW_TRACKING_URI), wandb (WANDB_MODE, "
        "WANDB_API_KEY, ...); a resumed run continues the same tracked run (workdir/trackers.json)",
    )
    experiment: str | None = _f(
        None,
        "the MLflow experiment and the W&B project of the tracked run (null: "
        "MLFLOW_EXPERIMENT_NAME / WANDB_PROJECT, else each tool's default)",
    )


@dataclass
class FitConfig:
    """What a ``jddp.fit`` run was given from Python (written by it; null in a CLI run)."""

    model: str | None = _f(
        None,
        "written by jddp.fit: the class of the model given to it (module:Class); the model.* "
        "keys did not build it, so python -m jddp.train/evaluate/export refuse such a config "
        "(rerun the script, or jddp.load(W, model=...))",
    )
    optimizer: str | None = _f(
        None,
        "written by jddp.fit: the optax optimizer given to it (its state's types and a unit "
        "gradient's first update); a resume under another one is refused, naming both",
    )
    loss: str | None = _f(None, "written by jddp.fit: the loss given to it (module:name)")
    metrics: str | None = _f(None, "written by jddp.fit: the metrics given to it (module:name)")
    data: str | None = _f(
        None, "written by jddp.fit: the train data given to it (its type); data.name unused"
    )


@dataclass
class Config:
    workdir: str | None = _f(None, "run folder (default runs/<config file name>)")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    fit: FitConfig = field(default_factory=FitConfig)


def key_ranges() -> dict[str, str]:
    """Each bounded key's range, in declaration order: ``{"model.num_classes": "> 0", ...}``."""
    cfg = Config()
    return {
        f"{section.name}.{f.name}": f.metadata["range"]
        for section in fields(cfg)
        if is_dataclass(getattr(cfg, section.name))
        for f in fields(getattr(cfg, section.name))
        if "range" in f.metadata
    }
