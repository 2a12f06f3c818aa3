#!/usr/bin/env bash
# A lent GPU machine's session, one part per device call; what each part does, what it writes
# and the variables (OUT, JDDP_GPU_DEADLINE_S, JDDP_GPU_SMOKE_INSTALL, JDDP_GPU_SITE, PY) are in
# experiments/README.md, "On a lent GPU". Run ON the GPU machine from the repo root, with the
# ".whl" of `bash scripts/gpu_wheels.sh` carried:
#   bash experiments/gpu_session.sh PART [PART ...]    PART: suite|mpi|bench|torch|e2e|bench2|tune|lm|shard|finite|all
#   bash experiments/gpu_session.sh --smoke PART ...   (or JDDP_GPU_SMOKE=1) on a CPU, tiny sizes
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=${JDDP_GPU_SMOKE:-0}
if [ "${1:-}" = --smoke ]; then SMOKE=1; shift; fi
[ $# -ge 1 ] || { sed -n '2,7p' "$0"; exit 2; }
PARTS=("$@")
[ "${PARTS[0]}" = all ] && PARTS=(mpi suite bench bench2)
for p in "${PARTS[@]}"; do
  case $p in suite | mpi | bench | torch | e2e | bench2 | tune | lm | shard | finite) ;; *) echo "gpu_session: unknown part '$p'" >&2; exit 2 ;; esac
