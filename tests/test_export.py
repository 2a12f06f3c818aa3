"""``python -m jddp.export``: a tiny ResNet run (BatchNorm in eval mode) and a two-input custom
task, exported to StableHLO and ONNX with a dynamic batch, give the outputs of ``jddp.load(W)``
at two batch sizes; bad input is one line and exit 2; a model the converter cannot express is
one line naming the operation and exit 1."""

import runpy
import sys
from unittest import mock

import jax
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from flax import nnx

import jddp
from jddp.errors import ConfigError, ExportError
from jddp.export_lib.inputs import task_signature
from jddp.tasks.custom import CustomTask
from tests.helpers import TINY

TOLERANCE = 1e-4  # float32 outputs of the exported program vs the model in JAX
TWO_INPUTS = [
    "model.name=examples.two_inputs:model",
    "model.options.width=4",
    "data.name=examples.two_inputs:data",
    "data.global_batch_size=32",
    "train.loss=examples.two_inputs:loss",
    "log.progress=off",
]


def _train(workdir, overrides):
    from jddp.run.trainer import train_and_evaluate

    train_and_evaluate(jddp.load_config({"workdir": str(workdir)}, overrides))
    return workdir


@pytest.fixture(scope="module")
def resnet_run(tmp_path_factory):
    """The tests' tiny ResNet-18 (width 4, BatchNorm) on 8x8 synthetic images: checkpoints 2
    and 4."""
    workdir = tmp_path_factory.mktemp("export") / "resnet"
    return _train(workdir, [*TINY, "train.steps=4", "checkpoint.every_steps=2"])


@pytest.fixture(scope="module")
def two_inputs_run(tmp_path_factory):
    """examples/two_inputs.py: ``model(batch["image"], batch["side"])`` on a dict batch."""
    return _train(tmp_path_factory.mktemp("export") / "two", [*TWO_INPUTS, "train.steps=3"])


def export(argv, capfd) -> tuple[int, str, str]:
    """``python -m jddp.export ARGV`` in this process: exit code, stdout, stderr."""
    capfd.readouterr()
    with (
        mock.patch.object(sys, "argv", ["jddp.export", *map(str, argv)]),
        mock.patch("jddp.cli.os._exit", side_effect=sys.exit),
    ):
        with pytest.raises(SystemExit) as stop:
            runpy.run_module("jddp.export", run_name="__main__")
    out = capfd.readouterr()
    return stop.value.code, out.out, out.err


def run_exported(path, fmt, *inputs) -> np.ndarray:
    """The exported file's (one) output on ``inputs``."""
    if fmt == "stablehlo":
        return np.asarray(jax.export.deserialize(path.read_bytes()).call(*inputs))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    (out,) = session.run(None, dict(zip(names, inputs, strict=True)))
    return out


def assert_close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("fmt", ["stablehlo", "onnx"])
@pytest.mark.slow
def test_a_resnet_exports_with_a_dynamic_batch_and_gives_the_loaded_models_logits(
    resnet_run, fmt, tmp_path, capfd
):
    out = tmp_path / f"model.{fmt}"
    code, stdout, stderr = export(["--workdir", resnet_run, "--format", fmt, out], capfd)
    assert code == 0 and not stderr, stderr
    assert "images float32[batch,8,8,3] -> logits float32[batch,10]" in stdout
    model = jddp.load(resnet_run)  # eval mode: BatchNorm's running statistics
    rng = np.random.default_rng(1)
    for rows in (1, 5):
        x = rng.standard_normal((rows, 8, 8, 3)).astype(np.float32)
        assert_close(run_exported(out, fmt, x), np.asarray(model(x)))
    if fmt == "onnx":  # the named, symbolic batch axis
        (graph_input,) = onnx.load(str(out)).graph.input
        dims = graph_input.type.tensor_type.shape.dim
        assert graph_input.name == "images" and dims[0].dim_param == "batch"
    # Pixels normalised as the line says give predict's logits (predict normalises them so).
    line = next(s for s in stdout.splitlines() if "images go in normalised" in s)
    mean = np.array(eval(line.split("mean=")[1].split("]")[0] + "]"), np.float32)
    std = np.array(eval(line.split("std=")[1].split("]")[0] + "]"), np.float32)
    pixels = rng.integers(0, 256, (3, 8, 8, 3)).astype(np.uint8)
    normalised = ((pixels / np.float32(255) - mean) / std).astype(np.float32)
    assert_close(run_exported(out, fmt, normalised), jddp.predict(resnet_run, pixels))


