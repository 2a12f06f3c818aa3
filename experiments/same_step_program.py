"""Whether two checkouts compile the ResNet train step to the same XLA program.

    .venv/bin/python experiments/same_step_program.py --before PATH [--width 16] [--batch 16]

``PATH``: another checkout (``git worktree add /tmp/before COMMIT``). In each, the trainer's step
for a ``resnet18`` is compiled for a uint8 batch and its optimised HLO made canonical (metadata
dropped, names replaced, lines sorted) and hashed: equal hashes, the same program. Exit 0 when
equal, 1 when not.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import benchlib

DUMP = r"""
import hashlib, re, sys
import numpy as np, optax
from flax import nnx
from jddp import XlaComm, build_steps, create_train_state, load_config, make_mesh
from jddp.data.loader import process_rows_of, place_batch
from jddp.models import resnet18
width, batch = int(sys.argv[1]), int(sys.argv[2])
cfg = load_config(None, [f"data.global_batch_size={batch}"])
mesh = make_mesh()
tx = optax.sgd(0.1, momentum=0.9)
model = resnet18(num_classes=10, width=width, rngs=nnx.Rngs(0))
model_def, state = create_train_state(model, tx, mesh)
step, _ = build_steps(cfg, model_def, tx, mesh, XlaComm())
rng = np.random.default_rng(0)
local = {"images": rng.integers(0, 255, (batch, 32, 32, 3), dtype=np.uint8),
         "labels": rng.integers(0, 10, batch).astype(np.int32)}
placed = {"data": place_batch(local, mesh, process_rows_of(mesh, batch))}
text = step.lower(state, placed).compile().as_text()
text = text[text.index("\n%"):]  # the computations: no header, no source-location tables
text = re.sub(r",?\s*stack_frame_id=\d+|,?\s*metadata=\{[^}]*\}", "", text)
text = re.sub(r"%[\w.\-]+", "%X", text)
text = re.sub(r"\b(region|reduce_sum|fusion|wrapped)\w*", "N", text)
lines = sorted(line.strip() for line in text.splitlines() if line.strip())
print(hashlib.sha256("\n".join(lines).encode()).hexdigest(), len(lines))
"""


def program(tree: Path, width: int, batch: int) -> tuple[str, int]:
    """The canonical program's hash and instruction count when ``tree``'s jddp compiles the
    step."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", DUMP, str(width), str(batch)],
        cwd=tree,  # python -c puts the working directory first on sys.path: this tree's jddp
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    digest, size = out.stdout.split()[-2:]
    return digest, int(size)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the other checkout")
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args(argv)
    before = program(Path(args.before), args.width, args.batch)
    after = program(benchlib.REPO, args.width, args.batch)
    print(f"before ({args.before}): {before[0][:16]} {before[1]:,} instruction lines")
    print(f"after  ({benchlib.REPO}): {after[0][:16]} {after[1]:,} instruction lines")
    print("the same program" if before == after else "different programs")
    return 0 if before == after else 1


if __name__ == "__main__":
    sys.exit(main())
