"""XLA settings jddp chooses for you: measured defaults, each one overridable.

* A persistent compilation cache (``train.compilation_cache_dir``): a restarted or resumed run
  loads its compiled step instead of compiling it again (measured in ``experiments/RESULTS.md``).
* On CPU, convolutions off YNNPACK (``--xla_cpu_experimental_ynn_fusion_type=
  -individual_convolution``): the ResNet-18 step ran 1.4x faster with it on the 2-core VM. Only
  set where the installed XLA knows the flag (an XLA given an unknown flag aborts at start-up),
  never when ``XLA_FLAGS`` already sets it, and not at all with ``JDDP_XLA_DEFAULTS=0``.
* On CPU, each process computes on the cores it owns (``dist.cpu_threads``, default: its CPU
  affinity divided among the machine's processes): XLA:CPU sizes its intra-op (Eigen) thread
  pool from the process's CPU affinity and has no flag for the size (jaxlib 0.10.2: only
  ``--xla_cpu_multi_thread_eigen``), so jddp narrows the affinity to this process's share of
  the cores before XLA starts; two processes on two cores then run one compute thread each
  instead of two each.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import threading
from importlib import metadata
from pathlib import Path

from jddp.proc.cores import runs_on_cpu

YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
CPU_CONV_OFF_YNNPACK = f"{YNN_FLAG}=-individual_convolution"
KNOWN_JAXLIB_SERIES = ("0.10.",)  # releases checked to know the flag


def _xla_knows(flag: str) -> bool:
    """Whether the installed jaxlib's XLA defines ``flag`` (its name is in the library)."""
    try:
        version = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return False
    if version.startswith(KNOWN_JAXLIB_SERIES):
        return True
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return False
    needle = flag.lstrip("-").encode()
    for lib in Path(spec.submodule_search_locations[0]).glob("*.so"):
        if lib.stat().st_size < 1 << 20:
            continue
        with lib.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(needle) >= 0:
                return True
    return False


def apply_cpu_flags(environ: dict[str, str] | None = None) -> list[str]:
    """Add jddp's XLA:CPU defaults to ``XLA_FLAGS`` (before JAX starts its backends); returns
    the flags added."""
    env = os.environ if environ is None else environ
    flags = env.get("XLA_FLAGS", "")
    if env.get("JDDP_XLA_DEFAULTS", "1") == "0" or YNN_FLAG in flags or not runs_on_cpu(env):
        return []
    if not _xla_knows(YNN_FLAG):
        return []
    env["XLA_FLAGS"] = f"{flags} {CPU_CONV_OFF_YNNPACK}".strip()
    return [CPU_CONV_OFF_YNNPACK]


def enable_compilation_cache(directory: str | None) -> Path | None:
    """Use ``directory`` (``~`` expanded) as JAX's persistent compilation cache, unless it is
    None or the user configured one already; returns the folder in use. Programs that took
    0.5 s or more to compile are kept (JAX's own ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``
    and ``..._MIN_ENTRY_SIZE_BYTES``, where set, win)."""
    import jax  # lazily: the CLIs import this module before JAX may start (apply_cpu_flags)

    _same_cpu_cache_key_on_every_process()
    _whole_cache_entries()
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    if directory is None:
        return None
    path = Path(directory).expanduser()
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Cache every program that took a while to compile (the default skips those under 1 s),
    # unless JAX's own variable says otherwise (``=0`` keeps every program: a restart then
    # loads the model's small initialisation programs too; the tests set it, whose cold suite
    # compiled ~1,300 such programs ~3,700 times: experiments/RESULTS.md section 12).
    for option, value in (("jax_persistent_cache_min_compile_time_secs", 0.5),
                          ("jax_persistent_cache_min_entry_size_bytes", 0)):  # fmt: skip
        if option.upper() not in os.environ:
            jax.config.update(option, value)
    return path


def _same_cpu_cache_key_on_every_process() -> None:
    """Give CPU programs the same persistent-cache key on every process of a job.

    JAX writes the cache from process 0 only and expects the others to read what it wrote; on
    GPUs the key leaves out which devices a program runs on, but on CPUs (jax 0.10.2 and
    0.11) it hashes the device ids and each process's own view of the topology, so no process
    but 0 ever found an entry: each compiled every program again on every start (~30 s of
    eager model-init ops and ~30 s of the step for the tests' tiny ResNet-18 on the 2-core
    VM, the other processes waiting at the first collective). Here CPU keys leave the device
    assignment out as GPU keys do (JAX loads an entry onto the devices asked for) and hash
    the devices' kinds; elsewhere, and where JAX lacks these functions, nothing changes."""
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
    cache_key.get = key
    cache_key._hash_serialized_compile_options = options
    cache_key._hash_accelerator_config = accelerator_config


def _whole_cache_entries() -> None:
    """Make JAX's persistent cache write each entry whole or not at all.

    Without a size limit (JAX's default) JAX writes an entry in place, and a process reading it
    meanwhile -- another job sharing the folder (``~/.cache/jddp/jax`` is every run's default),
    a rank a few milliseconds behind the one writing -- reads the part written so far: JAX warns
    on stderr that the entry cannot be read and compiles the program again. Here the entry is
    written beside its final name and renamed into place (atomic on a local file system). With
    a size limit JAX locks the folder itself; on a remote file system and where JAX lacks
    ``LRUCache`` nothing changes."""
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
    lru_cache.LRUCache.put = whole_put
