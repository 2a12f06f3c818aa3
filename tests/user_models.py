"""A user model factory for the ``model.name="pkg.module:factory"`` CLI path (used by tests)."""

import jax
import jax.numpy as jnp
from flax import nnx

from jddp.models.resnet import Bottleneck, ResNet


class TinyMLP(nnx.Module):
    """No BatchNorm, no mutable state: flatten, one hidden layer."""

    def __init__(self, in_features: int, num_classes: int, rngs: nnx.Rngs, dtype=None):
        self.hidden = nnx.Linear(in_features, 32, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(32, num_classes, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))


def tiny_mlp(config: dict, dtype, rngs: nnx.Rngs) -> TinyMLP:
    """Factory: receives the config's model section, the compute dtype and an nnx.Rngs."""
    return TinyMLP(8 * 8 * 3, config["num_classes"], rngs, dtype=dtype)


class Calls(nnx.Variable):
    """A custom mutable variable: how many training forward passes the model has run."""


class DropoutMLP(nnx.Module):
    """Mutable state other than BatchNorm: dropout's RNG counter and a custom counter."""

    def __init__(self, in_features: int, num_classes: int, rngs: nnx.Rngs, rate: float = 0.5):
        self.hidden = nnx.Linear(in_features, 32, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.out = nnx.Linear(32, num_classes, rngs=rngs)
        self.calls = Calls(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        if not self.drop.deterministic:
            self.calls[...] += 1
        h = self.drop(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))
        return self.out(h)


def dropout_mlp(config: dict, dtype, rngs: nnx.Rngs) -> DropoutMLP:
    """Factory for the CLI: the dropout model on 8x8x3 images."""
    return DropoutMLP(8 * 8 * 3, config["num_classes"], rngs)


class ThreeLogits(nnx.Module):
    """A model whose head is too small for a 10-class data set."""

    def __init__(self, rngs: nnx.Rngs):
        self.out = nnx.Linear(8 * 8 * 3, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(x.reshape(x.shape[0], -1))


def three_logits(config: dict, dtype, rngs: nnx.Rngs) -> ThreeLogits:
    """Factory of a model with the wrong output shape (3 logits, whatever num_classes says)."""
    return ThreeLogits(rngs)


class NanModel(TinyMLP):
    """Every loss is NaN: every step is non-finite."""

    def __call__(self, x):
        return super().__call__(x) * jnp.nan


def nan_model(config: dict, dtype, rngs: nnx.Rngs) -> NanModel:
    """Factory of the always-NaN model."""
    return NanModel(8 * 8 * 3, config["num_classes"], rngs, dtype=dtype)


def _resnet(cls, block_cls, stage_sizes, config: dict, dtype, rngs: nnx.Rngs):
    """A ResNet (or subclass) from the model section's keys, as ``build_model`` builds a built-in
    one: initialised in one jitted program (the same parameters as ``model.name=resnetNN``)."""
    keys = ("num_classes", "stem", "width", "sync_batchnorm", "zero_init_residual")
    kwargs = {k: config[k] for k in keys}
    return nnx.jit(lambda r: cls(block_cls, stage_sizes, **kwargs, dtype=dtype, rngs=r))(rngs)


def bottleneck_resnet(config: dict, dtype, rngs: nnx.Rngs) -> ResNet:
    """ResNet-50's blocks (Bottleneck, 4x expansion) and stem, one block per stage instead of
    3-4-6-3: trains what ResNet-50 is made of at a quarter of its compiling (on CI's cold
    compilation cache ResNet-50's step alone compiled in 64 s)."""
    return _resnet(ResNet, Bottleneck, (1, 1, 1, 1), config, dtype, rngs)


PACE_ITERATIONS = 150_000_000  # a scalar loop of ~0.33 s on this VM's CPU (~2.2 ns each)


def held(x):
    """``x`` after a scalar loop of PACE_ITERATIONS in the compiled step, its value entering
    ``x`` times 0 (the same numbers bit for bit). The loop's bounds depend on the data and it
    carries a float: XLA can neither count nor drop it."""
    limit = PACE_ITERATIONS + (x.reshape(-1)[0] * 0).astype(jnp.int32)
    _, value = jax.lax.while_loop(
        lambda carry: carry[0] < limit,
        lambda carry: (carry[0] + 1, carry[1] * 0.5 + 1.0),
        (jnp.int32(0), x.reshape(-1)[0]),
    )
    return x + value * 0


class HeldMLP(TinyMLP):
    """TinyMLP whose train steps are each held ~0.33 s by :func:`held` (the losses are
    TinyMLP's bit for bit): long enough for a test's signal to land mid-run however fast the
    machine (at ~2 ms a step, 6 steps ended between a test seeing step 2 and its `scancel`),
    and unlike a host callback (jax.debug.callback, time.sleep) a step the compilation cache
    keeps. Only in training (``model.train()`` sets ``deterministic`` False): an evaluation's
    every batch would burn 0.33 s of a core."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deterministic = True

    def __call__(self, x):
        return super().__call__(x if self.deterministic else held(x))


def held_mlp(config: dict, dtype, rngs: nnx.Rngs) -> HeldMLP:
    """``tiny_mlp``'s parameters and losses, each train step held ~0.33 s."""
    return HeldMLP(8 * 8 * 3, config["num_classes"], rngs, dtype=dtype)


def per_process_mlp(config: dict, dtype, rngs: nnx.Rngs) -> TinyMLP:
    """A factory that (wrongly) seeds each process differently: its replicas start apart."""
    return TinyMLP(8 * 8 * 3, config["num_classes"], nnx.Rngs(jax.process_index()), dtype=dtype)


def forgets_to_return(config: dict, dtype, rngs: nnx.Rngs) -> None:
    """A factory that builds the model and forgets to return it."""
    TinyMLP(8 * 8 * 3, config["num_classes"], rngs, dtype=dtype)


class HungryMLP(TinyMLP):
    """:class:`TinyMLP` whose step holds 2 GiB per device: a 1 GiB activation (16 rows of 16M
    floats, an operand of a matrix product: XLA cannot fuse it away) and its gradient."""

    def __call__(self, x):
        h = self.hidden(x.reshape(x.shape[0], -1))
        wide = jnp.sin(jnp.arange(2**24, dtype=h.dtype)[None] * h[:, :1])
        return self.out(nnx.relu(h + 1e-9 * jnp.einsum("bn,bn->b", wide, wide)[:, None]))


def hungry_mlp_little_memory(config: dict, dtype, rngs: nnx.Rngs) -> HungryMLP:
    """:class:`HungryMLP` in a process left with little memory, as on a busy machine: its
    address space capped 600 MiB above what it uses now (enough to compile the step, not to
    run it), so XLA's allocation fails (RESOURCE_EXHAUSTED)."""
    import resource

    with open("/proc/self/status") as status:
        used_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    limit = used_kib * 1024 + 600 * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    return HungryMLP(8 * 8 * 3, config["num_classes"], rngs, dtype=dtype)
