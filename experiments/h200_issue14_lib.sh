# Shared by the issue-14 H200 scripts (source it from the project root; the caller sets OUT).
# step PRESET LAYERS STRATEGIES...: the floor table row of one shape at bs 1 and 8 (bench_vs_compile.py, one process),
# outputs $OUT/step_PRESET_LAYERS.{md,json,log}.
step() {
  local preset=$1 layers=$2; shift 2
  python3 experiments/bench_vs_compile.py --preset "$preset" --num-layers "$layers" --batch 1 8 --strategies "$@" \
    --skip-hf-generate --skip-compile --repeats 2 --out "$OUT/step_${preset}_${layers}.md" \
    --json "$OUT/step_${preset}_${layers}.json" 2>&1 | tee "$OUT/step_${preset}_${layers}.log" \
    | grep -E "own floor|failed|Error" | head -4
}
