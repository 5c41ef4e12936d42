#!/usr/bin/env bash
# compute-sanitizer's four tools over every kernel a backward launches (ours and cuBLAS's), on the
# 16 benchmark shapes and the edge shapes, each precision; a first (direct) run and a graph replay
# per shape (scripts/sanitize.py). Slow (memcheck ~10-100x): narrow it with the variables below.
#
#   bash scripts/sanitize.sh                                   # everything
#   SHAPES="2x64x77 1x100x93" TOOLS="memcheck" PRECISIONS="tf32" bash scripts/sanitize.sh
#
# RUN_SECONDS (default 600) bounds each tool × precision run: a run cut short still reports what
# it found (exit 124, and the kernels its reports name), so the next run gets its turn.
# Logs go to $OUT/sanitizer-logs when $OUT is set (the lent device machines), else ./sanitizer-logs;
# one line per run with compute-sanitizer's ERROR SUMMARY. Exit status 1 if any run reports an error.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD"
logs="${OUT:-$PWD}/sanitizer-logs"
mkdir -p "$logs"
suite="$(python3 -c 'from cupy_xattn import cases; print(" ".join(c.label for c in cases.load_suite("sol-execbench")))')"
SHAPES="${SHAPES:-$suite 1x1x77 2x64x1 1x256x512 1x691x77 2x853x93 3x130x33}"
TOOLS="${TOOLS:-memcheck racecheck initcheck synccheck}"
PRECISIONS="${PRECISIONS:-fp32 tf32 fp16}"
RUN_SECONDS="${RUN_SECONDS:-600}"
status=0
for tool in $TOOLS; do
    for precision in $PRECISIONS; do
        log="$logs/$tool-$precision.log"
        timeout "$RUN_SECONDS" compute-sanitizer --tool "$tool" --error-exitcode 1 \
            python3 scripts/sanitize.py --precision "$precision" $SHAPES > "$log" 2>&1
        rc=$?
        summary="$(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$log" | tail -1)"
        echo "$tool $precision: exit $rc; ${summary:-no summary (see $log)}"
        # Which kernels the reports point at (the logs may not come back from the device).
        grep -h -A1 "^========= [A-Z]" "$log" | grep -o "at [^ ]*" | sed 's/+0x[0-9a-f]*//' | sort | uniq -c | head -5
        [ $rc -eq 0 ] || status=1
    done
done
exit $status
