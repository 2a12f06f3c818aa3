"""A tiny custom task for the tests (regression of a linear target from 4 features, a dict batch
with per-example weights), and broken variants of its pieces for the bad-input tests; each is
importable as ``tests.user_tasks:<name>`` (``model.name``, ``data.name``, ``train.loss``,
``train.metrics``)."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

import jddp

TRAIN, EVAL = 96, 40  # 40: the eval set ends in a padded batch of 16


def arrays(n: int, seed: int) -> dict[str, np.ndarray]:
    """``{"x": [n, 4], "y": [n], "w": [n]}``: y linear in x plus noise; weights 1..3."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.1 * rng.normal(size=n)).astype(
        np.float32
    )
    return {"x": x, "y": y, "w": rng.integers(1, 4, n).astype(np.float32)}


def data(config: dict, seed: int = 0) -> tuple[dict, dict]:
    """``data.name=tests.user_tasks:data``."""
    return arrays(TRAIN, 0), arrays(EVAL, 1)


class Linear(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, features: int = 4):
        self.w = nnx.Linear(features, 1, rngs=rngs)

    def __call__(self, x):
        return self.w(x)[:, 0]


def linear(config: dict, dtype, rngs: nnx.Rngs) -> Linear:
    """``model.name=tests.user_tasks:linear``."""
    return Linear(rngs)


def loss(model, batch):
    """Squared error per example."""
    return (model(batch["x"]) - batch["y"]) ** 2


def weighted_loss(model, batch):
    """Squared error per example, weighted by ``w``."""
    return loss(model, batch), batch["w"]


def error_metrics(error, w):
    """Means, sums and extremes of the errors: the mean absolute error (unweighted), the
    weighted mean and sum of squares, the largest and smallest error (the largest among the
    rows of weight 3 alone: a weight masks a max), the count of errors above 1."""
    return {
        "mae": jnp.abs(error),
        "wmse": (error**2, w),
        "wsse": jddp.Metric(error**2, w, reduce="sum"),
        "max_error": jddp.Metric(error, reduce="max"),
        "max_error_w3": jddp.Metric(error, w == 3, reduce="max"),
        "min_error": jddp.Metric(error, reduce="min"),
        "big_errors": jddp.Metric(jnp.abs(error) > 1, reduce="sum"),
    }


def metrics(model, batch):
    """:func:`error_metrics` of the model's errors."""
    return error_metrics(model(batch["x"]) - batch["y"], batch["w"])


def loss_and_metrics(model, batch):
    """The weighted loss and :func:`metrics` from one forward pass."""
    error = model(batch["x"]) - batch["y"]
    return error**2, batch["w"], error_metrics(error, batch["w"])


# -- broken pieces -----------------------------------------------------------------------------


def scalar_loss(model, batch):
    return loss(model, batch).mean()


def int_loss(model, batch):
    return loss(model, batch).astype(jnp.int32)


def column_loss(model, batch):
    return loss(model, batch)[:, None]


def quadruple_loss(model, batch):
    return loss(model, batch), batch["w"], {}, batch["w"]


def loss_with_list_metrics(model, batch):
    return loss(model, batch), None, [loss(model, batch)]


def missing_key_loss(model, batch):
    return (model(batch["features"]) - batch["y"]) ** 2


def negative_weight_loss(model, batch):
    return loss(model, batch), batch["w"] - 2.0


def zero_weight_loss(model, batch):
    return loss(model, batch), batch["w"] * 0.0


def nan_weight_loss(model, batch):
    return loss(model, batch), batch["w"].at[3].set(jnp.nan)


def nan_loss(model, batch):
    return loss(model, batch) * jnp.nan


def negative_sum_weight_metrics(model, batch):
    """A sum whose weights go negative on rows of weight 1 (refused as a loss's)."""
    error = model(batch["x"]) - batch["y"]
    return {"wsse": jddp.Metric(error**2, batch["w"] - 1.5, reduce="sum")}


BIG = 2**26 + 1  # 16 of them fit int32 (a batch's sum); float32 keeps 24 bits, 40 need 32


def big_count_metrics(model, batch):
    """An integer sum whose total over the 40 eval rows passes 2^31 and whose every batch's sum
    (16 rows) passes float32's 2^24 by digits it cannot hold."""
    rows = batch["y"].shape[0]
    return {"big": jddp.Metric(jnp.full(rows, BIG, jnp.int32), reduce="sum")}


def clashing_metrics(model, batch):
    return {"loss": loss(model, batch)}


def raising_model(config: dict, dtype, rngs: nnx.Rngs):
    raise RuntimeError("the factory's own bug")


def raising_data(config: dict, seed: int = 0):
    raise KeyError("no such split")


def median_metrics(model, batch):
    return {"spread": jddp.Metric(loss(model, batch), reduce="median")}


def list_metrics(model, batch):
    return [loss(model, batch)]


def bad_data(config: dict, seed: int = 0):
    return 3


def ragged_data(config: dict, seed: int = 0):
    train = arrays(TRAIN, 0)
    train["y"] = train["y"][:-6]
    return train, None


