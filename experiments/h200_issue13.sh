#!/usr/bin/env bash
# Issue 13 on one H200: the fused-step GPU tests for every family, then bench_vs_compile per new real shape at bs 1
# and 8 (HF-module strategies for the MLA families, whose fused step is refused).
#   bash experiments/h200_issue13.sh OUTDIR [tests|bench|all] ["glm4_5_air olmoe_1b_7b ..." (default: all five)]
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue13}
WHAT=${2:-all}
NAMES=" ${3:-glm4_5_air olmoe_1b_7b gpt_oss_20b deepseek_v2_lite deepseek_v3} "
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  timeout 150 python3 -m pytest -q -s -m gpu tests/test_fast_gpu.py 2>&1 | tee "$OUT/gpu_fast_tests.log" \
    | grep -E "passed|failed|error|FAILED" | tail -20
fi
bench() {  # name preset layers strategies...
  local name=$1 preset=$2 layers=$3; shift 3
  [[ "$NAMES" == *" $name "* ]] || return 0
  timeout ${BENCH_TIMEOUT:-170} python3 experiments/bench_vs_compile.py --preset "$preset" --num-layers "$layers" \
    --batch 1 8 ${BENCH_ARGS:-} --strategies "$@" --out "$OUT/vs_compile_$name.md" --json "$OUT/vs_compile_$name.json" \
    > "$OUT/vs_compile_$name.log" 2>&1 || echo "bench $name exited $?"
  tail -4 "$OUT/vs_compile_$name.log"
}
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  HF="partial full capacity"
  FUSED="partial full capacity full+fused capacity+fused"
  bench glm4_5_air glm4_5_air 8 $FUSED
  bench olmoe_1b_7b olmoe_1b_7b 16 $FUSED
  bench gpt_oss_20b gpt_oss_20b ${GPT_OSS_LAYERS:-24} $FUSED
  bench deepseek_v2_lite deepseek_v2_lite ${V2_LITE_LAYERS:-27} $HF
  bench deepseek_v3 deepseek_v3 5 $HF
fi
if [ "$WHAT" = diag ]; then
  timeout 60 python3 experiments/diag_rope_gpu.py 2>&1 | tee "$OUT/diag_rope.log"
fi
