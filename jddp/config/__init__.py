"""Typed run configuration: YAML file + dotted ``key=value`` overrides, validated.

Every key has a default and a one-line meaning (``python -m jddp.train --help`` prints them).
Unknown keys and wrong types raise :class:`ConfigError`, whose message names the key and, for
unknown keys, the closest valid one. The CLI turns it into exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from jddp.config.parse import (
    _build,
    help_text,
    iter_keys,
    parse_override,
    read_file,
    set_dotted,
)
from jddp.config.schema import (
    IN_RANGE,
    CheckpointConfig,
    Config,
    DataConfig,
    DistConfig,
    FitConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    key_ranges,
)
from jddp.data.registry import DATA_NAMES
from jddp.errors import ConfigError

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistConfig",
    "FitConfig",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "apply_overrides",
    "dump",
    "from_dict",
    "refuse_fit_run",
    "help_text",
    "iter_keys",
    "load",
    "parse_override",
    "set_dotted",
    "to_dict",
    "validate",
    "with_default_workdir",
]


# The step counter, the seed and every count are int32 on the devices.
MAX_INT = 2**31 - 1
BYTE_KEYS = ("dist.device_memory_bytes",)  # host-side sizes: not counted on the devices


def _check_numbers(cfg: Config) -> None:
    """Every integer key within int32 (what the devices count in); floats (a learning rate of
    1e30 is a legal, if useless, number) are only checked finite as the values are read
    (:mod:`jddp.config.parse`). ``train.epochs``, a count too, is bounded here and again when
    converted to steps."""
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(values):
            continue
        for f in dataclasses.fields(values):
            v = getattr(values, f.name)
            key = f"{section.name}.{f.name}"
            counts = isinstance(v, int) or (key == "train.epochs" and v is not None)
            counts = counts and key not in BYTE_KEYS
            if counts and not isinstance(v, bool) and abs(v) > MAX_INT:
                raise ConfigError(f"{key}: must be at most {MAX_INT} in size, got {v:g}")


def validate(cfg: Config) -> Config:
    """Check value ranges that the types alone cannot express."""
    _check_numbers(cfg)
    _check_ranges(cfg)
    _check_formats(cfg)
    _check_user_code(cfg)
    _check_combinations(cfg)
    return cfg


def _check_ranges(cfg: Config) -> None:
    """Every key whose schema field declares a range (:data:`jddp.config.schema.IN_RANGE`) lies
    in it: sizes, counts and timeouts > 0, rates, periods (0: never), indices and the seed >= 0,
    fractions and momenta in [0, 1] or [0, 1); an optional key's null is not checked."""
    for key, bound in key_ranges().items():
        section, name = key.split(".")
        v = getattr(getattr(cfg, section), name)
        if v is not None and not IN_RANGE[bound](v):
            raise ConfigError(f"{key}: must be {bound}, got {v}")


def _check_formats(cfg: Config) -> None:
    """``workdir`` is not blank; ``log.profile_steps`` reads ``a:b``."""
    if cfg.workdir is not None and not cfg.workdir.strip():
        raise ConfigError("workdir: must not be empty; give a folder or leave it unset")
    if cfg.log.profile_steps is not None:
        parts = cfg.log.profile_steps.split(":")
        if (
            len(parts) != 2
            or not all(p.strip().isdigit() for p in parts)
            or not 0 <= int(parts[0]) < int(parts[1])
            or int(parts[1]) < 2  # steps are numbered from 1 (a=0 means from step 1)
        ):
            raise ConfigError(
                f"log.profile_steps: expected 'a:b' with integers 0 <= a < b, b >= 2 (steps are "
                f"numbered from 1), got "
                f"{cfg.log.profile_steps!r}"
            )


