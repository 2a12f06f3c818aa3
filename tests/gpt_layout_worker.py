"""The GPT of ``examples/lm_stdlib.py`` (2 layers, dropout 0.1) on 4 fake devices, 6 steps with
2 micro-batches each, under ``dist.shard`` none and full from the same start on the same
batches; prints ``{kind: [loss, ...]}`` as JSON (``test_shard_update.py`` compares them), with
``"memory"``: XLA's memory analysis of a wider GPT's fully sharded step, whose parameters
outweigh its activations (compiled, not run), and its parameters' bytes; and ``"edges"``: the
same for :class:`EdgeLM`, whose modules meet each case of ``jddp.models.units`` (``none``,
``full`` losses and the classes whose calls gathered their own parameters).

``python gpt_layout_worker.py`` in a subprocess with 4 fake devices, from the repository root.
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # examples.lm_stdlib, as from the repository root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jddp.models.units as units  # noqa: E402
from jddp import XlaComm, load_config  # noqa: E402
from jddp.build import build_layout, build_model, build_steps  # noqa: E402
from jddp.data.loader import place_batch, process_rows_of  # noqa: E402
from jddp.mesh import make_mesh  # noqa: E402
from jddp.optimizer import make_optimizer  # noqa: E402
from jddp.proc.xla import enable_compilation_cache  # noqa: E402
from jddp.state import create_train_state  # noqa: E402

# jddp's persistent compilation cache, as `python -m jddp.train` uses it: a rerun of the suite
# loads these nine steps instead of compiling them again.
enable_compilation_cache(load_config().train.compilation_cache_dir)

ROWS = 64


class Tagged(nnx.Module, pytree=False):
    """A leaf holder, not a pytree, whose call takes a Python flag, sows a value and returns a
    non-array with its array."""

    def __init__(self, width: int, rngs: nnx.Rngs):
        self.scale = nnx.Param(1.0 + 0.1 * jax.random.normal(rngs.params(), (width,)))

    def __call__(self, x, *, double: bool = False):
        self.sow(nnx.Intermediate, "mean", x.mean())
        return (x * self.scale[...] * (2.0 if double else 1.0), "tag")


class EdgeLM(nnx.Module):
    """Next-byte logits through: an embedding whose table the head reads too (``attend``: a read
    outside its own call), BatchNorm called with a keyword flag (statistics in and out of the
    checkpoint), :class:`Tagged`, dropout, and a parameter held by the root itself (whose
    sub-modules hold parameters: read whole)."""

    def __init__(self, config=None, dtype=None, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.embed = nnx.Embed(256, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.tagged = Tagged(32, rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((256,)))

    def __call__(self, tokens, lengths=None):
        x = self.embed(tokens.astype(jnp.int32))
        x = self.norm(x, use_running_average=False)
        x, tag = self.tagged(x, double=True)
        assert tag == "tag"
        return self.embed.attend(self.drop(x)) + self.bias[...]


def gpt_config(kind: str, rows: int, *overrides: str):
    return load_config(str(ROOT / "configs" / "lm_stdlib.yaml"), [
        f"data.global_batch_size={rows}", f"dist.shard={kind}", *overrides
    ])  # fmt: skip


def full_step_memory(mesh) -> dict[str, int]:
    """The compiled ``dist.shard=full`` step of a 4-layer GPT of width 256 at 2 sequences of
    16 bytes per device, plain SGD: its temporaries, and its parameters' whole bytes."""
    rows = 8
    cfg = gpt_config("full", rows, "model.options.width=256", "model.options.layers=4",
                     "model.options.heads=4", "model.options.seq_len=16", "optim.name=sgd",
                     "optim.momentum=0")  # fmt: skip
    comm = XlaComm()
    tx, schedule = make_optimizer(cfg.optim, rows, 100)
    model_def, state = create_train_state(build_model(cfg, nnx.Rngs(0)), tx, mesh)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    layout = build_layout(cfg, mesh, comm)
    state = layout.place(state)
    step, _ = build_steps(cfg, model_def, tx, mesh, comm, schedule=schedule, layout=layout)
    batch = {"tokens": np.ones((rows, 17), np.uint8), "lengths": np.full(rows, 17, np.int32)}
    placed = {"data": place_batch(batch, mesh, process_rows_of(mesh, rows))}
    stats = step.lower(state, placed).compile().memory_analysis()
    return {"temp_bytes": int(stats.temp_size_in_bytes), "param_bytes": int(param_bytes)}


