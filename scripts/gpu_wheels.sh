#!/usr/bin/env bash
# Gather, on this (internet-connected) machine, the Python packages jddp needs that the lent GPU
# machine's image lacks, as cp312 manylinux x86_64 wheels in .whl/ (git-ignored), plus the
# mpi4jax sdist (built there by experiments/gpu_session.sh). Versions come from
# requirements.lock, so the GPU run uses what CI tests. Also records the checkout's commit in
# .whl/gpu_commit.txt (the tree travels to the GPU machine without .git; benchlib reads it).
# Idempotent; takes ~10 s once the files are there.
# Usage (repo root): bash scripts/gpu_wheels.sh          then carry ".whl" in the device run
#                    bash scripts/gpu_wheels.sh --commit  only refresh .whl/gpu_commit.txt
#                                                         (after a commit, before the next run)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
DEST=.whl
MPI4JAX_VERSION=0.9.1.post2   # as scripts/setup.sh
# Missing from the GPU image (/work/.library/device/KINDS.md): grain and its array-record,
# simplejpeg (the decoder; the image has opencv-python-headless), portpicker, tensorboardX,
# tzdata, the MPICH runtime (mpicc/mpirun). Carried at the lock's
# version although the image has them: flax, optax, orbax-checkpoint (pure Python, the versions
# CI tests), mpi4py (its MPI lookup must find the carried MPICH; mpi4jax builds against it) and
# nanobind (mpi4jax's build needs it; rehearsed: without it the build stops).
WHEELS="grain array_record simplejpeg portpicker tensorboardX tzdata mpich flax optax orbax-checkpoint mpi4py nanobind"
mkdir -p "$DEST"
record_commit() {  # "<short commit> clean|dirty" (tracked files only; .whl/ is ignored)
  local dirty
  dirty=$(git status --porcelain --untracked-files=no | wc -l)
  printf '%s %s\n' "$(git rev-parse --short HEAD)" "$([ "$dirty" = 0 ] && echo clean || echo dirty)" \
    > "$DEST/gpu_commit.txt"
  echo "gpu_wheels: $DEST/gpu_commit.txt = $(cat "$DEST/gpu_commit.txt")"
}
if [ "${1:-}" = --commit ]; then record_commit; exit 0; fi
lock_version() {  # the == version of $1 in requirements.lock (names compared case-insensitively)
  awk -F'==' -v n="$1" 'BEGIN{IGNORECASE=1; gsub(/[-_.]/, "_", n)}
    /^[^#]/ {k=$1; gsub(/[-_.]/, "_", k); if (tolower(k) == tolower(n)) print $2}' requirements.lock
}
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64"
for name in $WHEELS; do
  v=$(lock_version "$name")
  [ -n "$v" ] || { echo "gpu_wheels: $name is not in requirements.lock" >&2; exit 1; }
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp $PLATFORMS -d "$DEST" "$name==$v" 2>&1 \
    | { grep -v 'is ignored: it is neither' || true; }
done
# The sdist's metadata is prepared without build isolation (an isolated build env resolves jax
# and jaxlib from scratch and fails); only its metadata is read here, nothing is built.
"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary=:all: \
  --no-build-isolation -d "$DEST" "mpi4jax==$MPI4JAX_VERSION" 2>&1 \
  | { grep -v 'is ignored: it is neither' || true; }
# One version of each: a stale second one stops the install there.
"$PY" - "$DEST" <<'PYCHECK'
import collections, pathlib, re, sys
seen = collections.defaultdict(list)
for p in pathlib.Path(sys.argv[1]).glob("*-*.*"):
    seen[re.split(r"-\d", p.name, maxsplit=1)[0].lower().replace("_", "-")].append(p.name)
dups = {k: v for k, v in seen.items() if len(v) > 1}
if dups:
    sys.exit(f"gpu_wheels: more than one version in .whl/, delete the stale ones: {dups}")
PYCHECK

# What each wheel needs (the GPU machine has no registry): its Requires-Dist, less extras.
echo "gpu_wheels: Requires-Dist of the wheels (check each against KINDS.md's package list):"
for w in "$DEST"/*.whl; do
  deps=$(unzip -p "$w" '*.dist-info/METADATA' | { grep '^Requires-Dist' || true; } \
    | { grep -v 'extra ==\|Windows"\|win32"' || true; } | sed 's/^Requires-Dist: //; s/[ ;<>=!~(\[].*//' | sort -u | tr '\n' ' ')
  echo "  $(basename "$w"): ${deps:-none}"
done

# The commit of this checkout, for the results there (benchlib.machine_info reads it when there
# is no .git).
record_commit

ls -l "$DEST"
echo "gpu_wheels: .whl/ total $(du -sh "$DEST" | cut -f1)"
tracked=$(git ls-files -z | du -ch --files0-from=- | tail -1 | cut -f1)
echo "gpu_wheels: tracked files $tracked; travel limit 64 MiB (tracked + untracked + carried .whl)"
