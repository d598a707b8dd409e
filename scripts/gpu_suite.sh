#!/usr/bin/env bash
# GPU test suite + benchmarks in one go (for a machine with a CUDA GPU, run from the repo root).
# Logs go to $OUT (default ./gpu-logs).
#   PYTEST_ARGS  extra pytest arguments (e.g. "-k forward" or a list of test files)
#   BENCH_ARGS   arguments of benchmarks/bench_kernels.py; SKIP_BENCH=1 skips the benchmark
#   JOBS         processes for the parallel kernel compile that fills the cache first (default: nproc)
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
start=$SECONDS
python -m cuflash2 compile --jobs "${JOBS:-$(nproc)}" > "$OUT/compile.log" 2>&1
echo "compile: exit $? in $((SECONDS - start)) s, $(grep -c '^ok' "$OUT/compile.log") ok" | tee -a "$OUT/gpu.txt"
grep -v '^ok' "$OUT/compile.log" | head -20
start=$SECONDS
python -m pytest tests -m gpu -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest-gpu.log" | tail -40
echo "pytest: $((SECONDS - start)) s" | tee -a "$OUT/gpu.txt"
if [[ -z "${SKIP_BENCH:-}" ]]; then
    python benchmarks/bench_kernels.py ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
fi
