"""Typed run configuration: YAML file + dotted ``key=value`` overrides, validated.

Every key has a default and a one-line meaning (``python -m jddp.train --help`` prints them).
Unknown keys and wrong types raise :class:`ConfigError`, whose message names the key and, for
unknown keys, the closest valid one. The CLI turns it into exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from jddp.data.augment import AUGMENTS
from jddp.data.pipeline import WORKER_KINDS
from jddp.data.registry import DATA_NAMES
from jddp.errors import ConfigError


def _f(default: Any, help: str, **choices: Any) -> Any:
    return field(default=default, metadata={"help": help, **choices})


@dataclass
class ModelConfig:
    name: str = _f(
        "resnet18",
        "resnet18|resnet34|resnet50|resnet101|resnet152, or 'pkg.module:factory' "
        "(called as fn(config=<model section>, dtype=<compute dtype>, rngs=nnx.Rngs))",
    )
    num_classes: int = _f(10, "number of output classes")
    stem: Literal["cifar", "imagenet"] = _f(
        "cifar", "cifar: 3x3 conv, no max-pool (small images); imagenet: 7x7/2 conv + max-pool"
    )
    width: int = _f(64, "base channel width of the first stage (64 is the standard ResNet)")
    sync_batchnorm: bool = _f(
        False, "average BatchNorm batch statistics across all devices (global-batch BN)"
    )


@dataclass
class DataConfig:
    name: Literal[DATA_NAMES] = _f("digits", "data set: " + "|".join(DATA_NAMES))
    path: str | None = _f(None, "file or folder of the data set (cifar10, mnist, npz, imagefolder)")
    global_batch_size: int = _f(128, "examples per optimizer step over all devices and processes")
    image_size: int | None = _f(None, "resize images to this side length (null: native size)")
    prefetch_batches: int = _f(2, "batches placed on the devices ahead of the running step")
    augment: Literal[AUGMENTS] = _f(
        "none",
        "training augmentation: none | cifar (4-pixel zero pad, random crop, flip) | imagenet "
        "(random-resized crop 8-100%, aspect 3/4-4/3, + flip; eval: 1.14x resize, centre crop)",
    )
    workers: int | None = _f(
        None,
        "host workers decoding/augmenting batches ahead (null: the cores available divided "
        "among this machine's processes; 0: none, the placement thread does it)",
    )
    worker_kind: Literal[WORKER_KINDS] = _f(
        "thread", "thread (numpy/Pillow release the GIL) | process (grain mp_prefetch)"
    )


@dataclass
class OptimConfig:
    name: Literal["sgd", "adamw"] = _f("sgd", "sgd (with momentum, decoupled L2) | adamw")
    lr: float = _f(0.1, "peak learning rate (before linear scaling, see lr_scaling)")
    momentum: float = _f(0.9, "SGD momentum (nesterov off); unused by adamw")
    nesterov: bool = _f(False, "use Nesterov momentum with sgd")
    weight_decay: float = _f(
        5e-4, "weight decay (L2 added to the gradient for sgd, decoupled for adamw)"
    )
    b1: float = _f(0.9, "adamw beta1")
    b2: float = _f(0.999, "adamw beta2")
    schedule: Literal["constant", "cosine"] = _f(
        "cosine", "constant|cosine (decays to 0 at the last step)"
    )
    warmup_steps: int = _f(0, "linear warmup from 0 to the peak lr over this many steps")
    lr_scaling: Literal["none", "linear"] = _f(
        "none", "linear: peak lr = lr * global_batch_size / base_batch_size (Goyal et al. 2017)"
    )
    base_batch_size: int = _f(256, "reference batch size of the linear lr-scaling rule")


@dataclass
class TrainConfig:
    steps: int | None = _f(None, "optimizer steps to run (exclusive with epochs; default 1 epoch)")
    epochs: float | None = _f(None, "epochs to run, converted to steps (exclusive with steps)")
    seed: int = _f(0, "seed of parameter init and of the data order")
    eval_every_steps: int = _f(0, "evaluate every k steps (0: only at the end)")
    grad_accum_steps: int = _f(1, "micro-batches accumulated per optimizer step")
    precision: Literal["float32", "bfloat16"] = _f(
        "float32", "compute dtype; parameters and BatchNorm statistics stay float32"
    )
    label_smoothing: float = _f(0.0, "label smoothing of the cross-entropy loss")
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


@dataclass
class DistConfig:
    backend: Literal["xla", "mpi"] = _f(
        "xla",
        "xla: XLA collectives over all devices; mpi: pmean locally + mpi4jax across processes",
    )
    num_local_devices: int | None = _f(None, "devices of each process to use (null: all)")
    coordinator_address: str | None = _f(
        None, "host:port of process 0 for jax.distributed (null: from the launcher/cluster)"
    )
    num_processes: int | None = _f(None, "processes in the job (null: from the launcher/cluster)")
    process_id: int | None = _f(None, "this process's index (null: from the launcher/cluster)")
    grad_allreduce_dtype: Literal["float32", "bfloat16"] = _f(
        "float32", "dtype in which gradients are sent for averaging (bfloat16 halves the bytes)"
    )
    check_sync_every: int = _f(
        0, "every k steps verify (checksum) that all replicas hold the same parameters (0: off)"
    )
    init_timeout_s: int = _f(300, "seconds to wait for all processes to join at start")
    heartbeat_timeout_s: int = _f(
        100, "seconds without a heartbeat after which a peer counts as dead and the job stops"
    )


@dataclass
class CheckpointConfig:
    every_steps: int = _f(
        0, "save every k steps (0: only at the end); the final step is always saved"
    )
    keep: int = _f(3, "newest checkpoints kept")
    resume: bool = _f(True, "continue from the newest checkpoint in workdir/checkpoints")
    async_save: bool = _f(True, "write checkpoints in the background while training goes on")
    allow_config_change: bool = _f(
        False,
        "resume even if model/data/optim/train keys differ from the checkpoint's config "
        "(refused otherwise, naming the keys); also --allow-config-change",
    )
    init_from: str | None = _f(
        None,
        "start a new run (step 0, fresh optimizer) from the params and model state of another "
        "run: its workdir or one checkpoint folder; a head of another num_classes is "
        "re-initialised; ignored when workdir holds a checkpoint to resume",
    )


@dataclass
class LogConfig:
    every_steps: int = _f(10, "write a train line to metrics.jsonl every k steps")
    progress: Literal["auto", "on", "off", "lines"] = _f(
        "auto",
        "auto: a progress bar on a terminal, else plain lines on stdout (step, epoch, loss, lr, "
        "img/s, ETA every log.every_steps; evals; epoch ends)|on (bar)|off|lines",
    )
    profile_steps: str | None = _f(
        None, "'a:b': write a jax.profiler trace of steps a..b-1 to workdir/profile (TensorBoard)"
    )
    baseline_img_per_s: float | None = _f(
        None,
        "measured img/s of ONE device at the same per-device batch; when set, train lines "
        "report train/scaling_efficiency = img_per_s / (devices x baseline)",
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


# ---------------------------------------------------------------------------------------------
# Introspection


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def iter_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, Any, Any, str]]:
    """All leaf keys as ``(dotted_key, type, default, help)``, in declaration order."""
    out = []
    hints = _hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = prefix + f.name
        if _is_section(tp):
            out.extend(iter_keys(tp, key + "."))
        else:
            out.append((key, tp, getattr(defaults, f.name), f.metadata.get("help", "")))
    return out


def _all_keys() -> list[str]:
    return [k for k, *_ in iter_keys()]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "|".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def help_text() -> str:
    """Every config key with its type, default and meaning, one per line."""
    rows = []
    for key, tp, default, meaning in iter_keys():
        shown = yaml.safe_dump(default).strip().removesuffix("...").strip()
        rows.append(f"  {key:<28} {_type_name(tp):<24} default: {shown:<10}  {meaning}")
    return "config keys (set in the YAML file or as key=value overrides):\n" + "\n".join(rows)


# ---------------------------------------------------------------------------------------------
# Type checking and coercion


class _NotFinite(ConfigError):
    """A float key holding NaN or +-Inf (every float key must be finite)."""


def _coerce(key: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            try:
                return _coerce(key, value, options[0])
            except _NotFinite:
                raise
            except ConfigError as e:
                raise ConfigError(f"{e} (or null)") from None
        for a in options:
            try:
                return _coerce(key, value, a)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(allowed):
            value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a bool
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            choices = ", ".join(map(str, allowed))
            raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {choices}{hint}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(number):
            raise _NotFinite(f"{key}: must be a finite number, got {number}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")


def _unknown_key(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, _all_keys(), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else "; see --help for every key"
    return ConfigError(f"unknown config key {key!r}{hint}")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = prefix + str(k)
        if k not in names:
            while isinstance(v, dict) and len(v) == 1:  # name the whole dotted key
                ((sub, v),) = v.items()
                key = f"{key}.{sub}"
            raise _unknown_key(key)
        tp = hints[k]
        kwargs[k] = _build(tp, v, key + ".") if _is_section(tp) else _coerce(key, v, tp)
    return cls(**kwargs)


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for ``key="a.b.c"``, creating sections as needed."""
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise _unknown_key(key)
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key.sub=value`` and type the value as YAML does (``0.2``, ``true``, ``null``)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if re.fullmatch(r"\s*\d+\s*:\s*\d+\s*", raw):  # YAML 1.1 would read 2:4 as 124
        return key, raw.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot parse value {raw!r}: {e}") from None
    return key, value


