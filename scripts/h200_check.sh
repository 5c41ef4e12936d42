#!/usr/bin/env bash
# Everything a GPU session verifies: every GPU test with the GPU required and the machine-code
# (sass) tests with its compiler, the full sweep with baselines and ceilings (scripts/sweep_h200.sh:
# benchmarks/*.json and BENCHMARKS.md), and the accuracy tables.
#
#   CUPY_XATTN_GIT_COMMIT=<short hash> bash scripts/h200_check.sh [tests | sweep]
#
# With no part, both in one call; where one device call (600 s) is too short for both, run "tests",
# then "sweep" (the sweep and the accuracy tables), or bound the tests with TEST_SECONDS: each shard
# stops after the test that passes that many seconds from the start (tests/conftest.py's
# CUPY_XATTN_TEST_DEADLINE), writes its summary and fails the check. The sweep takes ~70 s on a warm
# H200. How long each part took on which machine is in docs/perf-notes.md.
#
# Give the hash of the checkout as it is here, literally: the device's copy of the repository
# carries the working tree (whatever branch is checked out), but its git metadata can be older.
#
# Results go to $OUT when set (an absolute path: the device tool's folder), else to the repository root; copy
# BENCHMARKS.md, benchmarks/h200-latest.json and accuracy.md (as docs/accuracy.md) back.
# It leaves at most six files under $OUT, and the device tool returns at most eight from a call (the
# rest are lost: Session 25 lost its JSON and test log that way), so add at most two of your own.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 CUPY_XATTN_REQUIRE_GPU=1
out="${OUT:-$PWD}"
status=0

part="${1:-all}"
case "$part" in all|tests|sweep) ;; *) echo "h200_check.sh: the part is tests or sweep, not '$part'" >&2; exit 2;; esac

# Every GPU test, and the machine-code checks (marker sass) with this machine's NVRTC and nvdisasm
# (CI's are other versions).
# SHARDS pytest processes side by side on the one GPU (tests/conftest.py's CUPY_XATTN_TEST_SHARD),
# so that a fresh machine's NVRTC builds use SHARDS of its cores; their logs, one after the other,
# make pytest_gpu.log.
if [ "$part" != sweep ]; then
    shards="${SHARDS:-8}"
    [[ $shards =~ ^[1-9][0-9]*$ ]] || { echo "h200_check.sh: SHARDS is a positive integer, not '$shards'" >&2; exit 2; }
    # One BLAS thread pool a shard, its share of the cores: eight shards of OpenBLAS's default (a
    # thread a core) spin against each other in the float64 references' small batched products.
    threads=$(( $(nproc) / shards )); [ "$threads" -ge 1 ] || threads=1
    export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-$threads}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-$threads}"
    if [ -n "${TEST_SECONDS:-}" ]; then
        [[ $TEST_SECONDS =~ ^[1-9][0-9]*$ ]] || { echo "h200_check.sh: TEST_SECONDS is a positive integer, not '$TEST_SECONDS'" >&2; exit 2; }
        export CUPY_XATTN_TEST_DEADLINE=$(( $(date +%s) + TEST_SECONDS ))
    fi
    pids=()
    for k in $(seq 0 $((shards - 1))); do  # each its own temporary folder: the processes run at once
        CUPY_XATTN_TEST_SHARD="$k/$shards" python3 -m pytest tests -m "gpu or sass" -q --tb=short --durations=10 \
            -p no:cacheprovider --basetemp="${TMPDIR:-/tmp}/cupy_xattn_shard$k" > "$out/pytest_gpu.$k.log" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    : > "$out/pytest_gpu.log"
    for k in $(seq 0 $((shards - 1))); do
        log="$out/pytest_gpu.$k.log"
        cut=$(grep -q "Interrupted: CUPY_XATTN_TEST_DEADLINE" "$log" && echo " (cut at TEST_SECONDS)")
        echo "shard $k/$shards: $(tail -n 1 "$log")$cut"  # its pytest summary line
        { echo "== shard $k/$shards"; cat "$log"; } >> "$out/pytest_gpu.log"
        rm "$log"
    done
fi
if [ "$part" != tests ]; then
    bash scripts/sweep_h200.sh > "$out/sweep_table.txt" 2> "$out/sweep_err.txt" || status=1
    grep -A14 "suite means" "$out/sweep_table.txt"
    python3 scripts/accuracy_table.py --commit "${CUPY_XATTN_GIT_COMMIT:-unknown}" > "$out/accuracy.md" || status=1
    if grep -q FAIL "$out/accuracy.md"; then echo "accuracy: some case FAILS the benchmark rule"; status=1; fi
fi
exit $status
