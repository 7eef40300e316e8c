#!/usr/bin/env bash
# Issue 14 on one H200, final round A: the norm_route kernel's GPU test and its step timing (one-pass version);
# long context (32k-slot cache, 30k-token prompt, chunked prefill) at bs 1 and 8; capture time of buckets 1-64
# from a cold and a warm Triton cache.
#   MOECG_GIT_SHA=<sha> bash experiments/h200_issue14_final_a.sh OUTDIR [router,long,capture]
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue14_step}
WHAT=${2:-router,capture,long}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
has() { [[ ",$WHAT," == *",$1,"* ]]; }
if has router; then
  python3 -m pytest -q -m gpu tests/test_fast_gpu.py -k "norm_route or fused_full_capture" 2>&1 \
    | tee "$OUT/gpu_tests_router.log" | tail -3
  for spec in "qwen3_30b_a3b 12 qwen3" "mixtral_8x7b 8 mixtral"; do
    read -r preset layers tag <<< "$spec"
    python3 experiments/bench_step_variants.py --preset "$preset" --num-layers "$layers" \
      --variants slot+pdl slot+pdl+router --out "$OUT/variants_${tag}_router2.md" \
      --json "$OUT/variants_${tag}_router2.json" 2>&1 | tee "$OUT/variants_${tag}_router2.log" | grep -E "^\| [0-9]"
  done
fi
if has long; then
  source experiments/h200_issue14_lib.sh  # long_rows
  long_rows
fi
if has capture; then
  python3 experiments/capture_time.py --preset qwen1_5_moe_a2_7b --out "$OUT/capture_time.md" \
    --json "$OUT/capture_time.json" 2>&1 | tee "$OUT/capture_time.log" | tail -12
fi
exit 0
