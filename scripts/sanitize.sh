#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over every kernel family on small odd
# shapes, CuPy pool disabled. Run on a GPU machine from the repo root; logs under $OUT.
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
python scripts/sanitize_driver.py > /dev/null  # compile (and cache) the kernels outside the sanitizer
status=0
for tool in memcheck racecheck synccheck initcheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 9 python scripts/sanitize_driver.py > "$OUT/sanitize-$tool.log" 2>&1
    rc=$?
    echo "$tool: exit $rc, $(grep -c '^ok' "$OUT/sanitize-$tool.log") cases; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize-$tool.log" | tail -1)"
    [ $rc -eq 0 ] || status=1
done
exit $status
