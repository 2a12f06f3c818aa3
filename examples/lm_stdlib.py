"""A byte-level GPT trained on the Python standard library's own sources (text every Python ships).

    python examples/lm_stdlib.py [key=value ...]
    python -m jddp.launch --nproc 2 -- python examples/lm_stdlib.py
    python -m jddp.train --config configs/lm_stdlib.yaml    # the same run from the CLI

A causal transformer (learned positions, pre-LayerNorm blocks) reads source lines packed into
variable-length byte sequences of up to ``data.options.seq_len`` + 1 bytes, zero-padded; the
loss is each sequence's mean next-byte cross-entropy weighted by its number of real targets, so
jddp's objective is the exact mean over every real token of the global batch, whatever the
padding and the topology (``log.weight_unit=tokens``: tokens/s and eval/tokens are reported).
Held-out files (every 20th of the sorted list) give the eval loss, its perplexity and the
unigram baseline: the cross-entropy of the held-out bytes under the train bytes' frequencies.
The run's settings are ``configs/lm_stdlib.yaml``'s; ``key=value`` arguments override them.

Expected: see configs/lm_stdlib.yaml's header (measured in experiments/RESULTS.md, "Any task").
"""

from __future__ import annotations

import math
import sys
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jddp
from jddp.config import to_dict

VOCAB = 256  # bytes; 0 pads (it never occurs in the sources)
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "lm_stdlib.yaml"
DATA_OPTIONS = {"seq_len": 128, "eval_every": 20, "max_files": None}
MODEL_OPTIONS = {"width": 128, "layers": 4, "heads": 4, "dropout": 0.0, "seq_len": 128}


# -- data ------------------------------------------------------------------------------------


def stdlib_files(max_files: int | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted, without its test suites."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "test" not in p.relative_to(root).parts[0]
    )
    return files[:max_files] if max_files else files


def sequences(files: list[Path], seq_len: int) -> dict[str, np.ndarray]:
    """Each file's lines packed greedily into sequences of at most ``seq_len + 1`` bytes (a
    line is never split unless it alone is longer), zero-padded: ``tokens`` uint8
    ``[N, seq_len + 1]`` and ``lengths`` int32 ``[N]`` (real bytes; at least 2: one target)."""
    width = seq_len + 1
    chunks: list[bytes] = []
    for path in files:
        current = b""
        for line in path.read_bytes().splitlines(keepends=True):
            for start in range(0, len(line), width):
                piece = line[start : start + width]
                if len(current) + len(piece) > width:
                    chunks.append(current)
                    current = b""
                current += piece
        chunks.append(current)
    chunks = [c for c in chunks if len(c) >= 2]
    tokens = np.zeros((len(chunks), width), np.uint8)
    for i, chunk in enumerate(chunks):
        tokens[i, : len(chunk)] = np.frombuffer(chunk, np.uint8)
    return {"tokens": tokens, "lengths": np.array([len(c) for c in chunks], np.int32)}


def data(config: dict, seed: int = 0) -> tuple[dict, dict]:
    """Train and held-out sequences (every ``eval_every``-th file is held out). As
    ``data.name=examples.lm_stdlib:data`` it gets the ``data`` section."""
    options = {**DATA_OPTIONS, **(config.get("options") or {})}
    files = stdlib_files(options["max_files"])
    held_out = set(files[:: options["eval_every"]])
    train = sequences([f for f in files if f not in held_out], options["seq_len"])
    evals = sequences(sorted(held_out), options["seq_len"])
    return train, evals


def unigram_baseline(train: dict, evals: dict) -> float:
    """Cross-entropy (nats per byte) of the held-out targets under the train bytes'
    frequencies (add-one smoothed): what a model that ignores context scores."""

    def targets(split: dict) -> np.ndarray:
        t = split["tokens"][:, 1:]
        real = np.arange(t.shape[1])[None, :] < (split["lengths"][:, None] - 1)
        return t[real]

    counts = np.bincount(targets(train), minlength=VOCAB) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[targets(evals)].mean())


