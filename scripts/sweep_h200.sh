#!/usr/bin/env bash
# The full benchmark run on the H200 (or any one-GPU machine), in one command:
#
#   scripts/sweep_h200.sh
#
# Times the 16 SOL-ExecBench cases at fp32, tf32 and fp16 (50 timed runs after 10
# warm-ups each, cold L2, rotated inputs), with the PyTorch and naive-CuPy baselines and
# the card's measured ceilings; writes benchmarks/h200-<UTC stamp>.json, copies it to
# benchmarks/h200-latest.json and regenerates BENCHMARKS.md from it (with the Wan2.2 JSON
# benchmarks/h200-wan22-latest.json where there is one). When $OUT is set
# (the lent device machines), the JSON and BENCHMARKS.md are copied there too.
#
# Overrides: PRECISIONS (default fp32,tf32,fp16), REPS (50), WARMUP (10), PYTHON (python3),
# CUPY_XATTN_GIT_COMMIT (the commit recorded; required where $OUT is set: the lent machines'
# copy of the repository carries the working tree, but its git metadata can be older, so git
# there names a stale commit, as BENCHMARKS.md once recorded "b76e44f+dirty" for a649f15).
# Runs from the checkout, no install: PYTHONPATH is set to the repo root.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${OUT:-}" ] && [ -z "${CUPY_XATTN_GIT_COMMIT:-}" ]; then
    echo "sweep_h200.sh: give CUPY_XATTN_GIT_COMMIT=<the checkout's short hash> (git here may be stale)" >&2
    exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python3}"
PRECISIONS="${PRECISIONS:-fp32,tf32,fp16}"
REPS="${REPS:-50}"
WARMUP="${WARMUP:-10}"

stamp="$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p benchmarks
json="benchmarks/h200-$stamp.json"

start=$SECONDS
"$PYTHON" -m cupy_xattn sweep --suite sol-execbench --precision "$PRECISIONS" \
    --reps "$REPS" --warmup "$WARMUP" --baselines --ceilings --format json --out "$json"
echo "sweep took $((SECONDS - start)) s; wrote $json" >&2

cp "$json" benchmarks/h200-latest.json
wan22=()  # the Wan2.2 suite's last sweep keeps its section of BENCHMARKS.md
[ -f benchmarks/h200-wan22-latest.json ] && wan22=(benchmarks/h200-wan22-latest.json)
"$PYTHON" scripts/write_benchmarks_md.py benchmarks/h200-latest.json "${wan22[@]}" -o BENCHMARKS.md
"$PYTHON" -c 'import json, sys; from cupy_xattn import bench; sys.stdout.write(bench.format_rows(json.load(open(sys.argv[1])), "table"))' "$json"

if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    mkdir -p "$OUT/benchmarks"
    cp benchmarks/h200-latest.json "$OUT/benchmarks/"  # one JSON: the device tool returns few files
    cp BENCHMARKS.md "$OUT/"
    echo "copied the JSON and BENCHMARKS.md to $OUT" >&2
fi
