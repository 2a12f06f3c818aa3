"""A run's checkpoints, one job per module:

* :mod:`~jddp.checkpoint.store`: :class:`Checkpoints`, the orbax checkpoints of the train state
  in ``workdir/checkpoints/<step>/``: saved in the background, verified on restore;
* :mod:`~jddp.checkpoint.policy`: when a run saves (every k steps, by the clock, at eval steps
  for the best checkpoints), the one object the loop asks;
* :mod:`~jddp.checkpoint.manifest`: each leaf's path, shape, dtype and CRC-32;
* :mod:`~jddp.checkpoint.resume`: where a run resumes (its newest good checkpoint) and which
  config changes a resume allows;
* :mod:`~jddp.checkpoint.warm_start`: ``checkpoint.init_from`` (another run's weights, or
  pretrained tensors: :mod:`~jddp.checkpoint.pretrained`);
* :mod:`~jddp.checkpoint.find`: a run's checkpoint from a path, opened for reading;
* :mod:`~jddp.checkpoint.room`: whether the disk has room for the next checkpoint;
* :mod:`~jddp.checkpoint.orbax_quiet`: orbax's reports jddp makes itself, kept off the terminal.

How orbax writes (replicas' shares cut on the host on CPU devices, a failed save's other writes
awaited) is :mod:`jddp.compat.orbax_writes`: it relies on orbax's private modules.
"""

from jddp.checkpoint.store import Checkpoints

__all__ = ["Checkpoints"]
