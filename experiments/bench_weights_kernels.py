"""The quantized GEMM kernels alone, against their bf16 selves: one Qwen3-30B-A3B layer's shapes on a GPU.

  python experiments/bench_weights_kernels.py --out experiments/results/weights/kernels.md --json .../kernels.json

Rows: the dropless MoE kernels (moe_experts, T 1 and 8), the capacity kernels (every expert read, cf 1.25: at each T the
table's tiles for C rows in the format, which capacity_experts picks, and the bf16 rule for T; at T 8 a grid too) and
the qkv / o GEMVs (T 1 and 8), each in bf16 with its default tiles (the GEMVs: ops.linear's choice, cuBLAS or the
table) and in block-FP8 over a grid of tiles; the MoE and capacity kernels in mxfp4 too (--formats; mxfp4 quantizes
the experts only, so it has no GEMV rows). us per call: --copies distinct weight sets cycled inside one CUDA graph
(so the weights come from HBM, not from L2), median of replays; GB/s: the weight bytes one call must read (the
experts it hits, values + scales) over that time. Each FP8 output is checked against the dequantize-then-matmul
reference (max abs error printed).
GPT-OSS-120B's experts: --hidden 2880 --inter 2880 --experts 128 --top-k 4.
--activations fp8_dynamic: the block-FP8 weights take quantized inputs (W8A8: each kernel's A8 path, K steps of 128
on the tensor cores, x quantized once outside the timing as the step's producers do), over a grid of its own (column
tiles, stages, warps, split-K for the GEMVs); --ops picks rows.
--cublas (with fp8_dynamic): the GEMV rows also time cuBLAS's block-scaled FP8 GEMM (torch.nn.functional.scaled_mm,
1x128 input scales by 128x128 weight scales, the same e4m3 values and scales; bf16 out). --table-only: the GEMVs at
the table's tiles only (no grid).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys

import torch
from bench_kernels import graph_time_us  # same directory: one graph of back-to-back calls, timed by replays

from moecg.kernels import ref, triton_ops as tri
from moecg.kernels.quant import quantize_rows
from moecg.kernels.tiles import GemvTiles, MoeTiles, capacity_tiles, moe_tiles
from moecg.moe_math import capacity
from moecg.models.formats import BlockFp8, Mxfp4, mx_quantize, quantize_stacked
from moecg.report import env_fields, write_report

BF = torch.bfloat16


def nbytes(w, rows=None):
    """Bytes of weight w (or of its rows `rows` of dim 0: the experts hit) as stored."""
    if isinstance(w, (BlockFp8, Mxfp4)):
        q, s = (w.q, w.scale) if rows is None else (w.q[rows], w.scale[rows])
        return q.numel() + s.numel() * s.element_size()
    return (w if rows is None else w[rows]).numel() * 2


def time_us(fns, replays=20):
    """us per call: every fn of `fns` once, in order, captured in one graph, median over replays
    (bench_kernels.graph_time_us); nan where the tiles do not compile here (too much shared memory): printed."""
    try:
        cycle = itertools.cycle(fns)  # one graph of len(fns) calls, each fn once, in order
        return graph_time_us(lambda: next(cycle)(), reps=len(fns), replays=replays)
    except Exception as e:  # noqa: BLE001 - one tile set that does not fit must not lose the others' rows
        print(f"failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return float("nan")


def cases(full, quant, t0, variants, fma):
    """(format, weight sets, tiles): bf16 at the table's tiles and the CUDA-core (block_m < 16) ones, each quantized
    format over the variants too."""
    yield "bf16", full, [t0, *fma]
    for fmt, sets in quant.items():
        yield fmt, sets, [t0, *variants, *fma]


QUANTIZERS = {"fp8_block": lambda w, parts: quantize_stacked(w, parts, BF),
              "mxfp4": lambda w, parts: Mxfp4(*mx_quantize(w), BF)}


def cublas_block_fp8(xq, xs, w):
    """cuBLAS's block-scaled FP8 GEMM on act_quant'ed rows (xq [T, K] e4m3, xs [T, K / 128] fp32, M-major: a
    transposed contiguous [K / 128, T], as a producer would write them for it) and a block-FP8 weight (w.q [N, K],
    w.scale [N / 128, K / 128]; cuBLAS reads both transposed) -> [T, N] bf16."""
    from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

    return scaled_mm(xq, w.q.t(), xs, ScalingType.BlockWise1x128, w.scale.t(), ScalingType.BlockWise128x128,
                     swizzle_a=SwizzleType.NO_SWIZZLE, swizzle_b=SwizzleType.NO_SWIZZLE, output_dtype=BF)


def act_fn(activations: str):
    """A quantized weight set as the kernels take it with these activations (BlockFp8.act; mxfp4 has no A8 path)."""
    return lambda w: dataclasses.replace(w, act=activations) if isinstance(w, BlockFp8) else w


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--qkv", type=int, default=5120, help="rows of the fused qkv projection")
    ap.add_argument("--o-in", type=int, default=4096, help="inner dim of the o projection")
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--formats", nargs="+", default=["fp8_block", "mxfp4"], choices=sorted(QUANTIZERS))
    ap.add_argument("--skip-gemv", action="store_true", help="the MoE rows only")
    ap.add_argument("--activations", default="full", choices=["full", "fp8_dynamic"],
                    help="the block-FP8 weights' inputs (model.activations)")
    ap.add_argument("--ops", nargs="+", default=["moe_experts", "capacity_experts", "qkv", "o"],
                    choices=["moe_experts", "capacity_experts", "qkv", "o"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--table-only", action="store_true",
                    help="the capacity kernels at the two table choices only, the GEMVs at the table's tiles only")
    ap.add_argument("--cublas", action="store_true", help="with fp8_dynamic: cuBLAS's block-scaled FP8 GEMM rows too")
    ap.add_argument("--stages", nargs="+", type=int, default=None,
                    help="the GEMV grid's pipeline stages (default 3 4; with fp8_dynamic 3 4 6)")
    ap.add_argument("--rows", nargs="+", type=int, default=[16],
                    help="the GEMV grid's rows a program on the tensor cores (block-FP8: up to 64)")
    ap.add_argument("--block-n", nargs="+", type=int, default=None, help="the GEMV grid's column blocks")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("bench_weights_kernels.py times CUDA kernels: run it on a GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    D, I, E, K, C = args.hidden, args.inter, args.experts, args.top_k, args.copies
    rows = []

    def row(kind, T, fmt, tiles, us, gb, err=None):
        r = {"op": kind, "T": T, "weights": fmt, "tiles": str(tiles), "us": us, "gbps": gb / us / 1e3,
             "max_abs_err": err}
        rows.append(r)
        print(json.dumps(r), flush=True)

    # -- MoE ------------------------------------------------------------------------------------------------------
    full = [(torch.randn(E, 2 * I, D, device="cuda", generator=g).to(BF) * 0.02,
             torch.randn(E, D, I, device="cuda", generator=g).to(BF) * 0.02) for _ in range(C)]
    act = act_fn(args.activations)
    quant = {f: [(act(QUANTIZERS[f](gu.float(), 2)), act(QUANTIZERS[f](dn.float(), 1))) for gu, dn in full]
             for f in args.formats}
    variants = [MoeTiles(up_k=256, down_k=256, stages=3), MoeTiles(stages=6), MoeTiles(stages=3),
                MoeTiles(up_n=128, down_n=128, stages=3), MoeTiles(up_n=32, down_n=32, stages=6),
                MoeTiles(up_k=64, down_k=64, stages=8), MoeTiles(warps=8), MoeTiles(up_k=256, down_k=256, warps=8,
                                                                                    stages=3),
                MoeTiles(up_n=32, down_n=32, up_k=256, down_k=256, warps=8, stages=3)]
    # the products on the CUDA cores (block_m < 16: no padded rows, no operand layout change): 3-d accumulators of
    # up_n x up_k (two: gate and up) and down_n x down_k fp32 values a program, kept within 64 registers a thread
    fma = [MoeTiles(block_m=1, up_n=16, up_k=256, down_n=16, down_k=256, stages=3),
           MoeTiles(block_m=1, up_n=16, up_k=256, down_n=16, down_k=256, stages=4),
           MoeTiles(block_m=1, up_n=8, up_k=512, down_n=8, down_k=512, stages=3),
           MoeTiles(block_m=1, up_n=32, up_k=128, down_n=32, down_k=128, stages=4),
           MoeTiles(block_m=1, up_n=16, up_k=128, down_n=16, down_k=128, stages=6),
           MoeTiles(block_m=1, up_n=16, up_k=512, down_n=16, down_k=512, warps=8, stages=3),
           MoeTiles(block_m=1, up_n=32, up_k=256, down_n=32, down_k=256, warps=8, stages=3),
           MoeTiles(block_m=2, up_n=16, up_k=256, down_n=16, down_k=256, stages=3)]
    if args.activations != "full":  # K steps of 128 on the tensor cores: more columns or stages instead
        variants = [MoeTiles(up_n=n, down_n=dn_, stages=st, warps=wp) for n, dn_, wp in ((64, 64, 4), (128, 64, 4),
                                                                                   (128, 64, 8), (128, 128, 8))
                    for st in (3, 4, 6)]
    for T in args.tokens if {"moe_experts", "capacity_experts"} & set(args.ops) else ():
        x = torch.randn(T, D, device="cuda", generator=g).to(BF)
        idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)]).int()
        w = torch.rand(T, K, device="cuda", generator=g).to(BF)
        hit = idx.unique().long()
        t0 = moe_tiles(T, D, I, E)
        for fmt, sets, tile_set in cases(full, quant, t0, variants, fma) if "moe_experts" in args.ops else ():
            gb = nbytes(sets[0][0], hit) + nbytes(sets[0][1], hit)
            for t in tile_set:
                t = MoeTiles(**{**t.__dict__, "down_split": t0.down_split})
                fns = [lambda gu=gu, dn=dn, t=t: tri.moe_experts(x, idx, w, gu, dn, tiles=t) for gu, dn in sets]
                us, err = time_us(fns), None
                if fmt != "bf16" and us == us:
                    err = float((fns[0]() - ref.moe_experts(x, idx, w, *sets[0])).abs().max())
                row("moe_experts", T, fmt, t, us, gb, err)
        # capacity: every expert's weights once; the table's tiles for C rows in the format (what capacity_experts
        # picks) and the bf16 rule for T (its choice before the format's table keyed on C), the grid at T 8
        if "capacity_experts" in args.ops:
            cap = capacity(T, K, E, 1.25, 1)
            for fmt, sets, tile_set in cases(full, quant, t0, variants, fma):
                gb = nbytes(sets[0][0]) + nbytes(sets[0][1])
                table = capacity_tiles(cap, D, I, E, *(("full", "full") if fmt == "bf16" else (fmt, args.activations)))
                grid = tile_set if T == 8 and not args.table_only else []
                for t in dict.fromkeys([table, t0, *grid]):
                    fns = [lambda gu=gu, dn=dn, t=t: tri.capacity_experts(x, idx, w, gu, dn, capacity_factor=1.25,
                                                                          tiles=t) for gu, dn in sets[:3]]
                    note = " ".join(n for n, c in ((f"[table at C {cap}]", t == table), ("[bf16 rule at T]", t == t0))
                                    if c)
                    row("capacity_experts", T, fmt, f"{t} {note}".strip(), time_us(fns), gb)
    del full, quant
    torch.cuda.empty_cache()
    # -- GEMVs ----------------------------------------------------------------------------------------------------
    gemvs = [(n, N, Kd) for n, N, Kd in (("qkv", args.qkv, D), ("o", D, args.o_in)) if n in args.ops]
    for name, N, Kd in () if args.skip_gemv or "fp8_block" not in args.formats else gemvs:
        ws = [torch.randn(N, Kd, device="cuda", generator=g).to(BF) * 0.02 for _ in range(C * 4)]
        qs = [act(quantize_stacked(wi.float(), 1, BF)) for wi in ws]
        bns = args.block_n or (16, 32, 64, 128)
        grid = [GemvTiles(bn, bk, wp, st, rows=r) for bn in bns if bn <= 64 for bk in (128, 256, 512) for wp in (4, 8)
                for st in args.stages or (3, 4) for r in args.rows]
        if args.activations != "full":  # the A8 tensor-core K step is 128 whatever block_k says: columns, stages, split-K
            grid = [GemvTiles(bn, 128, wp, st, split_k=sk, rows=r)
                    for bn, wp in ((16, 4), (32, 4), (64, 4), (64, 8), (128, 8)) if bn in bns
                    for st in args.stages or (3, 4, 6) for sk in ((1, 2, 4) if name == "o" and bn <= 64 else (1,))
                    for r in args.rows]
        # one row a program, its products on the CUDA cores (batch 1): an accumulator of block_n x block_k fp32
        fma = [GemvTiles(bn, bk, wp, st, rows=1) for bn, bk in ((8, 256), (16, 256), (8, 512), (16, 512), (32, 128),
                                                                (4, 1024)) for wp in (4, 8) for st in (3, 4)]
        if args.table_only:
            grid, fma = [None], []
        for T in args.tokens:
            x = torch.randn(T, Kd, device="cuda", generator=g).to(BF)
            row(name, T, "bf16", "ops.linear", time_us([lambda wi=wi: tri.linear(x, wi) for wi in ws]), nbytes(ws[0]))
            for t in fma if T == 1 else ():  # the Triton GEMV on bf16 weights, one row a program
                row(name, T, "bf16", t, time_us([lambda wi=wi, t=t: tri.linear(x, wi, tiles=t) for wi in ws]),
                    nbytes(ws[0]))
            # A8 on the tensor cores: x quantized once here, as the step's producers do (not timed); CUDA-core tiles
            # quantize their rows themselves
            xq = quantize_rows(x) if args.activations != "full" and T > 2 else None
            tiles = grid if T > 2 or args.activations == "full" or args.table_only else []
            for t in tiles + (fma if T <= 2 else []):
                # split-K: the fp32 partial rows (the consumer, add_rmsnorm / norm_route, adds them), summed here
                split = t is not None and t.split_k > 1
                op = tri.linear_partials if split else tri.linear
                fns = [lambda wi=wi, t=t, op=op: op(x, wi, tiles=t, xq=xq) for wi in qs]
                us, err = time_us(fns), None
                if us == us:
                    out = fns[0]()
                    out = out.sum(1).to(BF) if split else out
                    err = float((out - ref.linear(x, qs[0])).abs().max())
                row(name, T, "fp8_block", t or "table", us, nbytes(qs[0]), err)
            if args.cublas and args.activations != "full":
                xq8, xs = quantize_rows(x)
                xs = xs.t().contiguous().t()  # M-major (cublas_block_fp8)
                fns = [lambda wi=wi: cublas_block_fp8(xq8, xs, wi) for wi in qs]
                us, err = time_us(fns), None
                if us == us:
                    err = float((fns[0]() - ref.linear(x, qs[0])).abs().max())
                row(name, T, "fp8_block", "cuBLAS scaled_mm (1x128 x 128x128)", us, nbytes(qs[0]), err)
    lines = [f"Quantized GEMM kernels, {env_fields()['device_name']}: D {D}, I {I}, E {E}, K {K}; qkv {args.qkv} x {D}, "
             f"o {D} x {args.o_in}; {C} weight sets cycled per graph; activations {args.activations}", "",
             "| op | T | weights | tiles | us | GB/s | max abs err vs reference |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        err = "" if r["max_abs_err"] is None else f"{r['max_abs_err']:.2e}"
        lines.append(f"| {r['op']} | {r['T']} | {r['weights']} | {r['tiles']} | {r['us']:.1f} | {r['gbps']:.0f} | "
                     f"{err} |")
    write_report("\n".join(lines), rows, args, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
