#!/usr/bin/env bash
# Issue 14 on one H200, final round C: the long-context split rule for single rows (~512 programs) in the captured
# step (measured at dca50e9, then reverted: slower, see attn_splits): the split-attention GPU test, then 32k-slot / 30k-prompt decode at bs 1 on Qwen3 (12 layers) and Mixtral (8).
#   MOECG_GIT_SHA=<sha> bash experiments/h200_issue14_final_c.sh OUTDIR
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue14_final}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -m pytest -q -m gpu tests/test_fast_gpu.py -k "split_merge" 2>&1 | tail -2 | tee "$OUT/gpu_tests_long_split.log"
for spec in "qwen3_30b_a3b 12" "mixtral_8x7b 8"; do
  read -r preset layers <<< "$spec"
  python3 experiments/bench_vs_compile.py --preset "$preset" --num-layers "$layers" --batch 1 --prompt-len 30000 \
    --new-tokens 16 --cache-len 32768 --buckets 1 --prefill-chunk 4096 --skip-compile --skip-hf-generate \
    --strategies full+fused --repeats 1 --out "$OUT/long_${preset}_bs1.md" --json "$OUT/long_${preset}_bs1.json" \
    2>&1 | tee "$OUT/long_${preset}_bs1.log" | grep -E "own floor|failed|Error" | head -3
done
exit 0
