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