def validate(cfg: Config) -> Config:
    """Check value ranges that the types alone cannot express."""
    positive = {
        "data.global_batch_size": cfg.data.global_batch_size,
        "model.num_classes": cfg.model.num_classes,
        "model.width": cfg.model.width,
        "train.grad_accum_steps": cfg.train.grad_accum_steps,
        "checkpoint.keep": cfg.checkpoint.keep,
        "log.every_steps": cfg.log.every_steps,
        "optim.base_batch_size": cfg.optim.base_batch_size,
    }
    for opt_key, opt_val in {
        "train.steps": cfg.train.steps,
        "train.epochs": cfg.train.epochs,
        "data.image_size": cfg.data.image_size,
        "dist.num_local_devices": cfg.dist.num_local_devices,
        "dist.num_processes": cfg.dist.num_processes,
        "log.baseline_img_per_s": cfg.log.baseline_img_per_s,
    }.items():
        if opt_val is not None:
            positive[opt_key] = opt_val
    for key, v in positive.items():
        if v <= 0:
            raise ConfigError(f"{key}: must be > 0, got {v}")
    non_negative = {
        "optim.lr": cfg.optim.lr,
        "optim.weight_decay": cfg.optim.weight_decay,
        "optim.warmup_steps": cfg.optim.warmup_steps,
        "train.eval_every_steps": cfg.train.eval_every_steps,
        "checkpoint.every_steps": cfg.checkpoint.every_steps,
        "data.prefetch_batches": cfg.data.prefetch_batches,
        "dist.process_id": cfg.dist.process_id or 0,
        "dist.init_timeout_s": cfg.dist.init_timeout_s,
        "dist.check_sync_every": cfg.dist.check_sync_every,
        "dist.heartbeat_timeout_s": cfg.dist.heartbeat_timeout_s,
    }
    for key, v in non_negative.items():
        if v < 0:
            raise ConfigError(f"{key}: must be >= 0, got {v}")
    if not 0.0 <= cfg.train.label_smoothing < 1.0:
        raise ConfigError(
            f"train.label_smoothing: must be in [0, 1), got {cfg.train.label_smoothing}"
        )
    for key, v in {
        "optim.momentum": cfg.optim.momentum,
        "optim.b1": cfg.optim.b1,
        "optim.b2": cfg.optim.b2,
    }.items():
        if not 0.0 <= v < 1.0:
            raise ConfigError(f"{key}: must be in [0, 1), got {v}")
    if cfg.workdir is not None and not cfg.workdir.strip():
        raise ConfigError("workdir: must not be empty; give a folder or leave it unset")
    if cfg.log.profile_steps is not None:
        parts = cfg.log.profile_steps.split(":")
        if (
            len(parts) != 2
            or not all(p.strip().isdigit() for p in parts)
            or (int(parts[0]) >= int(parts[1]))
        ):
            raise ConfigError(
                f"log.profile_steps: expected 'a:b' with integers 0 <= a < b, got "
                f"{cfg.log.profile_steps!r}"
            )
    if cfg.train.steps is not None and cfg.train.epochs is not None:
        raise ConfigError("train.steps and train.epochs are both set; set only one of them")
    if cfg.model.sync_batchnorm and cfg.dist.backend == "mpi":
        raise ConfigError(
            "model.sync_batchnorm=true needs dist.backend=xla: under dist.backend=mpi processes "
            "share no JAX runtime, so BatchNorm statistics could only be averaged within each "
            "process (a different model); set model.sync_batchnorm=false or dist.backend=xla"
        )
    if cfg.data.global_batch_size % cfg.train.grad_accum_steps:
        raise ConfigError(
            f"data.global_batch_size={cfg.data.global_batch_size} is not divisible by "
            f"train.grad_accum_steps={cfg.train.grad_accum_steps}"
        )
    return cfg


