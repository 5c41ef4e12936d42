#!/usr/bin/env bash
# Everything a GPU session verifies, in one device call (~7 minutes on a warm H200, 6 of them the tests):
# every GPU test with the GPU required and the machine-code (sass) tests with its compiler, the full sweep with baselines and ceilings
# (scripts/sweep_h200.sh: benchmarks/*.json and BENCHMARKS.md), and the accuracy tables.
#
#   CUPY_XATTN_GIT_COMMIT=<short hash> bash scripts/h200_check.sh
#
# Give the hash of the checkout as it is here, literally: the device's copy of the repository
# carries the working tree, but its git metadata can be older (seen: a whole session long).
#
# Results go to $OUT when set (the device tool's folder), else to the current folder; copy
# BENCHMARKS.md, benchmarks/h200-latest.json and accuracy.md (as docs/accuracy.md) back.
# It leaves six files under $OUT, and the device tool returns at most eight from a call (the
# rest are lost: Session 25 lost its JSON and test log that way), so add at most two of your own.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 CUPY_XATTN_REQUIRE_GPU=1
out="${OUT:-$PWD}"
status=0

# Every GPU test, and the machine-code checks (marker sass) with this machine's NVRTC and nvdisasm
# (CI's are other versions).
python3 -m pytest tests -m "gpu or sass" -q --tb=short --durations=25 2>&1 | tee "$out/pytest_gpu.log" | tail -5 || status=1
bash scripts/sweep_h200.sh > "$out/sweep_table.txt" 2> "$out/sweep_err.txt" || status=1
grep -A14 "suite means" "$out/sweep_table.txt"
python3 scripts/accuracy_table.py --commit "${CUPY_XATTN_GIT_COMMIT:-unknown}" > "$out/accuracy.md" || status=1
if grep -q FAIL "$out/accuracy.md"; then echo "accuracy: some case FAILS the benchmark rule"; status=1; fi
exit $status
