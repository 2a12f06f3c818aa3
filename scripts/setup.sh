#!/usr/bin/env bash
# Set up jddp on a fresh machine: a virtualenv in .venv with the pinned dependencies
# (requirements.lock), jddp itself (editable), MPICH from PyPI, mpi4py and mpi4jax.
# Idempotent: a second run only checks. Usage: bash scripts/setup.sh
# Environment: PYTHON (interpreter, default python3), JDDP_VENV (default .venv),
#              JDDP_CUDA=1 (or 12) to also install jax[cuda12] and build mpi4jax's CUDA bridge;
#              JDDP_CUDA=13 the same with jax[cuda13] (CUDA 13 drivers).
#              JDDP_TENSORBOARD=1 to also install the TensorBoard viewer (pinned below).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${JDDP_VENV:-.venv}
MPI4JAX_VERSION=0.9.1.post2
JAX2ONNX_VERSION=0.17.1
case "${JDDP_CUDA:-0}" in
  0) cuda_extra="" ;;
  1 | 12) cuda_extra=cuda12 ;;
  13) cuda_extra=cuda13 ;;
  *) echo "setup: JDDP_CUDA=${JDDP_CUDA}: allowed 0 (CPU), 1 or 12 (jax[cuda12]), 13 (jax[cuda13])" >&2; exit 2 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q -r requirements.lock
"$PY" -m pip install -q --no-deps -e .
# jax2onnx (python -m jddp.export --format onnx) pins orbax-checkpoint<0.11.37 for an orbax-export
# feature jddp does not use; its real imports (onnx, onnx-ir, onnxruntime, equinox, dm_pix) are in
# requirements.lock, so it goes in without its declared dependencies.
"$PY" -m pip install -q --no-deps "jax2onnx==${JAX2ONNX_VERSION}"
if [ -n "$cuda_extra" ]; then
  "$PY" -m pip install -q -c requirements.lock -e ".[$cuda_extra]"
fi
if [ "${JDDP_TENSORBOARD:-0}" = 1 ]; then
  # Optional: runs write TensorBoard files without it (tensorboardX); this is the viewer.
  "$PY" -m pip install -q -c requirements.lock "tensorboard==2.21.0"
fi

# mpi4jax builds from source against the MPICH that requirements.lock installed into the
# venv (its mpicc lives in $VENV/bin). Its setup guesses the CUDA root from the nvcc on PATH;
# on machines whose nvcc folder has no CUDA headers that guess fails the build. So: with
# JDDP_CUDA set, use CUDA_PATH (or the toolkit root that holds include/cuda_runtime.h); otherwise
# point CUDA_PATH at an empty folder, which builds the CPU bridge only.
if ! "$PY" -c "import mpi4jax" 2>/dev/null; then
  cuda_path=""
  if [ -n "$cuda_extra" ]; then
    for root in "${CUDA_PATH:-}" "${CUDA_HOME:-}" /usr/local/cuda; do
      if [ -n "$root" ] && [ -f "$root/include/cuda_runtime.h" ]; then cuda_path=$root; break; fi
    done
    [ -n "$cuda_path" ] || { echo "setup: JDDP_CUDA=${JDDP_CUDA} but no CUDA toolkit with include/cuda_runtime.h found; set CUDA_PATH" >&2; exit 1; }
  else
    cuda_path=$(mktemp -d)
  fi
  echo "setup: building mpi4jax $MPI4JAX_VERSION (CUDA_PATH=$cuda_path)"
  PATH="$PWD/$VENV/bin:$PATH" CUDA_PATH="$cuda_path" MPI4JAX_BUILD_MPICC="$PWD/$VENV/bin/mpicc" \
    "$PY" -m pip install -q --no-build-isolation --no-cache-dir "mpi4jax==$MPI4JAX_VERSION"
fi

# Fail loudly if anything the project needs cannot be imported.
"$PY" - <<'PYCHECK'
import importlib, sys
missing = []
for name in ["jax", "flax", "optax", "orbax.checkpoint", "sklearn", "mpi4py", "mpi4jax", "jddp.train"]:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        missing.append(f"{name} ({type(e).__name__}: {e})")
if missing:
    sys.exit("setup: cannot import " + "; ".join(missing))
import jax
print(f"setup: ok (jax {jax.__version__}, devices: {jax.devices()})")
PYCHECK
