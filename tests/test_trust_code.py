"""A run folder's saved config names code (``model.name=pkg.module:factory``, ``data.name``,
``train.loss``, ``train.metrics``): reading it imports that code only with the user's consent
(``--trust-code``, ``trust_code=True``). Without it: one line naming the config, the key, the
module and the flag, exit 2, and the module not imported. The probe module below leaves a file
beside it when it is imported."""

import runpy
import sys

import numpy as np
import pytest
import yaml
from flax import nnx

import jddp
from jddp.errors import ConfigError
from jddp.imports import code_specs, names_code, refuse_untrusted
from tests.helpers import TINY, run_python, train, with_overrides

PROBE = '''"""Imported only with consent: importing it leaves the file 'imported' beside it."""
from pathlib import Path

from flax import nnx

Path(__file__).with_name("imported").touch()


class TinyMLP(nnx.Module):
    """tests/user_models.py's TinyMLP: the same weights' names and shapes."""

    def __init__(self, num_classes, rngs, dtype=None):
        self.hidden = nnx.Linear(8 * 8 * 3, 32, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(32, num_classes, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))


def model(config, dtype, rngs):
    return TinyMLP(config["num_classes"], rngs, dtype)
'''
MODULE = "trust_probe"
RUN = [
    f"model.name={MODULE}:model",
    "data.name=synthetic",
    "data.image_size=8",
    "data.global_batch_size=16",
    "train.steps=2",
    "log.progress=off",
]


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """A folder holding the probe module (on ``sys.path`` here) and a 2-step run whose config
    names its factory: ``(folder, workdir, marker)``; the marker is gone after the run."""
    from jddp.run.trainer import train_and_evaluate

    folder = tmp_path_factory.mktemp("trust")
    (folder / f"{MODULE}.py").write_text(PROBE)
    sys.path.insert(0, str(folder))
    try:
        workdir = folder / "run"
        train_and_evaluate(jddp.load_config({"workdir": str(workdir)}, RUN))
        yield folder, workdir, folder / "imported"
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(MODULE, None)


@pytest.fixture
def run(probe):
    """The probe's folder, run and marker, the module not imported (nor its marker left)."""
    folder, workdir, marker = probe
    sys.modules.pop(MODULE, None)
    marker.unlink(missing_ok=True)
    return folder, workdir, marker


def refusal(where, key="model.name", spec=f"{MODULE}:model") -> str:
    return (
        f"{where} names {key}={spec}: importing {spec.partition(':')[0]} runs its code; pass "
        "--trust-code (trust_code=True) if you trust this run folder"
    )


def test_a_name_with_a_colon_is_code_and_a_refusal_names_the_key_the_module_and_the_flag():
    assert names_code("pkg.mod:factory") and not names_code("resnet18")
    assert not names_code("digits") and not names_code(None)
    refuse_untrusted("W/config.yaml", [("model.name", "resnet18"), ("data.name", "digits")])
    refuse_untrusted("W/config.yaml", [("model.name", "evil.mod:factory")], trust_code=True)
    with pytest.raises(ConfigError) as refused:
        refuse_untrusted("W/config.yaml", [("model.name", "evil.mod:factory")])
    assert str(refused.value) == refusal("W/config.yaml", spec="evil.mod:factory")


