"""Config: YAML + overrides, typing, validation, --help and --print-config."""

import os
import re
import typing
from pathlib import Path

import pytest
import yaml

from jddp import config as config_lib
from jddp.config import ConfigError
from tests.helpers import run_python


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


def test_a_yaml_boolean_for_a_word_is_named_as_yaml_read_it(tmp_path):
    """``dist.shard=off``: YAML 1.1 reads off/no/false as a bool; the error says so and points to
    the word the key takes instead of naming a ``False`` nobody wrote."""
    for given in (["dist.shard=off"], ["dist.shard=no"]):
        with pytest.raises(ConfigError) as e:
            config_lib.load(None, given)
        assert str(e.value) == (
            "dist.shard: YAML reads off, no or false as the boolean false, which is not allowed; "
            "choose one of none, optimizer, full (did you mean 'none'?)"
        )
    said = r"data.augment: YAML reads on, yes or true as the boolean true, which is not allowed"
    with pytest.raises(ConfigError, match=said + "; choose one of none, cifar, imagenet$"):
        config_lib.load(write(tmp_path, "data:\n  augment: yes\n"))
    assert config_lib.load(None, ["log.progress=off"]).log.progress == "off"  # on/off keys


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


def run_cli(*args, cwd=None, env=None):
    return run_python("-m", "jddp.train", *args, cwd=cwd, env=env)


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


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim.lr=nan", "optim.lr"),
        ("optim.lr=inf", "optim.lr"),
        ("optim.lr=-.inf", "optim.lr"),
        ("optim.weight_decay=nan", "optim.weight_decay"),
        ("optim.momentum=.nan", "optim.momentum"),
        ("train.label_smoothing=nan", "train.label_smoothing"),
        ("train.epochs=inf", "train.epochs"),
        ("log.baseline_img_per_s=inf", "log.baseline_img_per_s"),
        ("optim.b1=nan", "optim.b1"),
    ],
)
def test_non_finite_numbers_are_refused(override, key):
    with pytest.raises(ConfigError) as e:
        config_lib.load(None, [override])
    msg = str(e.value)
    assert msg.startswith(key + ":") and "finite" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "override, words",
    [
        ("train.seed=-1", "train.seed: must be >= 0, got -1"),
        ("train.epochs=1e300", "train.epochs: must be at most 2147483647"),
        ("train.steps=3000000000", "train.steps: must be at most 2147483647"),
        ("dist.heartbeat_timeout_s=0", "dist.heartbeat_timeout_s: must be > 0, got 0"),
        ("dist.init_timeout_s=0", "dist.init_timeout_s: must be > 0, got 0"),
        ("train.max_skipped_fraction=1.5", "train.max_skipped_fraction: must be in [0, 1]"),
    ],
)
def test_numeric_ranges_are_checked_at_load(override, words):
    with pytest.raises(ConfigError) as e:
        config_lib.load(None, [override])
    assert words in str(e.value) and "\n" not in str(e.value)


def test_every_declared_range_is_checked_and_shown():
    """Each key's range sits in its schema field (issue 47.4): a value just outside it is refused
    in one line naming the key and the range, and --help shows it beside the type."""
    from jddp.config.parse import help_text
    from jddp.config.schema import BELOW_ONE, NON_NEGATIVE, POSITIVE, UNIT, key_ranges

    outside = {POSITIVE: 0, NON_NEGATIVE: -1, UNIT: 1.5, BELOW_ONE: 1}
    ranges = key_ranges()
    assert ranges["optim.b2"] == BELOW_ONE and ranges["dist.process_id"] == NON_NEGATIVE
    for key, bound in ranges.items():
        with pytest.raises(ConfigError, match=re.escape(f"{key}: must be {bound}, got ")) as e:
            config_lib.load(None, [f"{key}={outside[bound]}"])
        assert "\n" not in str(e.value)
    assert "int, > 0" in help_text() and "float, in [0, 1)" in help_text()


def test_epochs_whose_step_count_does_not_fit_are_refused():
    from jddp.build import total_steps

    cfg = config_lib.load(None, ["train.epochs=2e9"])
    assert total_steps(config_lib.load(None, ["train.epochs=2"]), 3) == 6
    with pytest.raises(ConfigError, match="^train.epochs=2e[+]09 is 6000000000 steps"):
        total_steps(cfg, 3)


def test_every_float_key_must_be_finite(tmp_path):
    float_keys = [
        k for k, tp, *_ in config_lib.iter_keys() if tp is float or float in typing.get_args(tp)
    ]
    assert "optim.lr" in float_keys and "log.baseline_img_per_s" in float_keys
    for key in float_keys:
        section, name = key.split(".")
        with pytest.raises(ConfigError, match=f"^{key}: .*finite"):
            config_lib.load(write(tmp_path, f"{section}:\n  {name}: .nan\n"))


@pytest.mark.parametrize(
    "override, words",
    [
        ("optim.b1=1", ["optim.b1", "[0, 1)", "1.0"]),
        ("optim.b1=-0.1", ["optim.b1", "[0, 1)"]),
        ("optim.b2=1.5", ["optim.b2", "[0, 1)"]),
        ("optim.weight_decay=-1e-4", ["optim.weight_decay", ">= 0"]),
    ],
)
def test_out_of_range_values(override, words):
    with pytest.raises(ConfigError) as e:
        config_lib.load(None, [override])
    for w in words:
        assert w in str(e.value)


def test_large_finite_values_are_fine():
    cfg = config_lib.load(None, ["optim.lr=1e3", "optim.b1=0", "optim.b2=0.9999"])
    assert cfg.optim.lr == 1000.0 and cfg.optim.b1 == 0.0


