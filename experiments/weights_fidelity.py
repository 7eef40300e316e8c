"""What a weight format costs in quality: each trained stdlib model in --weights against its own full-precision self.

  python experiments/weights_fidelity.py --out experiments/results/weights/fidelity.md --json ...fidelity.json  # CPU
  python experiments/weights_fidelity.py --weights mxfp4 ...  # the experts in MXFP4
  python experiments/weights_fidelity.py --activations fp8_dynamic ...  # block-FP8 with quantized GEMM inputs

Per model (moecg/checkpoints/*_stdlib, quantized at load, model.weights=--weights, fp8_block by default):
  agreement    greedy tokens of the quantized model against the full-precision model's (HF modules, dropless), held-out
               prompts: free-running, and teacher-forced (each step fed the full model's token); the full model's
               top-1 minus top-2 margin at the largest teacher-forced flip next to its median margin
  bpb          held-out bits per byte (teacher-forced over the shipped held-out text), dropless and under
               dispatch=capacity at each --capacity-factors, with the drop rate of each (share of routed assignments
               dropped over the whole text; the capacity C of a forward of 16 windows x 256 bytes)
  route flips  share of (token, layer) top-k expert sets that differ between the formats on the same dropless
               teacher-forced text: how often quantization changes which experts a token picks
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from moecg.dispatch import attach, detach, make_dispatcher, state_of
from moecg.engine import DecodeEngine
from moecg.fidelity import agreement, top2_margins
from moecg.models import build_model
from moecg.models.weights import weight_bytes
from moecg.quality import heldout_bpb, heldout_prompts
from moecg.report import env_fields, write_report

STDLIB = ["mixtral_stdlib", "qwen2_moe_stdlib", "deepseek_v3_stdlib"]


def _greedy(model, prompts, new_tokens, force=None):
    attach(model, make_dispatcher("dropless"), max_rows=prompts.shape[0])
    try:
        eng = DecodeEngine(model, prompts.shape[1] + new_tokens, prompts.shape[0])
        return eng.generate(prompts, new_tokens, keep_logits=True, timing=False, force_tokens=force)
    finally:
        detach(model)


def _bpb(model, dispatch, max_bytes, **kw):
    attach(model, make_dispatcher(dispatch, **kw))
    try:
        bpb = heldout_bpb(model, max_bytes=max_bytes)
        return bpb, state_of(model).snapshot()["drop_rate"]
    finally:
        detach(model)


def _routes(model, adapter, ids):
    """Top-k expert ids per MoE layer [T, K] (sorted) of a dropless teacher-forced forward over ids [1, T]: what each
    experts module is handed."""
    got = []
    hooks = [experts.register_forward_pre_hook(lambda m, a: got.append(a[1].sort(-1).values))
             for _, experts in adapter.moe_layers(model)]
    attach(model, make_dispatcher("dropless"))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        detach(model)
        for h in hooks:
            h.remove()
    return got


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=STDLIB)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--weights", default="fp8_block")
    ap.add_argument("--activations", default="full", help="how block-FP8 GEMMs take their inputs (model.activations)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--capacity-factors", type=float, nargs="+", default=[1.0, 1.25])
    ap.add_argument("--max-bytes", type=int, default=65536, help="held-out bytes scored (bpb, drop rates)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for preset in args.preset:
        full = build_model(preset, dtype=args.dtype, device=args.device)
        quant = build_model(preset, dtype=args.dtype, device=args.device, weights=args.weights,
                            activations=args.activations)
        prompts = heldout_prompts(args.batch, args.prompt_len)
        ref = _greedy(full.model, prompts, args.new_tokens)
        free = _greedy(quant.model, prompts, args.new_tokens)
        forced = _greedy(quant.model, prompts, args.new_tokens, force=ref.tokens)
        margin = top2_margins(ref.logits)
        free_agree, forced_agree, worst = agreement(ref.tokens, free.tokens, forced.tokens, margin)
        ids = heldout_prompts(1, 1024, seed=7).to(full.device)
        ra, rb = _routes(full.model, full.adapter, ids), _routes(quant.model, quant.adapter, ids)
        flips = sum(int((a != b).any(-1).sum()) for a, b in zip(ra, rb)) / sum(a.shape[0] for a in ra)
        row = {"model": preset, "weights": quant.weights, "activations": args.activations,
               "dtype": str(full.dtype).replace("torch.", ""),
               "free_agreement": free_agree, "forced_agreement": forced_agree, "worst_flip_margin": worst,
               "median_margin": float(margin.median()), "route_flip_rate": flips,
               "weight_bytes_full": weight_bytes(full.model), "weight_bytes": weight_bytes(quant.model)}
        for name, built in (("full", full), ("quant", quant)):
            row[f"bpb_{name}"], _ = _bpb(built.model, "dropless", args.max_bytes)
            for cf in args.capacity_factors:
                row[f"bpb_{name}_cf{cf}"], row[f"drop_{name}_cf{cf}"] = _bpb(built.model, "capacity", args.max_bytes,
                                                                             capacity_factor=cf)
        rows.append(row)
        print(json.dumps(row), flush=True)
    cfs = args.capacity_factors
    acts = f"{args.dtype} activations" if args.activations == "full" else \
        f"{args.dtype} activations, block-FP8 GEMM inputs {args.activations}"
    lines = [f"{args.weights} against full precision ({acts}), {env_fields()['device_name']}; "
             f"{args.batch} held-out prompts of {args.prompt_len} bytes, {args.new_tokens} new; bpb over "
             f"{args.max_bytes} held-out bytes", "",
             "| model | free-running agreement | teacher-forced agreement | largest margin at a flip | median margin "
             "| route flips | weight bytes full / quantized |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['free_agreement']:.4f} | {r['forced_agreement']:.4f} | "
                     f"{r['worst_flip_margin']:.3f} | {r['median_margin']:.3f} | {r['route_flip_rate']:.4f} | "
                     f"{r['weight_bytes_full'] / 2**20:.2f} / {r['weight_bytes'] / 2**20:.2f} MiB |")
    lines += ["", "| model | bpb full | bpb " + args.weights + " | delta | "
              + " | ".join(f"cf {cf}: drop full / {args.weights}, bpb delta" for cf in cfs) + " |",
              "|---|---|---|---|" + "---|" * len(cfs)]
    for r in rows:
        cells = [f"{r[f'drop_full_cf{cf}']:.4f} / {r[f'drop_quant_cf{cf}']:.4f}, "
                 f"{r[f'bpb_quant_cf{cf}'] - r[f'bpb_full_cf{cf}']:+.4f}" for cf in cfs]
        lines.append(f"| {r['model']} | {r['bpb_full']:.4f} | {r['bpb_quant']:.4f} | "
                     f"{r['bpb_quant'] - r['bpb_full']:+.4f} | " + " | ".join(cells) + " |")
    write_report("\n".join(lines), rows, args, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
