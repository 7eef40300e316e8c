"""One call of each weight-streaming kernel of a Qwen3-30B-A3B layer (batch 1 unless --tokens), in bf16 and
block-FP8 (with --activations fp8_dynamic: W8A8), for Nsight Compute (hardware counters: achieved DRAM bandwidth,
issue-slot use, warp stall reasons, occupancy).

  ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \
      --section Occupancy --section LaunchStats --section SchedulerStats python3 experiments/ncu_kernels.py

Every op runs twice first (compilation, autotuning-free warm calls), then once between cudaProfilerStart/Stop, so
ncu sees exactly one launch of each kernel (ncu flushes the caches before each pass: the weights come from HBM).
--ops picks the ops (names printed in launch order); the tiles are the tables' own (moecg.kernels.tiles), or the MoE
kernels' with --moe-tiles overrides (e.g. down_n=64,down_k=256). --shape gpt_oss: GPT-OSS-20B's layer (D 2880, I
2880, 32 experts, top 4; its experts as HF stores them: [E, D, 2I] interleaved gate/up and [E, I, D] down, biased,
clamped SwiGLU) in place of Qwen3-30B-A3B's.

--time instead times the GEMVs (no ncu): us per call in a CUDA graph of back-to-back calls, once cycling a ring of
weight copies larger than L2 (each call streams its weight from HBM, as in the step) and once on one copy (after the
first call it sits in L2): how much faster a projection whose weight an L2 prefetch had brought in could run.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from moecg.kernels import triton_ops as tri
from moecg.kernels.tiles import moe_tiles
from moecg.models.adapter import ExpertSpec
from moecg.models.formats import ACTIVATIONS, quantize_stacked

BF = torch.bfloat16


SHAPES = {"qwen3": dict(D=2048, I=768, E=128, K=8, qkv=5120, o_in=4096),
          "gpt_oss": dict(D=2880, I=2880, E=32, K=4, qkv=5120, o_in=4096, gpt_oss=True)}


def ops(D=2048, I=768, E=128, K=8, qkv=5120, o_in=4096, T=1, activations="full", gpt_oss=False, moe_tiles=None):
    """The ops by name; T rows (routed to K distinct experts each); activations: the block-FP8 GEMMs' inputs (full
    or fp8_dynamic, quantized as the step's producers would: by quantize_rows on 16-row tiles, in the kernel on
    the CUDA-core ones). gpt_oss: the experts in GPT-OSS's layout and activation (bf16 only); moe_tiles: a
    MoeTiles for the MoE kernels (None: the table's)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, device="cuda", generator=g) * 0.02).to(BF)  # noqa: E731
    x = rnd(T, D) * 50
    xo = rnd(T, o_in) * 50
    wq, wo = rnd(qkv, D), rnd(D, o_in)
    gu, dn = rnd(E, 2 * I, D), rnd(E, D, I)
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)]).int()
    w = torch.rand(T, K, device="cuda", generator=g).to(BF)
    if gpt_oss:  # HF's GptOssExperts: [E, D, 2I] (g0 u0 g1 u1 ...) and [E, I, D], biases, alpha 1.702, limit 7
        spec = ExpertSpec("swiglu_clamp", interleaved=True, transposed=True, has_bias=True, alpha=1.702, limit=7.0)
        gu, dn = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
        kw = dict(spec=spec, gate_up_bias=rnd(E, 2 * I), down_bias=rnd(E, D), tiles=moe_tiles)
        return {"qkv_bf16": lambda: tri.linear(x, wq), "o_bf16": lambda: tri.linear(xo, wo),
                "moe_bf16": lambda: tri.moe_experts(x, idx, w, gu, dn, **kw)}
    q = {n: dataclasses.replace(quantize_stacked(t.float(), p, BF), act=activations)
         for n, t, p in (("wq", wq, 1), ("wo", wo, 1), ("gu", gu, 2), ("dn", dn, 1))}
    return {
        "qkv_bf16": lambda: tri.linear(x, wq),
        "qkv_fp8": lambda: tri.linear(x, q["wq"]),
        "o_bf16": lambda: tri.linear(xo, wo),
        "o_fp8": lambda: tri.linear(xo, q["wo"]),
        "moe_bf16": lambda: tri.moe_experts(x, idx, w, gu, dn, tiles=moe_tiles),
        "moe_fp8": lambda: tri.moe_experts(x, idx, w, q["gu"], q["dn"], tiles=moe_tiles),
    }


def time_l2(copies_mib=256):
    from bench_kernels import graph_time_us  # same directory

    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, N, K in (("qkv", 5120, 2048), ("o", 2048, 4096)):
        x = (torch.randn(1, K, device="cuda", generator=g)).to(BF)
        for fmt in ("bf16", "fp8"):
            n = max(2, copies_mib * 2**20 // (N * K * (2 if fmt == "bf16" else 1)))
            ws = [(torch.randn(N, K, device="cuda", generator=g) * 0.02).to(BF) for _ in range(n)]
            if fmt == "fp8":
                ws = [quantize_stacked(w.float(), 1, BF) for w in ws]
            nbytes = N * K * (2 if fmt == "bf16" else 1)
            for where, ring in (("hbm", ws), ("l2", ws[:1])):
                it = iter(range(10**9))
                us = graph_time_us(lambda r=ring: tri.linear(x, r[next(it) % len(r)]), reps=len(ws), replays=15)
                rows.append((name, fmt, where, us, nbytes / us / 1e3))
                print(f"{name} {fmt} {where}: {us:.2f} us ({nbytes / us / 1e3:.0f} GB/s)", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", nargs="+", default=None)
    ap.add_argument("--time", action="store_true", help="time the GEMVs from HBM and from L2 instead")
    ap.add_argument("--tokens", type=int, default=1, help="rows of every op (the step's batch)")
    ap.add_argument("--activations", default="full", choices=ACTIVATIONS,
                    help="the block-FP8 ops' inputs (model.activations)")
    ap.add_argument("--shape", default="qwen3", choices=list(SHAPES), help="whose layer (the module docstring)")
    ap.add_argument("--moe-tiles", default=None, help="MoeTiles fields for the MoE kernels, e.g. down_n=64,down_k=256")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("ncu_kernels.py launches CUDA kernels: run it on a GPU")
    if args.time:
        time_l2()
        return 0
    mt = None
    if args.moe_tiles:
        f = {k: int(v) for k, v in (kv.split("=") for kv in args.moe_tiles.split(","))}
        mt = dataclasses.replace(moe_tiles(args.tokens, SHAPES[args.shape]["D"], SHAPES[args.shape]["I"],
                                           SHAPES[args.shape]["E"]), **f)
    table = ops(**SHAPES[args.shape], T=args.tokens, activations=args.activations, moe_tiles=mt)
    names = args.ops or list(table)
    for n in names:
        table[n]()
        table[n]()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for n in names:
        print("op", n, flush=True)
        table[n]()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