# -- model -----------------------------------------------------------------------------------


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, width: int, heads: int, dropout: float, dtype, rngs: nnx.Rngs):
        self.heads = heads
        self.ln1 = nnx.LayerNorm(width, rngs=rngs)
        self.qkv = nnx.Linear(width, 3 * width, dtype=dtype, rngs=rngs)
        self.proj = nnx.Linear(width, width, dtype=dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(width, rngs=rngs)
        self.fc1 = nnx.Linear(width, 4 * width, dtype=dtype, rngs=rngs)
        self.fc2 = nnx.Linear(4 * width, width, dtype=dtype, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x_BxTxD: jax.Array, mask_BxTxT: jax.Array) -> jax.Array:
        b, t, d = x_BxTxD.shape
        qkv = self.qkv(self.ln1(x_BxTxD)).reshape(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores_BxHxTxT = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32)
        scores_BxHxTxT = scores_BxHxTxT / math.sqrt(d // self.heads)
        scores_BxHxTxT = jnp.where(mask_BxTxT[:, None], scores_BxHxTxT, -1e9)
        attn = self.drop(jax.nn.softmax(scores_BxHxTxT, axis=-1)).astype(v.dtype)
        x_BxTxD = x_BxTxD + self.proj(jnp.einsum("bhts,bshd->bthd", attn, v).reshape(b, t, d))
        hidden = nnx.gelu(self.fc1(self.ln2(x_BxTxD)))
        return x_BxTxD + self.drop(self.fc2(hidden))


class GPT(nnx.Module):
    """Byte embeddings plus learned positions, ``layers`` blocks, a final LayerNorm and a linear
    head to the 256 next-byte logits (float32)."""

    def __init__(
        self,
        max_len: int,
        width: int = 128,
        layers: int = 4,
        heads: int = 4,
        dropout: float = 0.0,
        dtype=jnp.float32,
        *,
        rngs: nnx.Rngs,
    ):
        # the blocks in a list: model.remat=blocks recomputes each one's activations
        self.embed = nnx.Embed(VOCAB, width, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (max_len, width)))
        self.blocks = nnx.List([Block(width, heads, dropout, dtype, rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, VOCAB, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.dtype = dtype

    def __call__(self, tokens_BxT: jax.Array, lengths_B: jax.Array | None = None) -> jax.Array:
        """Next-byte logits ``[B, T, 256]``; position t sees bytes 0..t, and none past a
        sequence's ``lengths`` (its padding)."""
        t = tokens_BxT.shape[1]
        x = self.embed(tokens_BxT.astype(jnp.int32)) + self.pos[:t]
        mask_BxTxT = jnp.tril(jnp.ones((t, t), bool))[None]
        if lengths_B is not None:
            mask_BxTxT = mask_BxTxT & (jnp.arange(t)[None, None, :] < lengths_B[:, None, None])
        x = self.drop(x.astype(self.dtype))
        for block in self.blocks:
            x = block(x, mask_BxTxT)
        return self.head(self.ln(x).astype(jnp.float32))


def gpt(config: dict, dtype, rngs: nnx.Rngs) -> GPT:
    """``model.name=examples.lm_stdlib:gpt``: the model of the ``model.options`` (``seq_len``:
    the longest sequence it reads, at least ``data.options.seq_len``)."""
    options = {**MODEL_OPTIONS, **(config.get("options") or {})}
    return GPT(options.pop("seq_len"), **options, dtype=dtype, rngs=rngs)


# -- task ------------------------------------------------------------------------------------


def _next_byte(model: GPT, batch: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-position cross-entropy and correctness of the next-byte predictions, and the mask of
    real targets, each ``[B, T]``."""
    tokens = batch["tokens"].astype(jnp.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits_BxTxV = model(inputs, batch["lengths"])
    real_BxT = jnp.arange(targets.shape[1])[None, :] < (batch["lengths"][:, None] - 1)
    ce_BxT = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets)
    correct_BxT = jnp.argmax(logits_BxTxV, -1) == targets
    return ce_BxT, correct_BxT, real_BxT


def _per_sequence(value_BxT: jax.Array, real_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each sequence's mean over its real targets, weighted by their count."""
    tokens_B = real_BxT.sum(-1).astype(jnp.float32)
    return (value_BxT * real_BxT).sum(-1) / jnp.maximum(tokens_B, 1.0), tokens_B


def loss(model: GPT, batch: dict) -> tuple[jax.Array, jax.Array, dict]:
    """Mean next-byte cross-entropy of each sequence, weighted by its real targets; and, from
    the same forward pass, the next-byte accuracy (a separate metrics function would run the
    model again: jddp/tasks/custom.py)."""
    ce_BxT, correct_BxT, real_BxT = _next_byte(model, batch)
    accuracy = _per_sequence(correct_BxT.astype(jnp.float32), real_BxT)
    return *_per_sequence(ce_BxT, real_BxT), {"accuracy": accuracy}


def main(argv: list[str]) -> jddp.RunResult:
    jddp.initialize()  # joins the other processes under jddp.launch / mpirun / SLURM
    cfg = jddp.load_config(CONFIG, argv)
    sections = to_dict(cfg)  # the model and data sections, as the CLI hands them to factories
    train, evals = data(sections["data"], cfg.train.seed)
    model = gpt(sections["model"], jnp.float32, nnx.Rngs(cfg.train.seed))
    result = jddp.fit(model, None, train, evals, loss=loss, config=cfg)
    baseline = unigram_baseline(train, evals)
    if jax.process_index() == 0:
        ev = result.eval
        print(
            f"lm_stdlib: {len(train['lengths'])} train / {len(evals['lengths'])} held-out "
            f"sequences; held-out loss {ev['eval/loss']:.4f} nats/byte (perplexity "
            f"{math.exp(ev['eval/loss']):.2f}), next-byte accuracy {ev['eval/accuracy']:.4f}; "
            f"unigram baseline {baseline:.4f} nats/byte; {result.weight_per_s:.0f} tokens/s"
        )
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
