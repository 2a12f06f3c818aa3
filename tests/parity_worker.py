"""Run 3 data-parallel train steps on N fake CPU devices and save losses and parameters.

Used by test_step.py in a subprocess with N fake devices (``tests.helpers.fake_devices``: the
device count is fixed at JAX import):
``python parity_worker.py N OUT.npz [--x64] [--comm=pmean|psum] [--accum=K] [--model=cnn]``
(``cnn``: no BatchNorm, so micro-batches see exactly what the whole batch does).
"""

import re
import sys

import jax

num_devices = int(sys.argv[1])

if "--x64" in sys.argv:
    jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jddp.api import load_config  # noqa: E402
from jddp.build import build_steps  # noqa: E402
from jddp.comm import XlaComm  # noqa: E402
from jddp.data.loader import place_batch, process_rows_of  # noqa: E402
from jddp.mesh import DATA_AXES, make_mesh  # noqa: E402
from jddp.models import resnet10  # noqa: E402
from jddp.proc.xla import enable_compilation_cache  # noqa: E402
from jddp.state import create_train_state  # noqa: E402

# jddp's persistent compilation cache, as `python -m jddp.train` uses it: a rerun of the suite
# loads these programs (a resnet10's step: seconds of CPU to compile on the 2-core VM).
enable_compilation_cache(load_config().train.compilation_cache_dir)

COLLECTIVES = {
    "psum", "psum_invariant", "pmax", "pmin", "ppermute", "all_gather", "all_gather_invariant",
    "all_to_all", "reduce_scatter", "psum_scatter",
}  # fmt: skip


def count_collectives(jaxpr, in_loop: bool = False) -> tuple[int, int]:
    """(collectives anywhere, collectives inside a scan/while body) in a jaxpr, recursively."""
    total = looped = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in COLLECTIVES:
            total += 1
            looped += in_loop
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    t, lp = count_collectives(
                        inner, in_loop or eqn.primitive.name in ("scan", "while")
                    )
                    total, looped = total + t, looped + lp
    return total, looped


class SmallCnn(nnx.Module):
    """Two convolutions and a linear head, no BatchNorm."""

    def __init__(self, dtype, rngs: nnx.Rngs):
        kw = {"dtype": dtype, "param_dtype": dtype, "rngs": rngs}
        self.conv1 = nnx.Conv(3, 8, (3, 3), **kw)
        self.conv2 = nnx.Conv(8, 8, (3, 3), strides=(2, 2), **kw)
        self.head = nnx.Linear(8, 10, **kw)

    def __call__(self, x):
        x = nnx.relu(self.conv2(nnx.relu(self.conv1(x))))
        return self.head(x.mean(axis=(1, 2)))


class SumComm(XlaComm):
    """The classic bug: summing instead of averaging (gradients N times too large)."""

    def average(self, tree):
        return jax.lax.psum(tree, DATA_AXES)


def main() -> None:
    out = sys.argv[2]
    dtype = jnp.float64 if "--x64" in sys.argv else jnp.float32
    grad_dtype = "bfloat16" if "--grad-dtype=bfloat16" in sys.argv else "float32"
    fuse = False if "--no-fuse" in sys.argv else None  # None: the default (on for CPUs)
    comm = SumComm() if "--comm=psum" in sys.argv else XlaComm(grad_dtype, fuse=fuse)
    accum = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--accum=")), 1)
    mesh = make_mesh(jax.devices()[:num_devices])

    def make(rngs):
        if "--model=cnn" in sys.argv:
            return SmallCnn(dtype, rngs)
        return resnet10(  # every kind of ResNet layer; half resnet18's blocks to compile
            num_classes=10,
            stem="cifar",
            width=4,
            sync_batchnorm=True,
            dtype=dtype,
            param_dtype=dtype,
            rngs=rngs,
        )

    model = nnx.jit(make)(nnx.Rngs(0))  # one compilation, as jddp.build.build_model does
    tx = optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1, momentum=0.9))
    model_def, state = create_train_state(model, tx, mesh)
    cfg = load_config(overrides=[f"train.grad_accum_steps={accum}"])
    step, _ = build_steps(cfg, model_def, tx, mesh, comm)
    rng = np.random.default_rng(0)
    losses, hlo = [], ""
    for _ in range(3):
        local = {
            "images": rng.normal(size=(16, 8, 8, 3)).astype(dtype),
            "labels": rng.integers(0, 10, size=16).astype(np.int32),
        }
        batch = {"data": place_batch(local, mesh, process_rows_of(mesh, 16))}
        if not hlo:
            hlo = step.lower(state, batch).as_text()
            collectives = count_collectives(jax.make_jaxpr(step)(state, batch).jaxpr)
        state, metrics = step(state, batch)
        losses.append(float(metrics["train/loss"]))
    # Shapes and element types of the all-reduces in the step's program (what goes over the
    # wire), e.g. ("44622", "bf16").
    reduces = re.findall(
        r"stablehlo\.all_reduce.*?\}\) : \(tensor<(?:([0-9x]*)x)?([a-z]+[0-9]+)>", hlo, re.S
    )
    reduce_types = [dtype for _, dtype in reduces]
    reduce_sizes = [int(np.prod([int(d) for d in shape.split("x") if d])) for shape, _ in reduces]
    params = np.concatenate([np.ravel(x) for x in jax.tree.leaves(state.params)])
    stats = np.concatenate([np.zeros(0), *map(np.ravel, jax.tree.leaves(state.model_state))])
    np.savez(
        out,
        losses=np.array(losses),
        params=params,
        stats=stats,
        reduce_types=np.array(reduce_types),
        reduce_sizes=np.array(reduce_sizes, np.int64),
        num_params=params.size,
        num_param_leaves=len(jax.tree.leaves(state.params)),
        collectives_total=collectives[0],
        collectives_in_loop=collectives[1],
    )


main()
