"""How a checkpoint of arrays every device holds is written (jddp.compat.orbax_writes)."""

import json

from tests.helpers import fake_devices, run_python

# Two devices holding the same arrays; the programs JAX lowers while each save runs.
_SAVE_TWICE = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jddp.checkpoint import Checkpoints
from jddp.state import TrainState

lowered = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **_: lowered.append(event)
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" else None)
whole = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P())

def state(params):
    params = jax.device_put(params, whole)
    return TrainState(step=jnp.int32(1), params=params, model_state={}, opt_state=(),
                      skipped_steps=jnp.int32(0))

small = {"kernel": np.full((3, 3, 16, 32), 0.5, np.float32), "bias": np.arange(32.0),
         "scale": np.ones(32, np.float32)}
large = {"kernel": np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512)}  # 2 MiB
counts = {}
for name, params in (("small", small), ("large", large)):
    ckpts = Checkpoints(sys.argv[1] + "/" + name, every_steps=1, keep=1, async_save=False,
                        damaged_directory=sys.argv[1] + "/damaged")
    saved = state(params)
    before = len(lowered)
    ckpts.save(1, saved, {})
    ckpts.wait()
    counts[name] = len(lowered) - before
    restored, _ = ckpts.restore_newest_good(saved)
    assert all(np.array_equal(restored.params[k], params[k]) for k in params), name
    ckpts.close()
# After the saves, orbax's shares of an array: each of the 2 replicas (devices) writes half
# of it, as before.
from orbax.checkpoint._src.serialization import replica_slices
kernel = jax.device_put(large["kernel"], whole)
shares = replica_slices.get_replica_slices(kernel, 0, True).replica_slices
before = len(lowered)
halves = [np.asarray(share.data()) for share in shares]
counts |= {"share_rows": [len(h) for h in halves], "share_programs": len(lowered) - before}
assert np.array_equal(np.concatenate(halves), large["kernel"])
print(json.dumps({"devices": jax.device_count(), **counts}))
"""


def test_replicated_arrays_on_cpu_are_split_between_replicas_without_compiling(tmp_path):
    """Orbax's replicas each write a slice of an array they all hold, cut by a program compiled
    per shape (a tiny ResNet's first save: 42 programs, a fifth of its run's CPU): on CPU
    devices jddp cuts them with NumPy. Each of the 2 replicas still holds its half of a 2 MiB
    array (so every process writes a share, and a full disk fails them all), no save lowers
    a program, and both saves restore equal."""
    out = run_python("-c", _SAVE_TWICE, str(tmp_path), env=fake_devices(2))
    assert out.returncode == 0, out.stderr[-3000:]
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["devices"] == 2
    assert counts["share_rows"] == [512, 512], counts
    assert counts == {**counts, "share_programs": 0, "small": 0, "large": 0}, counts


def test_room_for_a_checkpoint_is_the_newest_ones_size_else_the_states_bytes(tmp_path, monkeypatch):
    """Before a save: enough room is what the newest checkpoint takes on disk (the state's
    bytes before the first); short of it, the phrase names the folder, free and needed bytes."""
    import shutil
    from collections import namedtuple

    from jddp.checkpoint import room

    usage = namedtuple("usage", "total used free")
    free = {"bytes": 300 * 1024}
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(1 << 30, 0, free["bytes"]))
    assert room.shortfall(tmp_path, [], state_bytes=200 * 1024) is None
    assert room.shortfall(tmp_path, [], state_bytes=400 * 1024) == (
        f": {tmp_path} has 300 KiB free, a checkpoint needs more than 400 KiB (the training "
        "state's bytes)"
    )
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "data").write_bytes(b"x" * 320 * 1024)
    need = room.disk_bytes(tmp_path / "2")
    assert need >= 320 * 1024
    assert room.shortfall(tmp_path, [2], state_bytes=100) == (
        f": {tmp_path} has 300 KiB free, a checkpoint needs about {room.size_text(need)} (the size "
        "of checkpoint 2)"
    )
    free["bytes"] = need
    assert room.shortfall(tmp_path, [2], state_bytes=100) is None
    # A file system that reports no size (some FUSE mounts): unknown, no save refused.
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(0, 0, 0))
    assert room.shortfall(tmp_path, [2], state_bytes=100) is None
