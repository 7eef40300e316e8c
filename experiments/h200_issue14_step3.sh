#!/usr/bin/env bash
# Issue 14, third round on one H200: GPU tests after the in-kernel attention merge and the pad-row zeroing in the
# down kernel; PDL modes (0 off, 1 wait only, 2 early trigger) on the three shapes.
#   MOECG_GIT_SHA=<sha> bash experiments/h200_issue14_step3.sh OUTDIR
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue14_step}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -m pytest -q -s -m gpu tests/test_fast_gpu.py tests/test_capacity_kernel_gpu.py tests/test_ragged_fused.py \
  2>&1 | tee "$OUT/gpu_tests_r3.log" | grep -E "passed|failed|error|FAILED" | tail -30
run() {  # preset layers tag [extra args]
  local preset=$1 layers=$2 tag=$3; shift 3
  python3 experiments/bench_step_variants.py --preset "$preset" --num-layers "$layers" "$@" \
    --out "$OUT/variants_${tag}.md" --json "$OUT/variants_${tag}.json" 2>&1 | tee "$OUT/variants_${tag}.log" \
    | grep -E "^\| [0-9]" | tail -60
}
run qwen3_30b_a3b 12 qwen3_r3 --variants slot slot+pdl1 slot+pdl slot+pdl+down_n=128 slot+pdl+stages=3
run qwen1_5_moe_a2_7b 24 qwen15_r3 --variants slot+overlap slot+overlap+pdl1 slot+overlap+pdl
run mixtral_8x7b 8 mixtral_r3 --variants slot slot+pdl1 slot+pdl
exit 0
