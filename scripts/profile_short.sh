#!/usr/bin/env bash
# Nsight Compute over every kernel of one backward pass, cuflash2's (dot, fused, convert) and FA2's,
# at a short sequence (SEQLEN, default 1024; batch x seqlen = 16k): where the time goes when each key
# block has few query blocks. Logs to $OUT/ncu-short-d<dim>-<causal>.txt.
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
for case in ${CASES:-128:causal 64:full}; do  # head_dim:causal|full
    set -- ${case/:/ }
    SEQLEN=${SEQLEN:-1024} ncu --clock-control none -k regex:'flash_bwd|dq_dk_dv|dot_do_o|convert' \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        python scripts/profile_bwd.py "$1" "$2" fused-only > "$OUT/ncu-short-d$1-$2.txt" 2>&1
    echo "d$1 $2: exit $?"
    grep -E "^  [a-z_: ]*(flash|void)|Duration|Waves Per SM|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput" \
        "$OUT/ncu-short-d$1-$2.txt" | sed 's/(const.*//' | cut -c1-110
done