@pytest.mark.parametrize("value", ["", "' '", "''"])
def test_empty_workdir_is_refused(value):
    with pytest.raises(ConfigError, match="^workdir: .*empty"):
        config_lib.load(None, [f"workdir={value}"])


def test_empty_workdir_in_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="^workdir: "):
        config_lib.load(write(tmp_path, "workdir: ''\n"))


def test_workdir_tilde_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert config_lib.load(None, ["workdir=~/x"]).workdir == str(tmp_path / "x")
    cfg = config_lib.load(write(tmp_path, "workdir: ~/runs/a\n"))
    assert cfg.workdir == str(tmp_path / "runs" / "a")
    assert config_lib.load(None, ["workdir=a/~b"]).workdir == "a/~b"  # only a leading ~


def test_workdir_of_unknown_user_is_refused():
    with pytest.raises(ConfigError, match="workdir.*~nosuchuser-jddp"):
        config_lib.load(None, ["workdir=~nosuchuser-jddp/x"])


def test_cli_print_config_expands_tilde(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path)}
    out = run_cli("--print-config", "workdir=~/x", cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["workdir"] == str(tmp_path / "x")
    assert not (tmp_path / "~").exists()


def test_config_file_not_utf8(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes("optim:\n  name: sgd  # r\xe9glage\n".encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        config_lib.load(p)
    assert str(e.value).startswith(f"--config {str(p)!r}: not UTF-8 text")
    assert "\n" not in str(e.value)


def test_config_file_is_a_directory(tmp_path):
    with pytest.raises(ConfigError) as e:
        config_lib.load(tmp_path)
    assert str(e.value).startswith(f"--config {str(tmp_path)!r}: ")
    assert "directory" in str(e.value)


@pytest.mark.parametrize(
    "text, key, lines",
    [
        ("optim:\n  lr: 0.1\ntrain:\n  steps: 3\noptim:\n  lr: 0.2\n", "optim", "1 and 5"),
        ("optim:\n  lr: 0.1\n  momentum: 0.8\n  lr: 0.2\n", "optim.lr", "2 and 4"),
        ("optim: {lr: 0.1, lr: 0.2}\n", "optim.lr", "1 and 1"),
        ("workdir: a\nworkdir: b\n", "workdir", "1 and 2"),
        ("model:\n  x:\n    y: 1\n    y: 2\n", "model.x.y", "3 and 4"),
    ],
)
def test_duplicate_yaml_keys_are_refused(tmp_path, text, key, lines):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        config_lib.load(p)
    msg = str(e.value)
    assert msg.startswith(f"--config {str(p)!r}: duplicate key {key!r}"), msg
    assert f"lines {lines}" in msg and "\n" not in msg


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    text = "base: &b {lr: 0.1, momentum: 0.5}\n"
    p = write(tmp_path, text + "optim:\n  <<: *b\n  lr: 0.2\n")
    # 'base' is not a config key; the merge itself must not count as a duplicate 'lr'.
    with pytest.raises(ConfigError, match="unknown config key 'base"):
        config_lib.load(p)


def test_repeated_override_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        config_lib.load(None, ["optim.lr=0.1", "train.steps=3", "optim.lr=0.2"])
    msg = str(e.value)
    assert msg.startswith("optim.lr:") and "0.1" in msg and "0.2" in msg
    # A key set in the file and once on the command line is an ordinary override.
    cfg = config_lib.load(write(tmp_path, "optim:\n  lr: 0.1\n"), ["optim.lr=0.3"])
    assert cfg.optim.lr == 0.3


@pytest.mark.parametrize(
    "args, words",
    [
        (["optim.lr=nan"], ["optim.lr", "finite"]),
        (["optim.b2=1"], ["optim.b2", "[0, 1)"]),
        (["workdir="], ["workdir", "empty"]),
        (["optim.lr=0.1", "optim.lr=0.2"], ["optim.lr", "0.1", "0.2"]),
    ],
)
def test_cli_new_checks_exit_2_with_one_line(args, words):
    out = run_cli("--print-config", *args)
    assert out.returncode == 2, out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jddp: error: "), out.stderr
    for w in words:
        assert w in lines[0]


def test_steps_on_the_command_line_replace_the_files_epochs():
    """configs/imagenet_resnet50_lars.yaml sets train.epochs; train.steps=2 on the command line
    is the run's length (and the reverse); both on the command line stay refused."""
    lars = Path(__file__).resolve().parents[1] / "configs" / "imagenet_resnet50_lars.yaml"
    cfg = config_lib.load(lars, ["train.steps=2"])
    assert cfg.train.steps == 2 and cfg.train.epochs is None
    with pytest.raises(ConfigError, match="both set"):
        config_lib.load(lars, ["train.steps=2", "train.epochs=1"])


def test_lars_with_a_zero_trust_coefficient_is_refused():
    """It would scale every update to 0: exit 0 after training nothing."""
    with pytest.raises(ConfigError, match="optim.trust_coefficient=0 with optim.name=lars"):
        config_lib.load(None, ["optim.name=lars", "optim.trust_coefficient=0"])


def test_a_config_that_never_ends_is_refused():
    with pytest.raises(ConfigError, match="^--config '/dev/zero': larger than 1 MiB"):
        config_lib.load("/dev/zero")


def test_overrides_may_follow_the_flags():
    from jddp.train import parse_args

    args = parse_args(["train.steps=3", "--print-config", "optim.lr=0.5", "--allow-config-change"])
    assert args.overrides == ["train.steps=3", "optim.lr=0.5"] and args.print_config
