#!/usr/bin/env bash
# The GPU check of docs/gpu.md: on a machine with one CUDA GPU, at most 8 minutes, prints one
# JSON object (bench/gpu_check.py says what it measures).
#
#   scripts/gpu_check.sh [--dry-run] [--out FILE]
#
# It uses the machine's own python and torch (a CUDA build): the repository goes on PYTHONPATH
# instead of being installed, so pyproject's torch>=2.13 never replaces the machine's torch.
# Wheels the machine lacks can be carried in gpu_wheels/ (or $KVMESH_GPU_WHEELS); they are
# installed with --no-deps into .gpu_deps/ first. --dry-run rehearses on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${KVMESH_GPU_WHEELS:-gpu_wheels}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    "$PY" -m pip install --quiet --no-deps --target .gpu_deps "$WHEELS"/*.whl
fi
export PYTHONPATH="$PWD:$PWD/.gpu_deps${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 480 "$PY" -m kvmesh.bench.gpu_check "$@"
