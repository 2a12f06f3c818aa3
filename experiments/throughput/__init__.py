"""Training throughput benchmark: jddp vs PyTorch DistributedDataParallel, interleaved.

Run it as ``python experiments/bench.py ...`` (or ``python experiments/throughput ...``);
``experiments/README.md`` describes the method and the options. Modules: :mod:`.specs`
(workload, configurations), :mod:`.jddp_worker`, :mod:`.mpi_worker`, :mod:`.torch_worker`,
:mod:`.protocol` (the workers' side of the pipe), :mod:`.breakdown` (``--profile``),
:mod:`.runner` (process groups, environments, interleaved rounds), :mod:`.results` (records,
MFU, ratios), :mod:`.tables` (tables, plot), :mod:`.results_md` (RESULTS.md's generated tables),
:mod:`.cli` (the command line).
"""
