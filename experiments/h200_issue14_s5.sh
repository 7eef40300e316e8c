#!/usr/bin/env bash
# Issue 14 on one H200, session 5: the fused-step GPU tests after last round's refactors, and capture time of
# buckets 1-64 (cold and warm Triton cache) with and without the precompile pass; `profile`: a host-side cProfile
# of each run's apply().
#   MOECG_GIT_SHA=<sha> bash experiments/h200_issue14_s5.sh OUTDIR [tests,captests,capture,gemv,step,profile]
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue14_s5}
WHAT=${2:-tests,captests,capture}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
has() { [[ ",$WHAT," == *",$1,"* ]]; }
if has tests; then
  python3 -m pytest -q -m gpu tests/test_fast_gpu.py tests/test_capacity_kernel_gpu.py 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -4
fi
if has captests; then
  python3 -m pytest -q -m gpu tests/test_fast_gpu.py -k "precompile or fused_full_capture" 2>&1 \
    | tee "$OUT/gpu_tests_precompile.log" | tail -4
fi
if has capture; then  # with the precompile pass, and without it (the first warmups compile)
  for pre in "" "--no-precompile"; do
    tag=${pre:+_no_precompile}
    python3 experiments/capture_time.py --preset qwen1_5_moe_a2_7b $pre --out "$OUT/capture_time$tag.md" \
      --json "$OUT/capture_time$tag.json" 2>&1 | tee "$OUT/capture_time$tag.log" | grep -E "^\| (cold|warm)|target"
  done
fi
if has gemv; then
  python3 -m pytest -q -m gpu tests/test_fast_gpu.py -k "gemv" 2>&1 | tee "$OUT/gpu_tests_gemv.log" | tail -3
  python3 experiments/bench_gemv.py --out "$OUT/gemv.md" --json "$OUT/gemv.json" 2>&1 | tee "$OUT/gemv.log" \
    | grep -E "^\| [a-z]|failed"
fi
if has step; then  # the step with and without the GEMV on qkv / o
  for spec in "qwen3_30b_a3b 12 qwen3" "qwen1_5_moe_a2_7b 24 qwen15" "mixtral_8x7b 8 mixtral"; do
    read -r preset layers tag <<< "$spec"
    python3 experiments/bench_step_variants.py --preset "$preset" --num-layers "$layers" --batch 1 8 \
      --variants slot+overlap+router+pdl slot+overlap+router+pdl+gemv --profile slot+overlap+router+pdl+gemv \
      --out "$OUT/variants_${tag}.md" --json "$OUT/variants_${tag}.json" 2>&1 | tee "$OUT/variants_${tag}.log" \
      | grep -E "^\| [0-9]"
  done
fi
if has profile; then
  python3 experiments/capture_time.py --preset qwen1_5_moe_a2_7b --out "$OUT/capture_time_profiled.md" \
    --json "$OUT/capture_time_profiled.json" --profile "$OUT/capture_profile" 2>&1 | tail -3
fi
exit 0
