"""Whether JAX's backends have started in this process, read from a private name of JAX
(``jax._src.xla_bridge.backends_are_initialized``, what ``jax.distributed.initialize`` itself
checks before it refuses). JAX has no public way to ask without starting them
(``jax.devices()`` starts them). Goes when JAX offers one.
"""

from __future__ import annotations


def backend_started() -> bool:
    """Whether JAX's backends (its XLA clients) exist: after the first array, device query or
    computation, when ``jax.distributed.initialize`` can no longer join a job. True where JAX
    cannot say (the name gone): then a caller refuses rather than lets JAX fail half-way."""
    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized
    except (ImportError, AttributeError):
        return True
    return bool(started())


def running_host_callback() -> str | None:
    """The function a host callback of a running step calls (``jax.debug.callback``,
    ``jax.pure_callback``, ``io_callback``), as ``name (file:line)``, the line it is at now: the
    outermost frame below JAX's, on any thread; None when no thread runs one. Read from the
    threads' frames: a thread in JAX's ``jax/_src/callback.py`` (a private file) is running a
    callback. A stalled step whose own callback still runs is this process's stall, not a
    peer's."""
    import os
    import sys

    jax_dir = os.sep + os.path.join("jax", "_src") + os.sep
    for frame in sys._current_frames().values():
        stack = []
        while frame is not None:
            stack.append(frame)
            frame = frame.f_back
        files = [f.f_code.co_filename for f in stack]  # innermost first
        entered = [i for i, name in enumerate(files) if name.endswith(f"{jax_dir}callback.py")]
        if not entered:
            continue
        inside = [f for f in stack[: entered[0]] if jax_dir not in f.f_code.co_filename]
        if inside:
            code, line = inside[-1].f_code, inside[-1].f_lineno
            return f"{code.co_name} ({_short(code.co_filename)}:{line})"
    return None


def _short(path: str) -> str:
    """``path`` relative to the working folder when it lies under it."""
    import os

    try:
        here = os.getcwd()
    except OSError:  # the folder was removed
        return path
    return os.path.relpath(path, here) if path.startswith(here + os.sep) else path