@pytest.mark.slow
def test_a_fixed_batch_and_an_older_step(resnet_run, tmp_path, capfd):
    out = tmp_path / "step2.stablehlo"
    argv = ["--workdir", resnet_run, "--step", 2, "--format", "stablehlo", "--batch-size", 4]
    code, stdout, stderr = export([*argv, out], capfd)
    assert code == 0 and not stderr, stderr
    exported = jax.export.deserialize(out.read_bytes())
    assert exported.in_avals[0].shape == (4, 8, 8, 3)
    # Plain convolutions: not the ResNet's division of each input by 1 + 0 * x (a training aid
    # on XLA:CPU); the one division left is the average pool's.
    assert exported.mlir_module().count("stablehlo.divide") == 1
    x = np.random.default_rng(2).standard_normal((4, 8, 8, 3)).astype(np.float32)
    want = np.asarray(jddp.load(resnet_run, step=2)(x))
    assert_close(np.asarray(exported.call(x)), want)
    assert np.abs(want - np.asarray(jddp.load(resnet_run)(x))).max() > 1e-3  # not step 4's


@pytest.mark.parametrize("fmt", ["stablehlo", "onnx"])
@pytest.mark.slow
def test_a_two_input_custom_task_exports_the_arrays_its_loss_passes_the_model(
    two_inputs_run, fmt, tmp_path, capfd
):
    out = tmp_path / f"two.{fmt}"
    argv = ["--workdir", two_inputs_run, "--format", fmt, "--trust-code", out]
    code, stdout, stderr = export(argv, capfd)
    assert code == 0 and not stderr, stderr
    assert "image float32[batch,8,8,1], side float32[batch,16] -> output float32[batch,10]" in (
        stdout
    )
    model = jddp.load(two_inputs_run, trust_code=True)
    rng = np.random.default_rng(3)
    for rows in (2, 7):
        image = rng.random((rows, 8, 8, 1), np.float32)
        side = rng.random((rows, 16), np.float32)
        assert_close(run_exported(out, fmt, image, side), np.asarray(model(image, side)))


@pytest.mark.slow  # resnet_run: a ResNet's train and eval steps compiled in this process
def test_bad_input_is_one_line_and_exit_2(resnet_run, tmp_path, capfd):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "m.onnx"
    base = ["--workdir", resnet_run, "--format", "onnx"]
    cases = {
        "--workdir: ": ["--workdir", empty, "--format", "onnx", out],
        "no checkpoint of step 3 in ": [*base, "--step", 3, out],
        "(there are: 2, 4)": [*base, "--step", 3, out],
        "invalid choice: 'tflite' (choose from 'stablehlo', 'onnx')": [
            *base[:2],
            "--format",
            "tflite",
            out,
        ],
        f"OUT: folder {tmp_path / 'missing'} does not exist": [*base, tmp_path / "missing/m"],
        f"OUT: {tmp_path} is a folder": [*base, tmp_path],
        "--batch-size: '0' is neither 'dynamic' nor a positive int": [
            *base,
            "--batch-size",
            0,
            out,
        ],
        "--input-shape: '3,x' is not one example's shape": [*base, "--input-shape", "3,x", out],
    }
    for expected, argv in cases.items():
        code, stdout, stderr = export(argv, capfd)
        lines = stderr.strip().splitlines()
        assert code == 2 and len(lines) == 1, (argv, stderr)
        assert lines[0].startswith("jddp: error: ") and expected in lines[0], (argv, stderr)
    assert not out.exists()


@pytest.mark.parametrize(
    ("fmt", "operation"), [("onnx", "pure_callback"), ("stablehlo", "python_callback")]
)
def test_a_model_the_converter_cannot_express_is_one_line_naming_the_operation(
    two_inputs_run, fmt, operation, tmp_path, capfd
):
    from examples.two_inputs import TwoInputs

    plain = TwoInputs.__call__

    def with_a_host_callback(self, image, side):
        logits = plain(self, image, side)
        return jax.pure_callback(
            np.negative, jax.ShapeDtypeStruct(logits.shape, logits.dtype), logits
        )

    out = tmp_path / f"m.{fmt}"
    with mock.patch.object(TwoInputs, "__call__", with_a_host_callback):
        argv = ["--workdir", two_inputs_run, "--format", fmt, "--trust-code", out]
        code, _, stderr = export(argv, capfd)
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1, stderr
    assert lines[0].startswith(f"jddp: error: --format {fmt}: ") and operation in lines[0]
    assert not out.exists() and not list(tmp_path.iterdir())  # no temporary file left either