done
OUT=${OUT:-experiments/results/gpu-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
DEADLINE=${JDDP_GPU_DEADLINE_S:-540}
WORK=$(mktemp -d /tmp/jddp-gpu.XXXXXX)  # run folders, bundled into $OUT/<part>-logs.tar.gz
trap 'rm -rf "$WORK"' EXIT
export OUT JDDP_GPU_SMOKE=$SMOKE PYTHONUNBUFFERED=1
declare -A RC
note() { echo "gpu_session: $*"; }
left() { echo $((DEADLINE - SECONDS)); }  # seconds left of this call

probe_trainer() {  # $1: label. One tiny training step on the CPU; its log kept in $WORK.
  local t0=$SECONDS log=$WORK/probe-$1.log
  JAX_PLATFORMS=cpu $PY -m jddp.train workdir="$WORK/probe-$1" model.width=4 data.name=synthetic \
    data.image_size=8 data.global_batch_size=8 train.steps=1 log.progress=off \
    checkpoint.async_save=false train.compilation_cache_dir=null > "$log" 2>&1
  local rc=$?
  [ $rc = 0 ] || tail -3 "$log"
  note "probe ($1 libraries): one training step on the CPU $([ $rc = 0 ] && echo ok || echo FAILED) in $((SECONDS - t0)) s"
  return $rc
}

# ---------------------------------------------------------------- prologue: interpreter, wheels
# On the GPU: the image's python3, the carried wheels installed into $SITE. Smoke: the repo's
# venv, nothing installed (JDDP_GPU_SMOKE_INSTALL=1: the prologue rehearsed with python3).
SITE=${JDDP_GPU_SITE:-/tmp/site}
INSTALL=1
[ "$SMOKE" = 1 ] && [ "${JDDP_GPU_SMOKE_INSTALL:-0}" != 1 ] && INSTALL=0
if [ $INSTALL = 0 ]; then
  PY=${PY:-$([ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || echo python3)}
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  MPI_BIN=$(dirname "$PY")
  note "smoke mode: $PY; the carried wheels are not installed (the venv has them)"
else
  PY=python3
  ls .whl/*.whl > /dev/null 2>&1 || { note "no .whl/: run 'bash scripts/gpu_wheels.sh' on the CPU machine and carry .whl"; exit 1; }
  # shellcheck disable=SC2046
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" $(ls .whl/*.whl | grep -v '/mpich-') || { note "wheel install failed"; exit 1; }
  export PYTHONPATH=$SITE:$PWD
  # An import does not show a flax/optax/orbax mismatch with the image's jax (flax 0.12.8 fails
  # only when a model is built on jax 0.11.2): one tiny training step on the CPU; if it fails,
  # drop the lock's flax for the image's, then optax and orbax too (env.json records which ran).
  if ! probe_trainer lock; then
    note "jddp does not train with the lock's flax on this jax: trying the image's flax"
    rm -rf "$SITE"/flax "$SITE"/flax-* "$SITE"/flaxlib_src
    if ! probe_trainer image-flax; then
      note "... nor with it: trying the image's optax and orbax-checkpoint too"
      rm -rf "$SITE"/optax "$SITE"/optax-* "$SITE"/orbax "$SITE"/orbax_checkpoint-*
      probe_trainer image-all || { note "jddp does not train here at all"; exit 1; }
    fi
  fi
  # MPICH's libmpi and mpirun must sit in the interpreter's prefix (lib/, bin/): mpi4py looks
  # for libmpi there, tests/helpers.py and benchlib.mpirun for mpirun next to sys.executable; pip
  # --target would drop the wheel's lib/.
  if $PY -m pip install -q --no-index --no-deps --no-cache-dir .whl/mpich-*.whl; then
    MPI_BIN=$(dirname "$($PY -c 'import sys; print(sys.executable)')")
    # The image also has Debian's Open MPI, which the mpi4py wheel finds first unless told: seen
    # 2026-11-24, mpi4jax then recorded Open MPI at build time and refused MPICH's mpirun.
    export MPI4PY_LIBMPI=$($PY -c 'import sys; print(sys.prefix)')/lib/libmpi.so.12
  else
    note "MPICH not installable into $($PY -c 'import sys; print(sys.prefix)'): using /tmp/mpich (tests expecting mpirun next to python will fail)"
    $PY -m pip install -q --no-index --no-deps --no-cache-dir --prefix /tmp/mpich .whl/mpich-*.whl
    MPI_BIN=/tmp/mpich/bin
    export PATH=/tmp/mpich/bin:$PATH LD_LIBRARY_PATH=/tmp/mpich/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export MPI4PY_LIBMPI=/tmp/mpich/lib/libmpi.so.12
  fi
  export JDDP_PREFER_COMMIT_FILE=1  # benchlib.checkout: .whl/gpu_commit.txt, not a stale .git
  note "python3 $($PY -c 'import sys; print(sys.executable, sys.version.split()[0])'); wheels in $SITE; MPICH in $MPI_BIN"
fi
if [ "$SMOKE" = 1 ]; then
  export JAX_PLATFORMS=cpu
  note "smoke mode: the CPU, tiny sizes; nothing here is a GPU measurement"
fi
unset MPI4JAX_USE_CUDA_MPI  # mpi4jax stages GPU buffers through the host (recorded in env.json)
MACHINE=gpu
case $(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1) in
  *H100*) MACHINE=h100 ;; *H200*) MACHINE=h200 ;;
esac
[ "$SMOKE" = 1 ] && MACHINE=smoke

# mpi4jax from the carried sdist, with its CUDA bridge (scripts/setup.sh's recipe: the MPICH
# mpicc, CUDA_PATH = the toolkit root that has include/cuda_runtime.h, no build isolation).
build_mpi4jax() {
  local sdist cuda="" nvcc root target=$SITE
  sdist=$(ls .whl/mpi4jax-*.tar.gz 2> /dev/null | head -1)
  if [ $INSTALL = 1 ] && $PY -c 'import mpi4jax' 2> /dev/null; then
    note "mpi4jax already importable"
    return 0
  fi
  [ -n "$sdist" ] || { note "no .whl/mpi4jax-*.tar.gz: the MPI tests and the mpi part will fail"; return 1; }
  # The venv's own mpi4jax stays the one imported in a plain smoke run: build into scratch.
  [ $INSTALL = 0 ] && target=$WORK/mpi4jax-build
  if [ "$SMOKE" = 1 ]; then
    cuda=$(mktemp -d)  # an empty CUDA_PATH: the CPU bridge only
  else
    nvcc=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2> /dev/null | head -1)
    for root in "${CUDA_PATH:-}" "${CUDA_HOME:-}" ${nvcc:+"$(dirname "$(dirname "$(readlink -f "$nvcc")")")"} /usr/local/cuda; do
      if [ -n "$root" ] && [ -f "$root/include/cuda_runtime.h" ]; then cuda=$root; break; fi
    done
    if [ -z "$cuda" ]; then
      root=$(find /usr/local /opt -name cuda_runtime.h -path '*/include/*' 2> /dev/null | head -1)
      [ -n "$root" ] && cuda=$(dirname "$(dirname "$root")")
    fi
    [ -n "$cuda" ] || { note "no CUDA toolkit with include/cuda_runtime.h (nvcc: ${nvcc:-none}); set CUDA_PATH"; return 1; }
    export LD_LIBRARY_PATH=$cuda/lib64:$cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
  note "building mpi4jax ($sdist) with CUDA_PATH=$cuda MPICC=$MPI_BIN/mpicc into $target"
  local t0=$SECONDS
  # The link line lists -L/usr/lib/x86_64-linux-gnu before the wrapper's own library folder, so
  # on the GPU image (which also has Debian's Open MPI) -lmpi found Open MPI's libmpi.so.40 and
  # mpi4jax refused MPICH's mpirun at run time (seen 2026-11-24): LDFLAGS puts MPICH's lib first.
  local mpi_lib
  mpi_lib=$(dirname "$MPI_BIN")/lib
  LDFLAGS="-L$mpi_lib -Wl,-rpath,$mpi_lib${LDFLAGS:+ $LDFLAGS}" \
  PATH="$MPI_BIN:$PATH" CUDA_PATH="$cuda" MPI4JAX_BUILD_MPICC="$MPI_BIN/mpicc" \
    $PY -m pip install -v --no-index --no-deps --no-build-isolation --no-cache-dir \
    --target "$target" "$sdist" > "$WORK/mpi4jax-build.log" 2>&1 \
    || { tail -30 "$WORK/mpi4jax-build.log"; note "mpi4jax build FAILED"; return 1; }
  grep -a "CUDA INFO" "$WORK/mpi4jax-build.log" | tail -1
  PYTHONPATH=$target:$PYTHONPATH $PY -c 'import mpi4jax as m; print("gpu_session: mpi4jax", m.__version__, "from", m.__file__, "cuda bridge:", m.has_cuda_support())'
  # which libmpi the bridges will load (MPICH's is libmpi.so.12, Open MPI's libmpi.so.40)
  find "$target/mpi4jax" -name 'mpi_xla_bridge_*.so' -exec sh -c 'echo "gpu_session: $(basename "$1"): $(ldd "$1" | grep -o "libmpi[^ ]* => [^ ]*")"' _ {} \;
  note "mpi4jax built in $((SECONDS - t0)) s"
}

bundle() {  # $1: part; its run folders (no checkpoints) -> $OUT/$1-logs.tar.gz
  [ -d "$WORK/$1" ] || return 0
  [ -f "$WORK/mpi4jax-build.log" ] && cp "$WORK/mpi4jax-build.log" "$WORK/$1/"
  tar czf "$OUT/$1-logs.tar.gz" -C "$WORK/$1" --exclude=checkpoints --exclude='*.npz' . \
    && note "$OUT/$1-logs.tar.gz $(du -h "$OUT/$1-logs.tar.gz" | cut -f1)"
}

# ---------------------------------------------------------------- parts
part_mpi() {
  mkdir -p "$WORK/mpi"
  $PY experiments/gpu_session.py mpi "$OUT" --logs "$WORK/mpi" 2>&1 | tee "$WORK/mpi/gpu_session.log"
  RC[mpi]=${PIPESTATUS[0]}
  bundle mpi
}

part_suite() {
  local budget n=${JDDP_SUITE_WORKERS:-8} args=() files
  read -r -a files <<< "${JDDP_SUITE_FILES:-tests}"  # e.g. JDDP_SUITE_FILES=tests/test_mpi.py
  [ "$SMOKE" = 1 ] && files=(tests/test_bench.py tests/test_xla_setup.py)
  # First, alone: the one test that trains on the GPU (skips without a GPU plugin).
  note "suite: tests/test_gpu.py first"
  timeout -s INT -k 30 $(($(left) - 60)) $PY -m pytest -q -p no:cacheprovider -rA \
    --junitxml="$OUT/junit-gpu.xml" tests/test_gpu.py 2>&1 | tee "$OUT/suite.log"
  RC[suite_gpu]=${PIPESTATUS[0]}
  budget=$(($(left) - 20))
  [ "$budget" -ge 60 ] || { note "suite: only $(left) s left, not started"; RC[suite]=124; return; }
  if $PY -c 'import xdist' 2> /dev/null; then
    # loadfile: a test file's module fixtures (e.g. test_mpi's reference runs) are built once.
    args=(-n "$n" --dist loadfile)
  else
    note "suite: no pytest-xdist here, tests run one at a time"
  fi
  [ "$SMOKE" = 1 ] && note "smoke: only ${files[*]}"
  note "suite: pytest ${args[*]} ${files[*]} with $budget s (SIGINT at the deadline keeps junit.xml)"
  # The suite forces JAX_PLATFORMS=cpu itself (tests/conftest.py).
  timeout -s INT -k 30 "$budget" $PY -m pytest -q -p no:cacheprovider --durations=30 -rfE \
    --junitxml="$OUT/junit.xml" --ignore=tests/test_gpu.py "${args[@]}" "${files[@]}" 2>&1 \
    | tee -a "$OUT/suite.log"
  RC[suite]=${PIPESTATUS[0]}
  case ${RC[suite]} in
    124 | 130 | 2) note "suite: CUT at the deadline (exit ${RC[suite]}): run the rest in a call of its own" ;;
  esac
  # pytest's last lines (-rfE) name every failure and the totals; junit.xml has the rest
  grep -E '^(FAILED|ERROR) |[0-9]+ (passed|failed)' "$OUT/suite.log" | tail -40
}

part_torch() {  # (a)
  mkdir -p "$WORK/bench"
  local budget reserve=${1:-15}
  budget=$(($(left) - reserve))
  if [ "$SMOKE" = 1 ]; then
    note "smoke: (a) as bench.py --quick on the CPU (the torch GPU rows need CUDA; torch is skipped when missing)"
    $PY experiments/bench.py --quick --configs jddp-1x1,torch-ddp-1x1 \
      --out "$OUT/bench-rn50.json" 2>&1 | tee "$WORK/bench/bench.log"
  else
    note "(a) bench.py ResNet-50 bf16, jddp vs torch eager vs torch.compile, $budget s at most"
    # 3 rounds x (jddp, torch eager, torch.compile): each run starts, compiles and trains anew
    timeout -s INT -k 20 "$budget" $PY experiments/bench.py --platform gpu \
      --preset resnet50-imagenet --dtypes bfloat16 \
      --configs jddp-1x1,torch-ddp-1x1,torch-ddp-1x1-compile --peak-tflops 989 \
      --rounds 3 --steps-per-round 20 --warmup 5 --machine "$MACHINE" \
      --out "$OUT/bench-rn50.json" 2>&1 | tee "$WORK/bench/bench.log"
  fi
  RC[torch]=${PIPESTATUS[0]}
  [ "${RC[torch]}" = 124 ] && note "(a) CUT at the deadline: no bench-rn50.json; run 'torch' in a call of its own"
}

part_e2e() {  # (c)
  mkdir -p "$WORK/bench"
  note "(c) end-to-end trainer throughput vs the input targets"
  $PY experiments/gpu_session.py e2e "$OUT" --logs "$WORK/bench" 2>&1 | tee "$WORK/bench/e2e.log"
  RC[e2e]=${PIPESTATUS[0]}
}

part_bench() {  # (a) then (c), which needs ~3 minutes
  part_torch 200
  part_e2e
  bundle bench
  # (a)'s table again, last, next to (c)'s (the tool returns only the output's tail)
  grep -A5 -- '^| config ' "$WORK/bench/bench.log" | tail -6 || true
}

part_bench2() {
  mkdir -p "$WORK/bench2"
  local smoke=()
  [ "$SMOKE" = 1 ] && smoke=(--smoke --steps 6)
  $PY experiments/bench_xla.py --platform gpu "${smoke[@]}" --machine "$MACHINE" \
    --out "$OUT/xla-gpu.json" --logs "$WORK/bench2" 2>&1 | tee "$WORK/bench2/bench_xla.log"
  RC[bench2]=${PIPESTATUS[0]}
  bundle bench2
}

part_tune() {  # issue 39's matrix at batch $JDDP_TUNE_BATCH (256; a second call: 384)
  mkdir -p "$WORK/tune"
  local b=${JDDP_TUNE_BATCH:-256} smoke=()
  [ "$SMOKE" = 1 ] && smoke=(--smoke --steps 6) && b=16,24
  $PY experiments/bench_xla.py --platform gpu --matrix tune --batches "$b" "${smoke[@]}" \
    --machine "$MACHINE" --out "$OUT/tune-$b.json" --logs "$WORK/tune" 2>&1 | tee "$WORK/tune/xla.log"
  RC[tune]=${PIPESTATUS[0]}
  bundle tune
}

part_lm() {  # the any-task GPT's tokens/s and MFU
  local lm=(--platform gpu --peak-tflops "${JDDP_GPU_PEAK_TFLOPS:-989}")
  [ "$SMOKE" = 1 ] && lm=(--quick)
  $PY experiments/bench_lm.py "${lm[@]}" --machine "$MACHINE" --out "$OUT/lm.json"
  RC[lm]=$?
}

part_shard() {  # issue 43: the ~100M GPT in bfloat16 under dist.shard none and full, remat
  local budget lm=(--platform gpu --peak-tflops "${JDDP_GPU_PEAK_TFLOPS:-989}" --size 100m
    --steps 120 --skip 40 --set train.precision=bfloat16 data.global_batch_size=256)
  # smoke: the config's small GPT on the CPU, a short eval (the 100M one takes minutes there)
  [ "$SMOKE" = 1 ] && lm=(--steps 8 --skip 2 --set data.global_batch_size=8 data.options.eval_every=400)
  budget=$(($(left) - 15))
  timeout -s INT -k 20 "$budget" $PY experiments/bench_lm.py "${lm[@]}" --configs 1x1 \
    --layouts "${JDDP_SHARD_LAYOUTS:-none,full,none+blocks}" --machine "$MACHINE" \
    --out "$OUT/lm-shard.json"
  RC[shard]=$?
}

part_finite() {  # the non-finite check computed once vs copied into every select: ResNet-50 bf16
  local fc=(${JDDP_FINITE_ARGS:-})
  [ "$SMOKE" = 1 ] && fc=(--smoke --steps 5 --rounds 1)
  $PY experiments/bench_finite_check.py "${fc[@]}" --machine "$MACHINE" --out "$OUT/finite-check.json"
  RC[finite]=$?
}

# ---------------------------------------------------------------- run
need_mpi4jax=0
for p in "${PARTS[@]}"; do [ "$p" = suite ] || [ "$p" = mpi ] && need_mpi4jax=1; done
# a suite of named files without the MPI tests needs no mpi4jax (its build takes a minute)
[[ -n "${JDDP_SUITE_FILES:-}" && "$JDDP_SUITE_FILES" != *mpi* && " ${PARTS[*]} " != *" mpi "* ]] \
  && need_mpi4jax=0
if [ $need_mpi4jax = 1 ]; then build_mpi4jax || RC[mpi4jax_build]=1; fi
$PY experiments/gpu_session.py env "$OUT" || RC[env]=1
for p in "${PARTS[@]}"; do
  note "=== $p ($(left) s left of ${DEADLINE} s) ==="
  "part_$p"
  case $p in torch | e2e) bundle bench ;; esac
done
echo
note "parts ${PARTS[*]} done in ${SECONDS} s; exit codes: $(for k in "${!RC[@]}"; do printf '%s=%s ' "$k" "${RC[$k]}"; done)"
ls -l "$OUT"
[ "$SMOKE" = 1 ] && note "smoke run: nothing here is a GPU measurement"
for k in "${!RC[@]}"; do [ "${RC[$k]}" = 0 ] || exit 1; done
exit 0
