#!/usr/bin/env bash
# Issue 15: expert-parallel decode on one host of H200s (nvidia-h200-x8; EPS="1 2" on an x2). Not run yet.
#   MOECG_GIT_SHA=$(git rev-parse --short HEAD) bash experiments/h200x8_ep.sh OUTDIR [tests|bench|runs|all]
# tests: the GPU tests with EP 2 and 4 (NCCL, real CUDA graphs, megatron-core's dispatchers).
# bench: per model and EP size one experiments/bench_ep.py (every strategy, moecg vs megatron-core, exchange share,
#        HBM + NVLink floor), one build per torchrun.
# runs:  moecg.run jobs (results.json each, with fidelity and drop counters) for the graph strategies.
# MODELS: preset:num_layers (empty: whole depth). Qwen3-235B-A22B is cut to 16 of 94 layers: every rank builds the
# whole model before keeping its experts, so the cut must fit one GPU (16 layers: 82 GB in bf16).
set -u -o pipefail
OUT=${1:-experiments/results/h200x8/ep}
WHAT=${2:-all}
EPS=${EPS:-"1 2 4 8"}
MODELS=${MODELS:-"mixtral_8x7b: qwen3_30b_a3b: qwen3_235b_a22b:16"}
BATCH=${BATCH:-"1 8 32"}                 # bench_ep.py: rows per rank, every strategy, one build per torchrun
RUN_BATCH=${RUN_BATCH:-"8"}              # moecg.run jobs (a build and ~370 decode steps each)
STRATEGIES=${STRATEGIES:-"full capacity"}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  python3 -m pytest -q -s -m gpu tests/test_parallel_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
fi
for m in $MODELS; do
  p=${m%%:*}; l=${m#*:}
  for ep in $EPS; do
    if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
      torchrun --standalone --nproc-per-node "$ep" experiments/bench_ep.py --preset "$p" ${l:+--layers "$l"} \
        --batch $BATCH --new-tokens 16 --prompt-len 32 --out "$OUT/bench_${p}_ep${ep}.md" \
        --json "$OUT/bench_${p}_ep${ep}.json" > "$OUT/bench_${p}_ep${ep}.log" 2>&1 \
        || echo "bench $p ep$ep failed: $(tail -3 "$OUT/bench_${p}_ep${ep}.log")"
    fi
    if [ "$WHAT" = runs ] || [ "$WHAT" = all ]; then
      for s in $STRATEGIES; do
        for bs in $RUN_BATCH; do
          d="$OUT/run_${p}_ep${ep}_${s}_bs${bs}"
          torchrun --standalone --nproc-per-node "$ep" -m moecg.run parallel.ep="$ep" model="$p" \
            ${l:+model.num_layers="$l"} strategy="$s" batch_size="$bs" new_tokens=32 prompt_len=32 measure.repeats=3 \
            hydra.output_subdir=null hydra.run.dir="$d" > "$d.log" 2>&1 || echo "run $p ep$ep $s bs$bs failed: $(tail -1 "$d.log")"
        done
      done
    fi
  done
done
if [ "$WHAT" = runs ] || [ "$WHAT" = all ]; then
  python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
rows = ["| model | layers | ep | strategy | dispatch | rows/rank | ms/step p50 | eager ms | floor ms | exchange floor ms | "
        "drop rate | forced agreement |", "|" + "---|" * 12]
f = lambda v, p="{:.3f}": "-" if v is None else p.format(v)
for j in sorted(out.glob("run_*/results.json")):
    r = json.loads(j.read_text())
    if r.get("status") != "ok":
        rows.append(f"| {j.parent.name} | failed: {r.get('error')} |")
        continue
    rows.append(f"| {r['model']} | {r['num_layers']} | {r['ep']} | {r['strategy']} | {r['dispatch']} | {r['batch_size']} | "
                f"{f(r['ms_per_token_p50'])} | {f(r['eager_ms_per_token_p50'])} | {f(r['floor_ms'])} | "
                f"{f(r['exchange_floor_ms'])} | {f(r['drop_rate'], '{:.4f}')} | "
                f"{f(r['token_agreement_forced_vs_eager'])} |")
(out / "runs.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PY
fi
