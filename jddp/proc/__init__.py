"""What a jddp process sets up about itself before any training code runs, one job per module
(low in the package: it imports nothing of jddp but :mod:`jddp.errors` and :mod:`jddp.compat`):

* :mod:`~jddp.proc.versions`: installed jax/flax pairs known not to work, refused in one line;
* :mod:`~jddp.proc.cores`: the cores this process owns (as its launcher says) and its pinning;
* :mod:`~jddp.proc.xla`: XLA flags jddp chooses, the persistent compilation cache;
* :mod:`~jddp.proc.lifeline`: dying with the parent (a launcher's ranks, a rank's input workers);
* :mod:`~jddp.proc.signals`: stop signals (SIGTERM, SIGUSR1, SIGINT, SIGHUP) turned into a
  per-batch flag every process sees;
* :mod:`~jddp.proc.watchdog`: a thread that ends a run which made no progress for
  ``dist.step_timeout_s`` (one line, exit :data:`~jddp.errors.STALLED`);
* :mod:`~jddp.proc.outputs`: stdout and stderr read to the last byte before an MPI abort;
* :mod:`~jddp.proc.interrupt`: Ctrl-C as one line and exit 130 for the commands that save
  nothing (imports only ``os`` and ``signal``: installed in their first statement).

Python's garbage collector run less often while JAX traces, and the replaced functions of
JAX's compilation cache that :mod:`~jddp.proc.xla` installs, are in :mod:`jddp.compat`.
"""
