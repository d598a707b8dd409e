#!/usr/bin/env bash
# The closing GPU-machine run of a session, in two calls (each under the 10-minute limit):
#   PART=suite     the GPU suite (compile everything, every GPU test), the decode benchmark against
#                  torch's backends, the host cost of a decoding step
#   PART=sanitize  compute-sanitizer over every kernel family, then the decode benchmark once more
#   PART=grid      FA2's grid (forward and backward, GRID_DIMS / GRID_SEQLENS) next to torch's flash
#                  and cuDNN backends, then compute-sanitizer over every kernel family (no decoding)
#   PART=all       the GPU suite, FA2's whole grid (seqlen 512-16k unless GRID_SEQLENS) and the
#                  sanitizer, no decoding: about 8 minutes on an H200, one call
#   PART=shapes    issue 5's other shapes with `cuflash2 bench` (forward and backward, seqlen 4k):
#                  head dims 64/96/128/192, GQA (16 query / 4 kv heads), 2048 queries x 8192 keys
#   PART=cli       FA2's whole grid through `cuflash2 bench` (the public API on CuPy arrays, what
#                  issue 5 measures), forward then backward (MODES="fwd bwd"; DTYPE=bf16), JSON under $OUT:
#                  about 3 minutes a mode; HEAD_DIMS (e.g. 96,192) replaces the grid's 64,128,256
# Logs under $OUT.
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
if [[ "${PART:-suite}" == all ]]; then
    SKIP_BENCH=1 OUT=$OUT bash scripts/gpu_suite.sh > "$OUT/suite.out" 2>&1
    tail -4 "$OUT/suite.out"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest-gpu.log" | head -20
    PART=grid GRID_SEQLENS=${GRID_SEQLENS:-512,1024,2048,4096,8192,16384} OUT=$OUT bash "$0"
    exit 0
elif [[ "${PART:-suite}" == shapes ]]; then
    for mode in fwd bwd; do
        for extra in "--seqlen 4096 --head-dim 64,96,128,192" "--seqlen 4096 --head-dim 128 --heads-kv 4" \
                     "--seqlen 2048 --seqlen-k 8192 --head-dim 128"; do
            # shellcheck disable=SC2086
            python -m cuflash2 bench --mode $mode --compare torch-flash,torch-cudnn $extra
        done
    done > "$OUT/shapes.log" 2>&1
    grep -E "^(cuflash2|torch-flash) " "$OUT/shapes.log"
    exit 0
elif [[ "${PART:-suite}" == cli ]]; then
    for mode in ${MODES:-fwd bwd}; do
        name=cli-$mode-${DTYPE:-bf16}${HEAD_DIMS:+-d${HEAD_DIMS//,/-}}
        # shellcheck disable=SC2086
        python -m cuflash2 bench --mode $mode --dtype "${DTYPE:-bf16}" --compare torch-flash,torch-cudnn \
            ${HEAD_DIMS:+--head-dim $HEAD_DIMS} --format json -o "$OUT/$name.json" > "$OUT/$name.log" 2>&1
        grep -E "^(cuflash2|torch-flash) " "$OUT/$name.log"
    done
    exit 0
elif [[ "${PART:-suite}" == suite ]]; then
    SKIP_BENCH=1 OUT=$OUT bash scripts/gpu_suite.sh > "$OUT/suite.out" 2>&1
    tail -4 "$OUT/suite.out"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest-gpu.log" | head -20
elif [[ "${PART}" == grid ]]; then
    python benchmarks/bench_kernels.py --modes fwd,bwd --head-dims "${GRID_DIMS:-64,128,256}" \
        --seqlens "${GRID_SEQLENS:-1024,4096,16384}" --json "$OUT/grid.json" > "$OUT/grid.log" 2>&1
    grep -A80 "^mode" "$OUT/grid.log"
    OUT=$OUT bash scripts/sanitize.sh
    exit 0
else
    OUT=$OUT bash scripts/sanitize.sh
fi
python -m cuflash2 bench --decode --compare torch-flash,torch-cudnn > "$OUT/decode.log" 2>&1
tail -42 "$OUT/decode.log"
python scripts/profile_calls.py decode decode-torch > "$OUT/profile_calls.log" 2>&1
grep "wall per call" "$OUT/profile_calls.log"
