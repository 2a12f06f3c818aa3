"""Tests for jddp.models (ResNet family and the model registry)."""

from __future__ import annotations

import functools
import math
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jddp.models import (
    MODELS,
    ResNet,
    get_model_factory,
    resnet10,
    resnet18,
    resnet34,
    resnet50,
    resnet101,
    resnet152,
)
from tests.helpers import fake_devices, run_python

TORCHVISION_PARAM_COUNTS = {
    resnet10: 5_418_792,  # torchvision.models.resnet.ResNet(BasicBlock, [1, 1, 1, 1])
    resnet18: 11_689_512,
    resnet34: 21_797_672,
    resnet50: 25_557_032,
    resnet101: 44_549_160,
    resnet152: 60_192_808,
}


def _num_params(model: nnx.Module) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _jit_forward(model: nnx.Module, x: jax.Array) -> jax.Array:
    """Train-mode forward through split/merge under jax.jit (much faster than eager NNX)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, x):
        return nnx.merge(graphdef, state, copy=True)(x)

    return fwd(state, x)


def _tiny(**kwargs) -> ResNet:
    kwargs = {"num_classes": 10, "stem": "cifar", "width": 4, "rngs": nnx.Rngs(0), **kwargs}
    return resnet18(**kwargs)


@pytest.mark.parametrize("factory", list(TORCHVISION_PARAM_COUNTS), ids=lambda f: f.__name__)
def test_param_count_matches_torchvision(factory):
    model = nnx.eval_shape(lambda: factory(rngs=nnx.Rngs(0)))
    assert isinstance(model, ResNet)
    assert _num_params(model) == TORCHVISION_PARAM_COUNTS[factory]


def test_bottleneck_width_scales_channels():
    model = nnx.eval_shape(lambda: resnet50(width=8, num_classes=10, rngs=nnx.Rngs(0)))
    assert model.fc.kernel.shape == (8 * 8 * 4, 10)
    assert model.blocks[0].conv2.kernel.shape == (3, 3, 8, 8)


@pytest.mark.parametrize(("stem", "size"), [("cifar", 8), ("cifar", 32), ("imagenet", 32)])
def test_output_shape(stem, size):
    model = _tiny(stem=stem)
    logits = _jit_forward(model, jnp.ones((2, size, size, 3), jnp.float32))
    assert logits.shape == (2, 10)
    assert logits.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(logits)))


def test_bad_stem_raises():
    with pytest.raises(ValueError, match="stem"):
        resnet18(stem="nope", rngs=nnx.Rngs(0))


def test_only_param_and_batchstat_state():
    model = _tiny()
    graphdef, params, stats, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
    assert len(jax.tree.leaves(rest)) == 0
    assert len(nnx.split(model, nnx.Param, nnx.BatchStat)) == 3


def test_sync_batchnorm_sets_axis_name():
    bns = lambda m: [n for _, n in nnx.iter_modules(m) if isinstance(n, nnx.BatchNorm)]  # noqa: E731
    synced = nnx.eval_shape(lambda: _tiny(sync_batchnorm=True, axis_name="data"))
    plain = nnx.eval_shape(lambda: _tiny())
    assert len(bns(synced)) == 1 + 2 * 8 + 3  # stem + 2 per block + 3 projections
    assert all(bn.axis_name == "data" for bn in bns(synced))
    assert all(bn.axis_name is None for bn in bns(plain))
    assert all(bn.momentum == 0.9 and bn.epsilon == 1e-5 for bn in bns(plain))


def test_split_merge_inside_jit_train_and_eval():
    model = _tiny(zero_init_residual=False)
    graphdef, params, batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)

    @functools.partial(jax.jit, static_argnums=3)
    def step(params, batch_stats, x, train):
        m = nnx.merge(graphdef, params, batch_stats, copy=True)
        if train:
            m.train()
        else:
            m.eval()
        logits = m(x)
        return logits, nnx.state(m, nnx.BatchStat)

    x = jax.random.normal(jax.random.key(1), (4, 8, 8, 3)) * 2.0 + 1.0

    logits, new_stats = step(params, batch_stats, x, True)
    assert logits.shape == (4, 10) and logits.dtype == jnp.float32
    assert jax.tree.structure(new_stats) == jax.tree.structure(batch_stats)
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), batch_stats, new_stats)
    assert all(jax.tree.leaves(changed))

    logits_eval, eval_stats = step(params, new_stats, x, False)
    assert logits_eval.shape == (4, 10)
    jax.tree.map(np.testing.assert_array_equal, eval_stats, new_stats)
    # The original model was not mutated by the traced copy.
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model, nnx.BatchStat), batch_stats)


@pytest.mark.parametrize(
    "factory, stem, size, dtype",
    [(resnet18, "cifar", 8, jnp.float32), (resnet18, "imagenet", 32, jnp.bfloat16)],
    ids=["cifar-float32", "imagenet-bfloat16"],
)
@pytest.mark.slow
def test_stored_conv_inputs_change_no_bit(factory, stem, size, dtype):
    """On CPU the ResNets divide each convolution's input by ``1 + 0 * input`` (so XLA stores it
    instead of recomputing it in the weight gradients' transposes): loss, gradients and batch
    statistics equal a model with plain convolutions bit for bit."""
    assert jax.default_backend() == "cpu"
    model = factory(num_classes=10, stem=stem, width=8, dtype=dtype, rngs=nnx.Rngs(0))
    plain = nnx.clone(model)
    for _, module in nnx.iter_modules(plain):
        if isinstance(module, nnx.Conv):
            module.conv_general_dilated = jax.lax.conv_general_dilated
    x = jax.random.normal(jax.random.key(1), (4, size, size, 3))
    y = jnp.arange(4) % 10

    def loss_grads_stats(m):
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)

        @jax.jit
        def f(params, rest):
            def loss(params):
                mm = nnx.merge(graphdef, params, rest, copy=True)
                logits = mm(x)
                ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1).mean()
                return ce, nnx.state(mm, nnx.BatchStat)

            return jax.value_and_grad(loss, has_aux=True)(params)

        return f(params, rest), str(jax.make_jaxpr(f)(params, rest))

    (ours, our_jaxpr), (reference, plain_jaxpr) = map(loss_grads_stats, (model, plain))
    jax.tree.map(np.testing.assert_array_equal, ours, reference)
    assert our_jaxpr.count(" div ") > plain_jaxpr.count(" div ")  # the models really differ


def test_bfloat16_compute_dtype():
    model = _tiny(dtype=jnp.bfloat16)
    graphdef, params, batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))

    @jax.jit
    def fwd(params, batch_stats, x):
        m = nnx.merge(graphdef, params, batch_stats, copy=True)
        m.train()
        return m(x), nnx.state(m, nnx.BatchStat)

    logits, new_stats = fwd(params, batch_stats, jnp.ones((2, 8, 8, 3), jnp.float32))
    assert logits.dtype == jnp.float32
    assert logits.shape == (2, 10)
    assert all(s.dtype == jnp.float32 for s in jax.tree.leaves(new_stats))
    assert np.all(np.isfinite(np.asarray(logits)))


_SYNC_BN_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jddp.models import resnet18

    assert jax.device_count() == 2, jax.devices()
    kw = dict(num_classes=10, stem="cifar", width=4)
    # Shapes only (cheap), then random numpy weights: skips compiling one initializer per
    # kernel shape, and gives non-trivial BN scales/biases too.
    graphdef, abs_params, abs_stats = nnx.split(
        nnx.eval_shape(lambda: resnet18(sync_batchnorm=True, rngs=nnx.Rngs(0), **kw)),
        nnx.Param, nnx.BatchStat,
    )
    ref_graphdef = nnx.graphdef(nnx.eval_shape(lambda: resnet18(rngs=nnx.Rngs(0), **kw)))
    rng = np.random.default_rng(0)

    def fill(a):
        if a.ndim == 1:
            return jnp.asarray(0.5 + 0.2 * rng.random(a.shape), a.dtype)
        std = (2.0 / np.prod(a.shape[:-1])) ** 0.5
        return jnp.asarray(std * rng.standard_normal(a.shape), a.dtype)

    params = jax.tree.map(fill, abs_params)
    stats = jax.tree.map(lambda a: jnp.asarray(rng.random(a.shape), a.dtype), abs_stats)
    ref_state = (params, stats)
    # 16x16 so the last stage still normalises over 8*2*2 values per channel; with 1x1
    # maps the tiny-variance BN amplifies float32 reduction-order noise past 1e-5.
    x = jnp.asarray(rng.standard_normal((8, 16, 16, 3)), jnp.float32)

    def f(state, x, graphdef):
        m = nnx.merge(graphdef, *state, copy=True)
        m.train()
        return m(x), nnx.state(m, nnx.BatchStat)

    ref_logits, ref_stats = jax.jit(lambda s, x: f(s, x, ref_graphdef))(ref_state, x)

    from jddp.mesh import DATA_AXES, make_mesh

    mesh = make_mesh(jax.devices()[:2])  # the step's mesh: synced BN averages over DATA_AXES

    g = jax.jit(jax.shard_map(
        lambda s, x: f(s, x, graphdef), mesh=mesh,
        in_specs=(P(), P(DATA_AXES)), out_specs=(P(DATA_AXES), P()), check_vma=False,
    ))
    xs = jax.device_put(x, NamedSharding(mesh, P(DATA_AXES)))
    logits, new_stats = g((params, stats), xs)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5, rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5),
        new_stats, ref_stats,
    )
    # Without sync the per-device statistics differ, so the outputs must differ.
    g_plain = jax.jit(jax.shard_map(
        lambda s, x: f(s, x, ref_graphdef)[0],
        mesh=mesh, in_specs=(P(), P(DATA_AXES)), out_specs=P(DATA_AXES), check_vma=False,
    ))
    plain = g_plain(ref_state, xs)
    assert np.abs(np.asarray(plain) - np.asarray(ref_logits)).max() > 1e-3
    print("SYNC_BN_OK")
    """
)


