"""jddp's changes to its libraries' private internals and to the process (jddp.compat): each
target still has the shape the change relies on, and the change is in place once what installs
it ran. Every patch leaves a target it does not find alone, silently: after an upgrade of JAX,
Flax or orbax these tests are what says that one no longer applies."""

import contextlib
import gc
import inspect
import re
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


# JAX's persistent compilation cache (jddp.compat.jax_cache)


def test_cpu_cache_keys_replace_jaxs_functions_of_the_shape_they_wrap():
    """The three functions of ``jax._src.cache_key`` that jddp replaces (and the one it calls)
    take the arguments its replacements pass, by the names they pass them."""
    from jax._src import cache_key

    from jddp.compat.jax_cache import same_cpu_cache_key_on_every_process
    from jddp.proc.xla import enable_compilation_cache

    enable_compilation_cache(None)  # installs it, as in every jddp process
    assert getattr(cache_key.get, "jddp", False)
    for name in ("get", "_hash_serialized_compile_options", "_hash_accelerator_config"):
        assert getattr(cache_key, name).__module__ == "jddp.compat.jax_cache", name
    same_cpu_cache_key_on_every_process()  # twice: wraps JAX's functions, not its own
    get = inspect.unwrap(cache_key.get)
    hash_options = inspect.unwrap(cache_key._hash_serialized_compile_options)
    hash_config = inspect.unwrap(cache_key._hash_accelerator_config)
    assert get.__module__ == hash_options.__module__ == hash_config.__module__ == cache_key.__name__
    assert parameters(get)[:4] == ["module", "devices", "compile_options", "backend"]
    assert parameters(hash_options) == [
        "hash_obj",
        "compile_options_obj",
        "strip_device_assignment",  # passed by name
    ]
    assert parameters(hash_config) == ["hash_obj", "accelerators"]
    assert parameters(cache_key._hash_devices) == ["hash_obj", "devices"]


def test_a_cpu_programs_cache_key_leaves_its_device_ids_out():
    """The key JAX's compilation cache asks for (``compilation_cache.get_cache_key``, which calls
    ``cache_key.get`` through its module): a CPU program assigned to device 0 or to device 1
    has the same key, so another process finds what process 0 wrote."""
    from jax._src import compilation_cache, compiler

    from jddp.compat.jax_cache import same_cpu_cache_key_on_every_process

    same_cpu_cache_key_on_every_process()
    module = jax.jit(lambda x: x + 1).lower(1.0).compiler_ir("stablehlo")
    device = jax.devices("cpu")[0]

    def key(device_id: int) -> str:
        assignment = np.array([[device_id]])
        options = compiler.get_compile_options(1, 1, device_assignment=assignment)
        return compilation_cache.get_cache_key(module, np.array([device]), options, device.client)

    assert key(0) == key(1)


def test_whole_cache_entries_replace_jaxs_put_where_jaxs_get_reads(tmp_path):
    """``LRUCache.put`` is jddp's once the cache is enabled; JAX's takes ``(key, value)``; an
    entry jddp writes is the file JAX's ``get`` reads (``path / key + _CACHE_SUFFIX``) and the
    attributes it reads (``path``, ``eviction_enabled``) are there."""
    from jax._src import lru_cache

    from jddp.proc.xla import enable_compilation_cache

    enable_compilation_cache(None)
    put = lru_cache.LRUCache.put
    assert getattr(put, "jddp", False) and put.__module__ == "jddp.compat.jax_cache"
    jaxs = inspect.unwrap(put)
    assert jaxs.__module__ == lru_cache.__name__ and parameters(jaxs) == ["self", "key", "value"]
    cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)  # JAX's default: no size limit
    assert cache.eviction_enabled is False and str(cache.path) == str(tmp_path)
    cache.put("key", b"entry")
    assert (tmp_path / f"key{lru_cache._CACHE_SUFFIX}").read_bytes() == b"entry"
    assert cache.get("key") == b"entry"