def _expand_workdir(cfg: Config) -> Config:
    """``workdir=~/x`` means the home folder's ``x``, not a folder named ``~``."""
    if cfg.workdir and cfg.workdir.startswith("~"):
        try:
            cfg.workdir = str(Path(cfg.workdir).expanduser())
        except RuntimeError as e:  # ~user of an unknown user, or no home folder
            raise ConfigError(f"workdir: cannot expand {cfg.workdir!r}: {e}") from None
    return cfg


def from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a :class:`Config` from a nested mapping (as read from YAML)."""
    return _expand_workdir(validate(_build(Config, data or {}, "")))


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _DuplicateKey(yaml.YAMLError):
    """A mapping in a YAML file names the same key twice."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose mappings refuse a key given twice (PyYAML silently keeps the
    last one); the error names the dotted key and both lines."""

    def construct_document(self, node: yaml.Node) -> Any:
        # Before anything is constructed (merges rewrite mappings in place): each mapping's
        # dotted prefix and the keys written in it.
        self._mappings: dict[int, tuple[str, list[yaml.Node]]] = {}
        self._label(node, "")
        return super().construct_document(node)

    def _label(self, node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.SequenceNode):
            for item in node.value:
                self._label(item, prefix)
        if not isinstance(node, yaml.MappingNode) or id(node) in self._mappings:
            return
        own = [k for k, _ in node.value if k.tag != _MERGE_TAG]
        self._mappings[id(node)] = (prefix, own)
        for key_node, value_node in node.value:
            sub = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
            self._label(value_node, f"{prefix}{sub}.")

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> Any:
        prefix, own = self._mappings.get(id(node), ("", []))
        seen: dict[Any, int] = {}
        for key_node in own:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(
                        f"duplicate key {prefix + str(key)!r} (lines {seen[key]} and {line}); "
                        "give each key once"
                    )
                seen[key] = line
            except TypeError:  # an unhashable key: the base class reports it
                break
        return super().construct_mapping(node, deep=deep)


def read_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML config file; ``ConfigError`` naming the file when it cannot be
    read, is not UTF-8, is not valid YAML, names a key twice or is not a mapping."""
    p = Path(path)
    where = f"--config {str(p)!r}"
    if p.is_dir():
        raise ConfigError(f"{where}: is a directory, not a YAML file")
    if not p.exists():
        raise ConfigError(f"{where}: no such file")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
            "save it as UTF-8"
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader
    except _DuplicateKey as e:
        raise ConfigError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        msg = " ".join(str(e).split())
        raise ConfigError(f"{where}: not valid YAML: {msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of sections at top level")
    return data


def load(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config file (or start from the defaults), apply overrides, validate.

    ``workdir`` defaults to ``runs/<file stem>`` (``runs/default`` without a file).
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = read_file(path)
    given: dict[str, str] = {}
    for text in overrides:
        key, value = parse_override(text)
        if key in given:
            raise ConfigError(
                f"{key}: set twice on the command line ({given[key]!r} and "
                f"{text.split('=', 1)[1]!r}); give each key once"
            )
        given[key] = text.split("=", 1)[1]
        set_dotted(data, key, value)
    cfg = from_dict(data)
    if cfg.workdir is None:
        cfg.workdir = str(Path("runs") / (Path(path).stem if path is not None else "default"))
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain nested dicts (for YAML dumps and checkpoints)."""
    return dataclasses.asdict(cfg)


def dump(cfg: Config) -> str:
    """The resolved config as YAML text; ``load`` of it gives the same config back."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
