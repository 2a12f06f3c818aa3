"""Global batches on the mesh: which rows this process reads, placement ahead of the step.

The composition of global batch *k* depends only on ``(seed, k)`` and its augmentation only on
``(seed, epoch, example)`` (:mod:`jddp.data.pipeline`). The number of devices or processes only
decides who reads which rows: process *p* reads the contiguous slice that its devices hold in
the mesh, and the global array is assembled from the local slices.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jddp.data.pipeline import (  # noqa: F401 - epoch_permutation: public here too
    HostBatches,
    epoch_permutation,
    eval_batch,
    host_iterator,
)
from jddp.data.source import Source
from jddp.mesh import batch_sharded
from jddp.proc.cores import cores_per_process

Batch = dict[str, Any]


@dataclass(frozen=True)
class ProcessRows:
    """Which rows of every global batch this process reads, and how they are placed.

    ``rows``: this process's contiguous block of the global batch. ``array_rows``: the leading
    size of the arrays built on the mesh — the whole global batch when the mesh spans every
    process (``jax.distributed``), only this process's block when the mesh is local (MPI).
    """

    rows: slice
    array_rows: int


def process_rows_of(
    mesh: Mesh, global_batch_size: int, process_index: int = 0, process_count: int = 1
) -> ProcessRows:
    """The :class:`ProcessRows` of this process; raises ``ValueError`` if the batch won't split.

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
        return ProcessRows(
            slice(mine[0] * per_device, (mine[-1] + 1) * per_device), global_batch_size
        )
    per_process = per_device * local
    start = process_index * per_process
    return ProcessRows(slice(start, start + per_process), per_process)


def place_batch(local: Any, mesh: Mesh, process_rows: ProcessRows) -> Any:
    """Every leaf of ``local`` (a pytree of this process's rows, see :class:`ProcessRows`) as an
    array sharded over ``data`` along its leading axis."""
    sharding = batch_sharded(mesh)
    return jax.tree.map(
        lambda v: jax.make_array_from_process_local_data(
            sharding, v, (process_rows.array_rows, *v.shape[1:])
        ),
        local,
    )


@dataclass(frozen=True)
class PipelineOptions:
    """How the host builds batches (``data.augment``, ``data.workers``, ``data.worker_kind``).

    ``augment``: ``none|cifar|imagenet`` (:mod:`jddp.data.augment`; an eval pass takes its eval
    transform, e.g. imagenet's centre crop). ``workers``: host workers building batches ahead
    (0: the placement thread builds them; None: the cores available, see
    :func:`~jddp.proc.cores.cores_per_process`); ``worker_kind``: ``thread|process``.
    """

    augment: str = "none"
    workers: int | None = 0
    worker_kind: str = "thread"


class TrainBatches:
    """Global train batches of ``source`` for steps ``k = 0, 1, ...``, placed on ``mesh``,
    built on the host as ``pipeline`` says (:class:`PipelineOptions`). Batch *k* is the same
    pixels whatever the workers, processes or devices.
    """

    def __init__(
        self,
        source: Source,
        global_batch_size: int,
        seed: int,
        mesh: Mesh,
        process_rows: ProcessRows | None = None,
        *,
        pipeline: PipelineOptions = PipelineOptions(),
    ):
        workers = pipeline.workers
        self.process_rows = process_rows or process_rows_of(mesh, global_batch_size)
        self.source = source
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.mesh = mesh
        if workers is not None and workers < 0:
            raise ValueError(f"data.workers={workers} must be >= 0 (null: one per core)")
        self.workers = cores_per_process() if workers is None else workers
        self.worker_kind = pipeline.worker_kind
        if len(source) // global_batch_size == 0:
            raise ValueError(
                f"data.global_batch_size={global_batch_size} is larger than the "
                f"{len(source)} train examples of {source!r}"
            )
        self.host = HostBatches(
            source, global_batch_size, seed, self.process_rows.rows, pipeline.augment
        )
        self.steps_per_epoch = self.host.steps_per_epoch

    def global_indices(self, step: int) -> np.ndarray:
        """Example indices of global batch ``step`` (the same on every process and topology)."""
        return self.host.global_indices(step)

    def host_batch(self, step: int) -> Any:
        """This process's rows of global batch ``step`` as numpy arrays (the task's pytree)."""
        return self.host(step)

    def place(self, local: Any) -> Batch:
        """This process's rows as the step's batch, ``{"data": ...}``, sharded over ``data``."""
        return place_batch({"data": local}, self.mesh, self.process_rows)

    def iterate(self, start_step: int, end_step: int, prefetch: int = 2) -> Iterator[Batch]:
        """Batches for steps ``start_step .. end_step-1``.

        The host workers build up to ``workers + prefetch`` batches ahead; a background
        thread places them on the devices (asynchronously, never waiting for the running
        step), keeping ``prefetch`` placed batches in flight.
        """
        host = host_iterator(
            self.host, range(start_step, end_step), self.workers, self.worker_kind, prefetch
        )
        return _placed(host, self.place, prefetch)


def _placed(host: Iterator, place, prefetch: int) -> Iterator[Batch]:
    """``place(b)`` for the host batches, ``prefetch`` ahead; stops the host workers at the end."""
    try:
        if prefetch <= 0:
            yield from (place(b) for b in host)
        else:
            yield from prefetch_iterator((functools.partial(place, b) for b in host), prefetch)
    finally:
        close = getattr(host, "close", None)
        if close is not None:
            close()


def eval_batches(
    source: Source,
    global_batch_size: int,
    mesh: Mesh,
    process_rows: ProcessRows | None = None,
    *,
    pipeline: PipelineOptions = PipelineOptions(),
) -> Iterator[Batch]:
    """Every example of ``source`` exactly once, in order; the last batch is padded and masked.

    Each batch has ``data`` (the task's pytree: ``{"images", "labels"}`` of an image source) and
    ``mask`` (1.0 for real rows, 0.0 for padding, which repeats example 0).
    ``pipeline.augment="imagenet"`` evaluates the centre crop
    (:func:`~jddp.data.pipeline.eval_rows`).
    """
    process_rows = process_rows or process_rows_of(mesh, global_batch_size)
    starts = range(0, len(source), global_batch_size)
    workers = cores_per_process() if pipeline.workers is None else pipeline.workers
    fn = functools.partial(
        _eval_rows, source, global_batch_size, process_rows.rows, pipeline.augment
    )
    host = host_iterator(fn, starts, workers, pipeline.worker_kind)
    return _placed(host, functools.partial(place_batch, mesh=mesh, process_rows=process_rows), 1)


def _eval_rows(
    source: Source, global_batch_size: int, rows: slice, augment: str, start: int
) -> dict[str, Any]:
    n = len(source)
    idx = np.arange(start, start + global_batch_size)
    mask = (idx < n).astype(np.float32)
    data = eval_batch(source, np.where(idx < n, idx, 0)[rows], augment)
    return {"data": data, "mask": mask[rows]}


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
