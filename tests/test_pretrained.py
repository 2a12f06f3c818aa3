"""``jddp.load_pretrained`` and ``checkpoint.init_from=FILE.safetensors``
(jddp/checkpoint/pretrained.py), ``model.bn_momentum``/``model.bn_epsilon``.

The files are built here: random tensors under the names and shapes of torchvision's
``resnet.py`` (written out below from its ``_make_layer``, not from jddp's mapping), and the
loaded jddp model's eval logits are compared with a numpy float64 NCHW forward pass of that
same torchvision network.
"""

import sys
import types

import numpy as np
import pytest
from flax import nnx
from numpy.lib.stride_tricks import sliding_window_view
from safetensors.numpy import save_file

import jddp
from jddp.build import build_model
from jddp.config import load as load_config
from jddp.errors import CheckpointError, ConfigError
from jddp.models import resnet18, resnet50
from tests.helpers import TINY, run_python, start, with_overrides

EPS = 1e-5  # torch.nn.BatchNorm2d's default epsilon, and jddp's


# --- torchvision's ResNet, written out ---------------------------------------------------------


def torchvision_state_dict(
    stages, bottleneck, num_classes, width=64, stem=7, seed=0
) -> dict[str, np.ndarray]:
    """Random tensors named and shaped as ``torchvision.models.ResNet(...).state_dict()``:
    ``stages`` blocks per layer, ``width`` the first layer's planes (64 in torchvision), a
    ``stem``x``stem`` first conv (7: torchvision's)."""
    rng = np.random.default_rng(seed)
    sd = {}

    def conv(name, out, inp, k):
        sd[name] = rng.normal(0, np.sqrt(2 / (inp * k * k)), (out, inp, k, k))

    def bn(name, c):
        sd[f"{name}.weight"] = rng.uniform(0.5, 1.5, c)
        sd[f"{name}.bias"] = rng.normal(0, 0.1, c)
        sd[f"{name}.running_mean"] = rng.normal(0, 0.1, c)
        sd[f"{name}.running_var"] = rng.uniform(0.5, 1.5, c)
        sd[f"{name}.num_batches_tracked"] = np.array(100, np.int64)

    expansion = 4 if bottleneck else 1
    conv("conv1.weight", width, 3, stem)
    bn("bn1", width)
    inplanes = width
    for i, blocks in enumerate(stages):
        planes = width * 2**i
        for j in range(blocks):
            stride = 2 if i > 0 and j == 0 else 1
            p = f"layer{i + 1}.{j}"
            if bottleneck:  # conv1x1, conv3x3 (the stride, v1.5), conv1x1 to planes * 4
                conv(f"{p}.conv1.weight", planes, inplanes, 1)
                bn(f"{p}.bn1", planes)
                conv(f"{p}.conv2.weight", planes, planes, 3)
                bn(f"{p}.bn2", planes)
                conv(f"{p}.conv3.weight", planes * 4, planes, 1)
                bn(f"{p}.bn3", planes * 4)
            else:
                conv(f"{p}.conv1.weight", planes, inplanes, 3)
                bn(f"{p}.bn1", planes)
                conv(f"{p}.conv2.weight", planes, planes, 3)
                bn(f"{p}.bn2", planes)
            if j == 0 and (stride != 1 or inplanes != planes * expansion):
                conv(f"{p}.downsample.0.weight", planes * expansion, inplanes, 1)
                bn(f"{p}.downsample.1", planes * expansion)
            inplanes = planes * expansion
    sd["fc.weight"] = rng.normal(0, 0.05, (num_classes, inplanes))
    sd["fc.bias"] = rng.normal(0, 0.05, num_classes)
    return {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in sd.items()}


# --- the same network in numpy, NCHW, float64 --------------------------------------------------