def test_a_saved_config_is_refused_key_by_key_unless_trusted_or_overridden(tmp_path):
    """``run_config`` (what ``python -m jddp.evaluate`` reads): each key that names code, in
    turn; an override replaces the saved value with the user's own; built-in names pass."""
    from jddp.eval_lib import run_config

    saved = {
        "model": {"name": "resnet10"},
        "data": {"name": f"{MODULE}:data"},
        "train": {"loss": f"{MODULE}:loss", "metrics": f"{MODULE}:metrics"},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    where = tmp_path / "config.yaml"
    with pytest.raises(ConfigError) as refused:
        run_config(tmp_path)
    assert str(refused.value) == refusal(where, "data.name", f"{MODULE}:data")
    with pytest.raises(ConfigError) as refused:
        run_config(tmp_path, ["data.name=synthetic"])
    assert str(refused.value) == refusal(where, "train.loss", f"{MODULE}:loss")
    cfg = run_config(tmp_path, trust_code=True)
    assert cfg.train.loss == f"{MODULE}:loss"
    run_config(tmp_path, ["data.name=synthetic"], imports=("model.name", "data.name"))
    assert code_specs(cfg, given=["model.name=x", "data.name=y"]) == [
        ("train.loss", f"{MODULE}:loss"),
        ("train.metrics", f"{MODULE}:metrics"),
    ]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": {"name": "resnet10"}}))
    assert run_config(tmp_path).model.name == "resnet10"  # built-in names: no consent
    assert MODULE not in sys.modules


def test_load_and_predict_import_a_runs_model_code_only_with_consent(run):
    folder, workdir, marker = run
    where = f"the config of checkpoint {workdir / 'checkpoints' / '2'}"
    x = np.random.default_rng(0).integers(0, 256, (3, 8, 8, 3)).astype(np.uint8)
    with pytest.raises(ConfigError) as refused:
        jddp.load(workdir)
    assert str(refused.value) == refusal(where)
    with pytest.raises(ConfigError, match="pass --trust-code"):
        jddp.predict(workdir, x)
    with pytest.raises(ConfigError, match="pass --trust-code"):  # one checkpoint folder
        jddp.load(workdir / "checkpoints" / "2")
    assert not marker.exists() and MODULE not in sys.modules
    logits = jddp.predict(workdir, x, trust_code=True)
    assert marker.exists() and logits.shape == (3, 10)
    from tests.user_models import tiny_mlp  # the same weights, built by the test's own code

    floats = np.random.default_rng(1).standard_normal((4, 8, 8, 3)).astype(np.float32)
    mine = jddp.load(workdir, model=tiny_mlp({"num_classes": 10}, None, nnx.Rngs(1)))
    trusted = jddp.load(workdir, trust_code=True)
    np.testing.assert_array_equal(np.asarray(trusted(floats)), np.asarray(mine(floats)))


def test_a_model_given_to_load_imports_nothing_from_the_run(run):
    from tests.user_models import tiny_mlp

    folder, workdir, marker = run
    template = tiny_mlp({"num_classes": 10}, None, nnx.Rngs(0))
    model = jddp.load(workdir, model=template)
    x = np.random.default_rng(1).standard_normal((4, 8, 8, 3)).astype(np.float32)
    y = np.arange(4) % 10
    assert np.isfinite(jddp.evaluate(model, (x, y))["eval/loss"])
    assert not marker.exists() and MODULE not in sys.modules


def test_library_evaluate_and_export_of_a_run_import_its_code_only_with_consent(run, tmp_path):
    folder, workdir, marker = run
    out = tmp_path / "model.stablehlo"
    with pytest.raises(ConfigError, match="names model.name=trust_probe:model: .*--trust-code"):
        jddp.evaluate(workdir)
    with pytest.raises(ConfigError, match="names model.name=trust_probe:model: .*--trust-code"):
        jddp.export(workdir, out)
    assert not marker.exists() and not out.exists() and MODULE not in sys.modules
    metrics = jddp.evaluate(workdir, trust_code=True)
    assert marker.exists() and metrics["eval/count"] > 0
    assert jddp.export(workdir, out, trust_code=True).path == out and out.is_file()


@pytest.mark.slow
def test_the_evaluate_and_export_commands_refuse_a_run_that_names_code_without_the_flag(run):
    folder, workdir, marker = run
    out = folder / "model.stablehlo"
    evaluate = ["-m", "jddp.evaluate", "--workdir", str(workdir)]
    export = ["-m", "jddp.export", "--workdir", str(workdir), "--format", "stablehlo"]
    for argv in (evaluate, [*export, str(out)], [*export, "--input-shape", "8,8,3", str(out)]):
        refused = run_python(*argv, cwd=folder)  # the module importable: as if trusted
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert refused.stderr.splitlines() == [f"jddp: error: {refusal(workdir / 'config.yaml')}"]
        assert not marker.exists() and not out.exists()
    done = run_python(*evaluate, "--trust-code", cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "jddp: eval step=2 eval/loss=" in done.stdout and marker.exists()
    marker.unlink()
    done = run_python(*export, "--trust-code", str(out), cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.is_file() and marker.exists()


@pytest.mark.slow
def test_init_from_another_run_reads_its_weights_not_its_code(run, tmp_path):
    """``checkpoint.init_from`` reads the other run's checkpointed arrays, never its config:
    the config given (the user's own, trusted) builds the model; no consent is asked."""
    folder, workdir, marker = run
    mine = with_overrides(TINY, "model.name=tests.user_models:tiny_mlp", "train.steps=1")
    out = train(tmp_path / "mine", *mine, f"checkpoint.init_from={workdir}", base=[])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "checkpoint.init_from: starting at step 0 from the params" in out.stdout
    assert not marker.exists()


def test_a_failed_final_eval_names_the_evaluate_command_with_the_flag(tmp_path, monkeypatch):
    """The run's config names its model's factory: the command that evaluates it again says
    --trust-code, or it would be refused."""
    from jddp.errors import EvalFailed
    from jddp.eval_lib import EvalRun
    from jddp.run.trainer import train_and_evaluate

    def broken_eval(*args, **kwargs):
        raise OSError("image file is truncated")

    monkeypatch.setattr(EvalRun, "__call__", broken_eval)
    overrides = with_overrides(RUN, "model.name=tests.user_models:tiny_mlp", "train.steps=1")
    with pytest.raises(EvalFailed) as failed:
        train_and_evaluate(jddp.load_config({"workdir": str(tmp_path / "run")}, overrides))
    again = f"python -m jddp.evaluate --workdir {tmp_path / 'run'} --trust-code"
    assert str(failed.value).endswith(f"evaluate it again with: {again}")


def test_each_command_takes_the_flag_and_says_what_it_does(capsys):
    for module, argv in (
        ("jddp.evaluate", ["--workdir", "W", "--trust-code"]),
        ("jddp.export", ["--workdir", "W", "--format", "onnx", "--trust-code", "OUT"]),
        ("jddp.train", ["--config", "C.yaml", "--trust-code"]),
    ):
        # The command's module run, not imported (that would bind jddp.evaluate to it); one a
        # test before imported is used as it is (runpy warns of running it again).
        loaded = sys.modules.get(module)
        namespace = vars(loaded) if loaded else runpy.run_module(module, run_name="cli")
        parse_args = namespace["parse_args"]
        assert parse_args(argv).trust_code
        assert not parse_args([a for a in argv if a != "--trust-code"]).trust_code
        with pytest.raises(SystemExit):
            parse_args(["--help"])
        assert "--trust-code" in capsys.readouterr().out
