"""Host input pipeline: augmentation determinism across workers and process layouts, crops,
JPEG decode, worker failures (jddp.data.pipeline, jddp.data.augment)."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
from PIL import Image

from jddp.data import augment as aug
from jddp.data.formats.imagefolder import ImageFolderSource
from jddp.data.pipeline import GIL_SWITCH_INTERVAL_S, HostBatches, eval_rows, host_iterator
from jddp.data.source import ArraySource
from jddp.errors import DataError


def _source(n=64, size=12, channels=3, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, size, size, channels), dtype=np.uint8)
    labels = np.arange(n) % 10
    return ArraySource(images, labels, 10, [0.5] * channels, [0.25] * channels, "toy")


def _run(host, steps, workers, kind="thread"):
    it = host_iterator(host, range(steps), workers, kind)
    try:
        return [b["images"] for b in it]
    finally:
        if hasattr(it, "close"):
            it.close()


@pytest.mark.parametrize("augment", ["cifar", "imagenet"])
def test_same_pixels_for_any_workers_and_process_layout(augment):
    src = _source()
    whole = HostBatches(src, 16, seed=7, rows=slice(0, 16), augment=augment)
    ref = _run(whole, 9, 0)  # 9 steps: crosses into epoch 2 (4 steps per epoch)
    for workers in (1, 4):
        got = _run(whole, 9, workers)
        assert all(np.array_equal(a, b) for a, b in zip(ref, got, strict=True)), workers
    halves = [HostBatches(src, 16, 7, slice(r, r + 8), augment) for r in (0, 8)]
    for k in range(9):  # two processes' rows, read separately, make the same global batch
        joined = np.concatenate([h(k)["images"] for h in halves])
        np.testing.assert_array_equal(joined, ref[k])
    plain = HostBatches(src, 16, 7, slice(0, 16), "none")
    assert not np.array_equal(plain(0)["images"], ref[0])  # it did augment
    assert not np.array_equal(ref[0], ref[4][np.argsort(whole.global_indices(4))])


def test_same_pixels_in_worker_processes():
    host = HostBatches(_source(), 16, seed=3, rows=slice(0, 16), augment="cifar")
    ref = _run(host, 4, 0)
    got = _run(host, 4, 2, "process")
    assert all(np.array_equal(a, b) for a, b in zip(ref, got, strict=True))
    assert multiprocessing.active_children() == []


def test_thread_workers_shorten_the_gil_switch_interval():
    """Decoding threads must not keep the training loop's thread waiting 5 ms for the GIL."""
    import sys

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)  # Python's default
        host = HostBatches(_source(), 16, seed=3, rows=slice(0, 16), augment="none")
        _run(host, 2, 0)
        assert sys.getswitchinterval() == pytest.approx(0.005)  # no threads: left alone
        _run(host, 2, 2)
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)
        sys.setswitchinterval(0.0001)  # a shorter one the user chose stays
        _run(host, 2, 2)
        assert sys.getswitchinterval() == pytest.approx(0.0001)
    finally:
        sys.setswitchinterval(before)


def test_draws_depend_on_seed_epoch_and_example_only():
    keys = aug.example_keys(1, 2, np.array([5, 6, 5]))
    assert keys[0] == keys[2] and keys[0] != keys[1]
    assert aug.example_keys(1, 3, np.array([5]))[0] != keys[0]
    assert aug.example_keys(2, 2, np.array([5]))[0] != keys[0]
    u = aug.uniforms(aug.example_keys(0, 0, np.arange(20000)), 3)
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.01


def test_cifar_crop_flip_is_a_padded_shifted_window():
    images = np.arange(2 * 8 * 8, dtype=np.uint8).reshape(2, 8, 8, 1) + 1
    keys = aug.example_keys(0, 0, np.arange(2))
    out = aug.cifar_crop_flip(images, keys)
    u = aug.uniforms(keys, aug.FLIP_DRAW + 1)
    for i in range(2):
        top, left = int(u[i, 0] * 9), int(u[i, 1] * 9)
        want = np.pad(images[i], ((4, 4), (4, 4), (0, 0)))[top : top + 8, left : left + 8]
        if u[i, aug.FLIP_DRAW] < 0.5:
            want = want[:, ::-1]
        np.testing.assert_array_equal(out[i], want)


