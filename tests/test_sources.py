"""Tests for jddp.data sources and formats: real small files in every format, no network."""

from __future__ import annotations

import gzip
import pickle
import struct
import tarfile

import numpy as np
import pytest
from PIL import Image

from jddp.data.formats.imagefolder import IMAGENET_MEAN, IMAGENET_STD, ImageFolderSource
from jddp.data.formats.mnist import read_idx
from jddp.data.image_ops import channel_stats, resize_images
from jddp.data.registry import DATA_NAMES, load_splits
from jddp.data.source import ArraySource, Source, Splits
from jddp.errors import DataError
from tests.datafiles import (
    idx_bytes,
    write_cifar_folder,
    write_imagefolder,
    write_mnist,
)

# ----------------------------------------------------------------------------- helpers


def _normalized(source, indices):
    """``get_batch`` as the model sees it: uint8 normalised as PixelNorm does on the device."""
    x, y = source.get_batch(np.asarray(indices))
    if x.dtype == np.uint8:
        x = (x / np.float32(255.0) - source.mean) / source.std
    return x, y


# ----------------------------------------------------------------------------- basics


def test_data_names_and_unknown_name():
    assert DATA_NAMES == (
        "synthetic", "digits", "cifar10", "mnist", "npz", "imagefolder", "packed", "parquet",
        "webdataset",
    )  # fmt: skip
    with pytest.raises(DataError) as err:
        load_splits("imagenet21k", None, None)
    msg = str(err.value)
    assert "imagenet21k" in msg and all(n in msg for n in DATA_NAMES)
    assert "\n" not in msg
    assert issubclass(DataError, ValueError)


def test_bad_image_size_and_num_classes():
    with pytest.raises(DataError, match="image_size"):
        load_splits("synthetic", None, 0)
    with pytest.raises(DataError, match="num_classes"):
        load_splits("synthetic", None, None, num_classes=-1)


@pytest.mark.parametrize("name", ["cifar10", "mnist", "npz", "imagefolder"])
def test_path_required_and_missing(name, tmp_path):
    with pytest.raises(DataError) as err:
        load_splits(name, None, None)
    assert "data.path is required" in str(err.value) and name in str(err.value)
    missing = str(tmp_path / "x" / "y")
    with pytest.raises(DataError) as err:
        load_splits(name, missing, None)
    msg = str(err.value)
    assert f"data.path={missing!r} does not exist" in msg and "\n" not in msg


def test_missing_cifar_message_matches_spec():
    with pytest.raises(DataError) as err:
        load_splits("cifar10", "/x/y", None)
    assert str(err.value) == (
        "data.path='/x/y' does not exist: put the CIFAR-10 python batches "
        "(cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html, "
        "extracted or not) there"
    )


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_deterministic_and_in_range():
    a = load_splits("synthetic", None, None, seed=3)
    b = load_splits("synthetic", None, None, seed=3)
    c = load_splits("synthetic", None, None, seed=4)
    assert isinstance(a, Splits) and isinstance(a.train, Source)
    assert len(a.train) == 1024 and len(a.eval) == 256
    assert a.train.image_shape == (32, 32, 3) and a.train.num_classes == 10
    idx = np.arange(len(a.train))
    xa, ya = a.train.get_batch(idx)
    xb, yb = b.train.get_batch(idx)
    xc, _ = c.train.get_batch(idx)
    np.testing.assert_array_equal(xa, xb)
    np.testing.assert_array_equal(ya, yb)
    assert not np.array_equal(xa, xc)
    assert xa.dtype == np.uint8 and ya.dtype == np.int32  # normalised on the device
    assert ya.min() >= 0 and ya.max() < 10
    assert len(np.unique(ya)) == 10  # every class occurs
    small = load_splits("synthetic", None, 8, num_classes=3)
    x, y = small.eval.get_batch(np.arange(len(small.eval)))
    assert x.shape == (256, 8, 8, 3) and y.max() < 3 and small.train.num_classes == 3


def test_synthetic_labels_are_learnable():
    from sklearn.linear_model import LogisticRegression

    splits = load_splits("synthetic", None, 16, seed=0)
    x_tr, y_tr = _normalized(splits.train, np.arange(len(splits.train)))
    x_ev, y_ev = _normalized(splits.eval, np.arange(len(splits.eval)))
    model = LogisticRegression(max_iter=300, C=0.01).fit(x_tr.reshape(len(x_tr), -1), y_tr)
    accuracy = model.score(x_ev.reshape(len(x_ev), -1), y_ev)
    assert accuracy > 0.6, accuracy  # chance is about 0.1


