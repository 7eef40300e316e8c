#!/usr/bin/env bash
# Two one-GPU checks (H200):
#  ep1     issue 15: parallel.ep=1 under torchrun (one process group of one rank) gives the plain run's record
#  stdlib  issue 12: serving on the fused step with the shipped trained models: each served request's greedy tokens
#          against the same request decoded alone eagerly on HF's modules (dropless)
#   bash experiments/h200_ep1_stdlib.sh OUTDIR [ep1|stdlib|all]
set -u -o pipefail
OUT=${1:-experiments/results/h200/ep1_stdlib}
WHAT=${2:-all}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
if [ "$WHAT" = ep1 ] || [ "$WHAT" = all ]; then
  COMMON="model=qwen1_5_moe_a2_7b model.num_layers=4 batch_size=8 new_tokens=16 prompt_len=32 measure.repeats=2
          hydra.output_subdir=null"
  for s in full capacity; do
    d=$([ $s = capacity ] && echo "dispatch=capacity" || echo "dispatch=dropless")
    timeout 120 python3 -m moecg.run strategy=$s $d $COMMON hydra.run.dir="$OUT/plain_$s" > "$OUT/plain_$s.log" 2>&1 \
      || echo "plain $s failed: $(tail -2 "$OUT/plain_$s.log")"
    timeout 120 torchrun --standalone --nproc-per-node 1 -m moecg.run parallel.ep=1 strategy=$s $d $COMMON \
      hydra.run.dir="$OUT/torchrun_$s" > "$OUT/torchrun_$s.log" 2>&1 || echo "torchrun $s failed: $(tail -2 "$OUT/torchrun_$s.log")"
  done
  python3 - "$OUT" <<'PY' | tee "$OUT/ep1.md"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
keys = ["status", "ep", "captured", "dropped_assignments", "routed_assignments", "capacity", "token_agreement_vs_eager",
        "token_agreement_forced_vs_eager", "max_logit_diff_vs_eager", "ms_per_token_p50"]
print("| run | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
for s in ("full", "capacity"):
    for kind in ("plain", "torchrun"):
        f = out / f"{kind}_{s}" / "results.json"
        r = json.loads(f.read_text()) if f.exists() else {}
        print(f"| {kind} {s} | " + " | ".join(str(r.get(k)) for k in keys) + " |")
PY
fi
if [ "$WHAT" = stdlib ] || [ "$WHAT" = all ]; then
  for m in mixtral_stdlib qwen2_moe_stdlib; do
    timeout 120 python3 -m moecg.run model=$m workload=poisson workload.rate=100 workload.n_requests=32 \
      workload.output_len=64 'workload.prompt_len=[16,128]' workload.max_batch=16 capture.kernels=fused dispatch=fused \
      strategy=full measure.fidelity_rows=32 hydra.output_subdir=null hydra.run.dir="$OUT/serve_$m" \
      > "$OUT/serve_$m.log" 2>&1 || echo "serve $m failed: $(tail -2 "$OUT/serve_$m.log")"
    python3 -c "import json,sys; r=json.load(open('$OUT/serve_$m/results.json')); print('$m', {k: r.get(k) for k in ('status','captured','kernels','n_requests','token_agreement_vs_eager','output_tokens_per_s','tpot_ms_p90','gpu_idle_share','batch_size_hist')})" | tee -a "$OUT/stdlib.md"
  done
fi
