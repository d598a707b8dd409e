#!/usr/bin/env bash
# Where the fused backward's warps wait: Nsight Compute's per-instruction stall sampling (SASS view)
# of the fused kernel and FA2's, at seqlen 4k (scripts/profile_bwd.py). Logs to $OUT:
#   src-d<dim>.csv  per SASS instruction: executed count and sampled stall reasons
#   ncu-src-d<dim>.txt  the summary sections
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
for dim in ${DIMS:-64 128}; do
    ncu --clock-control none -k regex:'flash_bwd_fused|dq_dk_dv' \
        --section WarpStateStats --section SourceCounters --section SpeedOfLight \
        -o "$OUT/src-d$dim" -f python scripts/profile_bwd.py "$dim" ${CAUSAL:-full} fused-only > "$OUT/ncu-src-d$dim.log" 2>&1
    echo "d$dim: exit $?"
    ncu -i "$OUT/src-d$dim.ncu-rep" --page details > "$OUT/ncu-src-d$dim.txt" 2>&1
    ncu -i "$OUT/src-d$dim.ncu-rep" --page source --csv --print-source sass > "$OUT/src-d$dim.csv" 2>&1
    echo "  source page: $(wc -l < "$OUT/src-d$dim.csv") lines"
done