def test_inputs_a_loss_hides_from_the_model_call_ask_for_input_shape(two_inputs_run):
    model = jddp.load(two_inputs_run, trust_code=True)
    example = {"image": jax.ShapeDtypeStruct((8, 8, 1), np.float32)}

    def through_a_submodule(model, batch):
        return model.conv1(batch["image"]).sum((1, 2, 3))

    with pytest.raises(ConfigError, match=r"does not call the model .*pass --input-shape"):
        task_signature(model, CustomTask(through_a_submodule), example, "loss")

    class Scaled(nnx.Module):
        def __call__(self, x, scale):
            return (x * scale).sum(-1)

    def a_batch_statistic(model, batch):  # the batch's mean: no leading batch axis
        return model(batch["x"], batch["x"].mean(0))

    spec = {"x": jax.ShapeDtypeStruct((4,), np.float32)}
    with pytest.raises(ConfigError, match=r"float32\[4\] whose leading axis is not the batch"):
        task_signature(Scaled(), CustomTask(a_batch_statistic), spec, "loss")


def test_an_export_that_computes_something_else_is_refused(two_inputs_run, tmp_path):
    from jddp import export_lib

    out = tmp_path / "m.stablehlo"
    model = jddp.load(two_inputs_run, trust_code=True)
    example = (np.zeros((1, 8, 8, 1), np.float32), np.zeros((1, 16), np.float32))
    real = export_lib.run_stablehlo

    def off_by_a_bit(data, arrays):  # a converter's bug, as it would look
        return [y + 1e-2 for y in real(data, arrays)]

    with mock.patch.object(export_lib, "run_stablehlo", off_by_a_bit):
        with pytest.raises(ExportError, match=r"computes something else .* nothing was written"):
            export_lib.export_model(model, out, "stablehlo", example=example)
    assert not out.exists()
    jddp.export(model, out, "stablehlo", example=example)  # the library call
    image, side = (np.ones((2, *e.shape[1:]), np.float32) for e in example)
    assert_close(run_exported(out, "stablehlo", image, side), np.asarray(model(image, side)))


def test_jddp_export_names_the_library_call_and_the_cli_module():
    import importlib.util

    from jddp.export_lib import export_model

    assert importlib.util.find_spec("jddp.export").origin.endswith("jddp/export.py")
    assert jddp.export is export_model


@pytest.mark.slow
def test_the_imagenet_stems_max_pool_runs_in_onnxruntime(tmp_path):
    """jax2onnx makes an NHWC max pool a pool over 4 axes, which onnxruntime refuses; the export
    pools over H and W alone."""
    from jddp.models import resnet10

    model = resnet10(num_classes=7, stem="imagenet", width=4, rngs=nnx.Rngs(0))
    model.eval()
    out = tmp_path / "stem.onnx"
    jddp.export(model, out, "onnx", example=np.zeros((1, 16, 16, 3), np.float32))
    rng = np.random.default_rng(4)
    for rows in (1, 3):
        x = rng.standard_normal((rows, 16, 16, 3)).astype(np.float32)
        assert_close(run_exported(out, "onnx", x), np.asarray(model(x)))


def test_a_loss_given_to_fit_needs_input_shape(tmp_path, capfd):
    """A run whose loss was passed to ``jddp.fit`` (its config names none): the inputs come from
    ``--input-shape``."""
    import optax

    from tests.user_tasks import Linear, arrays, loss

    workdir = tmp_path / "fit"
    overrides = ["model.name=tests.user_tasks:linear", "data.global_batch_size=16"]
    config = {"workdir": str(workdir), "train": {"steps": 2}, "log": {"progress": "off"}}
    data = arrays(32, 0)
    jddp.fit(
        Linear(nnx.Rngs(0)), optax.sgd(0.1), data, loss=loss, config=config, overrides=overrides
    )
    out = tmp_path / "linear.onnx"
    argv = ["--workdir", workdir, "--format", "onnx", "--trust-code"]  # model.name: code
    code, _, stderr = export([*argv, out], capfd)
    assert code == 2 and stderr.startswith("jddp: error: --input-shape: ") and "jddp.fit" in stderr
    code, stdout, stderr = export([*argv, "--input-shape", 4, out], capfd)
    assert code == 0 and "x float32[batch,4] -> output float32[batch]" in stdout, stderr
    model = jddp.load(workdir, trust_code=True)
    for rows in (1, 6):
        x = np.random.default_rng(rows).standard_normal((rows, 4)).astype(np.float32)
        assert_close(run_exported(out, "onnx", x), np.asarray(model(x)))