# ----------------------------------------------------------------------------- digits


def test_digits_split():
    a = load_splits("digits", None, None, seed=0)
    b = load_splits("digits", None, None, seed=123)  # split independent of seed
    assert len(a.train) == 1437 and len(a.eval) == 360
    assert a.train.image_shape == (8, 8, 1) and a.train.num_classes == 10
    assert a.train.images.dtype == np.float32
    assert a.train.images.min() >= 0.0 and a.train.images.max() <= 1.0
    np.testing.assert_array_equal(a.eval.images, b.eval.images)
    np.testing.assert_array_equal(a.eval.labels, b.eval.labels)
    counts = np.bincount(a.eval.labels, minlength=10)
    assert counts.sum() == 360 and counts.min() >= 35 and counts.max() <= 37  # stratified
    x, y = a.eval.get_batch(np.array([0, 5, 359]))
    assert x.shape == (3, 8, 8, 1) and x.dtype == np.float32 and y.dtype == np.int32


def test_digits_resize_keeps_float32():
    s = load_splits("digits", None, 16)
    assert s.train.image_shape == (16, 16, 1) and s.train.images.dtype == np.float32


# ----------------------------------------------------------------------------- cifar10


def _check_cifar(splits: Splits, batches: dict[str, dict]) -> None:
    assert len(splits.train) == 20 and len(splits.eval) == 4
    assert splits.train.image_shape == (32, 32, 3) and splits.train.num_classes == 10
    assert splits.train.images.dtype == np.uint8
    # Pixel (row 5, col 7, green) of image 1 of data_batch_2 -> CHW offset 1*1024 + 5*32 + 7.
    raw = batches["data_batch_2"][b"data"][1]
    assert splits.train.images[4 + 1, 5, 7, 1] == raw[1024 + 5 * 32 + 7]
    np.testing.assert_array_equal(splits.train.images[5], raw.reshape(3, 32, 32).transpose(1, 2, 0))
    np.testing.assert_array_equal(splits.eval.labels, batches["test_batch"][b"labels"])
    expected = np.concatenate([batches[f"data_batch_{i}"][b"labels"] for i in range(1, 6)])
    np.testing.assert_array_equal(splits.train.labels, expected)


def test_cifar_folder_parent_and_tarball(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    batches = write_cifar_folder(folder)
    _check_cifar(load_splits("cifar10", str(folder), None), batches)
    _check_cifar(load_splits("cifar10", str(tmp_path), None), batches)  # parent folder

    archive = tmp_path / "arch" / "cifar-10-python.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-py")
    from_tar = load_splits("cifar10", str(archive), None)
    _check_cifar(from_tar, batches)
    _check_cifar(load_splits("cifar10", str(archive.parent), None), batches)  # parent of tar
    assert not (archive.parent / "cifar-10-batches-py").exists()  # nothing extracted


def test_cifar_errors(tmp_path):
    folder = tmp_path / "c"
    write_cifar_folder(folder)
    (folder / "data_batch_3").unlink()
    with pytest.raises(DataError, match="data_batch_3"):
        load_splits("cifar10", str(folder), None)

    write_cifar_folder(folder)
    (folder / "test_batch").write_bytes(b"not a pickle at all")
    with pytest.raises(DataError) as err:
        load_splits("cifar10", str(folder), None)
    assert "test_batch" in str(err.value)

    write_cifar_folder(folder)
    batch = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [1, 12]}
    (folder / "data_batch_4").write_bytes(pickle.dumps(batch))
    with pytest.raises(DataError) as err:
        load_splits("cifar10", str(folder), None)
    assert "data_batch_4" in str(err.value) and "12" in str(err.value)

    # A pickle that would run code is refused, not executed.
    (folder / "data_batch_4").write_bytes(pickle.dumps({b"data": print, b"labels": []}))
    with pytest.raises(DataError, match="data_batch_4"):
        load_splits("cifar10", str(folder), None)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="cifar-10-python.tar.gz"):
        load_splits("cifar10", str(empty), None)

    not_tar = tmp_path / "file.bin"
    not_tar.write_bytes(b"x" * 100)
    with pytest.raises(DataError, match="not a tar archive"):
        load_splits("cifar10", str(not_tar), None)