def string_leaf_data(config: dict, seed: int = 0):
    train = arrays(TRAIN, 0)
    train["name"] = "regression"
    return train, None


# -- a rank that hangs while alive (tests/test_watchdog.py) -------------------------------------
# JDDP_TEST_STALL=input|model makes process 1 block for good after STALL_AFTER calls, in its
# input pipeline or inside the compiled step; unset, they are the plain task.
# JDDP_TEST_STALL_SIGNAL=SIGTERM: as the stall begins the process sends its parent (the launcher)
# that signal, which forwards it to every rank (a scheduler stopping a job whose step hangs).
STALL_AFTER = 8


def _stalls(where: str) -> bool:
    """Whether process 1 stalls at ``where``; with JDDP_TEST_STALL_ONCE=FILE only while FILE
    does not exist (it is made as the stall begins: a restarted job no longer stalls)."""
    import os
    from pathlib import Path

    import jax

    if os.environ.get("JDDP_TEST_STALL") != where:
        return False
    if where != "eval" and jax.process_index() != 1:  # eval: python -m jddp.evaluate, 1 process
        return False
    signal_name = os.environ.pop("JDDP_TEST_STALL_SIGNAL", None)  # once
    if signal_name:
        import signal

        os.kill(os.getppid(), signal.Signals[signal_name])
    once = os.environ.get("JDDP_TEST_STALL_ONCE")
    if once is None:
        return True
    marker = Path(once)
    if marker.exists() and marker.read_text() != str(os.getpid()):
        return False  # a later process: the stall happened once already
    marker.write_text(str(os.getpid()))
    return True


class StallingSource:
    """``arrays`` by index; with JDDP_TEST_STALL=input, process 1's reads hang after a few
    (``where="eval"``: with JDDP_TEST_STALL=eval, any process's reads after the first)."""

    def __init__(self, arrays: dict, where: str = "input", after: int = STALL_AFTER):
        from jddp.data.trees import ArrayTreeSource

        self.inner = ArrayTreeSource(arrays, "stalling")
        self.example = self.inner.example
        self.calls = 0
        self.where, self.after = where, after

    def __len__(self):
        return len(self.inner)

    def get_batch(self, indices):
        import time

        self.calls += 1
        while self.calls > self.after and _stalls(self.where):
            time.sleep(60)
        return self.inner.get_batch(indices)

    def __repr__(self):
        return f"StallingSource({self.inner!r})"


POISONED_STEP = 5  # the step whose batch holds poisoned_data's NaN (epoch 0: steps 1..6)


def poisoned_data(config: dict, seed: int = 0):
    """``data.name=tests.user_tasks:poisoned_data``: :func:`data` with a NaN in the first row of
    step POISONED_STEP's global batch of 16 (train.seed 0): that step's loss is NaN on every
    topology, every time (a deterministic failure under train.on_nonfinite=halt)."""
    from jddp.data.pipeline import epoch_permutation

    train, evals = data(config, seed)
    row = epoch_permutation(0, 0, TRAIN)[(POISONED_STEP - 1) * 16]  # epoch 0's order
    train["x"] = train["x"].copy()
    train["x"][row, 0] = np.nan
    return train, evals


def stalling_data(config: dict, seed: int = 0):
    """``data.name=tests.user_tasks:stalling_data``: :func:`data`, read through a StallingSource."""
    train, evals = data(config, seed)
    return StallingSource(train), StallingSource(evals, "eval", after=1)


_calls = [0]


def _maybe_block(_):
    import time

    _calls[0] += 1
    while _calls[0] > STALL_AFTER and _stalls("model"):
        time.sleep(60)


def stalling_loss(model, batch):
    """:func:`loss`; with JDDP_TEST_STALL=model, process 1's step hangs in a host callback."""
    import jax

    jax.debug.callback(_maybe_block, batch["x"][0, 0])
    return loss(model, batch)


class GatedSource:
    """``arrays`` by index; with JDDP_TEST_GATE=FILE, the reads after the first ``after``
    batches wait until FILE exists (a test does what it must between two steps, e.g. make the
    checkpoints folder read-only after the first save, then lets the run go on)."""

    def __init__(self, arrays: dict, after: int):
        from jddp.data.trees import ArrayTreeSource

        self.inner = ArrayTreeSource(arrays, "gated")
        self.example = self.inner.example
        self.calls, self.after = 0, after

    def __len__(self):
        return len(self.inner)

    def get_batch(self, indices):
        import os
        import time
        from pathlib import Path

        self.calls += 1
        gate = os.environ.get("JDDP_TEST_GATE")
        while gate and self.calls > self.after and not Path(gate).exists():
            time.sleep(0.05)  # waits for the file, not for a moment
        return self.inner.get_batch(indices)


GATE_AFTER = 2  # batches read before the gate: the steps 1 and 2


def gated_data(config: dict, seed: int = 0):
    """``data.name=tests.user_tasks:gated_data``: :func:`data`, the train split read through
    a GatedSource (the batches of steps 1 and 2 pass, later ones wait for JDDP_TEST_GATE)."""
    train, evals = data(config, seed)
    return GatedSource(train, GATE_AFTER), evals
