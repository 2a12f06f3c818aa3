"""Optimizer and schedule: warmup, cosine/constant, linear lr scaling, sgd vs adamw."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jddp.config import OptimConfig
from jddp.optimizer import make_optimizer, make_schedule, peak_learning_rate


def test_linear_scaling_rule():
    cfg = OptimConfig(lr=0.1, lr_scaling="linear", base_batch_size=256)
    assert peak_learning_rate(cfg, 1024) == pytest.approx(0.4)
    assert peak_learning_rate(OptimConfig(lr=0.1), 1024) == 0.1  # default: no scaling


def test_warmup_then_cosine_to_zero():
    sched = make_schedule(OptimConfig(lr=0.2, warmup_steps=10, schedule="cosine"), 256, 110)
    assert float(sched(0)) == 0.0
    assert float(sched(5)) == pytest.approx(0.1)
    assert float(sched(10)) == pytest.approx(0.2)
    assert float(sched(60)) == pytest.approx(0.1, rel=1e-5)  # half way down the cosine
    assert float(sched(110)) == pytest.approx(0.0, abs=1e-7)


def test_constant_schedule():
    sched = make_schedule(OptimConfig(lr=0.3, schedule="constant"), 256, 100)
    assert [float(sched(s)) for s in (0, 50, 99)] == pytest.approx([0.3] * 3)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_weight_decay_pulls_weights_down(name):
    tx, _ = make_optimizer(
        OptimConfig(name=name, lr=0.1, weight_decay=0.5, schedule="constant"), 256, 10
    )
    params = {"w": jnp.ones(3)}
    updates, _ = tx.update({"w": jnp.zeros(3)}, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    assert np.all(np.asarray(new["w"]) < 1.0)  # zero gradient: only the decay moves them


def test_sgd_momentum_matches_optax():
    cfg = OptimConfig(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.0, schedule="constant")
    tx, _ = make_optimizer(cfg, 256, 10)
    ref = optax.sgd(0.1, momentum=0.9)
    p, g = {"w": jnp.ones(2)}, {"w": jnp.array([1.0, -2.0])}
    s1, s2 = tx.init(p), ref.init(p)
    for _ in range(3):
        u1, s1 = tx.update(g, s1, p)
        u2, s2 = ref.update(g, s2, p)
        np.testing.assert_allclose(u1["w"], u2["w"], rtol=1e-6)
