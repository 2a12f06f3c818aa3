"""A training run: :mod:`~jddp.run.setup` assembles it from the config (:class:`Run`),
:mod:`~jddp.run.loop` runs its steps, :mod:`~jddp.run.hooks` do the periodic work (logging,
evals, checkpoints, sync checks, profiling), :mod:`~jddp.run.trainer` ties them together (lock,
loop, final eval and save, summary)."""
