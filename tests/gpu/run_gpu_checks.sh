#!/usr/bin/env bash
# GPU verification: every check that needs a CUDA GPU, plus the timing table.
#
# Usage (from the repository root, on a machine with one or more GPUs):
#   bash tests/gpu/run_gpu_checks.sh [OUTDIR]
# Writes OUTDIR/env.txt, OUTDIR/pytest.log, OUTDIR/bench.log and
# OUTDIR/bench.json (default OUTDIR: ./gpu-check-out). Exits non-zero if a
# check fails. Needs torch with CUDA, CuPy (the cuda/cuda13 extra), pyzmq,
# msgspec, psutil, numpy, pytest and pytest-timeout importable.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-gpu-check-out}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  python3 -c 'import torch, sys; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda)'
  python3 -c 'import cupy; print("cupy", cupy.__version__, "runtime", cupy.cuda.runtime.runtimeGetVersion())' || true
  python3 -m coordinator.cli doctor || true
} 2>&1 | tee "$out/env.txt"

# Each step is bounded as a whole (GPU_CHECK_PYTEST_S, GPU_CHECK_BENCH_S seconds),
# on top of the tests' own per-test timeouts.
status=0
timeout -k 10 "${GPU_CHECK_PYTEST_S:-420}" python3 -m pytest tests/gpu -v -p no:cacheprovider \
  -o addopts="" --durations=15 2>&1 | tee "$out/pytest.log" || status=1
timeout -k 10 "${GPU_CHECK_BENCH_S:-300}" python3 -m coordinator.cli bench collectives \
  --device cuda --json "$out/bench.json" 2>&1 | tee "$out/bench.log" || status=1
echo "gpu checks exit status: $status"
exit $status
