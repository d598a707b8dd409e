#!/usr/bin/env bash
# One GPU-machine call for a decoding change: host cost per call (profile_calls), the split sweep,
# the decode benchmark against torch's backends, ncu of the decode and combine kernels, the KV-cache
# GPU tests. Logs under $OUT. NCU_CASES="batch kv_len ..." pairs; SKIP_TESTS=1 skips the tests;
# TILES=1 adds the tile sweep (bench_decode_tiles.py).
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
if [[ -z "${SKIP_TESTS:-}" ]]; then
    python -m pytest -q -m gpu -p no:cacheprovider tests/test_kvcache_gpu.py > "$OUT/pytest-kvcache.log" 2>&1
    tail -3 "$OUT/pytest-kvcache.log"
fi
python scripts/profile_calls.py decode decode-torch > "$OUT/profile_calls.log" 2>&1
grep -E "wall per call" "$OUT/profile_calls.log"
python benchmarks/bench_decode_splits.py > "$OUT/splits.log" 2>&1
cat "$OUT/splits.log"
python -m cuflash2 bench --decode --compare torch-flash,torch-cudnn > "$OUT/decode.log" 2>&1
tail -42 "$OUT/decode.log"
if [[ -n "${TILES:-}" ]]; then
    python benchmarks/bench_decode_tiles.py > "$OUT/tiles.log" 2>&1
    cat "$OUT/tiles.log"
fi
set -- ${NCU_CASES:-1 65536 1 2048}
while [[ $# -ge 2 ]]; do
    timeout 120 ncu --clock-control none --kernel-name regex:"kvcache|decode|combine" --launch-skip 4 --launch-count 2 \
        --section SpeedOfLight --section LaunchStats --section Occupancy \
        python scripts/profile_decode.py "$1" "$2" > "$OUT/ncu-decode-$1-$2.log" 2>&1
    echo "ncu batch $1 kv $2:"; grep -E "^  [a-z_ ]*void|Duration|DRAM Throughput" "$OUT/ncu-decode-$1-$2.log" | cut -c1-60
    shift 2
done
