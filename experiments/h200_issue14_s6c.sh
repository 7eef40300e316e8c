#!/usr/bin/env bash
# Issue 14 on one H200, session 6, the closing runs at one commit: the op tests, the floor table of the five shapes
# (capacity+fused beside dropless on the three short ones), stdlib fidelity (round C); the per-kernel profile, the
# long-context rows and capture time (round D).
#   MOECG_GIT_SHA=<sha> bash experiments/h200_issue14_s6c.sh OUTDIR [tests,floor,fidelity,profile,long,capture]
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue14_s6/final}
WHAT=${2:-tests,floor,fidelity}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
has() { [[ ",$WHAT," == *",$1,"* ]]; }
source experiments/h200_issue14_lib.sh  # step(), long_rows()
if has tests; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
  python3 -m pytest -q -m gpu tests/test_fast_gpu.py 2>&1 | tail -2 | tee "$OUT/gpu_tests.log"
fi
if has floor; then
  step qwen1_5_moe_a2_7b 24 full+fused capacity+fused
  step qwen3_30b_a3b 12 full+fused capacity+fused
  step mixtral_8x7b 8 full+fused capacity+fused
  step qwen3_30b_a3b 48 full+fused
  step mixtral_8x7b 32 full+fused
fi
if has fidelity; then
  python3 experiments/fidelity_fused.py --preset mixtral_stdlib qwen2_moe_stdlib --backend triton --device cuda 2>&1 \
    | tee "$OUT/stdlib_fidelity.log" | tail -6
fi
if has profile; then  # per kernel without PDL (so each kernel's time is its own), and the default step beside it
  for spec in "qwen3_30b_a3b 12 qwen3" "qwen1_5_moe_a2_7b 24 qwen15"; do
    read -r preset layers tag <<< "$spec"
    python3 experiments/bench_step_variants.py --preset "$preset" --num-layers "$layers" --batch 1 \
      --variants slot+overlap+router+gemv+pdl slot+overlap+router+gemv --profile slot+overlap+router+gemv \
      --out "$OUT/profile_$tag.md" --json "$OUT/profile_$tag.json" 2>&1 | tee "$OUT/profile_$tag.log" \
      | grep -E "^\| [0-9]|failed"
  done
fi
if has long; then
  long_rows
fi
if has capture; then
  for w in 1 3; do
    python3 experiments/capture_time.py --preset qwen1_5_moe_a2_7b --warmup $w --recapture \
      --out "$OUT/capture_time_w$w.md" --json "$OUT/capture_time_w$w.json" 2>&1 | tee "$OUT/capture_time_w$w.log" \
      | grep -E "^\| (cold|warm)|re-capture|target"
  done
fi
exit 0
