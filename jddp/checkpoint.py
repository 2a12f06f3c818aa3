"""Orbax checkpoints of the train state in ``workdir/checkpoints/<step>/``.

Orbax writes each step to a temporary folder and renames it when complete, so a crash during a
save never leaves a half checkpoint under a step name. Saves are asynchronous: training goes on
while the previous save is written; :meth:`Checkpoints.close` waits for the last one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jddp.state import TrainState


class Checkpoints:
    """Save every ``every_steps`` steps (and on demand), keep the newest ``keep``, restore.

    Under ``jax.distributed`` every process calls :meth:`save` (orbax makes process 0 the
    primary host). With ``writes=False`` (MPI ranks other than 0, which share no JAX runtime
    and would each act as primary) the process only restores.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        every_steps: int,
        keep: int,
        async_save: bool,
        writes: bool = True,
    ):
        self.directory = Path(directory).absolute()
        self.every_steps = every_steps
        self.writes = writes
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                create=True,
                enable_async_checkpointing=async_save,
            ),
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def should_save(self, step: int) -> bool:
        """Whether the periodic schedule saves after optimizer step ``step``."""
        return self.every_steps > 0 and step % self.every_steps == 0

    def save(self, step: int, state: TrainState, config: dict[str, Any]) -> None:
        """Start saving ``state`` (and the resolved config, for reference) as ``step``.

        A no-op on processes that don't write (MPI ranks other than 0).
        """
        if not self.writes or step in self._manager.all_steps():
            return
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(config)
            ),
        )

    def restore(self, step: int, like: TrainState) -> TrainState:
        """Restore ``step`` with the shapes, dtypes and shardings of ``like``."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        )
        return restored["state"]

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
