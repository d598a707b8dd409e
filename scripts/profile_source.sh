#!/usr/bin/env bash
# Where a backward kernel's warps wait: Nsight Compute's per-instruction stall sampling (SASS view).
# FAMILY=mma_sync (default): the fused kernel and FA2's at seqlen 4k (scripts/profile_bwd.py);
# FAMILY=wgmma: the Hopper backward's main kernel, one call of FA2's grid at $SEQLEN (default 2048;
# scripts/profile_hopper_bwd.py); FAMILY=wgmma-fwd: the Hopper forward, likewise
# (scripts/profile_fwd.py). CAUSAL=causal for causal calls. Logs to $OUT:
#   src-d<dim>.csv  per SASS instruction: executed count and sampled stall reasons
#   ncu-src-d<dim>.txt  the summary sections
# and prints scripts/stall_summary.py's digest of each (the instructions with 0.3% of the samples
# or more).
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
if [[ "${FAMILY:-mma_sync}" == wgmma ]]; then
    KERNELS='flash_bwd_sm90'; RUN=(python scripts/profile_hopper_bwd.py DIM "${CAUSAL:-full}" "${SEQLEN:-2048}")
    LIMIT=(-s 1 -c 1)
elif [[ "${FAMILY}" == wgmma-fwd ]]; then
    export SEQLEN=${SEQLEN:-2048}
    KERNELS='flash_fwd_sm90'; RUN=(python scripts/profile_fwd.py DIM "${CAUSAL:-full}")
    LIMIT=(-c 1)
else
    KERNELS='flash_bwd_fused|dq_dk_dv'; RUN=(python scripts/profile_bwd.py DIM "${CAUSAL:-full}" fused-only)
    LIMIT=()
fi
for dim in ${DIMS:-64 128}; do
    ncu --clock-control none -k regex:"$KERNELS" ${LIMIT[@]+"${LIMIT[@]}"} \
        --section WarpStateStats --section SourceCounters --section SpeedOfLight \
        -o "$OUT/src-d$dim" -f "${RUN[@]/DIM/$dim}" > "$OUT/ncu-src-d$dim.log" 2>&1
    echo "d$dim: exit $?"
    ncu -i "$OUT/src-d$dim.ncu-rep" --page details > "$OUT/ncu-src-d$dim.txt" 2>&1
    ncu -i "$OUT/src-d$dim.ncu-rep" --page source --csv --print-source sass > "$OUT/src-d$dim.csv" 2>&1
    echo "  source page: $(wc -l < "$OUT/src-d$dim.csv") lines"
    python scripts/stall_summary.py "$OUT/src-d$dim.csv" | head -${SUMMARY_LINES:-80}
done