def _check_combinations(cfg: Config) -> None:
    """Settings that are each valid but not together."""
    twice = {t for t in cfg.log.trackers if cfg.log.trackers.count(t) > 1}
    if twice:
        raise ConfigError(f"log.trackers: {', '.join(sorted(twice))} given twice; name each once")
    if cfg.train.steps is not None and cfg.train.epochs is not None:
        raise ConfigError("train.steps and train.epochs are both set; set only one of them")
    if cfg.optim.name == "lars" and cfg.optim.trust_coefficient == 0:
        raise ConfigError(
            "optim.trust_coefficient=0 with optim.name=lars scales every update to 0 (nothing "
            "trains); use a coefficient > 0 (You et al. 2017: 0.001)"
        )
    if cfg.model.sync_batchnorm and cfg.dist.backend == "mpi":
        raise ConfigError(
            "model.sync_batchnorm=true needs dist.backend=xla: under dist.backend=mpi processes "
            "share no JAX runtime, so BatchNorm statistics could only be averaged within each "
            "process (a different model); set model.sync_batchnorm=false or dist.backend=xla"
        )
    group = cfg.dist.shard_group
    if isinstance(group, int) and group < 1:
        raise ConfigError(f"dist.shard_group: must be all, process or > 0, got {group}")
    if cfg.dist.shard != "none" and cfg.dist.backend == "mpi" and group == "all":
        raise ConfigError(
            f"dist.shard={cfg.dist.shard} with dist.backend=mpi splits the state within each "
            "process: set dist.shard_group=process (the processes then hold replicas, their "
            "slices averaged by mpi4jax), or dist.backend=xla"
        )
    metric = cfg.train.early_stop_metric
    if metric is not None and cfg.train.eval_every_steps == 0:
        raise ConfigError(
            f"train.early_stop_metric={metric} needs evals during the run: set "
            "train.eval_every_steps > 0 (with train.eval_every_steps=0 the only eval is the "
            "final one: it could never stop)"
        )
    ckpt = cfg.checkpoint
    if ckpt.keep_best > 0 and cfg.train.eval_every_steps == 0:
        raise ConfigError(
            f"checkpoint.keep_best={ckpt.keep_best} needs evals during the run: set "
            "train.eval_every_steps > 0 (the best are ranked by their evals)"
        )
    if ckpt.resume_from is not None and not ckpt.resume:
        raise ConfigError(
            f"checkpoint.resume_from={ckpt.resume_from} with checkpoint.resume=false: resuming "
            "from a checkpoint needs checkpoint.resume=true (the default)"
        )
    if isinstance(ckpt.resume_from, int) and ckpt.resume_from < 0:
        raise ConfigError(f"checkpoint.resume_from: a step must be >= 0, got {ckpt.resume_from}")
    if isinstance(ckpt.resume_from, str) and not ckpt.resume_from.strip():
        raise ConfigError("checkpoint.resume_from: must not be empty; give STEP, best or PATH")
    if cfg.data.global_batch_size % cfg.train.grad_accum_steps:
        raise ConfigError(
            f"data.global_batch_size={cfg.data.global_batch_size} is not divisible by "
            f"train.grad_accum_steps={cfg.train.grad_accum_steps}"
        )


def _check_user_code(cfg: Config) -> None:
    """``data.name`` a built-in data set or ``pkg.module:factory``; ``train.loss`` and
    ``train.metrics`` ``pkg.module:function``; a task's metrics need its loss;
    ``log.weight_unit`` a plain word."""
    if cfg.data.name not in DATA_NAMES and ":" not in cfg.data.name:
        close = difflib.get_close_matches(cfg.data.name, DATA_NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"data.name: {cfg.data.name!r} is not allowed; choose one of "
            f"{', '.join(DATA_NAMES)}, or 'pkg.module:factory' for your own data{hint}"
        )
    for key, value in (("train.loss", cfg.train.loss), ("train.metrics", cfg.train.metrics)):
        module, _, name = (value or "").partition(":")
        if value is not None and not (module and name):
            raise ConfigError(f"{key}: expected 'package.module:function', got {value!r}")
    if cfg.train.metrics is not None and cfg.train.loss is None:
        raise ConfigError(
            "train.metrics is set without train.loss: a custom task's metrics need its loss "
            "(image classification logs accuracy and top-5 itself)"
        )
    unit = cfg.log.weight_unit
    if unit is not None and not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", unit):
        raise ConfigError(
            f"log.weight_unit: {unit!r} must be a word (letters, digits, _), e.g. tokens"
        )


def _expand_workdir(cfg: Config) -> Config:
    """``workdir=~/x`` means the home folder's ``x``, not a folder named ``~``."""
    if cfg.workdir and cfg.workdir.startswith("~"):
        try:
            cfg.workdir = str(Path(cfg.workdir).expanduser())
        except RuntimeError as e:  # ~user of an unknown user, or no home folder
            raise ConfigError(f"workdir: cannot expand {cfg.workdir!r}: {e}") from None
    return cfg


