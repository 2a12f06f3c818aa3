#!/bin/bash
# jddp with mpirun across nodes. NOT run in CI. Two ways:
#   dist.backend=xla : mpirun only launches; jax.distributed + XLA collectives (NCCL on GPUs)
#   dist.backend=mpi : pmean over each process's local devices + mpi4jax across processes
#
#   HOSTS=node1:8,node2:8 bash examples/slurm/mpirun.sh 16 configs/digits.yaml dist.backend=xla
set -euo pipefail
NP=${1:?usage: mpirun.sh NUM_PROCESSES CONFIG.yaml [key=value ...]}
CONFIG=${2:?usage: mpirun.sh NUM_PROCESSES CONFIG.yaml [key=value ...]}
shift 2
.venv/bin/mpirun -np "$NP" ${HOSTS:+-hosts "$HOSTS"} \
  .venv/bin/python -m jddp.train --config "$CONFIG" "$@"
