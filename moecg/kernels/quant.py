"""The block-FP8 weight tile the GEMM kernels dequantize in registers (moecg.models.weights: e4m3 values, one fp32
scale per QROWS weight rows x 128 columns). Shared by the GEMV (gemv.py) and the MoE kernels (moe.py, capacity.py).

Dims: BLOCK_N weight rows of the tile, BLOCK_K columns (a divisor or a multiple of 128), NS = BLOCK_K / 128 scale
columns a wide tile spans.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dequant_tile(w, srow_ptr, k0, K, s_sk, nmask, dt: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """w [BLOCK_N, BLOCK_K] e4m3 (columns k0 ..) -> the same tile in dt, each value times its block's scale in fp32
    and rounded once, as the reference (moecg.models.weights.dequantize). srow_ptr [BLOCK_N]: each row's scale row."""
    if BLOCK_K <= 128:  # the tile sits inside one scale column (k0 is a multiple of BLOCK_K)
        s = tl.load(srow_ptr + (k0 // 128) * s_sk, mask=nmask, other=0.0)  # [BLOCK_N]
        out = (w.to(tl.float32) * s[:, None]).to(dt)
    else:
        NS: tl.constexpr = BLOCK_K // 128
        j = k0 // 128 + tl.arange(0, NS)
        s = tl.load(srow_ptr[:, None] + j[None, :] * s_sk, mask=nmask[:, None] & (j * 128 < K)[None, :],
                    other=0.0)  # [BLOCK_N, NS]
        w3 = tl.reshape(w.to(tl.float32), (BLOCK_N, NS, 128)) * s[:, :, None]
        out = tl.reshape(w3, (BLOCK_N, BLOCK_K)).to(dt)
    return out


def check_block_k(block_k: int) -> int:
    """A quantized GEMM's K step: a divisor of 128 (inside one scale column) or a multiple of it (whole columns)."""
    if not (128 % block_k == 0 or block_k % 128 == 0):
        raise ValueError(f"BLOCK_K={block_k}: a block-FP8 GEMM steps by a divisor or a multiple of 128")
    return block_k
