"""Old import path, kept for user code: the names now live in one module per job.

:mod:`jddp.data.source` (the Source protocol, ArraySource), :mod:`jddp.data.image_ops`,
:mod:`jddp.data.registry` (``load_splits``) and :mod:`jddp.data.formats` (one per format).
"""

from jddp.data.formats.imagefolder import IMAGENET_MEAN, IMAGENET_STD, ImageFolderSource
from jddp.data.formats.mnist import read_idx
from jddp.data.image_ops import channel_stats, resize_images
from jddp.data.registry import DATA_NAMES, load_splits
from jddp.data.source import ArraySource, Source, Splits
from jddp.errors import DataError

__all__ = [
    "DATA_NAMES",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ArraySource",
    "DataError",
    "ImageFolderSource",
    "Source",
    "Splits",
    "channel_stats",
    "load_splits",
    "read_idx",
    "resize_images",
]