def test_a_selection_of_booleans_runs_in_onnxruntime(tmp_path):
    """``jnp.where`` on boolean values (a causal mask's, in examples/lm_stdlib.py): onnxruntime
    has no Where of booleans; the export selects bytes."""

    class Masked(nnx.Module):
        def __call__(self, x):
            keep = jax.numpy.where(x > 0, x < 1, False)
            return jax.numpy.where(keep, x, -x)

    out = tmp_path / "masked.onnx"
    jddp.export(Masked(), out, "onnx", example=np.zeros((1, 5), np.float32))
    x = np.random.default_rng(5).standard_normal((4, 5)).astype(np.float32) * 2
    assert_close(run_exported(out, "onnx", x), np.where((x > 0) & (x < 1), x, -x))


def test_a_folder_it_cannot_write_is_said_before_any_work(tmp_path, monkeypatch):
    """OUT in a folder this process cannot write (a read-only mount; root ignores chmod, so
    the check is os.access): one line before the export's work (it failed after ~50 s with a
    raw OSError on a temporary file)."""
    import importlib

    from jddp.errors import ConfigError

    # Importing the CLI module binds it over the library call jddp.export, and a later
    # runpy.run_module("jddp.export") in this process warns that it was imported: undo both.
    monkeypatch.setattr(jddp, "export", jddp.export)
    command = importlib.import_module("jddp.export")
    try:
        monkeypatch.setattr(command.os, "access", lambda path, mode: False)
        with pytest.raises(ConfigError, match=f"OUT: folder {tmp_path} is not writable"):
            command._check_out(tmp_path / "m.onnx")
    finally:
        del sys.modules["jddp.export"]


@pytest.mark.slow
def test_class_names_go_from_the_data_to_the_checkpoint_the_export_and_the_trackers(
    resnet_run, tmp_path, capfd
):
    """An image folder names its classes: a run left at model.num_classes=10 on its 2 classes
    is said in one warning line (it trained a 10-way head without a word); the names are
    recorded with the checkpoints (jddp.class_names), in the ONNX export's metadata and the
    CLI's report, and in the trackers' parameters (data.classes)."""
    from jddp.run.setup import Run
    from tests.datafiles import write_imagefolder

    write_imagefolder(tmp_path / "imf")
    folder = ["data.name=imagefolder", f"data.path={tmp_path / 'imf'}", "data.image_size=8"]
    folder.append("data.global_batch_size=4")
    capfd.readouterr()
    run = _train(tmp_path / "run", [*TINY, *folder, "train.steps=2"])
    said = capfd.readouterr()
    warning = (
        "jddp: warning: model.num_classes=10 but the train data names 2 classes (cat, dog): 8 "
        "outputs will never be a label; set model.num_classes=2"
    )
    assert warning in said.out.splitlines(), said.out
    assert jddp.class_names(run) == ["cat", "dog"]
    out = tmp_path / "model.onnx"
    code, stdout, stderr = export(["--workdir", run, "--format", "onnx", out], capfd)
    assert code == 0 and not stderr, stderr
    assert "jddp: outputs are the classes, in order: cat, dog (in the ONNX metadata" in stdout
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert session.get_modelmeta().custom_metadata_map["jddp.classes"] == '["cat", "dog"]'
    tracked = Run.tracked_config.fget(
        mock.Mock(
            config_dict={"data": {"name": "imagefolder"}},
            checkpoints=mock.Mock(classes=["cat", "dog"]),
        )
    )
    assert tracked["data"] == {"name": "imagefolder", "classes": "cat, dog"}
    assert jddp.class_names(resnet_run) is None  # synthetic arrays name no classes
