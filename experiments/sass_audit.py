"""The fused step's Triton kernels at a preset's real shapes, compiled for sm_90 on this machine (CPU-only works:
Triton's bundled ptxas and cuobjdump): per distinct kernel specialisation of each variant and batch size, its grid,
warps, stages, tiles, registers, spilled stack, shared memory, global loads by width, instructions and block
barriers (moecg.kernels.sass).

  python experiments/sass_audit.py --preset qwen3_30b_a3b --num-layers 1 --batch 1 8 \\
      --out experiments/results/sass_audit/qwen3_30b_a3b.md --json experiments/results/sass_audit/qwen3_30b_a3b.json

The step runs once per batch size inside sm90_dry_run (its launches recorded, none run; the model built on the CPU in
bf16, random weights): the kernels, grids and tiles are the GPU's for these shapes, PDL as on an H100/H200. Variants as
bench_step_variants.py names them (its switches and tile fields), so an audited row and a timed one are the same
launch. Read it for: `stack` > 0 (spills), a weight-streaming kernel (gemv, moe_up, moe_down) whose tensor-core tiles
(BLOCK_M / BLOCK_T >= 16) have no async (cp.async) loads or whose one-row tiles load narrower than 16 bytes.
Layers: one decoder layer of each kind suffices (the rest launch the same specialisations), so --num-layers is small
(DeepSeek's dense first layers: 1 + first_k_dense_replace).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from bench_step_variants import parse_variant, set_variant  # same directory: the variants' names and switches
from moecg.capture import Capture
from moecg.dispatch import attach, detach, make_dispatcher
from moecg.engine import DecodeEngine
from moecg.kernels import sass
from moecg.models import build_model
from moecg.models.formats import ACTIVATIONS, FORMATS
from moecg.report import write_report

D_STEP = "slot+overlap+side+router+gemv+pdl"  # every default switch of the fused step


def records_of(model, v: dict, bs: int, dispatch: str = "fused", capacity_factor: float = 1.25) -> list:
    disp = make_dispatcher(dispatch, **({"capacity_factor": capacity_factor} if dispatch == "capacity" else {}))
    attach(model, disp, max_rows=bs)
    try:
        with sass.sm90_dry_run() as rec:
            eng = DecodeEngine(model, 512, bs)
            cap = Capture(eng, "eager", buckets=(bs,), kernels="fused", pdl=v["pdl"], preload=v["pre"],
                          overlap_shared=v["overlap"], fuse_router=v["router"]).apply()
            with torch.no_grad():
                eng.eager_step(eng.ids, bs)
            cap.unwrap()
        return list(rec)
    finally:
        detach(model)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3_30b_a3b")
    ap.add_argument("--num-layers", type=int, default=1)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--variants", nargs="+", default=[D_STEP])
    ap.add_argument("--weights", default="full", choices=FORMATS)
    ap.add_argument("--activations", default="full", choices=ACTIVATIONS)
    ap.add_argument("--dispatch", default="fused", choices=("fused", "capacity"),
                    help="the experts' dispatcher on the fused step: fused (dropless) or capacity (its kernels)")
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--config-overrides", default=None,
                    help='JSON of config fields, e.g. \'{"n_routed_experts": 32}\' for a shape too big for this '
                         "machine's memory (the grids then hold fewer experts; the tiles do not depend on it)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    variants = {name: parse_variant(name) for name in args.variants}
    built = build_model(args.preset, num_layers=args.num_layers, device="cpu", dtype="bfloat16",
                        weights=args.weights, activations=args.activations,
                        config_overrides=json.loads(args.config_overrides) if args.config_overrides else None)
    rows, seqs = [], []
    for name, v in variants.items():
        seen: set = set()
        for bs in args.batch:
            set_variant(v)
            rec = records_of(built.model, v, bs, args.dispatch, args.capacity_factor)
            seqs.append((name, bs, [k.fn.__name__.lstrip("_") for k, *_ in rec]))
            for r in sass.audit(rec, seen):
                rows.append({"variant": name, "batch_size": bs, **r})
                print(json.dumps(rows[-1]), flush=True)
    head = (f"{args.preset}, {args.num_layers} layers, weights {built.weights}, activations {args.activations}, "
            f"dispatch {args.dispatch}" + (f" @ {args.capacity_factor}" if args.dispatch == "capacity" else "")
            + (f", config overrides {args.config_overrides}" if args.config_overrides else "")
            + "; the fused step's kernels compiled for sm_90 (moecg.kernels.sass), one row per distinct "
            "specialisation, at the first batch size that launches it")
    lines = [head, "", "| variant | bs | kernel | grid | warps | stages | tiles | regs | stack | smem KB | "
             "16-byte loads | async | 1-2 byte | instr | BAR |", "|" + "---|" * 15]
    for r in rows:
        tiles = " ".join(f"{k}={t}" for k, t in r["tiles"].items())
        lines.append(f"| {r['variant']} | {r['batch_size']} | {r['kernel']} | {'x'.join(map(str, r['grid']))} | "
                     f"{r['warps']} | {r['stages']} | {tiles} | {r['registers']} | {r['stack']} | "
                     f"{r['shared'] / 1024:.1f} | {r['wide_loads']} | {r['async_loads']} | {r['narrow_loads']} | "
                     f"{r['instructions']} | {r['barriers']} |")
    lines += ["", f"The step's Triton launches in order ({args.num_layers} decoder layers; torch / cuBLAS ops between "
              "them, as the embedding, lm_head and any projection the GEMV table leaves to cuBLAS, are not listed):", ""]
    lines += [f"- {name}, bs {bs}: {len(seq)} launches: {' '.join(seq)}" for name, bs, seq in seqs]
    write_report("\n".join(lines), rows, args, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
