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
from importlib import metadata
from pathlib import Path

from jddp.compat.jax_cache import same_cpu_cache_key_on_every_process, whole_cache_entries
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

    same_cpu_cache_key_on_every_process()
    whole_cache_entries()
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
