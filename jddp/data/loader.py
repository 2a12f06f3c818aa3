"""Global batches: which examples form batch *k*, which slice this process reads, prefetch.

The composition of global batch *k* depends only on ``(seed, k)``: epoch ``e = k // steps_per
_epoch`` shuffles the examples with a permutation drawn from ``(seed, e)`` and batch *k* is the
next ``global_batch_size`` of them (the incomplete tail of an epoch is dropped). The number of
devices or processes only decides who reads which rows: process *p* reads the contiguous slice
that its devices hold in the mesh, and the global array is assembled from the local slices.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh

from jddp.data.source import Source
from jddp.mesh import batch_sharded

Batch = dict[str, jax.Array]


def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
    """The example order of ``epoch``: a permutation that depends only on (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


@dataclass(frozen=True)
class BatchLayout:
    """Which rows of every global batch this process reads, and how they are placed.

    ``rows``: this process's contiguous block of the global batch. ``array_rows``: the leading
    size of the arrays built on the mesh — the whole global batch when the mesh spans every
    process (``jax.distributed``), only this process's block when the mesh is local (MPI).
    """

    rows: slice
    array_rows: int


def batch_layout(
    mesh: Mesh, global_batch_size: int, process_index: int = 0, process_count: int = 1
) -> BatchLayout:
    """The :class:`BatchLayout` of this process; raises ``ValueError`` if the batch won't split.

    ``process_index``/``process_count`` count the job's processes, which differ from JAX's when
    processes share no JAX runtime (the MPI backend: then the mesh holds local devices only).
    """
    devices = list(mesh.devices.flat)
    spans_processes = len({d.process_index for d in devices}) > 1
    local = len(mesh.local_devices)
    total = len(devices) if spans_processes else local * process_count
    if global_batch_size % total:
        raise ValueError(
            f"data.global_batch_size={global_batch_size} is not divisible by the {total} "
            f"devices ({total // local} processes x {local} local devices)"
        )
    per_device = global_batch_size // total
    if spans_processes:
        mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
        if mine != list(range(mine[0], mine[-1] + 1)):
            raise ValueError("this process's devices are not contiguous in the mesh")
        return BatchLayout(
            slice(mine[0] * per_device, (mine[-1] + 1) * per_device), global_batch_size
        )
    per_process = per_device * local
    start = process_index * per_process
    return BatchLayout(slice(start, start + per_process), per_process)


def place_batch(local: dict[str, np.ndarray], mesh: Mesh, layout: BatchLayout) -> Batch:
    """Arrays sharded over ``data`` from each process's rows (see :class:`BatchLayout`)."""
    sharding = batch_sharded(mesh)
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (layout.array_rows, *v.shape[1:]))
        for k, v in local.items()
    }


class TrainBatches:
    """Global train batches of ``source`` for steps ``k = 0, 1, ...``, placed on ``mesh``."""

    def __init__(
        self,
        source: Source,
        global_batch_size: int,
        seed: int,
        mesh: Mesh,
        layout: BatchLayout | None = None,
    ):
        self.layout = layout or batch_layout(mesh, global_batch_size)
        self.source = source
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.mesh = mesh
        self.steps_per_epoch = len(source) // global_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"data.global_batch_size={global_batch_size} is larger than the "
                f"{len(source)} train examples of {source!r}"
            )
        self._perm_cache: tuple[int, np.ndarray] | None = None

    def global_indices(self, step: int) -> np.ndarray:
        """Example indices of global batch ``step`` (the same on every process and topology)."""
        epoch, offset = divmod(step, self.steps_per_epoch)
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            self._perm_cache = (epoch, epoch_permutation(self.seed, epoch, len(self.source)))
        start = offset * self.global_batch_size
        return self._perm_cache[1][start : start + self.global_batch_size]

    def host_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch ``step`` as numpy arrays."""
        images, labels = self.source.get_batch(self.global_indices(step)[self.layout.rows])
        return {"images": images, "labels": labels}

    def place(self, local: dict[str, np.ndarray]) -> Batch:
        """This process's rows as arrays sharded over ``data``."""
        return place_batch(local, self.mesh, self.layout)

    def iterate(self, start_step: int, end_step: int, prefetch: int = 2) -> Iterator[Batch]:
        """Batches for steps ``start_step .. end_step-1``, loaded ``prefetch`` ahead."""
        steps = range(start_step, end_step)
        if prefetch <= 0:
            return (self.place(self.host_batch(k)) for k in steps)
        return prefetch_iterator(
            (lambda k=k: self.place(self.host_batch(k)) for k in steps), prefetch
        )


def eval_batches(
    source: Source, global_batch_size: int, mesh: Mesh, layout: BatchLayout | None = None
) -> Iterator[Batch]:
    """Every example of ``source`` exactly once, in order; the last batch is padded and masked.

    Each batch has ``images``, ``labels`` and ``mask`` (1.0 for real rows, 0.0 for padding).
    """
    layout = layout or batch_layout(mesh, global_batch_size)
    rows = layout.rows
    n = len(source)
    for start in range(0, n, global_batch_size):
        idx = np.arange(start, start + global_batch_size)
        mask = (idx < n).astype(np.float32)
        idx = np.where(idx < n, idx, 0)[rows]
        images, labels = source.get_batch(idx)
        local = {"images": images, "labels": labels, "mask": mask[rows]}
        yield place_batch(local, mesh, layout)


_DONE = object()


def prefetch_iterator(thunks: Iterator, depth: int) -> Iterator:
    """Run ``thunk()`` for each thunk in a background thread, ``depth`` results ahead.

    Host loading and the host-to-device copy of the next batches overlap the running step.
    An exception in the thread is re-raised in the consumer.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work() -> None:
        try:
            for thunk in thunks:
                if stop.is_set():
                    return
                q.put(thunk())
            q.put(_DONE)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put(e)

    thread = threading.Thread(target=work, daemon=True, name="jddp-prefetch")
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.05)
