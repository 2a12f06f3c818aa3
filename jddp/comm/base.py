"""The protocol every gradient-averaging backend implements, and what they share.

A backend is one swappable piece. The step calls its hooks *inside* the ``shard_map`` step
(:meth:`Comm.average_grads`, :meth:`Comm.average`, :meth:`Comm.device_index`; for a split
state :meth:`Comm.mean_scatter`, :meth:`Comm.gather`, :meth:`Comm.gather_all`,
:meth:`Comm.mean_of_slice_sums`) and hands it its two stages to assemble (:meth:`Comm.compose`);
the loop calls its host-side hooks (eval sums, barriers, config and replica checks), so neither
asks which backend it runs on.

Which collective carries a split state's gradients is the backend's choice, not the layout's:
a reduce-scatter where XLA's is trusted, else an all-reduce of which each device keeps its
slice (:attr:`Comm.reduce_scatter`).
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jddp import weighted
from jddp.distributed import Job
from jddp.mesh import DATA_AXES, DTYPES, REPLICA_AXIS, SHARD_AXIS

PyTree = Any
GradsStage = Callable[[PyTree, PyTree], tuple[PyTree, ...]]
UpdateStage = Callable[..., tuple[PyTree, PyTree]]


def allreduce_bytes(grads: PyTree, wire_dtype: str) -> int:
    """Bytes of one gradient all-reduce payload when sent as ``wire_dtype``."""
    itemsize = jnp.dtype(DTYPES[wire_dtype]).itemsize
    return sum(int(np.prod(x.shape)) * itemsize for x in jax.tree.leaves(grads))


def config_fingerprint(config: dict[str, Any]) -> int:
    """A 63-bit hash of a config dict, equal on every process that was given the same config."""
    text = json.dumps(config, sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def cpu_gloo() -> bool:
    """Whether XLA:CPU runs this process's collectives through gloo (CPUs under
    ``jax.distributed``, even between the devices of one process)."""
    return (
        jax.default_backend() == "cpu"
        and jax.distributed.is_initialized()
        # a flag jax's Config sets as an attribute at run time: not in its type
        and jax.config.jax_cpu_collectives_implementation == "gloo"  # type: ignore[attr-defined]
    )


def rows_of(x: jax.Array, axis: int, n: int) -> jax.Array:
    """``x`` as ``[n, size/n]``: row *i* is device *i*'s slice along ``axis``, flat."""
    s = x.shape
    x = x.reshape(*s[:axis], n, s[axis] // n, *s[axis + 1 :])
    return jnp.moveaxis(x, axis, 0).reshape(n, -1)


def slice_shape(shape: tuple[int, ...], axis: int, n: int) -> tuple[int, ...]:
    """The shape of one device's slice of ``shape`` split ``n`` ways along ``axis``."""
    return (*shape[:axis], shape[axis] // n, *shape[axis + 1 :])


def my_slice(x: jax.Array, axis: int, n: int) -> jax.Array:
    """Inside ``shard_map``: this device's slice of the whole ``x`` split ``n`` ways along
    ``axis`` over the ``shard`` axis."""
    size = x.shape[axis] // n
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(SHARD_AXIS) * size, size, axis)


def fused(reduce: Callable[[jax.Array], jax.Array], tree: PyTree) -> PyTree:
    """``reduce`` applied once per dtype to the concatenation of ``tree``'s floating leaves
    (flattened), the results split back into the leaves' shapes; other leaves go through
    ``reduce`` one by one. Elementwise reductions (sums, means over devices) give the same
    values as leaf by leaf, with one collective instead of one per leaf."""
    leaves, treedef = jax.tree.flatten(tree)
    by_dtype: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            by_dtype.setdefault(leaf.dtype, []).append(i)
    out = list(leaves)
    for i, leaf in enumerate(leaves):
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            out[i] = reduce(leaf)
    for idx in by_dtype.values():
        flat = reduce(jnp.concatenate([jnp.ravel(leaves[i]) for i in idx]))
        offsets = np.cumsum([leaves[i].size for i in idx])[:-1]
        for i, part in zip(idx, jnp.split(flat, offsets), strict=True):
            out[i] = part.reshape(leaves[i].shape)
    return jax.tree.unflatten(treedef, out)


class Comm(ABC):
    """A gradient-averaging backend for the processes of ``job`` (default: as the runtime sees
    them now, e.g. after :func:`jddp.distributed.initialize`).

    ``grad_dtype`` is the wire dtype of the gradient all-reduce (``bfloat16`` halves the bytes).
    """

    name: str

    def __init__(
        self, grad_dtype: str = "float32", job: Job | None = None, fuse: bool | None = None
    ):
        self.grad_dtype = grad_dtype
        self.job = job or self.current_job()
        self._fuse = fuse

    @property
    def fuse(self) -> bool:
        """Whether :meth:`average` packs a tree's floating leaves into one collective per
        dtype: default on CPUs, where each collective costs a fixed ~1 ms in-process and
        several ms through gloo whatever its size; GPUs' XLA combines all-reduces itself."""
        if self._fuse is None:
            return jax.default_backend() == "cpu"
        return self._fuse

    @staticmethod
    @abstractmethod
    def current_job() -> Job:
        """The job as this backend's runtime sees it now (when none is given)."""

    @property
    def process_index(self) -> int:
        """This process's rank in the job."""
        return self.job.process_index

    @property
    def process_count(self) -> int:
        """Processes in the job."""
        return self.job.process_count

    def num_devices(self, mesh: Mesh) -> int:
        """The devices of a step over all processes: ``mesh``'s devices of this process times
        the processes (under MPI each process's mesh holds only its own devices)."""
        return len(mesh.local_devices) * self.process_count

    @property
    def is_writer(self) -> bool:
        """Whether this process prints and writes the run's outputs (process 0 alone)."""
        return self.job.is_writer

    # -- inside the step --------------------------------------------------------------------
    def average(self, tree: PyTree) -> PyTree:
        """``pmean`` over the ``data`` mesh axis (one collective per dtype where fused)."""
        return self._mean_over(tree, DATA_AXES)

    def _mean_over(self, tree: PyTree, axes: Any) -> PyTree:
        if not self.fuse:
            return jax.lax.pmean(tree, axes)
        return fused(lambda flat: jax.lax.pmean(flat, axes), tree)

    def reduce_terms(self, terms: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """A train step's metric terms over the ``data`` mesh axis, each kind by its own
        collective (:mod:`jddp.weighted`): means averaged (:meth:`average`), sums added,
        maxima and minima kept."""
        groups = weighted.split(terms)
        for kind, group in groups.items():
            reduce = weighted.COLLECTIVE.get(kind)
            groups[kind] = self.average(group) if reduce is None else reduce(group, DATA_AXES)
        return weighted.merge(groups)

    # -- inside the step, for a split state (dist.shard optimizer, full) -----------------------
    @property
    def reduce_scatter(self) -> bool:
        """Whether the step reduce-scatters a split state's gradients (XLA's ``psum_scatter``,
        and the transpose of a per-array gather): not through gloo, whose reduce-scatter in
        jaxlib 0.10 returns wrong values on rank 0 now and then once a device's share reaches a
        few MiB (jax issue 40830; measured: off by up to 8.1 in 1 of 20 calls of 2 x 6M floats,
        while ``psum`` never was) and which pays a few ms per collective whatever its size.
        There an all-reduce carries them, each device keeping its slice: the same values as
        the replicated step's, bitwise."""
        return not cpu_gloo()

    def mean_scatter(self, grads: PyTree, axes: list[int | None]) -> PyTree:
        """Per-device gradients (a list) -> their global mean, each device keeping its slice
        along ``axes[i]`` of the split ones (over the ``shard`` axis) and the whole of the
        others (``None``). With :attr:`reduce_scatter`: one ``psum_scatter`` per dtype within
        the group over the slices packed as ``[G, size/G]`` rows, sent in ``grad_dtype`` like
        the all-reduce, then the groups' results averaged; without: :meth:`average_grads`
        (the replicated step's all-reduce, bitwise), then each device's slice."""
        n = jax.lax.psum(1, SHARD_AXIS)
        if not self.reduce_scatter:
            means = self.average_grads(grads)
            return [m if k is None else my_slice(m, k, n) for m, k in zip(means, axes, strict=True)]
        out = list(grads)
        whole = [i for i, k in enumerate(axes) if k is None]
        for i, mean in zip(whole, self.average_grads([grads[i] for i in whole]), strict=True):
            out[i] = mean
        split = {i: k for i, k in enumerate(axes) if k is not None}  # index -> its split axis
        by_dtype: dict[Any, list[int]] = {}
        for i in split:
            by_dtype.setdefault(jnp.dtype(grads[i].dtype), []).append(i)
        wire = DTYPES[self.grad_dtype]
        for dtype, idx in by_dtype.items():
            send = dtype if self.grad_dtype == "float32" else wire
            rows = [rows_of(grads[i].astype(send), split[i], n) for i in idx]
            mine = jax.lax.psum_scatter(
                jnp.concatenate(rows, axis=1), SHARD_AXIS, scatter_dimension=0, tiled=False
            )
            mine = self._mean_over_replicas(mine / n)  # as pmean divides its sum
            offsets = np.cumsum([r.shape[1] for r in rows])[:-1]
            for i, part in zip(idx, jnp.split(mine, offsets), strict=True):
                out[i] = part.reshape(slice_shape(grads[i].shape, split[i], n)).astype(dtype)
        return out

    def mean_of_slice_sums(self, sums: list[jax.Array]) -> list[jax.Array]:
        """The gradients of a device's slices summed over its group (what a gather's transpose
        gives) -> their mean over every device: divided by the group's size as ``pmean``
        divides, then averaged over the groups."""
        n = jax.lax.psum(1, SHARD_AXIS)
        return self._mean_over_replicas([g / n for g in sums])

    def _mean_over_replicas(self, tree: PyTree) -> PyTree:
        """A group's slices averaged over the groups; with one group nothing (a split array's
        spec then names the replica axis too: :mod:`jddp.shard.specs`)."""
        if jax.lax.axis_size(REPLICA_AXIS) == 1:
            return tree
        return self._mean_over(tree, REPLICA_AXIS)

    def gather(self, x: jax.Array, axis: int) -> jax.Array:
        """This device's slice ``x`` of an array split along ``axis`` over the group -> the
        whole array; its transpose (the gradient's way back) gives each device the *sum* over
        the group of its slice's gradient, a reduce-scatter. A plain primitive, not a
        ``custom_vjp``: ``jax.checkpoint`` recomputes it in the backward pass (it keeps a
        ``custom_vjp``'s outputs from the forward pass)."""
        return jax.lax.all_gather(x, SHARD_AXIS, axis=axis, tiled=True)

    def gather_all(self, slices: list[jax.Array], axes: list[int]) -> list[jax.Array]:
        """The whole arrays of several split ones, with the transpose :meth:`gather` has:
        one gather per array with :attr:`reduce_scatter`; else one ``all_gather`` per dtype of
        the slices packed into one buffer, whose backward all-reduces the whole gradients as
        one buffer per dtype (as the replicated step sends them, :func:`fused`) and keeps each
        device's slices (a ``custom_vjp``: a ``psum``-made gather differentiates into a
        ``psum`` that XLA:CPU splits back into one all-reduce per array: a 4-layer GPT's step
        made 55 gloo calls, 0.2 s of its 0.5 s)."""
        if self.reduce_scatter:
            return [self.gather(x, k) for x, k in zip(slices, axes, strict=True)]
        return _packed_gather(tuple(axes))(list(slices))

    def gather_whole(self, slices: list[jax.Array], axes: list[int | None]) -> list[jax.Array]:
        """Forward only (no gradient flows back): this device's slices along ``axes[i]`` of
        arrays split over the group -> the whole arrays (``None``: whole already). Where
        :attr:`fuse`, one all-gather per dtype of the slices packed into one buffer (gloo pays
        a few ms per collective, and XLA:CPU gathers each array apart); else one per array."""
        split = {i: k for i, k in enumerate(axes) if k is not None}  # index -> its split axis
        out = list(slices)
        if not self.fuse:
            for i, k in split.items():
                out[i] = self.gather(slices[i], k)
            return out
        gathered = _packed_gather(tuple(split.values()))([slices[i] for i in split])
        for i, x in zip(split, gathered, strict=True):
            out[i] = x
        return out

    @abstractmethod
    def device_index(self) -> jax.Array:
        """This device's index among all devices of the job (inside the step)."""

    @abstractmethod
    def average_grads(self, grads: PyTree) -> PyTree:
        """The gradient mean over the mesh (and what of the wire dtype applies there)."""

    @abstractmethod
    def compose(
        self,
        grads_stage: GradsStage,
        update_stage: UpdateStage,
        compiler_options: dict[str, str] | None = None,
    ) -> Callable:
        """The step ``(state, batch) -> (state, metrics)`` assembled from its two stages;
        ``compiler_options``: XLA options the layout's step needs (:mod:`jddp.layout`)."""

    # -- host side --------------------------------------------------------------------------
    @property
    @abstractmethod
    def writes_checkpoints(self) -> bool:
        """Whether this process calls orbax's save."""

    @abstractmethod
    def sum_across_processes(self, values: dict[str, float]) -> dict[str, float]:
        """Host totals over every process: added, but eval maxima and minima (the terms
        ``name~max``, ``name~min`` of :mod:`jddp.weighted`) kept."""

    @abstractmethod
    def allgather_int(self, value: int) -> list[int]:
        """``value`` from every process, in rank order."""

    @abstractmethod
    def broadcast_state(self, state: PyTree, mesh: Mesh) -> PyTree:
        """Make every process start from the same state."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait for every process."""

    @abstractmethod
    def meet(self, mesh: Mesh) -> None:
        """Make the connections the step's collectives over ``mesh`` use now, while every
        process is at the same point (see :meth:`jddp.comm.xla.XlaComm.meet`)."""

    def agree(self, ok: bool) -> bool:
        """True on every process iff ``ok`` on every process."""
        return all(v == 1 for v in self.allgather_int(int(ok)))


def _packed_gather(axes: tuple[int, ...]) -> Callable:
    """:meth:`Comm.gather_all` without reduce-scatters, for slices split along ``axes``."""

    def gather_all(slices: list[jax.Array]) -> list[jax.Array]:
        n = jax.lax.psum(1, SHARD_AXIS)
        out = list(slices)  # each replaced by its whole array: every slice is in one dtype group
        by_dtype: dict[Any, list[int]] = {}
        for i, x in enumerate(slices):
            by_dtype.setdefault(jnp.dtype(x.dtype), []).append(i)
        for idx in by_dtype.values():
            mine = jnp.concatenate([jnp.ravel(jnp.moveaxis(slices[i], axes[i], 0)) for i in idx])
            rows = jax.lax.all_gather(mine, SHARD_AXIS)  # [n, mine.size], device order
            offset = 0
            for i in idx:
                x, k = slices[i], axes[i]
                local = jnp.moveaxis(x, k, 0).shape  # the slice with its split axis first
                part = rows[:, offset : offset + x.size].reshape(n, *local)
                whole = part.reshape(n * local[0], *local[1:])  # row blocks in device order
                out[i] = jnp.moveaxis(whole, 0, k)
                offset += x.size
        return out

    @jax.custom_vjp
    def packed(slices: list[jax.Array]) -> list[jax.Array]:
        return gather_all(slices)

    def forward(slices: list[jax.Array]) -> tuple[list[jax.Array], None]:
        return gather_all(slices), None

    def backward(_: None, whole_grads: list[jax.Array]) -> tuple[list[jax.Array]]:
        n = jax.lax.psum(1, SHARD_AXIS)
        sums = fused(lambda flat: jax.lax.psum(flat, SHARD_AXIS), list(whole_grads))
        return ([my_slice(g, k, n) for g, k in zip(sums, axes, strict=True)],)

    packed.defvjp(forward, backward)
    return packed
