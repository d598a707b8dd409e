#!/usr/bin/env bash
# Nsight Compute over one forward pass of cuflash2 and of FA2 (torch SDPA flash) on the same
# inputs, at SEQLEN (default 4096; batch x seqlen = 16k, model dim 2048): speed of light, occupancy,
# launch statistics and warp stall reasons. CASES lists head_dim:causal|full (default 256:full).
# Logs to $OUT/ncu-fwd-d<dim>-<causal>-<seqlen>.txt.
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
seqlen=${SEQLEN:-4096}
for case in ${CASES:-256:full}; do
    set -- ${case/:/ }
    log="$OUT/ncu-fwd-d$1-$2-$seqlen.txt"
    SEQLEN=$seqlen ncu --clock-control none -k regex:'flash_fwd' \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis \
        python scripts/profile_fwd.py "$1" "$2" > "$log" 2>&1
    echo "d$1 $2 seqlen $seqlen: exit $?"
    grep -E "^  [a-z_: ]*(flash|void)|Duration|Waves Per SM|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Issued Warp Per|No Eligible|L2 Hit Rate|Stall" \
        "$log" | sed 's/(const.*//' | cut -c1-120
done
