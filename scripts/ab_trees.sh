#!/usr/bin/env bash
# A/B of two or more checkouts on one GPU, in one device call: each tree's quick sweep (no
# baselines) of the same suite and precisions, run from inside the tree. (`python3 -m` puts the
# current folder first on sys.path, so PYTHONPATH=<tree> from elsewhere would time this checkout.)
#
#   git archive <commit> | tar -x -C .scratch/base     # a tree to compare, carried to the device
#   bash scripts/ab_trees.sh .scratch/base .           # PRECISIONS=fp32 REPS=30 WARMUP=5 SUITE=wan22-a14b TAG=fp32-
#
# Prints each tree's per-case table and suite means; JSON per tree to $OUT (or .) as ab-<TAG><n>.json
# (give each run of one device call its own TAG: a second run would overwrite the first's files);
# then scripts/ab_compare.py's deltas against tree 1 of every run in that folder so far.
set -uo pipefail
PRECISIONS="${PRECISIONS:-tf32,fp16,fp32}"
REPS="${REPS:-30}"
WARMUP="${WARMUP:-5}"
SUITE="${SUITE:-sol-execbench}"
TAG="${TAG:-}"
out="${OUT:-$PWD}"
n=0
status=0
for tree in "$@"; do
    n=$((n + 1))
    echo "== tree $n: $tree"  # (a tree unpacked inside this checkout reports this checkout's commit in its JSON)
    (cd "$tree" && PYTHONPATH=. python3 -m cupy_xattn sweep --suite "$SUITE" --precision "$PRECISIONS" \
        --reps "$REPS" --warmup "$WARMUP" --format json --out "$out/ab-$TAG$n.json" > /dev/null) || status=1
    python3 -c 'import json, sys; from cupy_xattn import bench; sys.stdout.write(bench.format_rows(json.load(open(sys.argv[1])), "table"))' \
        "$out/ab-$TAG$n.json" || status=1
done
python3 "$(dirname "$0")/ab_compare.py" "$out" || status=1
exit $status
