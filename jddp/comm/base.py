"""The protocol every gradient-averaging backend implements, and what they share.

A backend is one swappable piece. The step calls its hooks *inside* the ``shard_map`` step
(:meth:`Comm.average_grads`, :meth:`Comm.average`, :meth:`Comm.device_index`) and hands it its
two stages to assemble (:meth:`Comm.compose`); the loop calls its host-side hooks (eval sums,
barriers, config and replica checks), so neither asks which backend it runs on.
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
from jddp.mesh import DATA_AXIS, DTYPES

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
        if not self.fuse:
            return jax.lax.pmean(tree, DATA_AXIS)
        return fused(lambda flat: jax.lax.pmean(flat, DATA_AXIS), tree)

    def reduce_terms(self, terms: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """A train step's metric terms over the ``data`` mesh axis, each kind by its own
        collective (:mod:`jddp.weighted`): means averaged (:meth:`average`), sums added,
        maxima and minima kept."""
        groups = weighted.split(terms)
        for kind, group in groups.items():
            reduce = weighted.COLLECTIVE.get(kind)
            groups[kind] = self.average(group) if reduce is None else reduce(group, DATA_AXIS)
        return weighted.merge(groups)

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
