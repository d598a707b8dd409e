#!/usr/bin/env bash
# GPU test suite + benchmarks in one go (for a machine with a CUDA GPU, run from the repo root).
# Logs go to $OUT (default ./gpu-logs). Usage: bash tests/gpu_suite.sh [pytest -k expr] [bench args]
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
python -m pytest tests -m gpu -x -q ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest-gpu.log" | tail -30
python tests/bench_kernels.py ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