def test_cifar_num_classes_too_small(tmp_path):
    folder = tmp_path / "c"
    batches = write_cifar_folder(folder)
    highest = max(max(b[b"labels"]) for b in batches.values())
    with pytest.raises(DataError) as err:
        load_splits("cifar10", str(folder), None, num_classes=2)
    msg = str(err.value)
    assert f"label {highest}" in msg and "num_classes=2" in msg


# ----------------------------------------------------------------------------- mnist


@pytest.mark.parametrize("compress", [True, False])
def test_mnist_gz_and_plain(tmp_path, compress):
    arrays = write_mnist(tmp_path, compress)
    s = load_splits("mnist", str(tmp_path), None)
    assert len(s.train) == 12 and len(s.eval) == 5
    assert s.train.image_shape == (28, 28, 1) and s.train.images.dtype == np.uint8
    np.testing.assert_array_equal(s.train.images[..., 0], arrays["xtr"])
    np.testing.assert_array_equal(s.eval.labels, arrays["yte"])
    x, y = s.eval.get_batch(np.array([4, 0]))
    assert x.shape == (2, 28, 28, 1) and list(y) == [arrays["yte"][4], arrays["yte"][0]]


def test_mnist_truncated_idx(tmp_path):
    write_mnist(tmp_path, compress=False)
    images = np.zeros((12, 28, 28), np.uint8)
    raw = struct.pack(">IIII", 0x803, 60000, 28, 28) + images.tobytes()
    bad = tmp_path / "train-images-idx3-ubyte"
    bad.write_bytes(raw)
    with pytest.raises(DataError) as err:
        load_splits("mnist", str(tmp_path), None)
    msg = str(err.value)
    assert (
        "train-images-idx3-ubyte" in msg
        and "60000" in msg
        and "says 60000 images of 28x28 but it holds 12" in msg
    )


def test_mnist_wrong_magic(tmp_path):
    write_mnist(tmp_path, compress=True)
    labels_as_images = gzip.compress(idx_bytes(np.zeros(12, np.uint8)))
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(labels_as_images)
    with pytest.raises(DataError) as err:
        load_splits("mnist", str(tmp_path), None)
    msg = str(err.value)
    assert "train-images-idx3-ubyte.gz" in msg and "0x00000803" in msg

    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(
        gzip.compress(b"\x12\x34\x56\x78" + b"\0" * 20)
    )
    with pytest.raises(DataError, match="0x12345678"):
        read_idx(tmp_path / "t10k-labels-idx1-ubyte.gz")


