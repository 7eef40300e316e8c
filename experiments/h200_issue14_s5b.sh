#!/usr/bin/env bash
# Issue 14 on one H200, session 5, round B: the step with the GEMV table (per-shape tiles from bench_gemv.py) against
# cuBLAS projections; capture time with the precompile pass; the trained stdlib models' agreement with HF eager; the
# floor table (bench_vs_compile.py, one process per shape) of the three main shapes.
#   MOECG_GIT_SHA=<sha> bash experiments/h200_issue14_s5b.sh OUTDIR [variants,capture,fidelity,gemv,floor,deep]
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue14_s5}
WHAT=${2:-variants,capture,fidelity,floor}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
has() { [[ ",$WHAT," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
if has variants; then
  python3 -m pytest -q -m gpu tests/test_fast_gpu.py -k "gemv or fused_full_capture" 2>&1 | tail -2 \
    | tee "$OUT/gpu_tests_gemv_table.log"
  for spec in "qwen3_30b_a3b 12 qwen3" "qwen1_5_moe_a2_7b 24 qwen15" "mixtral_8x7b 8 mixtral"; do
    read -r preset layers tag <<< "$spec"
    python3 experiments/bench_step_variants.py --preset "$preset" --num-layers "$layers" --batch 1 8 \
      --variants slot+overlap+router+pdl slot+overlap+router+pdl+gemv \
      --out "$OUT/variants_${tag}_table.md" --json "$OUT/variants_${tag}_table.json" 2>&1 \
      | tee "$OUT/variants_${tag}_table.log" | grep -E "^\| [0-9]"
  done
fi
if has capture; then
  python3 experiments/capture_time.py --preset qwen1_5_moe_a2_7b --out "$OUT/capture_time_b.md" \
    --json "$OUT/capture_time_b.json" 2>&1 | tee "$OUT/capture_time_b.log" | grep -E "^\| (cold|warm)|target"
fi
if has fidelity; then
  python3 experiments/fidelity_fused.py --preset mixtral_stdlib qwen2_moe_stdlib --backend triton --device cuda 2>&1 \
    | tee "$OUT/stdlib_fidelity.log" | tail -6
fi
source experiments/h200_issue14_lib.sh  # step()
if has gemv; then  # plain launches (PDL 0): the first run (gemv.md) chained the GEMVs by PDL
  python3 experiments/bench_gemv.py --pdl 0 --out "$OUT/gemv_pdl0.md" --json "$OUT/gemv_pdl0.json" 2>&1 \
    | tee "$OUT/gemv_pdl0.log" | grep -E "^\| [a-z]|failed"
fi
if has floor; then
  step qwen1_5_moe_a2_7b 24 full+fused
  step mixtral_8x7b 8 full+fused
  step qwen3_30b_a3b 12 full+fused
fi
if has deep; then
  step qwen3_30b_a3b 48 full+fused
  step mixtral_8x7b 32 full+fused
fi
exit 0