def translate_old_keys(data: dict[str, Any]) -> dict[str, Any]:
    """Older spellings in a config mapping (a saved ``config.yaml``, a file, overrides) put in
    today's words, in place. ``dist.shard_weight_update: true`` (before ``dist.shard``) is
    ``dist.shard: optimizer``, ``false`` is the default; where both are given, ``dist.shard``
    wins (a run of an old workdir switched with ``dist.shard=...``)."""
    dist = data.get("dist") if isinstance(data, dict) else None
    if isinstance(dist, dict) and "shard_weight_update" in dist:
        old = dist.pop("shard_weight_update")
        if not isinstance(old, bool):
            raise ConfigError(
                f"dist.shard_weight_update: expected true or false, got {old!r} (the older "
                "spelling of dist.shard: none|optimizer|full)"
            )
        if old and "shard" not in dist:
            dist["shard"] = "optimizer"
    return data


def from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a :class:`Config` from a nested mapping (as read from YAML, older
    spellings translated: :func:`translate_old_keys`)."""
    return _expand_workdir(validate(_build(Config, translate_old_keys(data or {}), "")))


def load(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config file (or start from the defaults), apply overrides, validate.

    ``workdir`` defaults to ``runs/<file stem>`` (``runs/default`` without a file).
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = read_file(path)
    given = apply_overrides(data, overrides)
    # The run's length on the command line replaces the file's, in either unit.
    for key, other in (("train.steps", "train.epochs"), ("train.epochs", "train.steps")):
        section = data.get("train")
        if key in given and other not in given and isinstance(section, dict):
            section.pop(other.split(".")[1], None)
    return with_default_workdir(from_dict(data), path)


def with_default_workdir(cfg: Config, path: str | Path | None = None) -> Config:
    """``cfg`` with ``workdir`` set if unset: ``runs/<stem of the config file>``, or
    ``runs/default`` without one (the one place that decides it)."""
    if cfg.workdir is None:
        cfg.workdir = str(Path("runs") / (Path(path).stem if path is not None else "default"))
    return cfg


def apply_overrides(
    data: dict[str, Any], overrides: Iterable[str], *, once: bool = True
) -> dict[str, str]:
    """Set each dotted ``key=value`` of ``overrides`` in the nested dict ``data`` (in place);
    returns the keys set and their value texts. ``once``: a key given twice is a
    :class:`ConfigError` (the command line); otherwise the last one wins."""
    given: dict[str, str] = {}
    for text in overrides:
        key, value = parse_override(text)
        if once and key in given:
            raise ConfigError(
                f"{key}: set twice on the command line ({given[key]!r} and "
                f"{text.split('=', 1)[1]!r}); give each key once"
            )
        given[key] = text.split("=", 1)[1]
        set_dotted(data, key, value)
    return given


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain nested dicts (for YAML dumps and checkpoints)."""
    return dataclasses.asdict(cfg)


def dump(cfg: Config) -> str:
    """The resolved config as YAML text; ``load`` of it gives the same config back."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def refuse_fit_run(cfg: Config, command: str) -> None:
    """``ConfigError`` when ``cfg`` is a ``jddp.fit`` run's whose model came from Python and
    ``command`` cannot build it from ``model.*``, saying what to do instead. Not when
    ``model.name`` names a ``pkg.module:factory`` (the run said how to build it) or the model
    was one of jddp's own (``model.*`` may describe it: the arrays' shapes will say)."""
    model = cfg.fit.model
    if model is None or ":" in cfg.model.name or model.startswith("jddp."):
        return
    where = f" {cfg.workdir}" if cfg.workdir else ""
    raise ConfigError(
        f"fit.model: this config is a jddp.fit run's{where} (its model, {model}, was given "
        f"to jddp.fit; model.name={cfg.model.name} did not build it): {command} cannot build "
        "it; rerun the "
        "script, or in Python pass a freshly built one: jddp.evaluate(jddp.load(W, "
        "model=...), data), jddp.export(jddp.load(W, model=...), OUT, example=...)"
    )
