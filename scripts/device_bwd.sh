#!/usr/bin/env bash
# One GPU-machine call for a backward change: its GPU tests, the fused kernel against the two-kernel
# plan, the backward benchmark next to torch SDPA (FA2, cuDNN), optionally the sanitizer. Logs in $OUT.
#   TEST_K        pytest -k expression over tests/test_backward_gpu.py (default: all of it)
#   FUSED_DIMS    head dims of benchmarks/bench_fused_tiles.py (default "192 256")
#   DIMS SEQLENS  head dims / seqlens of the backward benchmark (default 256 / 1024,4096,16384)
#   SANITIZE=1    also scripts/sanitize.sh
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
start=$SECONDS
python -m pytest -q -p no:cacheprovider tests/test_backward_gpu.py ${TEST_K:+-k "$TEST_K"} > "$OUT/tests.log" 2>&1
echo "tests: exit $? in $((SECONDS - start)) s: $(tail -1 "$OUT/tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
python benchmarks/bench_fused_tiles.py ${FUSED_DIMS:-192 256} 2>&1 | tee "$OUT/fused.log"
python benchmarks/bench_kernels.py --modes bwd --head-dims "${DIMS:-256}" --seqlens "${SEQLENS:-1024,4096,16384}" \
    --json "$OUT/bwd.json" > "$OUT/bwd.log" 2>&1
grep -A40 "^mode" "$OUT/bwd.log"
if [[ -n "${SANITIZE:-}" ]]; then OUT=$OUT bash scripts/sanitize.sh; fi