def remat_memory(mesh) -> dict[str, dict[str, int]]:
    """XLA's temporaries of the fully sharded step of ResNet-10 and of a 4-layer GPT (4
    sequences of 64 bytes per device), with and without ``model.remat=blocks``."""
    models = {
        "resnet10": (["model.name=resnet10", "model.width=8", "data.name=synthetic",
                      "data.image_size=16", "train.loss=null"],
                     {"images": np.zeros((16, 16, 16, 3), np.uint8),
                      "labels": np.zeros(16, np.int32)}),
        "gpt": (["model.options.width=64", "model.options.layers=4", "model.options.heads=2",
                 "model.options.seq_len=64"],
                {"tokens": np.ones((16, 65), np.uint8), "lengths": np.full(16, 65, np.int32)}),
    }  # fmt: skip
    out = {}
    for name, (overrides, batch) in models.items():
        out[name] = {}
        for remat in ("none", "blocks"):
            cfg = gpt_config("full", 16, *overrides, f"model.remat={remat}", "optim.name=sgd")
            comm = XlaComm()
            tx, schedule = make_optimizer(cfg.optim, 16, 100)
            model_def, state = create_train_state(build_model(cfg, nnx.Rngs(0)), tx, mesh)
            layout = build_layout(cfg, mesh, comm)
            state = layout.place(state)
            step, _ = build_steps(cfg, model_def, tx, mesh, comm, schedule=schedule, layout=layout)
            placed = {"data": place_batch(batch, mesh, process_rows_of(mesh, 16))}
            stats = step.lower(state, placed).compile().memory_analysis()
            out[name][remat] = int(stats.temp_size_in_bytes)
    return out


def losses_of(mesh, batches, make_model, *overrides: str) -> dict[str, list[float]]:
    """``{kind: [loss, ...]}`` of the model ``make_model(cfg)`` under ``dist.shard`` none and
    full, from the same start on ``batches``."""
    losses = {}
    for kind in ("none", "full"):
        cfg = gpt_config(kind, ROWS, *overrides)
        comm = XlaComm()
        tx, schedule = make_optimizer(cfg.optim, ROWS, 100)
        model_def, state = create_train_state(make_model(cfg), tx, mesh)
        layout = build_layout(cfg, mesh, comm)
        state = layout.place(state)
        step, _ = build_steps(cfg, model_def, tx, mesh, comm, schedule=schedule, layout=layout)
        where = process_rows_of(mesh, ROWS)
        losses[kind] = []
        for batch in batches:
            state, metrics = step(state, {"data": place_batch(batch, mesh, where)})
            losses[kind].append(float(metrics["train/loss"]))
    return losses


def main() -> None:
    mesh = make_mesh(jax.devices()[:4])
    rng = np.random.default_rng(0)
    batches = [
        {
            "tokens": rng.integers(1, 256, (ROWS, 33)).astype(np.uint8),
            "lengths": rng.integers(2, 34, ROWS).astype(np.int32),
        }
        for _ in range(6)
    ]
    gpt = [
        "model.options.width=64", "model.options.layers=2", "model.options.heads=2",
        "model.options.seq_len=32", "model.options.dropout=0.1", "train.grad_accum_steps=2",
    ]  # fmt: skip
    losses = losses_of(mesh, batches, lambda cfg: build_model(cfg, nnx.Rngs(0)), *gpt)
    units._UNIT_CLASSES.clear()
    edges = losses_of(mesh, batches[:3], lambda cfg: EdgeLM(), "model.options.seq_len=32")
    edges["bound"] = sorted({cls.__name__ for cls, kind in units._UNIT_CLASSES if kind == "leaf"})
    memory = full_step_memory(mesh)
    print(json.dumps({**losses, "memory": memory, "edges": edges, "remat": remat_memory(mesh)}))


if __name__ == "__main__":
    main()
