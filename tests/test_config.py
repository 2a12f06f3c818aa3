"""Config: YAML + overrides, typing, validation, --help and --print-config."""

import subprocess
import sys

import pytest
import yaml

from jddp import config as config_lib
from jddp.config import ConfigError


def write(tmp_path, text, name="run.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_and_workdir_from_file_name(tmp_path):
    cfg = config_lib.load(write(tmp_path, "train:\n  steps: 5\n", "mine.yaml"))
    assert cfg.train.steps == 5
    assert cfg.workdir == "runs/mine"
    assert cfg.data.name == "digits"


def test_overrides_are_yaml_typed(tmp_path):
    cfg = config_lib.load(
        write(tmp_path, "optim:\n  lr: 0.1\n"),
        [
            "optim.lr=0.2",
            "train.steps=100",
            "model.sync_batchnorm=true",
            "data.path=null",
            "dist.backend=xla",
            "log.progress=off",
        ],
    )
    assert cfg.optim.lr == 0.2 and isinstance(cfg.optim.lr, float)
    assert cfg.train.steps == 100
    assert cfg.model.sync_batchnorm is True
    assert cfg.data.path is None
    assert cfg.log.progress == "off"


def test_int_accepted_for_float(tmp_path):
    assert config_lib.load(None, ["optim.lr=1"]).optim.lr == 1.0


@pytest.mark.parametrize(
    "override, words",
    [
        (["optim.lrr=0.1"], ["optim.lrr", "did you mean 'optim.lr'"]),
        (["trian.steps=3"], ["trian.steps", "train.steps"]),
        (["optim.lr=abc"], ["optim.lr", "expected a number"]),
        (["train.steps=1.5"], ["train.steps", "integer"]),
        (["model.sync_batchnorm=3"], ["model.sync_batchnorm", "true or false"]),
        (["optim.name=adam"], ["optim.name", "sgd, adamw", "did you mean 'adamw'"]),
        (["data.global_batch_size=0"], ["data.global_batch_size", "> 0"]),
        (["optim.lr=-1"], ["optim.lr", ">= 0"]),
        (["train.steps=3", "train.epochs=2"], ["train.steps", "train.epochs"]),
        (["data.global_batch_size=10", "train.grad_accum_steps=3"], ["10", "grad_accum_steps=3"]),
        (["optim=3"], ["optim", "mapping"]),
        (["nokey"], ["nokey", "key.sub=value"]),
    ],
)
def test_bad_values_name_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        config_lib.load(None, override)
    for w in words:
        assert w in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_key_in_file(tmp_path):
    with pytest.raises(ConfigError, match="model.widht.*model.width"):
        config_lib.load(write(tmp_path, "model:\n  widht: 8\n"))


def test_dump_round_trips(tmp_path):
    cfg = config_lib.load(None, ["optim.lr=0.3", "workdir=/tmp/x"])
    again = config_lib.load(write(tmp_path, config_lib.dump(cfg)))
    assert again == cfg


def test_every_key_has_help():
    for key, _tp, _default, help_ in config_lib.iter_keys():
        assert help_, key


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "jddp.train", *args], capture_output=True, text=True, cwd=cwd
    )


def test_cli_help_lists_every_key():
    out = run_cli("--help")
    assert out.returncode == 0
    for key, *_ in config_lib.iter_keys():
        assert key in out.stdout


def test_cli_print_config(tmp_path):
    out = run_cli(
        "--config", str(write(tmp_path, "train:\n  steps: 7\n")), "--print-config", "optim.lr=0.5"
    )
    assert out.returncode == 0
    printed = yaml.safe_load(out.stdout)
    assert printed["train"]["steps"] == 7 and printed["optim"]["lr"] == 0.5


@pytest.mark.parametrize(
    "args, words",
    [
        (["optim.lrr=0.1"], ["optim.lrr", "optim.lr"]),
        (["--config", "/nonexistent.yaml"], ["/nonexistent.yaml", "no such file"]),
        (["--bogus"], ["--bogus"]),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(args, words):
    out = run_cli(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1
    for w in words:
        assert w in lines[0]
