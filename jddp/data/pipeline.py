"""Host side of the input pipeline: this process's rows of global batch *k*, built in workers.

:class:`HostBatches` is a pure function ``step -> batch`` (numpy; ``{"images", "labels"}`` for
image sources, the source's own pytree for any other task's data): which examples (``(seed,
k)``), which rows this process reads, and their augmentation (``(seed, epoch, example)``, see
:mod:`jddp.data.augment`; images only). It holds no JAX object, so it pickles into
worker processes. :func:`host_iterator` runs it over a range of steps with grain: in the
calling thread (``workers=0``), in a grain thread pool (``ReadOptions``), or in grain worker
processes (``mp_prefetch``, shared-memory transfer). Results come back in step order
whatever the number or kind of workers.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, Literal, get_args

import numpy as np

from jddp.data import augment as aug
from jddp.data.image_ops import crop_resize
from jddp.data.source import Source, is_image_source

__all__ = [
    "WORKER_KINDS",
    "HostBatches",
    "eval_batch",
    "eval_rows",
    "host_iterator",
]

WorkerKind = Literal["thread", "process"]  # data.worker_kind's type in the config schema
WORKER_KINDS: tuple[str, ...] = get_args(WorkerKind)

_QUIET_TRACKER = "ignore:resource_tracker:UserWarning"


def crops(source: Source, indices: np.ndarray, boxes: aug.BoxFn) -> tuple[np.ndarray, np.ndarray]:
    """``source``'s rows at ``indices``, row ``k`` cropped to ``boxes(k, H, W)`` and resized back.

    Sources with a ``get_crops`` method crop while decoding (image files: crop on the full
    image, then resize); for any other source the decoded rows are cropped here.
    """
    if hasattr(source, "get_crops"):
        return source.get_crops(indices, boxes)
    images, labels = source.get_batch(indices)
    h, w = images.shape[1:3]
    out = np.stack([crop_resize(img, boxes(k, h, w), (h, w)) for k, img in enumerate(images)])
    return out, labels


def train_rows(
    source: Source, indices: np.ndarray, keys: np.ndarray, augment: str
) -> tuple[np.ndarray, np.ndarray]:
    """The training rows at ``indices`` with the ``augment`` policy; ``keys`` drive it."""
    if augment == "none":
        return source.get_batch(indices)
    if augment == "cifar":
        images, labels = source.get_batch(indices)
        return aug.cifar_crop_flip(images, keys), labels
    if augment == "imagenet":
        images, labels = crops(source, indices, aug.train_boxes(keys))
        return aug.flip_rows(images, keys), labels
    raise ValueError(f"data.augment={augment!r}: expected one of {', '.join(aug.AUGMENTS)}")


def eval_rows(source: Source, indices: np.ndarray, augment: str) -> tuple[np.ndarray, np.ndarray]:
    """The eval rows at ``indices``: ``imagenet`` takes the 1/1.14 centre crop, else as is."""
    if augment == "imagenet":
        return crops(source, indices, aug.eval_boxes(source.image_shape[0]))
    return source.get_batch(indices)


def eval_batch(source: Any, indices: np.ndarray, augment: str) -> Any:
    """The eval batch at ``indices``: ``{"images", "labels"}`` of an image source (with its eval
    transform, :func:`eval_rows`), the pytree ``get_batch`` gives for any other source."""
    if not is_image_source(source):
        return source.get_batch(indices)
    images, labels = eval_rows(source, indices, augment)
    return {"images": images, "labels": labels}


def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
    """The example order of ``epoch``: a permutation that depends only on (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


class HostBatches:
    """``step -> this process's rows of global batch step``, a pure function of (seed, step).

    Epoch ``e = step // steps_per_epoch`` shuffles the examples with a permutation drawn from
    ``(seed, e)``; the batch is the next ``global_batch_size`` of them (an epoch's incomplete
    tail is dropped). ``rows`` picks this process's block of the global batch.
    """

    def __init__(
        self, source: Source, global_batch_size: int, seed: int, rows: slice, augment: str
    ):
        if augment not in aug.AUGMENTS:
            raise ValueError(f"data.augment={augment!r}: expected one of {', '.join(aug.AUGMENTS)}")
        if augment != "none" and not is_image_source(source):
            raise ValueError(
                f"data.augment={augment}: augmentation transforms images, and {source!r} holds "
                "a custom task's batches; use data.augment=none (augment inside your loss or "
                "data instead)"
            )
        self.source = source
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.rows = rows
        self.augment = augment
        self.steps_per_epoch = len(source) // global_batch_size
        self._perm: tuple[int, np.ndarray] | None = None

    def global_indices(self, step: int) -> np.ndarray:
        """Example indices of global batch ``step`` (the same on every process and topology)."""
        epoch, offset = divmod(step, self.steps_per_epoch)
        cached = self._perm  # one read: threads may replace it concurrently
        if cached is None or cached[0] != epoch:
            cached = (epoch, epoch_permutation(self.seed, epoch, len(self.source)))
            self._perm = cached
        start = offset * self.global_batch_size
        return cached[1][start : start + self.global_batch_size]

    def __call__(self, step: int) -> Any:
        """This process's rows of global batch ``step`` as numpy arrays."""
        step = int(step)
        indices = self.global_indices(step)[self.rows]
        if not is_image_source(self.source):
            return self.source.get_batch(indices)
        keys = aug.example_keys(self.seed, step // self.steps_per_epoch, indices)
        images, labels = train_rows(self.source, indices, keys, self.augment)
        return {"images": images, "labels": labels}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_perm": None}


# Python hands the GIL to a waiting thread only every 5 ms (sys.getswitchinterval()). With many
# decoding threads, each holding it between C calls, the training loop's thread waited that long
# over and over: on a 16-core H100 host, ResNet-50 from a JPEG folder with 14 thread workers ran
# 1,833-3,853 images/s with Python's 5 ms and 5,232 (the step's own rate) with 0.5 ms
# (experiments/RESULTS.md, 2026-11-24).
GIL_SWITCH_INTERVAL_S = 0.0005


def shorten_gil_switch_interval(seconds: float = GIL_SWITCH_INTERVAL_S) -> None:
    """Let the GIL change hands every ``seconds`` at most (never lengthens a shorter interval)."""
    if sys.getswitchinterval() > seconds:
        sys.setswitchinterval(seconds)


def host_iterator(
    fn: Any, items: range, workers: int, kind: str = "thread", buffer: int = 2
) -> Iterator:
    """``fn(i)`` for ``i`` in ``items``, in order, computed ahead by ``workers`` workers.

    ``workers=0``: lazily in the consuming thread. ``thread``: a grain thread pool (numpy
    gathers, decode and resize release the GIL; the process's GIL switch interval is shortened
    to :data:`GIL_SWITCH_INTERVAL_S` so the consuming thread is not kept waiting).
    ``process``: grain worker processes (spawned; results through shared memory; a worker that
    dies stops the iterator with an error). Call ``close()`` on the result to stop the
    workers early.
    """
    if workers <= 0:
        return (fn(i) for i in items)
    import grain

    ds = grain.MapDataset.range(items.start, items.stop, items.step).map(fn)
    if kind == "thread":
        shorten_gil_switch_interval()
        read = grain.ReadOptions(num_threads=workers, prefetch_buffer_size=workers + buffer)
        return iter(ds.to_iter_dataset(read))
    if kind == "process":
        from absl import flags

        if not flags.FLAGS.is_parsed():  # grain's process prefetch reads its absl flags
            flags.FLAGS.mark_as_parsed()
        # The resource tracker (started with this list) frees the workers' semaphores and
        # shared memory when the run ends, also after an error exit that skips finalisers
        # (os._exit); its warning about freeing them would only add lines to the one-line error.
        if _QUIET_TRACKER not in sys.warnoptions:
            sys.warnoptions.append(_QUIET_TRACKER)
        from jddp.proc.lifeline import worker_lifeline

        options = grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=buffer)
        local = ds.to_iter_dataset(grain.ReadOptions(num_threads=0))
        # The workers die with this process whatever kills it (no orphan holds memory).
        return iter(local.mp_prefetch(options, worker_init_fn=worker_lifeline))
    raise ValueError(f"data.worker_kind={kind!r}: expected one of {', '.join(WORKER_KINDS)}")