@pytest.mark.slow
def test_sync_batchnorm_matches_single_device_in_shard_map():
    proc = run_python("-c", _SYNC_BN_SCRIPT, env=fake_devices(2), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SYNC_BN_OK" in proc.stdout


def test_registry_names():
    assert set(MODELS) == {"resnet10", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152"}
    for name, factory in MODELS.items():
        assert get_model_factory(name) is factory
    assert get_model_factory("jddp.models.resnet:resnet50") is resnet50


@pytest.mark.parametrize(
    "name", ["resnet9", "jddp.models.resnet:nope", "no_such_pkg_xyz.mod:f", ":f", "math:pi"]
)
def test_registry_errors(name):
    with pytest.raises(ValueError, match="resnet18") as info:
        get_model_factory(name)
    assert repr(name) in str(info.value) or name.partition(":")[0] in str(info.value)


@pytest.mark.parametrize("model", ["resnet10", "gpt"])
@pytest.mark.slow
def test_remat_blocks_takes_the_same_steps(model):
    """model.remat=blocks recomputes each block's activations in the backward pass: the same
    losses (to 1e-6) and BatchNorm statistics as without it, for the built-in ResNets and the
    GPT example (which reads the key from its config); the ResNet's step needs less memory."""
    import jax
    import optax

    from jddp import XlaComm, load_config
    from jddp.build import build_model, build_steps
    from jddp.data.loader import place_batch, process_rows_of
    from jddp.mesh import make_mesh
    from jddp.state import create_train_state

    if model == "gpt":
        base = ["model.name=examples.lm_stdlib:gpt", "train.loss=examples.lm_stdlib:loss",
                "model.options.width=32", "model.options.layers=2", "model.options.heads=2",
                "model.options.seq_len=16", "model.options.dropout=0.1"]  # fmt: skip
        rng = np.random.default_rng(0)
        batch = {"tokens": rng.integers(1, 256, (8, 17)).astype(np.uint8),
                 "lengths": rng.integers(2, 18, 8).astype(np.int32)}  # fmt: skip
    else:
        from tests.helpers import TINY

        base = list(TINY)  # resnet10 of width 4 on 8x8 synthetic images
        rng = np.random.default_rng(0)
        batch = {"images": rng.integers(0, 256, (8, 8, 8, 3)).astype(np.uint8),
                 "labels": rng.integers(0, 10, 8).astype(np.int32)}  # fmt: skip
    mesh = make_mesh(jax.devices()[:1])
    losses, temp_bytes = {}, {}
    for remat in ("none", "blocks"):
        cfg = load_config(overrides=[*base, "data.global_batch_size=8", f"model.remat={remat}"])
        tx = optax.sgd(0.05, momentum=0.9)
        model_def, state = create_train_state(build_model(cfg, nnx.Rngs(0)), tx, mesh)
        step, _ = build_steps(cfg, model_def, tx, mesh, XlaComm())
        placed = {"data": place_batch(batch, mesh, process_rows_of(mesh, 8))}
        program = str(step.run.trace(state, placed).jaxpr)
        assert ("remat2[" in program) == (remat == "blocks")  # the blocks are rematted
        compiled = step.run.lower(state, placed).compile()  # the executable the steps run
        temp_bytes[remat] = compiled.memory_analysis().temp_size_in_bytes
        losses[remat] = []
        for _ in range(3):
            state, metrics = step(state, placed)
            losses[remat].append(float(metrics["train/loss"]))
    np.testing.assert_allclose(losses["blocks"], losses["none"], rtol=1e-6)
    assert losses["none"][0] != losses["none"][2]  # it trained
    if model == "resnet10":  # (the GPT's peak at this size is not its activations)
        # XLA:CPU keeps the recomputation apart (jddp.step.keep_checkpoint_barriers):
        # measured 246 KB of temporaries against 301; 306 when it merged it back
        assert temp_bytes["blocks"] < 0.9 * temp_bytes["none"], temp_bytes


def test_remat_of_a_model_without_blocks_is_refused(tmp_path):
    """model.remat=blocks recomputes the blocks a model holds in a list of modules; given to
    jddp.fit with a model that holds none, it is refused in one line, not ignored."""
    import optax

    import jddp
    from jddp.errors import ConfigError
    from tests.helpers import data
    from tests.user_models import TinyMLP

    with pytest.raises(ConfigError) as caught:
        jddp.fit(
            TinyMLP(192, 2, nnx.Rngs(0)), optax.sgd(0.1), train_data=data(64),
            config={"workdir": str(tmp_path / "run")},
            overrides=["train.steps=1", "data.global_batch_size=16", "log.progress=off",
                       "model.remat=blocks"],
        )  # fmt: skip
    assert str(caught.value).startswith(
        "model.remat=blocks: TinyMLP holds no list of modules (its repeated blocks, e.g. "
        "self.blocks = nnx.List([...])) whose activations could be recomputed"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()
