"""JAX's persistent compilation cache as jddp's processes share it: the same key for a CPU
program on every process of a job (:func:`same_cpu_cache_key_on_every_process`), and each entry
written whole or not at all, for the processes and jobs reading the folder meanwhile
(:func:`whole_cache_entries`). Both replace private functions of ``jax._src``, for the rest of
the process; both are installed by :func:`jddp.proc.xla.enable_compilation_cache` (every jddp
command, every ``jddp.fit``) and are idempotent. ``tests/test_compat.py`` fails when what they
replace changes shape.
"""

from __future__ import annotations

import os
import threading


def same_cpu_cache_key_on_every_process() -> None:
    """Give CPU programs the same persistent-cache key on every process of a job.

    JAX writes the cache from process 0 only and expects the others to read what it wrote; on
    GPUs the key leaves out which devices a program runs on, but on CPUs (jax 0.10.2 and
    0.11) it hashes the device ids and each process's own view of the topology, so no process
    but 0 ever found an entry: each compiled every program again on every start (~30 s of
    eager model-init ops and ~30 s of the step for the tests' tiny ResNet-18 on the 2-core
    VM, the other processes waiting at the first collective). Here CPU keys leave the device
    assignment out as GPU keys do (JAX loads an entry onto the devices asked for) and hash
    the devices' kinds; elsewhere, and where JAX lacks these functions, nothing changes.

    Replaces ``jax._src.cache_key.get``, ``_hash_serialized_compile_options`` and
    ``_hash_accelerator_config`` (calls ``_hash_devices``). Goes when JAX keys CPU programs
    without their device ids and topology, as it keys GPU programs: not yet in JAX's main of
    2026-08-08 (cec06d1: ``strip_device_assignment=(backend.platform == "gpu")``)."""
    try:
        from jax._src import cache_key
    except ImportError:
        return
    original = (
        getattr(cache_key, name, None)
        for name in ("get", "_hash_serialized_compile_options", "_hash_accelerator_config",
                     "_hash_devices")
    )  # fmt: skip
    get, hash_options, hash_config, hash_kinds = original
    if None in (get, hash_options, hash_config, hash_kinds) or getattr(get, "jddp", False):
        return
    on_cpu = threading.local()  # whether the key being made is a CPU program's

    def key(module, devices, compile_options, backend, *args, **kwargs) -> str:
        on_cpu.now = backend.platform == "cpu"
        try:
            return get(module, devices, compile_options, backend, *args, **kwargs)
        finally:
            on_cpu.now = False

    def options(hash_obj, compile_options, strip_device_assignment=False) -> None:
        strip = strip_device_assignment or getattr(on_cpu, "now", False)
        return hash_options(hash_obj, compile_options, strip_device_assignment=strip)

    def accelerator_config(hash_obj, devices) -> None:
        return (hash_kinds if getattr(on_cpu, "now", False) else hash_config)(hash_obj, devices)

    key.jddp = True  # type: ignore[attr-defined]
    # JAX's own functions stay reachable (inspect.unwrap): tests/test_compat.py pins their shape
    key.__wrapped__, options.__wrapped__ = get, hash_options  # type: ignore[attr-defined]
    accelerator_config.__wrapped__ = hash_config  # type: ignore[attr-defined]
    cache_key.get = key
    cache_key._hash_serialized_compile_options = options
    cache_key._hash_accelerator_config = accelerator_config


def whole_cache_entries() -> None:
    """Make JAX's persistent cache write each entry whole or not at all.

    Without a size limit (JAX's default) JAX writes an entry in place, and a process reading it
    meanwhile -- another job sharing the folder (``~/.cache/jddp/jax`` is every run's default),
    a rank a few milliseconds behind the one writing -- reads the part written so far: JAX warns
    on stderr that the entry cannot be read and compiles the program again. Here the entry is
    written beside its final name and renamed into place (atomic on a local file system). With
    a size limit JAX locks the folder itself; on a remote file system and where JAX lacks
    ``LRUCache`` nothing changes.

    Replaces ``jax._src.lru_cache.LRUCache.put`` (reads its ``path``, ``eviction_enabled`` and
    the module's ``_CACHE_SUFFIX``). Goes when JAX writes an entry without a size limit
    atomically (to a temporary name, then renamed): not yet in JAX's main of 2026-08-08
    (cec06d1: ``cache_path.write_bytes(value)``)."""
    try:
        from jax._src import lru_cache
    except ImportError:
        return
    put = getattr(getattr(lru_cache, "LRUCache", None), "put", None)
    suffix = getattr(lru_cache, "_CACHE_SUFFIX", None)
    if put is None or suffix is None or getattr(put, "jddp", False):
        return

    def whole_put(self, key: str, value: bytes) -> None:
        folder = os.fspath(getattr(self, "path", "://"))
        if getattr(self, "eviction_enabled", True) or not key or "://" in folder:
            return put(self, key, value)
        final = os.path.join(folder, f"{key}{suffix}")
        if os.path.exists(final):
            return None  # as JAX: the first entry written stays
        partial = os.path.join(folder, f".{key}.{os.getpid()}.{threading.get_ident()}.partial")
        try:
            with open(partial, "wb") as f:
                f.write(value)
            os.replace(partial, final)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        return None

    whole_put.jddp = True  # type: ignore[attr-defined]
    whole_put.__wrapped__ = put  # type: ignore[attr-defined] - JAX's, for inspect.unwrap
    lru_cache.LRUCache.put = whole_put