# orbax's writes (jddp.compat.orbax_writes)


def test_replica_slices_on_cpu_are_cut_by_jddp_from_the_fields_orbax_has():
    """Orbax's ``ReplicaSlice`` has the fields jddp's ``data`` reads, ``data`` is jddp's once
    :class:`~jddp.checkpoint.Checkpoints` installed it, and a CPU array's share is the rows
    its ``SliceArgs`` name."""
    import dataclasses

    from orbax.checkpoint._src.serialization.replica_slices import ReplicaSlice, SliceArgs

    from jddp.compat import orbax_writes

    assert orbax_writes.ReplicaSlice is ReplicaSlice  # the private import still works
    orbax_writes.cut_cpu_slices_on_host()
    assert ReplicaSlice.data.__module__ == "jddp.compat.orbax_writes"
    assert parameters(inspect.unwrap(ReplicaSlice.data)) == ["self"]
    assert {"unsliced_data", "slice_args"} <= {f.name for f in dataclasses.fields(ReplicaSlice)}
    assert {f.name for f in dataclasses.fields(SliceArgs)} == {"start_index", "limit_index", "axis"}
    whole = jax.device_put(jnp.arange(12.0).reshape(6, 2), jax.devices("cpu")[0])
    share = ReplicaSlice(
        index=(slice(None), slice(None)),
        unsliced_data=whole,
        slice_args=SliceArgs(start_index=2, limit_index=5, axis=0),
    )
    np.testing.assert_array_equal(np.asarray(share.data()), np.asarray(whole)[2:5])


def test_orbaxs_commits_run_in_the_thread_class_jddp_waits_for():
    """``wait_for_failed_writes`` joins the live threads of orbax's private class
    ``_SignalingThread``: it is still a thread class, and orbax's futures still start one."""
    from orbax.checkpoint._src.futures import future

    from jddp.compat import orbax_writes

    assert orbax_writes.CommitThread is future._SignalingThread
    assert issubclass(future._SignalingThread, threading.Thread)
    assert re.search(r"=\s*_SignalingThread\(", inspect.getsource(future))


def test_waiting_for_a_failed_saves_other_writes_raises_nothing():
    """Orbax's commit thread's ``join`` raises what its write failed with: the wait for a
    failed save's other writes (before its folder is removed) returns, the failure being the
    save's to report (it had escaped the save's one line as a bare ValueError)."""
    from jddp.compat.orbax_writes import wait_for_failed_writes
    from tests.helpers import failing_commit

    with pytest.raises(ValueError, match="No space left on device"):
        failing_commit(0.0).join()  # orbax's join: what the thread failed with
    thread = failing_commit(0.5)
    wait_for_failed_writes()
    assert not thread.is_alive()


# Python's collector (jddp.compat.collector)


def test_collecting_less_often_sets_the_youngest_threshold_and_restores_it(monkeypatch):
    from jddp.compat.collector import YOUNG_THRESHOLD, collecting_less_often

    monkeypatch.delenv("JDDP_GC_DEFAULTS", raising=False)
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)  # Python's defaults (the suite runs with jddp's)
        with collecting_less_often():
            assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*before)


# sys.excepthook (jddp.compat.excepthook)


def test_only_an_uncaught_preemption_exits_75(monkeypatch):
    """The hook ``fit`` installs: Preempted at the top level is exit 75; any other exception
    goes to the hook before it; installing twice chains once."""
    from jddp.compat.excepthook import exit_75_on_uncaught_preemption
    from jddp.errors import Preempted

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(kind))
    exit_75_on_uncaught_preemption()
    exit_75_on_uncaught_preemption()
    with pytest.raises(SystemExit) as stop:
        sys.excepthook(Preempted, Preempted(3), None)
    assert stop.value.code == 75 and seen == []
    sys.excepthook(KeyError, KeyError("x"), None)
    assert seen == [KeyError]