def test_mnist_other_errors(tmp_path):
    write_mnist(tmp_path, compress=False)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte"):
        load_splits("mnist", str(tmp_path), None)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(4, np.uint8)))
    with pytest.raises(DataError, match="5 images .* 4 labels"):
        load_splits("mnist", str(tmp_path), None)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.full(5, 11, np.uint8)))
    with pytest.raises(DataError) as err:
        load_splits("mnist", str(tmp_path), None)
    assert "t10k-labels-idx1-ubyte" in str(err.value) and "label 11" in str(err.value)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(b"\x1f\x8b garbage")
    (tmp_path / "t10k-labels-idx1-ubyte").rename(tmp_path / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz"):
        load_splits("mnist", str(tmp_path), None)


def test_read_idx_other_dtypes(tmp_path):
    data = np.arange(6, dtype=">i4").reshape(2, 3)
    raw = struct.pack(">I", 0x0C02) + struct.pack(">II", 2, 3) + data.tobytes()
    (tmp_path / "a.idx").write_bytes(raw)
    out = read_idx(tmp_path / "a.idx")
    np.testing.assert_array_equal(out, np.arange(6).reshape(2, 3))
    (tmp_path / "b.idx").write_bytes(raw + b"\0")
    with pytest.raises(DataError, match="extra bytes after"):
        read_idx(tmp_path / "b.idx")


# ----------------------------------------------------------------------------- npz


def test_npz_hw_and_hwc(tmp_path):
    rng = np.random.default_rng(0)
    f3 = tmp_path / "gray.npz"
    np.savez(
        f3,
        x_train=rng.integers(0, 256, (10, 6, 6), dtype=np.uint8),
        y_train=np.arange(10) % 4,
        x_test=rng.integers(0, 256, (3, 6, 6), dtype=np.uint8),
        y_test=np.array([[0], [1], [2]]),  # Keras-style [N,1]
    )
    s = load_splits("npz", str(f3), None)
    assert s.train.image_shape == (6, 6, 1) and s.train.num_classes == 4
    assert s.eval.labels.tolist() == [0, 1, 2]

    f4 = tmp_path / "rgb.npz"
    x_train = rng.normal(3.0, 2.0, (10, 5, 7, 3)).astype(np.float64)
    np.savez(f4, x_train=x_train, y_train=np.zeros(10, int), x_test=x_train[:2], y_test=[0, 6])
    s = load_splits("npz", str(f4), None)
    assert s.train.image_shape == (5, 7, 3) and s.train.images.dtype == np.float32
    assert s.train.num_classes == 7  # max label + 1 over both splits
    x, _ = s.train.get_batch(np.arange(10))
    np.testing.assert_allclose(x.mean(axis=(0, 1, 2)), 0.0, atol=1e-4)
    s = load_splits("npz", str(f4), 4)
    assert s.eval.image_shape == (4, 4, 3) and s.eval.images.dtype == np.float32


def test_npz_errors(tmp_path):
    f = tmp_path / "d.npz"
    np.savez(f, x_train=np.zeros((2, 4, 4), np.uint8), y_train=[0, 1])
    with pytest.raises(DataError) as err:
        load_splits("npz", str(f), None)
    assert "d.npz" in str(err.value) and "x_test" in str(err.value)

    np.savez(
        f,
        x_train=np.zeros((2, 4, 4), np.uint8),
        y_train=[0, 7],
        x_test=np.zeros((2, 4, 4), np.uint8),
        y_test=[0, 1],
    )
    with pytest.raises(DataError) as err:
        load_splits("npz", str(f), None, num_classes=5)
    msg = str(err.value)
    assert "label 7" in msg and "num_classes=5" in msg and "y_train" in msg

    np.savez(
        f,
        x_train=np.zeros((2, 4, 4), np.uint8),
        y_train=[0, 1],
        x_test=np.zeros((2, 5, 5), np.uint8),
        y_test=[0, 1],
    )
    with pytest.raises(DataError) as err:
        load_splits("npz", str(f), None)
    assert "(4, 4, 1)" in str(err.value) and "(5, 5, 1)" in str(err.value)

    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(DataError, match="junk.npz"):
        load_splits("npz", str(tmp_path / "junk.npz"), None)


# ----------------------------------------------------------------------------- imagefolder


@pytest.mark.parametrize("eval_name", ["val", "test"])
def test_imagefolder(tmp_path, eval_name):
    write_imagefolder(tmp_path, eval_name)
    s = load_splits("imagefolder", str(tmp_path), 8)
    assert isinstance(s.train, ImageFolderSource) and s.train.classes == ["cat", "dog"]
    assert len(s.train) == 7 and len(s.eval) == 4 and s.train.num_classes == 2
    assert s.train.image_shape == (8, 8, 3) and s.eval.split == eval_name
    assert s.train.get_batch(np.arange(2))[0].dtype == np.uint8  # normalised on the device
    x, y = _normalized(s.train, np.arange(len(s.train)))
    assert x.shape == (7, 8, 8, 3) and x.dtype == np.float32 and y.tolist() == [0] * 3 + [1] * 4
    mean, std = np.asarray(IMAGENET_MEAN), np.asarray(IMAGENET_STD)
    np.testing.assert_allclose(x[0, 4, 4], (np.array([250, 10, 10]) / 255 - mean) / std, atol=1e-5)
    np.testing.assert_allclose(x[-1, 4, 4], (128 / 255 - mean) / std, atol=0.05)  # gray JPEG
    assert load_splits("imagefolder", str(tmp_path), None).train.image_shape == (224, 224, 3)


def test_imagefolder_class_mismatch_and_bad_image(tmp_path):
    write_imagefolder(tmp_path)
    (tmp_path / "val" / "dog").rename(tmp_path / "val" / "wolf")
    with pytest.raises(DataError) as err:
        load_splits("imagefolder", str(tmp_path), 8)
    msg = str(err.value)
    assert "val" in msg and "train" in msg and "dog" in msg and "wolf" in msg
    assert isinstance(err.value, ValueError)

    (tmp_path / "val" / "wolf").rename(tmp_path / "val" / "dog")
    bad = tmp_path / "train" / "cat" / "9_bad.png"
    bad.write_bytes(b"not a png")
    s = load_splits("imagefolder", str(tmp_path), 8)
    with pytest.raises(DataError, match="9_bad.png"):
        s.train.get_batch(np.array([3]))


def test_imagefolder_refuses_an_empty_class_folder(tmp_path):
    write_imagefolder(tmp_path)
    (tmp_path / "train" / "zebra").mkdir()
    with pytest.raises(DataError, match="1 class folder.*zebra"):
        load_splits("imagefolder", str(tmp_path), 8)


# ----------------------------------------------------------------------------- normalization


def test_normalization_uses_train_stats(tmp_path):
    rng = np.random.default_rng(0)
    x_train = np.stack(
        [
            rng.integers(0, 100, (50, 6, 6)),
            rng.integers(100, 256, (50, 6, 6)),
            rng.integers(0, 256, (50, 6, 6)),
        ],
        axis=-1,
    ).astype(np.uint8)
    x_test = np.full((4, 6, 6, 3), 200, np.uint8)
    f = tmp_path / "n.npz"
    np.savez(f, x_train=x_train, y_train=np.zeros(50, int), x_test=x_test, y_test=np.zeros(4))
    s = load_splits("npz", str(f), None)
    x, _ = _normalized(s.train, np.arange(50))
    np.testing.assert_allclose(x.mean(axis=(0, 1, 2)), 0.0, atol=1e-5)
    np.testing.assert_allclose(x.std(axis=(0, 1, 2)), 1.0, atol=1e-4)
    train_f = x_train.astype(np.float64) / 255
    mean, std = train_f.mean(axis=(0, 1, 2)), train_f.std(axis=(0, 1, 2))
    np.testing.assert_allclose(s.eval.mean, mean, rtol=1e-5)
    np.testing.assert_allclose(s.eval.std, std, rtol=1e-5)
    xe, _ = _normalized(s.eval, np.array([0, 3]))
    np.testing.assert_allclose(xe[0, 0, 0], (200 / 255 - mean) / std, rtol=1e-5)
    m, sd = channel_stats(x_train)
    np.testing.assert_allclose(m, mean, rtol=1e-5)
    np.testing.assert_allclose(sd, std, rtol=1e-5)


def test_array_source_direct():
    images = np.arange(2 * 2 * 2 * 1, dtype=np.uint8).reshape(2, 2, 2, 1) * 30
    src = ArraySource(images, np.array([1, 0]), 2, [0.5], [0.25], "toy")
    x, y = _normalized(src, np.array([1, 1, 0]))
    assert y.tolist() == [0, 0, 1] and y.dtype == np.int32
    np.testing.assert_allclose(x[2, 0, 1, 0], (30 / 255 - 0.5) / 0.25, rtol=1e-6)
    with pytest.raises(IndexError):
        src.get_batch(np.array([2]))
    assert repr(src) == (
        "ArraySource(name='toy', n=2, image_shape=(2, 2, 1), dtype=uint8, num_classes=2)"
    )


# ----------------------------------------------------------------------------- resize


def test_resize_matches_pillow_and_keeps_dtype():
    rng = np.random.default_rng(0)
    img = rng.random((13, 9)).astype(np.float32)
    for size in (4, 20):
        ours = resize_images(img[None, :, :, None], size)[0, :, :, 0]
        ref = np.asarray(Image.fromarray(img, mode="F").resize((size, size), Image.BILINEAR))
        np.testing.assert_allclose(ours, ref, atol=1e-5)
    u8 = rng.integers(0, 256, (3, 10, 10, 3), dtype=np.uint8)
    out = resize_images(u8, 5)
    assert out.shape == (3, 5, 5, 3) and out.dtype == np.uint8
    const = np.full((1, 7, 7, 2), 77, np.uint8)
    assert np.all(resize_images(const, 16) == 77)


def test_resize_via_image_size(tmp_path):
    write_mnist(tmp_path, compress=True)
    s = load_splits("mnist", str(tmp_path), 14)
    assert s.train.image_shape == (14, 14, 1) and s.eval.image_shape == (14, 14, 1)
    assert s.train.images.dtype == np.uint8
    x, _ = s.train.get_batch(np.arange(3))
    assert x.shape == (3, 14, 14, 1)


# ----------------------------------------------------------------------------- repr


def test_repr_is_stable_without_addresses(tmp_path):
    write_imagefolder(tmp_path / "imf")
    sources = [
        *vars(load_splits("synthetic", None, 8)).values(),
        *vars(load_splits("digits", None, None)).values(),
        *vars(load_splits("imagefolder", str(tmp_path / "imf"), 8)).values(),
    ]
    for src in sources:
        text = repr(src)
        assert "0x" not in text and "\n" not in text
    assert repr(load_splits("synthetic", None, 8).train) == repr(sources[0])
