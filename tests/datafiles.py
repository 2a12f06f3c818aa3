"""Small data files in the real formats jddp reads (CIFAR-10 python batches, MNIST IDX, image
folders), written by the tests: no data set is downloaded."""

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
from PIL import Image


def write_cifar_folder(folder: Path, per_batch: int = 4, seed: int = 0) -> dict[str, dict]:
    """Write data_batch_1..5 and test_batch pickles (CIFAR-10 python layout)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, per_batch)]
        batch = {
            b"batch_label": name.encode(),
            b"labels": labels,
            b"data": data,
            b"filenames": [f"img{i}.png".encode() for i in range(per_batch)],
        }
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
        batches[name] = batch
    return batches


def idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
    """IDX encoding of a uint8 array (magic 0x000008DD unless given)."""
    if magic is None:
        magic = 0x0800 | array.ndim
    header = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


MNIST_NAMES = {
    "xtr": "train-images-idx3-ubyte",
    "ytr": "train-labels-idx1-ubyte",
    "xte": "t10k-images-idx3-ubyte",
    "yte": "t10k-labels-idx1-ubyte",
}


def write_mnist(
    folder: Path, compress: bool, n_train: int = 12, n_test: int = 5
) -> dict[str, np.ndarray]:
    """Write the four MNIST IDX files (gzipped or plain); return the arrays."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    arrays = {
        "xtr": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "ytr": rng.integers(0, 10, n_train).astype(np.uint8),
        "xte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "yte": rng.integers(0, 10, n_test).astype(np.uint8),
    }
    for key, base in MNIST_NAMES.items():
        raw = idx_bytes(arrays[key])
        if compress:
            (folder / f"{base}.gz").write_bytes(gzip.compress(raw))
        else:
            (folder / base).write_bytes(raw)
    return arrays


def write_imagefolder(root: Path, eval_name: str = "val") -> None:
    """Two classes of small PNGs (plus one JPEG) with distinct, checkable colors."""
    colors = {"cat": (250, 10, 10), "dog": (10, 10, 250)}
    for split, count in (("train", 3), (eval_name, 2)):
        for cls, color in colors.items():
            d = root / split / cls
            d.mkdir(parents=True)
            for i in range(count):
                img = Image.new("RGB", (20 + i * 4, 16), color)  # non-square sizes
                img.save(d / f"{i}.png")
    Image.new("L", (40, 30), 128).save(root / "train" / "dog" / "z_gray.jpg")


def write_jpeg_folder(root: Path, classes: int = 2, per_class: int = 4, size=(40, 30)) -> None:
    """``train/`` and ``val/`` folders of small random JPEGs (ImageNet's layout)."""
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("val", 2)):
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.JPEG", quality=90)


def photo_folder(root: Path) -> Path:
    """The image folder of tests/datafiles (PNGs of several sizes, a grayscale JPEG) plus two
    real photos, small, as JPEGs of the two classes."""
    from sklearn.datasets import load_sample_images

    write_imagefolder(root)
    for i, photo in enumerate(load_sample_images().images):
        small = Image.fromarray(photo).resize((96, 64), Image.Resampling.BILINEAR)
        small.save(root / "train" / ("cat", "dog")[i] / f"photo{i}.jpg", quality=90)
        small.save(root / "val" / ("cat", "dog")[i] / f"photo{i}.jpg", quality=75)
    return root
