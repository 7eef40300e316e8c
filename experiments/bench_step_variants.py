"""The fused decode step's launch and grid variants, one shape per process, each against the others and the floor.

  python experiments/bench_step_variants.py --preset qwen3_30b_a3b --num-layers 12 --batch 1 8 \
      --out experiments/results/step_variants/variants_qwen3.md --json .../variants_qwen3.json

Variants (names: `+`-joined switches on top of `base`):
  base     every Triton kernel launched plainly (capture.pdl 0), the shared expert on the main stream
           (capture.overlap_shared false), add_rmsnorm + router GEMM + router kernel (capture.fuse_router
           False), the MoE kernels on a grid of one program per expert, no split-K, every
           projection on cuBLAS (tiles.GEMV_RULES empty)
  slot     the MoE kernels on grid="auto": one-row tiles on a program per assignment, each its own row; other tiles
           on a program per assignment when assignments < experts, the expert's first running it; grid=G: moe_experts'
           grid G (expert, slot, row, auto) whatever slot says
  splitN   the down GEMM split N ways over I (MoeTiles.down_split), partials added once in order, in the kernel
  overlap  the shared expert (silu-mul + down GEMM) on a second stream beside the routed experts
  side     with overlap, where an fp32 router GEMV runs apart (DeepSeek, Kimi-K2, GLM): the shared expert's gate/up
           GEMM on that stream too, the router first on the main one (moecg.fast.step.SHARED_GEMM_ON_SIDE)
  router   residual add + norm + router GEMV + top-k as one kernel where the router is its own linear
  gemv     the qkv and o projections on the Triton GEMV where moecg.kernels.tiles.GEMV_RULES say (else cuBLAS);
           gemv1: the same, the GEMV not triggering its successor early (GemvTiles.pdl_trigger False)
  pdl      programmatic dependent launch for every Triton kernel of the step, each triggering its successor's
           launch at its start (capture.pdl 2); pdl1: each only waits (mode 1: the successor launches as
           its blocks exit)
  pre=0    every kernel's weight loads after its PDL wait (capture.preload false); by default the GEMV's first K
           step, norm_route's router rows, the norms' weights and the MoE down kernel's first tile at batch 1 load
           before it, beside the predecessor
  nw=N     add_rmsnorm with N warps (moecg.kernels.tiles.norm_warps)
  rw=N     norm_route with N warps; rb=N: N experts a program; rk=1: its top-k a warp a row (every warp a copy of
           the logits), rk=0: one row across the warps (moecg.kernels.tiles.NormRouteTiles)
  mb=N     the split attention's merge loading N splits' partial outputs at a time (triton_ops.attn_merge_block)
  as=N     N splits per (row, kv head) context for the decode attention (triton_ops.attn_splits' choice otherwise);
           am=N: its merge (1 in the kernel, 2 the merge kernel)
  ls=N     N splits per (row, head block) context for MLA's decode attention (mla.mla_splits' choice otherwise);
           lm=N: its merge (1 in the kernel, 2 the merge kernel; mla.mla_attn_decode's choice otherwise); lt=0: its
           attention kernel not triggering its successor early (MlaTiles.pdl_trigger False)
  ok=N     the o projection on the Triton GEMV split N ways over K (GemvTiles.split_k: fp32 partial rows that the
           norm after it adds), on the table's tiles (bf16 shapes the table leaves to cuBLAS: 16 x 256)
  F=N      a MoE tile field (moecg.kernels.tiles.MoeTiles: up_n, up_k, down_n, down_k, warps, stages, block_m)
  g.F=N    a field of the GEMV's tiles (moecg.kernels.tiles.GemvTiles: block_n, block_k, warps, stages, rows) over
           what the tables pick for every projection (fp8_gemv_tiles, gemv_tiles; where gemv_tiles says cuBLAS, over
           GemvTiles(): the projection then runs the Triton GEMV); gn.F=N: the same over GemvTiles() on the
           projections gemv_tiles leaves to cuBLAS only (the table's own shapes keep its tiles)
  rt=0     the fp32 router's logits (DeepSeek, GLM) on cuBLAS's fp32 GEMM, not the Triton GEMV (gemv.router_logits);
           rt.F=N: a field of its tiles (moecg.kernels.tiles.router_tiles)
  hk.F=N   a field of MLA's per-head W_UK projection's tiles (moecg.kernels.tiles.head_tiles, N contiguous); hv.F=N:
           W_UV's (K contiguous)
Each variant is captured (strategy full, capture.kernels=fused, dispatch=fused, the one bucket = the batch) and
timed by CUDA events over --replays back-to-back replays, median of --repeats, after one pass of the first variant
that is not kept (--no-warmup-variant: none; the first timed work after the model's build ran up to 3% slow); the step's logits from one fixed
state are compared with base's: variants without split-K must give the same bits (they run the same arithmetic),
split-K ones the largest difference is printed. --profile VARIANT adds a per-kernel table of that variant (torch
profiler, CUPTI sees the kernels inside the graph) at each batch size.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import torch

from moecg.capture import Capture
from moecg.dispatch import attach, detach, make_dispatcher
from moecg.engine import DecodeEngine
from moecg.fast import step as fast_step
from moecg.floor import bench_bandwidth_gbps, step_floor_ms
from moecg.kernels import gemv, tiles as tiles_mod, triton_ops
from moecg.models import build_model
from moecg.models.formats import ACTIVATIONS, FORMATS
from moecg.report import env_fields, write_report
from profile_step import kernel_table  # same directory: the per-kernel profile

SWITCHES = ("slot", "overlap", "router", "gemv", "gemv1", "side")
TILE_FIELDS = tuple(f.name for f in dataclasses.fields(tiles_mod.MoeTiles) if f.name != "down_split")
GEMV_FIELDS = tuple(f.name for f in dataclasses.fields(tiles_mod.GemvTiles) if f.name != "split_k")


def parse_variant(name: str) -> dict:
    parts = [p for p in name.split("+") if p != "base"]
    v = {"slot": False, "overlap": False, "router": False, "gemv": False, "gemv1": False, "side": False, "pdl": 0,
         "split": 1, "pre": True}
    for p in parts:
        if p in SWITCHES:
            v[p] = True
        elif p in ("pdl", "pdl1", "pdl2"):
            v["pdl"] = 1 if p == "pdl1" else 2
        elif p.startswith("split") and p[5:].isdigit():
            v["split"] = int(p[5:])
        elif p in ("pre=0", "pre=1"):  # weight loads before the PDL wait (capture.preload)
            v["pre"] = p == "pre=1"
        elif p.startswith("nw=") and p[3:].isdigit():  # add_rmsnorm's warps (tiles.norm_warps)
            v["nw"] = int(p[3:])
        elif p[:3] in ("rw=", "rb=", "rk=") and p[3:].isdigit():  # norm_route's tiles (tiles.norm_route_tiles)
            v[p[:2]] = int(p[3:])
        elif p.startswith("ok=") and p[3:].isdigit():  # the o projection's split-K
            v["ok"] = int(p[3:])
        elif p[:3] in ("mb=", "as=", "am=", "ls=", "lm=", "lt=") and p[3:].isdigit():  # attention splits, merges
            v[p[:2]] = int(p[3:])
        elif p.split(".")[0] in ("g", "gn") and "=" in p and p.split(".")[-1].split("=")[0] in GEMV_FIELDS:
            key = "gemv_tiles" if p.startswith("g.") else "gemv_new"  # e.g. g.rows=1, gn.rows=1
            v.setdefault(key, {})[p.split(".")[-1].split("=")[0]] = int(p.split("=")[1])
        elif p in ("grid=expert", "grid=slot", "grid=row", "grid=auto"):  # moe_experts' grid
            v["grid"] = p[5:]
        elif p == "rt=0":  # the fp32 router on cuBLAS (F.linear) instead of the Triton GEMV
            v["rt"] = None
        elif p.startswith("rt.") and "=" in p and p[3:].split("=")[0] in GEMV_FIELDS:
            v.setdefault("rt", {})[p[3:].split("=")[0]] = int(p.split("=")[1])
        elif p.split(".")[0] in ("hk", "hv") and "=" in p and p.split(".")[-1].split("=")[0] in GEMV_FIELDS:
            v.setdefault(p.split(".")[0], {})[p.split(".")[-1].split("=")[0]] = int(p.split("=")[1])  # e.g. hv.rows=1
        elif "=" in p and p.split("=")[0] in TILE_FIELDS:  # a MoE tile field, e.g. down_n=32
            v.setdefault("tiles", {})[p.split("=")[0]] = int(p.split("=")[1])
        else:
            raise SystemExit(f"variant {name!r}: unknown switch {p!r} "
                             f"(base, {', '.join(SWITCHES)}, pdl, pdl1, splitN, pre=0, grid=G, nw=N, rw=N, rb=N, rk=N, "
                             "mb=N, as=N, am=N, ls=N, lm=N, lt=0, ok=N, F=N, g.F=N, gn.F=N, hk.F=N, hv.F=N, rt=0, rt.F=N)")
    return v


MOE_EXPERTS, MOE_TILES = triton_ops.moe_experts, tiles_mod.moe_tiles  # the originals, which set_variant wraps
ATTN_DECODE, MLA_ATTN_DECODE = triton_ops.attn_decode, triton_ops.mla_attn_decode
LINEAR_PARTIALS = triton_ops.linear_partials
GEMV_RULES, NORM_WARPS = tiles_mod.GEMV_RULES, tiles_mod.norm_warps
NORM_ROUTE_TILES = tiles_mod.norm_route_tiles
FP8_GEMV_TILES, GEMV_TILES = tiles_mod.fp8_gemv_tiles, tiles_mod.gemv_tiles
HEAD_TILES, ROUTER_TILES, MLA_TILES = tiles_mod.head_tiles, tiles_mod.router_tiles, tiles_mod.mla_tiles


def set_variant(v: dict) -> None:
    moe, tiles_of = MOE_EXPERTS, MOE_TILES
    fast_step.SHARED_GEMM_ON_SIDE = v["side"]
    tiles_mod.norm_warps = NORM_WARPS if "nw" not in v else (lambda T, D, KK, n=v["nw"]: n)
    nr = {f: (bool(v[k]) if k == "rk" else v[k]) for k, f in (("rb", "block_e"), ("rw", "warps"), ("rk", "warp_topk"))
          if k in v}
    tiles_mod.norm_route_tiles = NORM_ROUTE_TILES if not nr else (
        lambda T, E, D: dataclasses.replace(NORM_ROUTE_TILES(T, E, D), **nr))
    f = v.get("gemv_tiles")
    tiles_mod.fp8_gemv_tiles = FP8_GEMV_TILES if not f else (
        lambda T, N, K, a8=False: dataclasses.replace(FP8_GEMV_TILES(T, N, K, a8), **f))
    fn = v.get("gemv_new")
    tiles_mod.gemv_tiles = GEMV_TILES if not (f or fn) else (
        lambda T, N, K: dataclasses.replace(GEMV_TILES(T, N, K) or tiles_mod.GemvTiles(), **f) if f else
        (GEMV_TILES(T, N, K) or dataclasses.replace(tiles_mod.GemvTiles(), **fn)))
    hk, hv = v.get("hk", {}), v.get("hv", {})
    tiles_mod.head_tiles = HEAD_TILES if not (hk or hv) else (
        lambda T, N, K, nc: dataclasses.replace(HEAD_TILES(T, N, K, nc), **(hk if nc else hv)))
    tiles_mod.mla_tiles = MLA_TILES if "lt" not in v else (
        lambda T, H, C, L: dataclasses.replace(MLA_TILES(T, H, C, L), pdl_trigger=bool(v["lt"])))
    rt = v.get("rt", {})
    tiles_mod.router_tiles = ROUTER_TILES if rt == {} else (lambda T, E, D: None) if rt is None else (
        lambda T, E, D: dataclasses.replace(ROUTER_TILES(T, E, D), **rt))
    tiles_mod.GEMV_RULES = (GEMV_RULES if v["gemv"] else ()) if not v["gemv1"] else tuple(  # (): all cuBLAS
        dataclasses.replace(r, tiles=dataclasses.replace(r.tiles, pdl_trigger=False)) for r in GEMV_RULES)

    def moe_experts(*a, tiles=None, grid="auto", **kw):
        if tiles is None:  # moe_experts(x [T, D], idx [T, K], w, gate_up, down, ...): the table's tiles
            ea = triton_ops.ExpertArgs(a[3], a[4], kw.get("spec"))
            tiles = tiles_of(a[1].shape[0], a[0].shape[1], ea.inter, ea.num_experts, ea.weights,
                             ea.activations)  # its format's and inputs'
        tiles = dataclasses.replace(tiles, down_split=v["split"], **v.get("tiles", {}))
        return moe(*a, tiles=tiles, grid=v.get("grid") or ("auto" if v["slot"] else "expert"), **kw)

    triton_ops.moe_experts = moe_experts

    def attn_decode(*a, **kw):
        kw.setdefault("splits", v.get("as"))
        kw.setdefault("merge_block", v.get("mb"))
        kw.setdefault("merge", v.get("am"))
        return ATTN_DECODE(*a, **kw)

    triton_ops.attn_decode = attn_decode if ("as" in v or "mb" in v or "am" in v) else ATTN_DECODE

    def mla_attn_decode(*a, **kw):
        kw.setdefault("splits", v.get("ls"))
        kw.setdefault("merge", v.get("lm"))
        return MLA_ATTN_DECODE(*a, **kw)

    triton_ops.mla_attn_decode = mla_attn_decode if ("ls" in v or "lm" in v) else MLA_ATTN_DECODE

    def linear_partials(x, w, bias=None, tiles=None, **kw):
        tiles = tiles or gemv.table_tiles(x, w) or tiles_mod.GemvTiles(16, 256, 4, 3)  # cuBLAS shapes: 16 x 256
        return LINEAR_PARTIALS(x, w, bias, dataclasses.replace(tiles, split_k=v["ok"]), **kw)

    triton_ops.linear_partials = linear_partials if "ok" in v else LINEAR_PARTIALS


def time_variant(v, model, adapter, bs, prompts, cache_len, replays, repeats, bandwidth, profile_it,
                 prefill_chunk=None):
    attach(model, make_dispatcher("fused"), max_rows=bs)
    try:
        eng = DecodeEngine(model, cache_len, bs, prefill_chunk=prefill_chunk)
        cap = Capture(eng, "full", buckets=(bs,), kernels="fused", pdl=v["pdl"], preload=v["pre"],
                      overlap_shared=v["overlap"], fuse_router=v["router"]).apply()
        eng.generate(prompts, 4, timing=False)  # cache filled to prompt + 4
        with eng.scratch():
            _, logits = eng.step_impl(eng.ids, bs)
            logits = logits.float().cpu()
        times = []
        for _ in range(repeats):
            with eng.scratch():
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(replays):
                    eng.step_impl(eng.ids, bs)
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) / replays)
        if profile_it:
            with eng.scratch():
                table = kernel_table(lambda: eng.step_impl(eng.ids, bs), 10)[:25]
        else:
            table = None
        floor = step_floor_ms(eng, adapter, prompts, bandwidth, prompts.shape[1] + 4, False)
        cap.unwrap()
        return statistics.median(times), logits, floor, table
    finally:
        detach(model)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen1_5_moe_a2_7b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--variants", nargs="+", default=["base", "slot", "slot+split2", "slot+split4", "slot+overlap",
                                                      "slot+pdl", "slot+overlap+pdl", "slot+overlap+pdl+split2"])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--cache-len", type=int, default=512)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens per prefill forward (long prompts)")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", nargs="*", default=[], help="variants to profile per kernel")
    ap.add_argument("--warmup-variant", action=argparse.BooleanOptionalAction, default=True,
                    help="time the first variant once, not kept, before the variants at each batch size")
    ap.add_argument("--weights", default="full", choices=FORMATS, help="the weight format (model.weights)")
    ap.add_argument("--activations", default="full", choices=ACTIVATIONS,
                    help="how block-FP8 GEMMs take their inputs (model.activations)")
    ap.add_argument("--bandwidth-gbps", type=float, default=None,
                    help="HBM GB/s for the floor (default: moecg.floor's device table, else a copy measured here)")
    ap.add_argument("--save-logits", default=None,
                    help="write the first variant's logits per batch size to this file (torch.save), to compare "
                         "another commit's package against them with --against-logits")
    ap.add_argument("--against-logits", default=None,
                    help="a --save-logits file: each row also says whether its logits equal that file's bits")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    saved, against = {}, (torch.load(args.against_logits) if args.against_logits else None)
    variants = {name: parse_variant(name) for name in args.variants}
    built = build_model(args.preset, num_layers=args.num_layers, device="cuda", weights=args.weights,
                        activations=args.activations)
    model = built.model
    bw, bw_source = bench_bandwidth_gbps(torch.device("cuda"), args.bandwidth_gbps)
    results, tables = [], []
    for bs in args.batch:
        prompts = torch.randint(0, model.config.vocab_size, (bs, args.prompt_len),
                                generator=torch.Generator().manual_seed(bs))
        ref_logits = None
        if args.warmup_variant:  # the first timed work after the build ran up to 3% slow (H100): a pass not kept
            first = next(iter(variants.values()))
            set_variant(first)
            time_variant(first, model, built.adapter, bs, prompts, args.cache_len, args.replays, 1, None, False,
                         args.prefill_chunk)
        for name, v in variants.items():
            set_variant(v)
            try:
                ms, logits, floor, table = time_variant(v, model, built.adapter, bs, prompts, args.cache_len,
                                                        args.replays, args.repeats, bw,
                                                        name in args.profile, args.prefill_chunk)
            except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others' numbers
                print(f"{name} bs {bs} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
                continue
            if ref_logits is None:
                ref_logits = logits
                saved[bs] = logits
            diff = float((logits - ref_logits).abs().max())
            same = bool(torch.equal(logits, ref_logits))
            row = {"batch_size": bs, "variant": name, "ms": ms, "floor_ms": floor, "x_floor": ms / floor,
                   "bandwidth_gbps": bw, "bandwidth_source": bw_source,
                   "same_bits_as_first": same, "max_logit_diff": diff, "max_abs_logit": float(ref_logits.abs().max()),
                   **({"same_bits_as_saved": bool(torch.equal(logits, against[bs])),
                       "max_logit_diff_saved": float((logits - against[bs]).abs().max())}
                      if against is not None and bs in against else {}),
                   **{k: v[k] for k in v if k not in ("tiles", "gemv_tiles", "gemv_new")},
                   "tiles": v.get("tiles", {}), "gemv_tiles": v.get("gemv_tiles", {}), "gemv_new": v.get("gemv_new", {})}
            results.append(row)
            print(json.dumps(row), flush=True)
            if table:
                tables.append((name, bs, ms, table))
    if args.save_logits:
        torch.save(saved, args.save_logits)
    triton_ops.moe_experts, triton_ops.attn_decode, triton_ops.linear_partials = MOE_EXPERTS, ATTN_DECODE, LINEAR_PARTIALS
    tiles_mod.fp8_gemv_tiles, tiles_mod.gemv_tiles = FP8_GEMV_TILES, GEMV_TILES
    head = (f"{args.preset}, {len(built.adapter.layers(model))} layers, {built.dtype}, weights {built.weights}, "
            f"activations {args.activations}, "
            f"{env_fields()['device_name']}, "
            f"prompt {args.prompt_len}, cache {args.cache_len}; captured full+fused step, ms (CUDA events, "
            f"{args.replays} replays x median of {args.repeats}); floor at {bw:.0f} GB/s ({bw_source})")
    lines = [head, "", "| bs | variant | ms | x floor | floor ms | same bits as first | max logit diff | first's "
             "max abs logit |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['batch_size']} | {r['variant']} | {r['ms']:.3f} | {r['x_floor']:.2f} | "
                     f"{r['floor_ms']:.3f} | {r['same_bits_as_first']} | {r['max_logit_diff']:.2e} | "
                     f"{r['max_abs_logit']:.3g} |"
                     + (f" saved: same bits {r['same_bits_as_saved']}, max diff {r['max_logit_diff_saved']:.2e}"
                        if "same_bits_as_saved" in r else ""))
    for name, bs, ms, table in tables:
        lines += ["", f"per kernel, {name} bs {bs} ({ms:.3f} ms per step):", "",
                  "| kernel | us/step | share | calls/step |", "|---|---|---|---|"]
        tot = sum(t for _, t, _ in table)
        lines += [f"| {k} | {t:.1f} | {t / tot:.1%} | {n:.1f} |" for k, t, n in table]
    write_report("\n".join(lines), results, args, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
