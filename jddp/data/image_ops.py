"""Array image operations shared by the sources: channel statistics, bilinear resize, crops."""

from __future__ import annotations

import numpy as np

__all__ = ["channel_stats", "crop_resize", "resize_images"]


def channel_stats(images: np.ndarray, chunk: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std (float32 ``[C]``) of ``images`` ``[N,H,W,C]``.

    uint8 images are measured on the ``[0, 1]`` scale (divided by 255), other dtypes as
    they are.  Sums are accumulated in float64 over chunks of ``chunk`` images, so the
    memory cost stays bounded.  A channel whose std is (nearly) zero gets std 1.
    """
    if images.ndim != 4 or images.shape[0] == 0:
        raise ValueError(f"channel_stats: expected non-empty [N,H,W,C], got {images.shape}")
    channels = images.shape[-1]
    total = np.zeros(channels, np.float64)
    total_sq = np.zeros(channels, np.float64)
    for start in range(0, images.shape[0], chunk):
        block = images[start : start + chunk].reshape(-1, channels).astype(np.float64)
        total += block.sum(axis=0)
        total_sq += np.square(block).sum(axis=0)
    count = images.shape[0] * images.shape[1] * images.shape[2]
    mean = total / count
    var = np.maximum(total_sq / count - np.square(mean), 0.0)
    std = np.sqrt(var)
    if images.dtype == np.uint8:
        mean, std = mean / 255.0, std / 255.0
    std = np.where(std < 1e-6, 1.0, std)
    return mean.astype(np.float32), std.astype(np.float32)


def _bilinear_weights(n_in: int, n_out: int) -> np.ndarray:
    """``[n_out, n_in]`` resampling matrix of a triangle (bilinear) filter.

    Pixel centers are aligned (half-pixel convention) and, when shrinking, the filter
    is widened by the scale factor so it averages (antialiases) like Pillow's
    ``BILINEAR``; rows are normalized so a constant image stays constant.
    """
    scale = n_in / n_out
    support = max(scale, 1.0)
    centers = (np.arange(n_out, dtype=np.float64) + 0.5) * scale
    positions = np.arange(n_in, dtype=np.float64) + 0.5
    weights = np.maximum(0.0, 1.0 - np.abs(positions[None, :] - centers[:, None]) / support)
    weights /= weights.sum(axis=1, keepdims=True)
    return weights


def resize_images(images: np.ndarray, size: int, chunk_bytes: int = 1 << 26) -> np.ndarray:
    """Resize ``images`` ``[N,H,W,C]`` to ``[N,size,size,C]`` bilinearly, keeping the dtype.

    Matches Pillow's ``BILINEAR`` resize (antialiased when shrinking); uint8 results are
    rounded.  Work is done in chunks of about ``chunk_bytes`` of float32 output.  The
    input is returned unchanged when it already has the requested size.
    """
    if images.ndim != 4:
        raise ValueError(f"resize_images: expected [N,H,W,C], got shape {images.shape}")
    n, h, w, c = images.shape
    if (h, w) == (size, size):
        return images
    rows = _bilinear_weights(h, size).astype(np.float32)
    cols = _bilinear_weights(w, size).astype(np.float32)
    out = np.empty((n, size, size, c), images.dtype)
    per_image = max(size * max(size, w) * c * 4, 1)
    step = max(1, chunk_bytes // per_image)
    for start in range(0, n, step):
        block = images[start : start + step].astype(np.float32)
        block = np.einsum("oh,nhwc->nowc", rows, block, optimize=True)
        block = np.einsum("pw,nowc->nopc", cols, block, optimize=True)
        if images.dtype == np.uint8:
            block = np.clip(np.rint(block), 0, 255)
        out[start : start + step] = block
    return out


def crop_resize(
    image: np.ndarray, box: tuple[int, int, int, int], size: tuple[int, int]
) -> np.ndarray:
    """The ``box`` (left, top, right, bottom) of ``image`` ``[H,W,C]`` resized to ``size`` (h, w).

    uint8 images of 1 or 3 channels take the decoder's resize
    (:func:`jddp.data.decode.resize_crop`: the filter image files get, the GIL released);
    anything else goes through :func:`resize_images` (square ``size`` only).
    """
    left, top, right, bottom = box
    if image.dtype == np.uint8 and image.shape[-1] in (1, 3):
        from jddp.data.decode import resize_crop  # OpenCV: imported only by sources that crop

        out = resize_crop(image, box, size)
        return out.reshape(size[0], size[1], image.shape[-1])
    return resize_images(image[None, top:bottom, left:right], size[0])[0]