def conv2d(x_NCHW, w_OIHW, stride):
    k = w_OIHW.shape[-1]
    xp = np.pad(x_NCHW, ((0, 0), (0, 0), (k // 2, k // 2), (k // 2, k // 2)))
    windows = sliding_window_view(xp, (k, k), axis=(2, 3))[:, :, ::stride, ::stride]
    return np.einsum("nchwij,ocij->nohw", windows, w_OIHW, optimize=True)


def batchnorm(x, sd, name):
    c = (slice(None), None, None)
    scale = sd[f"{name}.weight"] / np.sqrt(sd[f"{name}.running_var"] + EPS)
    return (x - sd[f"{name}.running_mean"][c]) * scale[c] + sd[f"{name}.bias"][c]


def relu(x):
    return np.maximum(x, 0)


def max_pool_3x3_s2(x):
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
    return sliding_window_view(xp, (3, 3), axis=(2, 3))[:, :, ::2, ::2].max(axis=(-2, -1))


def reference_forward(sd, x_NCHW):
    """torchvision's ``ResNet.forward`` in eval mode: ``(pooled features, logits)``."""
    sd = {k: v.astype(np.float64) for k, v in sd.items()}
    stem = sd["conv1.weight"].shape[-1]
    x = relu(batchnorm(conv2d(x_NCHW, sd["conv1.weight"], 2 if stem == 7 else 1), sd, "bn1"))
    if stem == 7:
        x = max_pool_3x3_s2(x)
    for i in range(1, 5):
        j = 0
        while f"layer{i}.{j}.conv1.weight" in sd:
            p, stride = f"layer{i}.{j}", 2 if i > 1 and j == 0 else 1
            if f"{p}.conv3.weight" in sd:
                y = relu(batchnorm(conv2d(x, sd[f"{p}.conv1.weight"], 1), sd, f"{p}.bn1"))
                y = relu(batchnorm(conv2d(y, sd[f"{p}.conv2.weight"], stride), sd, f"{p}.bn2"))
                y = batchnorm(conv2d(y, sd[f"{p}.conv3.weight"], 1), sd, f"{p}.bn3")
            else:
                y = relu(batchnorm(conv2d(x, sd[f"{p}.conv1.weight"], stride), sd, f"{p}.bn1"))
                y = batchnorm(conv2d(y, sd[f"{p}.conv2.weight"], 1), sd, f"{p}.bn2")
            if f"{p}.downsample.0.weight" in sd:
                short = conv2d(x, sd[f"{p}.downsample.0.weight"], stride)
                x = batchnorm(short, sd, f"{p}.downsample.1")
            x = relu(y + x)
            j += 1
    features = x.mean(axis=(2, 3))
    return features, features @ sd["fc.weight"].T + sd["fc.bias"]


def jddp_logits(model, x_NCHW):
    model.eval()
    x_NHWC = x_NCHW.transpose(0, 2, 3, 1).astype(np.float32)
    return np.asarray(nnx.jit(lambda m, x: m(x))(model, x_NHWC), np.float64)


def rel_diff(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


# --- fixtures ----------------------------------------------------------------------------------

R10 = ((1, 1, 1, 1), False)  # the tests' tiny run's (tests/helpers.py TINY)
R18 = ((2, 2, 2, 2), False)
R50 = ((3, 4, 6, 3), True)


@pytest.fixture(scope="module")
def images():
    return np.random.default_rng(1).normal(0, 1, (2, 3, 32, 32))


@pytest.fixture(scope="module")
def r18(tmp_path_factory):
    """torchvision's ResNet-18 (1000 classes) as ``.safetensors``: ``(path, state dict)``."""
    sd = torchvision_state_dict(*R18, num_classes=1000)
    assert len(sd) == 122  # len(torchvision.models.resnet18().state_dict())
    path = tmp_path_factory.mktemp("pretrained") / "resnet18.safetensors"
    save_file(sd, path)
    return path, sd


def imagenet_resnet18():
    """jddp's ResNet-18 for torchvision's weights, shapes only (``nnx.eval_shape``: its
    initialisation, 5 s here, is skipped; every array is then loaded from the file)."""
    return nnx.eval_shape(lambda: resnet18(num_classes=1000, stem="imagenet", rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tests' tiny run's model (tests/helpers.py TINY: resnet10, width 4, cifar stem, 10
    classes), as
    ``python -m jddp.train`` builds it, and a torchvision file of its architecture with 7
    classes: ``(path, state dict, model, (fresh fc kernel, bias))``."""
    sd = torchvision_state_dict(*R10, num_classes=7, width=4, stem=3, seed=3)
    path = tmp_path_factory.mktemp("pretrained") / "tiny.safetensors"
    save_file(sd, path)
    cfg = load_config(None, TINY)
    model = build_model(cfg, nnx.Rngs(cfg.train.seed))
    fresh_fc = (np.array(model.fc.kernel[...]), np.array(model.fc.bias[...]))
    return path, sd, model, fresh_fc


# --- loading -----------------------------------------------------------------------------------


def test_resnet18_gives_torchvisions_logits(r18, images):
    path, sd = r18
    model = jddp.load_pretrained(path, imagenet_resnet18())
    _, want = reference_forward(sd, images)
    diff = rel_diff(jddp_logits(model, images), want)
    print(f"resnet18: max |jddp - numpy| / max |numpy| = {diff:.2e}")
    assert diff <= 1e-4


def test_bottleneck_resnet50_of_a_ddp_state_dict(tmp_path, images):
    """ResNet-50's blocks (conv3/bn3, a stride-1 projection in layer1) at width 8, saved from a
    DDP model: every name starts with ``module.``."""
    sd = torchvision_state_dict(*R50, num_classes=10, width=8, seed=2)
    assert len(sd) == 320  # len(torchvision.models.resnet50().state_dict())
    save_file({f"module.{k}": v for k, v in sd.items()}, tmp_path / "r50.safetensors")
    model = nnx.eval_shape(
        lambda: resnet50(num_classes=10, stem="imagenet", width=8, rngs=nnx.Rngs(0))
    )
    jddp.load_pretrained(tmp_path / "r50.safetensors", model)
    _, want = reference_forward(sd, images)
    diff = rel_diff(jddp_logits(model, images), want)
    print(f"resnet50 (width 8): max |jddp - numpy| / max |numpy| = {diff:.2e}")
    assert diff <= 1e-4


def test_another_num_classes_keeps_a_fresh_head(tiny, images, capsys):
    path, sd, model, fresh_fc = tiny
    jddp.load_pretrained(path, model)
    assert capsys.readouterr().out == (
        f"jddp: load_pretrained: loaded {path}; re-initialised params['fc']['bias'], "
        "params['fc']['kernel'] (class dimension 7 -> 10)\n"
    )
    np.testing.assert_array_equal(model.fc.kernel[...], fresh_fc[0])
    features, _ = reference_forward(sd, images)
    want = features @ fresh_fc[0].astype(np.float64) + fresh_fc[1]
    assert rel_diff(jddp_logits(model, images), want) <= 1e-4


@pytest.mark.slow
def test_init_from_a_safetensors_file(tiny, tmp_path):
    """A run starts from the file's tensors (lr 0: its one step changes no parameter), a head of
    another num_classes fresh; a file that does not fit is one line, exit 2."""
    path, sd, _, fresh_fc = tiny
    run = with_overrides(TINY, "train.steps=1", "optim.lr=0", f"checkpoint.init_from={path}")
    wider = with_overrides(run, "model.width=8")
    wide = start([sys.executable, "-m", "jddp.train", f"workdir={tmp_path}/wide", *wider])
    out = run_python("-m", "jddp.train", f"workdir={tmp_path}/run", *run, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (
        f"jddp: checkpoint.init_from: starting at step 0 from the tensors of {path} (optimizer "
        "state fresh); re-initialised params['fc']['bias'], params['fc']['kernel'] (class "
        "dimension 7 -> 10)"
    ) in out.stdout
    trained = jddp.load(tmp_path / "run")
    np.testing.assert_array_equal(
        trained.conv1.kernel[...], sd["conv1.weight"].transpose(2, 3, 1, 0)
    )
    np.testing.assert_array_equal(trained.blocks[3].bn2.scale[...], sd["layer4.0.bn2.weight"])
    np.testing.assert_array_equal(trained.fc.kernel[...], fresh_fc[0])

    _, stderr = wide.communicate(timeout=300)
    assert wide.returncode == 2, stderr[-2000:]
    assert stderr.count("\n") == 1, stderr
    assert stderr.startswith(f"jddp: error: checkpoint.init_from: {path} does not fit this model")
    assert "conv1.weight [4, 3, 3, 3] there vs [8, 3, 3, 3] now" in stderr


def test_a_training_checkpoint_pickled_by_torch(r18, monkeypatch):
    """A ``.pth`` holding ``{"state_dict": {"module.<name>": tensor}}`` (a DDP training
    checkpoint; bfloat16 among them) reads as the safetensors file does. torch is not a jddp
    dependency: a stand-in module gives ``torch.load``'s result."""
    path, sd = r18

    class Tensor:  # what _read_torch uses of a torch.Tensor
        def __init__(self, a, dtype=None):
            self.a, self.dtype, self.shape = a, dtype or a.dtype, a.shape

        def detach(self):
            return self

        cpu = detach

        def float(self):
            return Tensor(self.a.astype(np.float32))

        def numpy(self):
            assert self.dtype != "bf16", "numpy has no bfloat16: convert first"
            return self.a

    nested = {f"module.{k}": Tensor(v) for k, v in sd.items()}
    nested["module.fc.bias"] = Tensor(sd["fc.bias"], dtype="bf16")
    fake = types.SimpleNamespace(
        bfloat16="bf16", load=lambda *a, **k: {"epoch": 3, "state_dict": nested}
    )
    monkeypatch.setitem(sys.modules, "torch", fake)
    (pth := path.with_suffix(".pth")).write_bytes(b"a pickle")
    got = jddp.load_pretrained(pth, imagenet_resnet18())
    want = jddp.load_pretrained(path, imagenet_resnet18())
    for a, b in zip(
        nnx.to_flat_state(nnx.state(got)), nnx.to_flat_state(nnx.state(want)), strict=True
    ):
        np.testing.assert_array_equal(a[1][...], b[1][...])


# --- files that do not fit: one line naming the tensors ---------------------------------------


def refused(tmp_path, sd, model, error=ConfigError, name="w.safetensors") -> str:
    save_file(sd, tmp_path / name)
    with pytest.raises(error) as e:
        jddp.load_pretrained(tmp_path / name, model)
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.fixture(scope="module")
def small_r18():
    """A ResNet-18 of width 4 and the torchvision file that fits it."""
    sd = torchvision_state_dict(*R18, num_classes=10, width=4, stem=3)
    return sd, lambda: nnx.eval_shape(
        lambda: resnet18(num_classes=10, width=4, stem="cifar", rngs=nnx.Rngs(0))
    )


def test_names_missing_and_unexpected(tmp_path, small_r18):
    sd, model = small_r18
    sd = {k: v for k, v in sd.items() if k != "layer3.1.bn2.running_var"}
    sd["layer1.0.se.fc1.weight"] = np.zeros((2, 4, 1, 1), np.float32)
    message = refused(tmp_path, sd, model())
    assert message.startswith(f"load_pretrained: {tmp_path}/w.safetensors does not fit this model")
    assert "1 arrays are not in the file (layer3.1.bn2.running_var)" in message
    assert "1 arrays of the file are not in the model (layer1.0.se.fc1.weight)" in message


def test_a_resnet50_file_into_a_resnet18(tmp_path, small_r18):
    _, model = small_r18
    sd = torchvision_state_dict(*R50, num_classes=10, width=4, stem=3)
    message = refused(tmp_path, sd, model())
    assert "layer1.0.conv1.weight [4, 4, 1, 1] there vs [4, 4, 3, 3] now" in message
    assert "(layer1.0.bn3.bias, layer1.0.bn3.running_mean," in message  # unexpected, in order
    assert "the file holds a resnet50, this model is a resnet18" in message


def test_a_file_of_another_architecture_is_said_to_be_no_resnet(tmp_path, small_r18):
    """An MLP's tensors (no ResNet block) read "a ResNet of BasicBlock stages none"."""
    _, model = small_r18
    sd = {"fc1.weight": np.zeros((8, 4), np.float32), "fc1.bias": np.zeros(8, np.float32)}
    message = refused(tmp_path, sd, model())
    assert "the file holds a model that is no torchvision ResNet (no layer<stage>." in message
    assert "this model is a resnet18" in message and "stages none" not in message


def test_the_imagenet_stem_into_a_cifar_stem(tmp_path, small_r18):
    _, model = small_r18
    sd = torchvision_state_dict(*R18, num_classes=10, width=4, stem=7)
    message = refused(tmp_path, sd, model())
    assert "1 arrays have other shapes (conv1.weight [4, 3, 7, 7] there vs [4, 3, 3, 3] now)" in (
        message
    )
    assert "model.stem=imagenet" in message


def test_num_batches_tracked_is_optional(tmp_path, small_r18):
    sd, model = small_r18
    save_file({k: v for k, v in sd.items() if "num_batches" not in k}, tmp_path / "w.safetensors")
    loaded = jddp.load_pretrained(tmp_path / "w.safetensors", model())
    np.testing.assert_array_equal(loaded.bn1.var[...], sd["bn1.running_var"])


def test_unreadable_missing_and_torch_files(tmp_path, small_r18, monkeypatch):
    _, model = small_r18
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(CheckpointError, match=r"cannot read .*cut\.safetensors"):
        jddp.load_pretrained(tmp_path / "cut.safetensors", model())
    with pytest.raises(ConfigError, match=r"none\.safetensors: no such file"):
        jddp.load_pretrained(tmp_path / "none.safetensors", model())
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch fails, as without torch
    (tmp_path / "w.pth").write_bytes(b"a pickle")
    with pytest.raises(ConfigError, match=r"w\.pth is a PyTorch pickle.*pip install torch"):
        jddp.load_pretrained(tmp_path / "w.pth", model())


# --- model.bn_momentum, model.bn_epsilon -------------------------------------------------------


def batchnorms(model):
    return [m for _, m in nnx.iter_modules(model) if isinstance(m, nnx.BatchNorm)]


def test_bn_keys_reach_every_batchnorm():
    cfg = load_config(None, ["model.width=4", "model.bn_momentum=0.99", "model.bn_epsilon=1e-3"])
    model = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
    assert {(m.momentum, m.epsilon) for m in batchnorms(model)} == {(0.99, 1e-3)}
    default = load_config(None, []).model
    assert (default.bn_momentum, default.bn_epsilon) == (0.9, 1e-5)  # as before the keys


@pytest.mark.parametrize(
    "override, words",
    [
        ("model.bn_momentum=1", "model.bn_momentum: must be in [0, 1), got 1.0"),
        ("model.bn_momentum=-0.1", "model.bn_momentum: must be in [0, 1), got -0.1"),
        ("model.bn_epsilon=0", "model.bn_epsilon: must be > 0, got 0.0"),
    ],
)
def test_bad_bn_keys(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == words


def test_a_block_array_without_a_torchvision_name_is_said_to_be_no_resnet(tmp_path, small_r18):
    """A ResNet's block holding an array torchvision's has no name for (a user's extra layer):
    one line naming it, not a ``KeyError`` of its last name."""
    sd, model = small_r18
    extended = model()
    extended.blocks[0].gamma = nnx.Param(np.ones(4, np.float32))
    message = refused(tmp_path, sd, extended)
    assert message == (
        "load_pretrained: .params['blocks'][0]['gamma'].value has no torchvision name"
        " (a jddp ResNet is expected)"
    )
