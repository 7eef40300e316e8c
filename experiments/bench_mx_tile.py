"""Two ways a Triton GEMM can read mxfp4 weights, timed alone on one weight matrix (decode sizes: M = 16 rows, of
which T are real): moecg's register decode (moecg.kernels.quant.mx_tile, then tl.dot on bf16) against Triton's
tl.dot_scaled (e2m1 operand + e8m0 scales; on Hopper the compiler upcasts to bf16 in the MMA's operand layout), and
the same kernel on the bf16 weight. Both mxfp4 variants are checked against the dequantize-then-matmul reference.

  python experiments/bench_mx_tile.py --n 12288 --k 2048 --out experiments/results/weights/mx_tile.md

us: median of CUDA-graph replays of --copies distinct weights back to back (from HBM, not L2); GB/s: bytes read.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl
from bench_kernels import graph_time_us

from moecg.kernels.quant import mx_tile
from moecg.models.formats import mx_dequantize, mx_quantize
from moecg.report import env_fields, write_report


@triton.jit
def _gemm(x_ptr, w_ptr, s_ptr, y_ptr, T, N, K, MODE: tl.constexpr, FAST: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y [T, N] = x [T, K] @ W^T; MODE 0: W bf16 [N, K]; 1: mxfp4 via mx_tile; 2: mxfp4 via tl.dot_scaled."""
    nb = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * K + kk[None, :], mask=(m < T)[:, None] & (kk < K)[None, :], other=0.0)
        if MODE == 0:
            w = tl.load(w_ptr + n[:, None] * K + kk[None, :], mask=nm[:, None] & (kk < K)[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        elif MODE == 1:
            w = mx_tile(w_ptr + n[:, None] * (K // 2), s_ptr + n * (K // 32), k0, K, 1, 1, nm, x.dtype, BLOCK_N,
                        BLOCK_K)
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            wq = tl.load(w_ptr + n[None, :] * (K // 2) + kb[:, None], mask=nm[None, :] & (kb < K // 2)[:, None],
                         other=0)  # [BLOCK_K / 2, BLOCK_N]
            j = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            sc = tl.load(s_ptr + n[:, None] * (K // 32) + j[None, :], mask=nm[:, None] & (j < K // 32)[None, :],
                         other=127)  # [BLOCK_N, BLOCK_K / 32]
            acc = tl.dot_scaled(x, None, "bf16", wq, sc, "e2m1", acc, fast_math=FAST)
    tl.store(y_ptr + m[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=(m < T)[:, None] & nm[None, :])


def run(x, w, s, mode, fast, bn, bk, warps, stages):
    T, K = x.shape
    N = w.shape[0]
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    _gemm[(triton.cdiv(N, bn),)](x, w, s if s is not None else w, y, T, N, K, MODE=mode, FAST=fast, BLOCK_M=16,
                                 BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return y


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=12288, help="weight rows (8 Qwen3-30B-A3B experts' gate|up: 8 x 1536)")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    N, K = args.n, args.k
    dense = [torch.randn(N, K, device="cuda", generator=g) * 0.02 for _ in range(args.copies)]
    mx = [mx_quantize(w) for w in dense]
    bf = [w.to(torch.bfloat16) for w in dense]
    rows = []
    for T in (1, 8):
        x = torch.randn(T, K, device="cuda", generator=g).to(torch.bfloat16)
        want = x.float() @ mx_dequantize(*mx[0], torch.bfloat16).float().t()
        for mode, name in ((0, "bf16"), (1, "mx_tile"), (2, "dot_scaled"), (3, "dot_scaled fast_math")):
            for bn, bk, warps, stages in ((64, 128, 4, 4), (64, 256, 4, 3), (32, 256, 4, 4), (128, 128, 4, 3),
                                          (64, 128, 8, 4), (128, 256, 8, 3)):
                ws = bf if mode == 0 else mx
                args_ = [(w, None) if mode == 0 else w for w in ws]
                kmode, fast = min(mode, 2), mode == 3
                try:
                    y = run(x, *args_[0], kmode, fast, bn, bk, warps, stages)
                    it = iter(range(10 ** 9))
                    us = graph_time_us(lambda: run(x, *args_[next(it) % len(args_)], kmode, fast, bn, bk, warps,
                                                   stages), reps=len(args_), replays=20)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile must not lose the others
                    print(f"failed {name} {bn} {bk}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                err = None if mode == 0 else float((y.float() - want).abs().max())
                nbytes = N * K * 2 if mode == 0 else N * K // 2 + N * K // 32
                r = {"T": T, "variant": name, "tiles": f"{bn}x{bk} w{warps} s{stages}", "us": us,
                     "gbps": nbytes / us / 1e3, "max_abs_err": err}
                rows.append(r)
                print(json.dumps(r), flush=True)
    lines = [f"mxfp4 tile decode, {env_fields()['device_name']}: W [{N}, {K}], {args.copies} copies per graph", "",
             "| T | variant | tiles | us | GB/s | max abs err vs reference |", "|---|---|---|---|---|---|"]
    for r in rows:
        err = "" if r["max_abs_err"] is None else f"{r['max_abs_err']:.2e}"
        lines.append(f"| {r['T']} | {r['variant']} | {r['tiles']} | {r['us']:.1f} | {r['gbps']:.0f} | {err} |")
    write_report("\n".join(lines), rows, args, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
