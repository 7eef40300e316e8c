#!/usr/bin/env bash
# Issue 14, second round on one H200: MoE tile variants on Qwen3 (12 layers), the shared-expert overlap on Qwen1.5
# (24 layers), Mixtral (8 layers); profiles without PDL (PDL kernels start early, so their profiled durations
# include the wait for their predecessor).
#   MOECG_GIT_SHA=<sha> bash experiments/h200_issue14_step2.sh OUTDIR
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue14_step}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
run() {  # preset layers tag [extra args]
  local preset=$1 layers=$2 tag=$3; shift 3
  python3 experiments/bench_step_variants.py --preset "$preset" --num-layers "$layers" "$@" \
    --out "$OUT/variants_${tag}.md" --json "$OUT/variants_${tag}.json" 2>&1 | tee "$OUT/variants_${tag}.log" \
    | grep -E "^\| [0-9]" | tail -60
}
run qwen3_30b_a3b 12 qwen3_tiles --variants slot slot+pdl+down_n=32 slot+pdl+down_n=128 slot+pdl+down_k=64 \
  slot+pdl+down_k=256 slot+pdl+up_n=32 slot+pdl+stages=3 slot+pdl+warps=8 --profile slot
run qwen1_5_moe_a2_7b 24 qwen15 --variants base slot slot+overlap slot+overlap+pdl slot+overlap+pdl+split2 \
  slot+overlap+pdl+down_n=32 --profile slot+overlap
run mixtral_8x7b 8 mixtral --variants base slot slot+pdl slot+pdl+split2
exit 0
