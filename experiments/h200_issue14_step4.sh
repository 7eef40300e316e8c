#!/usr/bin/env bash
# Issue 14, fourth round on one H200: GPU tests after the fused norm + router kernel (norm_route) and the per-shape
# PDL trigger; the router fusion on Qwen3 (12 layers) and Mixtral (8 layers).
#   MOECG_GIT_SHA=<sha> bash experiments/h200_issue14_step4.sh OUTDIR
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue14_step}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -m pytest -q -s -m gpu tests/test_fast_gpu.py tests/test_capacity_kernel_gpu.py \
  2>&1 | tee "$OUT/gpu_tests_r4.log" | grep -E "passed|failed|error|FAILED|agreement" | tail -30
run() {  # preset layers tag [extra args]
  local preset=$1 layers=$2 tag=$3; shift 3
  python3 experiments/bench_step_variants.py --preset "$preset" --num-layers "$layers" "$@" \
    --out "$OUT/variants_${tag}.md" --json "$OUT/variants_${tag}.json" 2>&1 | tee "$OUT/variants_${tag}.log" \
    | grep -E "^\| [0-9]" | tail -60
}
run qwen3_30b_a3b 12 qwen3_r4 --variants slot+pdl slot+pdl+router slot+pdl+router+down_n=128 slot+router \
  --profile slot+router
run mixtral_8x7b 8 mixtral_r4 --variants slot+pdl1 slot+pdl slot+pdl+router
exit 0
