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


# How the GEMM kernels apply the scales (QACC): "dequant" (0) rounds each dequantized weight to the model dtype as the
# reference does, then the same tl.dot; "accumulate" (1) casts the values to the model dtype (exact: e4m3 fits in
# bf16) and multiplies each 128-column block's fp32 partial sum by its scale, as vLLM's and SGLang's block-FP8 kernels
# do: fewer instructions per weight, and the reference's products without its rounding of each weight.
QUANT_MODES = {"dequant": 0, "accumulate": 1}
MODE = "dequant"


def quant_acc() -> int:
    """The QACC constexpr of the current MODE."""
    return QUANT_MODES[MODE]


def check_block_k(block_k: int, qacc: int = 0) -> int:
    """A quantized GEMM's K step: a divisor of 128 (inside one scale column) or, dequantizing, a multiple of it."""
    if not (128 % block_k == 0 or (block_k % 128 == 0 and not qacc)):
        raise ValueError(f"BLOCK_K={block_k}: a block-FP8 GEMM steps by a divisor of 128" +
                         ("" if qacc else " or a multiple of it"))
    return block_k
