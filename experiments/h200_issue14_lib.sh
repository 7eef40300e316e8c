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

# variants TAG PRESET LAYERS ARGS...: bench_step_variants on one shape, outputs $OUT/variants_TAG.{md,json,log}.
variants() {
  local tag=$1 preset=$2 layers=$3; shift 3
  python3 experiments/bench_step_variants.py --preset "$preset" --num-layers "$layers" "$@" \
    --out "$OUT/variants_$tag.md" --json "$OUT/variants_$tag.json" 2>&1 | tee "$OUT/variants_$tag.log" \
    | grep -E "^\| [0-9]|failed"
}
# old TAG PRESET LAYERS ARGS...: the same on the previous commit's package ($OLD, default .gpu/old: a `git archive`
# of moecg/ carried to the device), first on PYTHONPATH: before and after on one host.
old() { PYTHONPATH="${OLD:-.gpu/old}:$PYTHONPATH" variants "$@"; }

# long_rows: the long-context rows (30k-token prompt, 32k-slot cache, 4096-token prefill chunks) of the three short
# shapes, outputs $OUT/long_PRESET.{md,json,log}. Qwen1.5's 16 kv heads x 24 layers: 103 GB of KV at bs 8, so bs 1 only.
long_rows() {
  local spec preset layers bss
  for spec in "qwen3_30b_a3b 12 1,8" "mixtral_8x7b 8 1,8" "qwen1_5_moe_a2_7b 24 1"; do
    read -r preset layers bss <<< "$spec"
    python3 experiments/bench_vs_compile.py --preset "$preset" --num-layers "$layers" --batch ${bss//,/ } \
      --prompt-len 30000 --new-tokens 16 --cache-len 32768 --buckets ${bss//,/ } --prefill-chunk 4096 \
      --skip-compile --skip-hf-generate --strategies full+fused --repeats 1 \
      --out "$OUT/long_${preset}.md" --json "$OUT/long_${preset}.json" 2>&1 | tee "$OUT/long_${preset}.log" \
      | grep -E "^\| [0-9]|floor|failed|Error" | head -12
  done
}
