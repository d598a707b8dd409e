#!/usr/bin/env bash
# Nsight Compute profile of the backward kernels next to FA2's (see scripts/profile_bwd.py); logs to $OUT.
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
# FUSED_ONLY=1: only the fused kernel and FA2's; MASK=causal: causal attention; EXTRA: more ncu
# arguments (sections, metrics); SEQLEN: see scripts/profile_bwd.py
for dim in ${DIMS:-128 64}; do
    ncu --clock-control none -k regex:'flash_bwd_kernel|flash_bwd_dq_kernel|flash_bwd_fused|dq_dk_dv' \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
        --section WarpStateStats --section Occupancy --section LaunchStats ${EXTRA:-} \
        python scripts/profile_bwd.py "$dim" "${MASK:-full}" ${FUSED_ONLY:+fused-only} > "$OUT/ncu-bwd-d$dim-${MASK:-full}.txt" 2>&1
    echo "d$dim: exit $?"
done