@pytest.mark.parametrize("raised", [None, "KeyError", "Preempted"])
def test_the_exit_75_hook_outlives_its_block_only_after_a_preemption(monkeypatch, raised):
    """``jddp.fit``'s block: the caller's hook is back after a normal end or another
    exception; after a ``Preempted`` jddp's stays, for the top level to exit 75 with; a hook
    installed over jddp's inside the block is left in place."""
    from jddp.compat.excepthook import exiting_75_on_uncaught_preemption
    from jddp.errors import Preempted

    def callers_hook(kind, value, tb):
        sys.__excepthook__(kind, value, tb)

    monkeypatch.setattr(sys, "excepthook", callers_hook)
    error = {None: None, "KeyError": KeyError("x"), "Preempted": Preempted(3)}[raised]
    hook_stays = raised == "Preempted"
    with contextlib.suppress(Preempted, KeyError), exiting_75_on_uncaught_preemption():
        assert getattr(sys.excepthook, "jddp_preempted_exits", False)
        if error is not None:
            raise error
    assert (sys.excepthook is not callers_hook) == hook_stays
    if hook_stays:
        with pytest.raises(SystemExit) as stop:
            sys.excepthook(Preempted, Preempted(3), None)
        assert stop.value.code == 75

    def theirs(kind, value, tb):
        callers_hook(kind, value, tb)

    monkeypatch.setattr(sys, "excepthook", callers_hook)
    with exiting_75_on_uncaught_preemption():
        sys.excepthook = theirs
    assert sys.excepthook is theirs


def test_whether_jaxs_backend_started_is_read_where_jax_distributed_reads_it():
    """``jax.distributed.initialize`` refuses once ``backends_are_initialized()``: jddp.fit
    reads the same function to join a launched job or say what to call first."""
    from jax._src import distributed, xla_bridge

    from jddp.compat.jax_backend import backend_started

    assert "backends_are_initialized()" in inspect.getsource(distributed.initialize)
    jnp.zeros(1).block_until_ready()
    assert xla_bridge.backends_are_initialized() and backend_started()


# Flax's internals that jddp.models.units is built on (it stays there: it is the mechanism)


class Scale(nnx.Module, pytree=False):
    """A module that chose ``pytree=False`` (flax's default for a subclass is True)."""

    def __init__(self):
        self.w = nnx.Param(jnp.ones(3))

    def __call__(self, x):
        return x * self.w


class Shift(nnx.Module):
    def __init__(self):
        self.b = nnx.Param(jnp.zeros(3))

    def __call__(self, x):
        return x + self.b


def test_flax_says_what_a_graph_node_is():
    from jddp.models import units

    assert units._is_graph_node is nnx.graphlib.is_graph_node
    assert nnx.graphlib.is_graph_node(Scale()) and not nnx.graphlib.is_graph_node(jnp.ones(3))


def test_a_unit_class_keeps_its_modules_choice_of_pytree():
    """Flax records ``pytree=`` as the class attribute ``_pytree__is_pytree`` and takes it as a
    class keyword; a unit class, made as ``jddp.models.units._make_unit`` makes it, keeps the
    choice of the class it wraps and computes as that class (here inside ``jax.checkpoint``,
    as a rematerialised block)."""
    from jddp.models import units

    assert "pytree" in parameters(nnx.Pytree.__init_subclass__)
    assert Scale._pytree__is_pytree is False and Shift._pytree__is_pytree is True
    for module, pytree in ((Scale(), False), (Shift(), True)):
        cls = type(module)
        x = jnp.full(3, 2.0)
        expected = module(x)
        units._make_unit(module, "block")
        unit = type(module)
        assert unit.__mro__[1] is cls and unit._jddp_unit == "block"
        assert unit._pytree__is_pytree is pytree, cls.__name__
        np.testing.assert_array_equal(module(x), expected)
