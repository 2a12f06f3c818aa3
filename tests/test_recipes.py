"""Every recipe in configs/ trains a few steps on small files of the format it reads (the real
data sets cannot be downloaded here): its keys are valid, its data loader and augmentation run,
and the model it names trains and evaluates."""

from pathlib import Path

import pytest

from jddp.api import load_config
from jddp.run.trainer import train_and_evaluate
from tests.datafiles import write_cifar_folder, write_jpeg_folder, write_mnist

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMALL = [
    "train.epochs=null",
    "train.steps=2",
    "train.eval_every_steps=0",
    "checkpoint.every_steps=0",
    "optim.warmup_steps=1",
    "model.width=4",
    "log.progress=off",
    "data.global_batch_size=8",
]


@pytest.mark.parametrize(
    "recipe, write, extra",
    [
        ("cifar10_resnet18.yaml", lambda d: write_cifar_folder(d), []),
        ("mnist.yaml", lambda d: write_mnist(d, compress=True), []),
        # ResNet-50's blocks and stem, one block per stage: ResNet-50's own step took CI 64 s
        # of compiling on a cold cache (the whole test 138 s); resnet50's shapes and parameter
        # count are checked in tests/test_models.py.
        (
            "imagenet_resnet50.yaml",
            lambda d: write_jpeg_folder(d),
            ["data.image_size=32", "model.name=tests.user_models:bottleneck_resnet"],
        ),
        # Its model is the recipe above's, trained there; here its LARS optimizer and data on a
        # ResNet-10.
        (
            "imagenet_resnet50_lars.yaml",
            lambda d: write_jpeg_folder(d),
            ["data.image_size=32", "model.name=resnet10"],
        ),
    ],
)
@pytest.mark.slow
def test_recipe_trains_on_files_of_its_format(tmp_path, recipe, write, extra):
    write(tmp_path / "data")
    overrides = [f"workdir={tmp_path / 'run'}", f"data.path={tmp_path / 'data'}", *SMALL, *extra]
    cfg = load_config(CONFIGS / recipe, overrides)
    result = train_and_evaluate(cfg)
    assert result.step == 2 and result.eval["eval/count"] > 0
    assert (tmp_path / "run" / "checkpoints" / "2").is_dir()


def test_the_lars_recipe_trains_the_model_of_the_resnet50_recipe():
    sgd, lars = (load_config(CONFIGS / f"imagenet_resnet50{s}.yaml") for s in ("", "_lars"))
    assert lars.model == sgd.model and lars.data.name == sgd.data.name


def test_every_recipe_says_how_to_run_it_and_what_to_expect():
    for path in CONFIGS.glob("*.yaml"):
        head = path.read_text().split("\n\n")[0]
        assert "python -m jddp" in head and "Expected" in head, path.name
