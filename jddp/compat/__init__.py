"""Where jddp changes its libraries' private internals or the state of the whole Python process:
one door, so an upgrade of JAX, Flax or orbax has one place to check (``tests/test_compat.py``
fails when a target changes shape), and a reader sees each change, why it is made and what
would let it go. Each module imports nothing of jddp but :mod:`jddp.errors`; this package
imports none of them (:mod:`~jddp.compat.collector` runs before JAX is imported).

Private functions of libraries, replaced for the rest of the process (idempotent; where the
target is missing nothing is replaced and the library's own behaviour stays):

* :func:`~jddp.compat.jax_cache.same_cpu_cache_key_on_every_process` replaces
  ``jax._src.cache_key.get``, ``_hash_serialized_compile_options`` and
  ``_hash_accelerator_config``: a CPU program's persistent-cache key leaves out the device ids
  and the process's view of the topology, as a GPU program's does, so the processes of a job
  load what process 0 wrote. Goes when JAX keys CPU programs so (not in its main of 2026-08-08).
* :func:`~jddp.compat.jax_cache.whole_cache_entries` replaces
  ``jax._src.lru_cache.LRUCache.put``: an entry is written beside its name and renamed into
  place, so a process reading it meanwhile never reads a part. Goes when JAX writes entries
  atomically without a size limit (not in its main of 2026-08-08).
* :func:`~jddp.compat.orbax_writes.cut_cpu_slices_on_host` replaces orbax's
  ``ReplicaSlice.data`` (``orbax.checkpoint._src.serialization.replica_slices``): a replica's
  share of an array on a CPU device is cut with NumPy, not by a program compiled per shape.
  Goes when orbax cuts host buffers without compiling (not in its main of 2026-08-19).

Private names read, nothing replaced:

* :func:`~jddp.compat.orbax_writes.wait_for_failed_writes` finds orbax's commit threads by
  their class, ``orbax.checkpoint._src.futures.future._SignalingThread``, to wait for a failed
  save's other writes before its folder is removed. Goes when orbax waits for them itself.
* :func:`~jddp.compat.jax_backend.backend_started` reads
  ``jax._src.xla_bridge.backends_are_initialized``: whether ``jddp.fit`` can still join the
  job a launcher describes (the script built its model before ``jddp.initialize()``, or never
  called it). Goes when JAX says it publicly without starting its backends.
* :mod:`jddp.models.units` (the mechanism itself, so it stays there): flax's
  ``nnx.graphlib.is_graph_node``, a class's ``_pytree__is_pytree``, and a subclass made as
  ``type(cls)(name, bases, namespace, pytree=...)``. Goes when flax offers a public way to
  wrap a module instance's ``__call__``.

The state of the process (no library's internals):

* :mod:`~jddp.compat.collector`: Python's garbage collector collects its youngest generation
  less often: for good in jddp's commands, within the call in ``jddp.fit`` (restored after).
* :mod:`~jddp.compat.excepthook`: ``sys.excepthook`` chained so that a ``JddpError`` nobody
  catches ends a ``jddp.fit`` script as the CLI ends: one line and its exit code (75 for a
  ``Preempted``, 2 for a ``ConfigError``): installed for ``fit``'s call, put back after it
  unless a ``JddpError`` left it (the hook's one use).

Not here: the version pairs refused at start-up (:mod:`jddp.proc.versions`), and the filters on
the ``absl`` and ``asyncio`` loggers and the ``sys.unraisablehook`` that keep orbax's reports of
failures jddp reports itself off the terminal (:mod:`jddp.checkpoint.orbax_quiet`: they rely
on no private name, only on the reports' text).
"""
