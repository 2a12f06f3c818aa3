"""The decoder (jddp/data/decode.py): fast path, Pillow fallback, same errors, pixels close to
the old Pillow path on real photos."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from PIL import Image

from jddp.data import augment as aug
from jddp.data import decode
from jddp.errors import DataError

SIZE = 64


def _encode(img: Image.Image, fmt: str = "JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    """The two real photos scikit-learn ships, as 500x375 JPEGs (quality 90)."""
    from sklearn.datasets import load_sample_images  # not at collection: ~1.5 s per worker

    images = [Image.fromarray(p) for p in load_sample_images().images]
    return [_encode(p.resize((500, 375), Image.Resampling.BILINEAR), quality=90) for p in images]


def _old_pillow_path(data: bytes, box_of, size: int) -> np.ndarray:
    """What jddp did before this decoder: Pillow draft + antialiased bilinear resize of the box."""
    with Image.open(io.BytesIO(data)) as img:
        width, height = img.size
        left, top, right, bottom = box_of(height, width)
        img.draft(
            "RGB",
            (math.ceil(width * size / (right - left)), math.ceil(height * size / (bottom - top))),
        )
        sx, sy = img.size[0] / width, img.size[1] / height
        img = img.convert("RGB")
        box = (left * sx, top * sy, right * sx, bottom * sy)
        return np.asarray(img.resize((size, size), Image.Resampling.BILINEAR, box=box))


def test_fast_decode_is_pillows_decode_bitwise(photos):
    """simplejpeg and Pillow run the same libjpeg-turbo IDCT: the same pixels before resizing."""
    import simplejpeg

    for data in photos:
        ours = simplejpeg.decode_jpeg(data, "RGB")
        pillow = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        np.testing.assert_array_equal(ours, pillow)


def test_crops_close_to_the_old_pillow_path(photos):
    """Random-resized and eval crops of real photos differ from the old Pillow path by < 1/255
    on average (the filter differs, not the geometry), at the ImageNet output size."""
    size = 224
    keys = aug.example_keys(0, 0, np.arange(40))
    u = aug.uniforms(keys, aug.RRC_DRAWS)
    diffs = []
    for i in range(40):
        data = photos[i % 2]
        if i % 4 == 3:
            box_of = lambda h, w: aug.center_box(h, w, size)  # noqa: E731
        else:
            box_of = lambda h, w, row=u[i]: aug.random_resized_box(row, h, w)  # noqa: E731
        ours = decode.decode_crop(data, box_of, size, "test")
        assert ours.shape == (size, size, 3) and ours.dtype == np.uint8
        diffs.append(np.abs(ours.astype(int) - _old_pillow_path(data, box_of, size)).mean())
    assert np.mean(diffs) < 1.0, diffs
    assert max(diffs) < 3.0, diffs


def test_dct_scaling_follows_pillows_draft_rule():
    assert decode.draft_factor((0, 0, 500, 375), 224) == 1
    assert decode.draft_factor((0, 0, 1000, 900), 224) == 4
    assert decode.draft_factor((0, 0, 4000, 3000), 224) == 8
    assert decode.draft_factor((0, 0, 460, 3000), 224) == 2


def test_a_large_photo_decodes_scaled_and_close(photos):
    """A 2000x1500 JPEG: decoded at 1/4 scale by both paths, same crop within rounding."""
    big = Image.open(io.BytesIO(photos[0])).resize((2000, 1500), Image.Resampling.BICUBIC)
    data = _encode(big, quality=90)
    box_of = lambda h, w: aug.center_box(h, w, SIZE)  # noqa: E731
    ours = decode.decode_crop(data, box_of, SIZE, "test")
    assert np.abs(ours.astype(int) - _old_pillow_path(data, box_of, SIZE)).mean() < 2.0


def _full(h, w):
    return (0, 0, w, h)


@pytest.mark.parametrize(
    "mode,fmt,kw",
    [
        ("L", "JPEG", {}),  # grayscale JPEG: Pillow path
        ("CMYK", "JPEG", {}),  # CMYK JPEG: Pillow path
        ("RGB", "JPEG", {"progressive": True}),  # progressive: fast path
        ("RGB", "PNG", {}),
        ("RGBA", "PNG", {}),
        ("P", "PNG", {}),
    ],
)
def test_every_kind_pillow_reads_still_decodes(mode, fmt, kw):
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8))
    img = rgb.convert(mode) if mode != "I;16" else rgb.convert("L").convert("I;16")
    data = _encode(img, fmt, **kw)
    out = decode.decode_crop(data, _full, SIZE, "test")
    assert out.shape == (SIZE, SIZE, 3) and out.dtype == np.uint8
    reference = np.asarray(
        Image.open(io.BytesIO(data)).convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    )
    assert np.abs(out.astype(int) - reference).mean() < 8  # same image, another filter


def test_paths_and_bytes_give_the_same_pixels(tmp_path, photos):
    path = tmp_path / "a.jpg"
    path.write_bytes(photos[1])
    box_of = lambda h, w: aug.center_box(h, w, SIZE)  # noqa: E731
    np.testing.assert_array_equal(
        decode.decode_crop(path, box_of, SIZE, "x"),
        decode.decode_crop(photos[1], box_of, SIZE, "x"),
    )


def _pillow_error(path) -> str:
    try:
        with Image.open(path) as img:
            img.convert("RGB")
    except (OSError, SyntaxError, ValueError) as err:
        return " ".join(str(err).split())
    raise AssertionError("Pillow decoded it")


@pytest.mark.parametrize("kind", ["truncated", "zero-byte", "text", "bad-header"])
def test_bad_files_raise_pillows_error_naming_the_file(kind, photos, tmp_path):
    data = {
        "truncated": photos[0][: len(photos[0]) // 3],
        "zero-byte": b"",
        "text": b"not an image at all\n",
        "bad-header": b"\xff\xd8\xff\xe0garbage" * 10,
    }[kind]
    path = tmp_path / f"{kind}.jpg"
    path.write_bytes(data)
    with pytest.raises(DataError) as info:
        decode.decode_crop(path, _full, SIZE, f"imagefolder: cannot decode image {str(path)!r}")
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert message.endswith(_pillow_error(path))
    with pytest.raises(DataError) as info:
        decode.decode_crop(data, _full, SIZE, "record 3")
    assert "BytesIO" not in str(info.value) and str(info.value).startswith("record 3: ")


def test_missing_file_names_it(tmp_path):
    with pytest.raises(DataError, match="gone.jpg"):
        decode.decode_crop(tmp_path / "gone.jpg", _full, SIZE, f"cannot read {tmp_path}/gone.jpg")


def test_resize_crop_keeps_channels_and_non_square_outputs():
    rng = np.random.default_rng(1)
    gray = rng.integers(0, 256, (30, 40, 1), dtype=np.uint8)
    from jddp.data.image_ops import crop_resize

    out = crop_resize(gray, (5, 5, 35, 25), (12, 16))
    assert out.shape == (12, 16, 1) and out.dtype == np.uint8
    const = np.full((50, 60, 3), 77, np.uint8)
    np.testing.assert_array_equal(decode.resize_crop(const, (3.5, 2.2, 57.1, 48.9), 20), 77)


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.int16])
def test_flip_rows_flips_exactly_the_drawn_rows(dtype):
    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (16, 9, 7, 3)).astype(dtype)
    keys = aug.example_keys(0, 0, np.arange(16))
    want = images.copy()
    flip = aug.flips(keys)
    assert 0 < flip.sum() < 16
    want[flip] = want[flip, :, ::-1]
    np.testing.assert_array_equal(aug.flip_rows(images, keys), want)


def test_16_bit_png_is_scaled_not_clipped():
    """A 16-bit grayscale PNG: 65535 is white, 32768 mid-gray (Pillow's convert clips)."""
    wide = np.full((32, 32), 32768, np.uint16)
    wide[:, 16:] = 65535
    out = decode.decode_crop(_encode(Image.fromarray(wide), "PNG"), _full, 32, "test")
    assert out.shape == (32, 32, 3)
    assert abs(int(out[5, 4, 0]) - 128) <= 1 and out[5, 28, 1] == 255
