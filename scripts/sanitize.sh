#!/usr/bin/env bash
# compute-sanitizer's four tools over our kernels, on the 16 benchmark shapes and the edge shapes
# (head_dim 128 ones included), each precision:
#   memcheck, synccheck: the whole library call per shape (scripts/sanitize.py: backward direct
#     and replayed, backward with padded text lengths, forward), with only our kernels
#     instrumented (KERNELS): cuBLAS then runs at full speed, so every shape fits;
#   racecheck, initcheck: our kernels alone (scripts/initcheck_probe.py kernels: both attention
#     kernels and the dK/dV reduction, every text token and padded lengths, fp16 K0|V0 where the
#     backward reads it, tf32's O^T and dQ^T layouts; the fp16 scaling, the
#     fp32 mode's remainders and the tf32 mode's transposes on tensors of the backward's sizes). initcheck
#     does not see cuBLAS's sm_90 kernels write their outputs and flags every later read of them;
#     racecheck with cuBLAS left uninstrumented made a cuBLAS GEMM fault (H200, 9fbd32d), and
#     instrumenting cuBLAS too takes minutes per small shape (docs/reliability.md).
#
#   bash scripts/sanitize.sh                                   # everything
#   SHAPES="2x64x77 1x100x93:256:2" TOOLS="memcheck" PRECISIONS="tf32" bash scripts/sanitize.sh
#
# RUN_SECONDS (default 600) bounds each tool × precision run: a run cut short still reports what
# it found (exit 124, and the kernels its reports name), so the next run gets its turn.
# Logs go to $OUT/sanitizer-logs when $OUT is set (the lent device machines), else ./sanitizer-logs;
# one line per run with compute-sanitizer's ERROR SUMMARY. Exit status 1 if any run reports an error,
# finds an output not finite (the drivers exit 1: outputs start as NaN), or is cut short.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD"
logs="${OUT:-$PWD}/sanitizer-logs"
mkdir -p "$logs"
suite="$(python3 -c 'from cupy_xattn import cases; print(" ".join(c.label for c in cases.load_suite("sol-execbench")))')"
edges="1x1x77 2x64x1 1x256x512 1x691x77 2x853x93 3x130x33 2x64x77:256:2 1x100x93:256:2 2x300x512:256:2"
SHAPES="${SHAPES:-$suite $edges}"
TOOLS="${TOOLS:-memcheck racecheck synccheck initcheck}"
PRECISIONS="${PRECISIONS:-fp32 tf32 fp16}"
RUN_SECONDS="${RUN_SECONDS:-600}"
KERNELS="${KERNELS:-attn_ half_ transposed_copies}"  # name substrings: every __global__ in kernels_cu/
status=0
for tool in $TOOLS; do
    for precision in $PRECISIONS; do
        log="$logs/$tool-$precision.log"
        if [ "$tool" = initcheck ] || [ "$tool" = racecheck ]; then
            command=(python3 scripts/initcheck_probe.py --precision "$precision" kernels $SHAPES)
            only=()
        else
            command=(python3 scripts/sanitize.py --precision "$precision" $SHAPES)
            only=()
            for name in $KERNELS; do only+=(--kernel-name "kns=$name"); done
        fi
        timeout "$RUN_SECONDS" compute-sanitizer --tool "$tool" ${only[@]+"${only[@]}"} --error-exitcode 1 "${command[@]}" \
            > "$log" 2>&1
        rc=$?
        summary="$(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$log" | tail -1)"
        echo "$tool $precision: exit $rc; $(grep -c "finite: True\|: finite" "$log") shape runs finite;" \
             "${summary:-no summary (see $log)}"
        # Which kernels the reports point at (the logs may not come back from the device).
        grep -h -A1 "^========= [A-Z]" "$log" | grep -o "at [^ ]*" | sed 's/+0x[0-9a-f]*//' | sort | uniq -c | head -5
        [ $rc -eq 0 ] || status=1
    done
done
exit $status
