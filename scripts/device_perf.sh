#!/usr/bin/env bash
# One GPU-machine call for a forward change: the GPU suite, an A/B of every default forward tile
# against an older commit's kernels (same process, interleaved), and a tile sweep.
#   AB_REF      commit whose kernels_cu/ is the A/B baseline (default HEAD), or AB_DIR: such a folder
#   SWEEPS      "head_dim=tile;tile ..." (tiles as block_m,block_n,warps,stages), SWEEP_SEQLENS
#   SKIP_SUITE=1 skips the GPU suite
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
if [[ -z "${SKIP_SUITE:-}" ]]; then
    SKIP_BENCH=1 OUT=$OUT bash scripts/gpu_suite.sh > "$OUT/suite.out" 2>&1
    tail -3 "$OUT/suite.out"
fi
base=${AB_DIR:-}
if [[ -z "$base" ]]; then
    base=$(mktemp -d)/kernels_cu
    git archive "${AB_REF:-HEAD}" kernels_cu | tar -x -C "${base%/kernels_cu}"
fi
python benchmarks/ab_forward.py "$base" --head-dims "${AB_DIMS:-32,64,96,128,160,224,256}" --rounds 3 \
    2>&1 | tee "$OUT/ab.log" | cut -c1-90
# SWEEPS: "head_dim=tile;tile ..." items (tiles as block_m,block_n,warps,stages), space-separated.
for item in ${SWEEPS:-128=128,64,4,2;128,128,8,2 256=128,64,8,2;128,32,8,2}; do
    dim=${item%%=*}
    python benchmarks/bench_kernels.py --modes fwd --head-dims "$dim" --seqlens "${SWEEP_SEQLENS:-1024,4096,16384}" \
        --sweep --tiles "${item#*=}" --json "$OUT/sweep-d$dim.json" > "$OUT/sweep-d$dim.log" 2>&1
    tail -7 "$OUT/sweep-d$dim.log"
done
