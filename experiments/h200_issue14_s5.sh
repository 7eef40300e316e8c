#!/usr/bin/env bash
# Issue 14 on one H200, session 5: the fused-step GPU tests after last round's refactors, and capture time of
# buckets 1-64 (cold and warm Triton cache) with a host-side profile of each run's apply().
#   MOECG_GIT_SHA=<sha> bash experiments/h200_issue14_s5.sh OUTDIR [tests,capture]
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue14_s5}
WHAT=${2:-tests,capture}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
has() { [[ ",$WHAT," == *",$1,"* ]]; }
if has tests; then
  python3 -m pytest -q -m gpu tests/test_fast_gpu.py tests/test_capacity_kernel_gpu.py 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -4
fi
if has capture; then
  python3 experiments/capture_time.py --preset qwen1_5_moe_a2_7b --out "$OUT/capture_time.md" \
    --json "$OUT/capture_time.json" --profile "$OUT/capture_profile" 2>&1 | tee "$OUT/capture_time.log" | tail -14
fi
exit 0
