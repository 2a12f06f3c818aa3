"""jddp: a JAX data-parallel trainer."""
