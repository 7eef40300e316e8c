"""Per-op timings of the fused decode path on one layer of a real-shape model (GPU), incl. MoE kernel configs.

  python experiments/bench_kernels.py --preset qwen1_5_moe_a2_7b --batch 1 8 32 --out experiments/results/kernels/kernels_qwen1_5_moe_a2_7b.md

Each op is captured 20 times back to back in one CUDA graph and replayed; time = median replay / 20 (CUDA
events, after warmup), so launch overhead is excluded, as inside moecg's captured step. GB/s counts the weight
bytes an op must read (routed experts: only the experts the batch hits). Variants:
  moe:triton[BN,BK,warps,stages]  moecg.kernels.triton_ops.moe_experts with those tiles (tiles=MoeTiles(...))
  moe:dropless                    sort + grouped GEMM (the `dropless` dispatcher), unreduced output
  attn:triton / attn:sdpa         decode attention over a half-full 256-slot cache
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from bench_dispatch import capture, time_us  # same directory: the graph capture and timing helpers

from moecg.dispatch import make_dispatcher
from moecg.kernels import ref, triton_ops
from moecg.kernels.tiles import MoeTiles
from moecg.report import env_fields, write_report
from moecg.models import build_model

MOE_CONFIGS = [(32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3), (16, 256, 4, 4), (64, 64, 4, 5),
               (32, 128, 8, 4), (128, 128, 8, 3), (64, 256, 8, 3)]


def graph_time_us(fn, reps: int = 20, replays: int = 15) -> float:
    """µs per call of `fn`: `reps` calls captured back to back in one graph, median of `replays` replays."""
    def burst():
        for _ in range(reps):
            fn()

    g = capture(burst, None)
    return time_us(g.replay, torch.device("cuda"), warmup=1, inner=1, repeats=replays) / reps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen1_5_moe_a2_7b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--configs", default="all", help="'all' or e.g. '32,128,4,4;64,128,4,4'")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("bench_kernels.py times CUDA kernels: run it on a GPU")
    configs = MOE_CONFIGS if args.configs == "all" else [tuple(int(v) for v in c.split(",")) for c in
                                                          args.configs.split(";")]
    built = build_model(args.preset, num_layers=1, device="cuda")
    model = built.model
    layer = built.adapter.layers(model)[0]
    experts = built.adapter.experts_of(layer)
    router = built.adapter.router_of(layer)
    at = layer.self_attn
    E, two_i, D = experts.gate_up_proj.shape
    K = int(router.top_k)
    esize = experts.gate_up_proj.element_size()
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for bs in args.batch:
        x = torch.randn(bs, D, device="cuda", dtype=built.dtype, generator=g)
        logits = F.linear(x, router.weight)
        idx, w = ref.route(logits, K, bool(getattr(router, "norm_topk_prob", True)), built.dtype)
        hit = int(torch.unique(idx).numel())
        moe_bytes = hit * 3 * (two_i // 2) * D * esize
        r = {"batch_size": bs, "experts_hit": hit, "moe_mb": moe_bytes / 1e6}
        want = ref.moe_experts(x, idx, w, experts.gate_up_proj, experts.down_proj)
        dropless = make_dispatcher("dropless")
        r["moe:dropless"] = graph_time_us(lambda: dropless.unreduced(experts, x, idx, w, None, None))
        for c in configs:
            tiles = MoeTiles(up_n=c[0], down_n=c[0], up_k=c[1], down_k=c[1], warps=c[2], stages=c[3])
            name = "moe:triton[" + ",".join(map(str, c)) + "]"
            try:
                got = triton_ops.moe_experts(x, idx, w, experts.gate_up_proj, experts.down_proj, tiles=tiles)
                err = float((got - want).abs().max())
                r[name] = graph_time_us(lambda: triton_ops.moe_experts(x, idx, w, experts.gate_up_proj,
                                                                       experts.down_proj, tiles=tiles))
                r[name + ":err"] = err
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects is reported, not fatal
                print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
                r[name] = float("nan")
        # attention over a half-full cache
        Hq, Dh = at.q_proj.weight.shape[0] // at.head_dim, at.head_dim
        Hkv = at.k_proj.weight.shape[0] // Dh
        L = 256
        keys = torch.randn(bs, Hkv, L, Dh, device="cuda", dtype=built.dtype, generator=g)
        vals = torch.randn_like(keys)
        q = torch.randn(bs, Hq, Dh, device="cuda", dtype=built.dtype, generator=g)
        pos = torch.tensor(L // 2, device="cuda")
        want = ref.attn_decode(q, keys, vals, pos, at.scaling)
        r["attn:err"] = float((triton_ops.attn_decode(q, keys, vals, pos, at.scaling) - want).abs().max())
        r["attn:triton"] = graph_time_us(lambda: triton_ops.attn_decode(q, keys, vals, pos, at.scaling))
        mask = (torch.arange(L, device="cuda") <= pos)[None, None, None, :]
        r["attn:sdpa"] = graph_time_us(lambda: F.scaled_dot_product_attention(
            q[:, :, None, :], keys, vals, attn_mask=mask, scale=at.scaling, enable_gqa=Hq != Hkv))
        wq = torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])
        r["qkv_gemm"] = graph_time_us(lambda: F.linear(x, wq))
        r["qkv_gemm_gbps"] = wq.numel() * esize / r["qkv_gemm"] / 1e3
        best = min((v, k) for k, v in r.items() if k.startswith("moe:triton") and not k.endswith(":err") and v == v)
        r["moe_best"] = best[1]
        r["moe_best_gbps"] = moe_bytes / best[0] / 1e3
        r["moe_dropless_gbps"] = moe_bytes / r["moe:dropless"] / 1e3
        rows.append(r)
        print(json.dumps(r), flush=True)
    head = (f"{args.preset}, one layer, {built.dtype}, {env_fields()['device_name']}; us per op inside a CUDA "
            "graph (20 back to back), median of 15 replays")
    lines = [head, "", "| bs | experts hit | MoE MB | dropless us | best triton | triton us | triton GB/s | "
             "dropless GB/s | attn triton us | attn sdpa us | qkv GEMM us (GB/s) |", "|---" * 11 + "|"]
    for r in rows:
        lines.append(f"| {r['batch_size']} | {r['experts_hit']} | {r['moe_mb']:.1f} | {r['moe:dropless']:.1f} | "
                     f"{r['moe_best']} | {r[r['moe_best']]:.1f} | {r['moe_best_gbps']:.0f} | "
                     f"{r['moe_dropless_gbps']:.0f} | {r['attn:triton']:.1f} | {r['attn:sdpa']:.1f} | "
                     f"{r['qkv_gemm']:.1f} ({r['qkv_gemm_gbps']:.0f}) |")
    lines += ["", "all MoE configs (BLOCK_N, BLOCK_K, warps, stages), us:", ""]
    for r in rows:
        cells = [f"{k[len('moe:triton'):]} {v:.1f}" for k, v in r.items()
                 if k.startswith("moe:triton") and not k.endswith(":err")]
        lines.append(f"- bs {r['batch_size']}: " + ", ".join(cells))
    write_report("\n".join(lines), rows, args, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