def test_random_resized_box_follows_torchvision():
    u = aug.uniforms(aug.example_keys(0, 0, np.arange(500)), aug.RRC_DRAWS)
    for row in u:
        left, top, right, bottom = aug.random_resized_box(row, 375, 500)
        w, h = right - left, bottom - top
        assert 0 <= left < right <= 500 and 0 <= top < bottom <= 375
        assert 0.08 * 0.99 <= w * h / (375 * 500) <= 1.0
        assert 3 / 4 * 0.95 <= w / h <= 4 / 3 * 1.05
    # no attempt fits in a 1x100 strip: torchvision's fallback, the centred crop of aspect 3/4
    assert aug.random_resized_box(u[0], 100, 1) == (0, 49, 1, 50)
    # smallest area (8 of 100 pixels) at aspect 3/4: w = round(sqrt(6)), h = round(sqrt(10.7))
    assert aug.random_resized_box(np.zeros(aug.RRC_DRAWS), 10, 10) == (0, 0, 2, 3)


def test_eval_center_crop():
    # shorter side 256 -> round(1.14 * 224) = 255: the crop is 224 * 256 / 255 = 224.9 -> 225
    assert aug.center_box(256, 320, 224) == (47, 15, 272, 240)
    # in-memory images at the output size: the centre 1/1.14 of the image, resized back
    images = np.zeros((1, 57, 57, 3), np.uint8)
    images[:, 7:50, 7:50] = 200  # a 43-pixel square: 57 / 1.14 = 50 -> the crop [3, 53)
    src = ArraySource(images, np.zeros(1), 1, [0.5] * 3, [0.25] * 3, "c")
    x, _ = eval_rows(src, np.array([0]), "imagenet")
    assert x.shape == (1, 57, 57, 3)
    column = x[0, :, 28, 0]  # the square [7, 50) grows by 57 / 50 about the centre: [5, 53)
    assert column[5] == column[52] == 200 and column[3] == column[54] == 0


def _jpeg_folder(root, sizes):
    from sklearn.datasets import load_sample_images

    photo = load_sample_images().images[0]  # 427x640 RGB
    for i, (h, w) in enumerate(sizes):
        folder = root / "train" / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(photo[:h, :w]).save(folder / f"{i}.jpg", quality=90)
    return root


def test_jpeg_decode_matches_pillow_at_full_scale(tmp_path):
    _jpeg_folder(tmp_path, [(64, 64), (64, 64)])
    src = ImageFolderSource(tmp_path, image_size=64)
    x, _ = src.get_batch(np.array([0]))
    with Image.open(src.files[0]) as img:
        ref = np.asarray(img.convert("RGB"), np.int16)
    assert x.dtype == np.uint8 and np.abs(x[0].astype(np.int16) - ref).max() <= 1


def test_jpeg_reduced_scale_decode_stays_close(tmp_path):
    _jpeg_folder(tmp_path, [(400, 400), (400, 400)])
    src = ImageFolderSource(tmp_path, image_size=48)  # 1/8 DCT scale: 50 >= 48 pixels
    x, _ = src.get_batch(np.array([0]))
    with Image.open(src.files[0]) as img:
        ref = np.asarray(img.convert("RGB").resize((48, 48), Image.Resampling.BILINEAR))
    assert np.abs(x[0].astype(np.int16) - ref).mean() < 4


def test_imagenet_crops_decode_in_workers(tmp_path):
    _jpeg_folder(tmp_path, [(375, 500)] * 8)
    src = ImageFolderSource(tmp_path, image_size=32)
    host = HostBatches(src, 8, seed=1, rows=slice(0, 8), augment="imagenet")
    ref = _run(host, 2, 0)
    assert ref[0].shape == (8, 32, 32, 3) and not np.array_equal(
        ref[0], src.get_batch(host.global_indices(0))[0]
    )
    got = _run(host, 2, 2)
    assert all(np.array_equal(a, b) for a, b in zip(ref, got, strict=True))


@pytest.mark.parametrize("workers, kind", [(0, "thread"), (2, "thread"), (2, "process")])
def test_corrupt_image_names_its_path(tmp_path, workers, kind):
    _jpeg_folder(tmp_path, [(40, 40)] * 4)
    bad = tmp_path / "train" / "c1" / "3.jpg"
    bad.write_bytes(bad.read_bytes()[:200])  # truncated JPEG
    host = HostBatches(ImageFolderSource(tmp_path, 16), 4, 0, slice(0, 4), "none")
    with pytest.raises(DataError, match="3.jpg") as err:
        _run(host, 3, workers, kind)
    assert "\n" not in str(err.value)
    assert multiprocessing.active_children() == []
