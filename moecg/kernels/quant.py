"""The quantized weight tiles the GEMM kernels dequantize in registers (moecg.models.formats), each as its format's
reference does (fp32 products rounded once to the compute dtype), so a kernel's tl.dot sees the reference's weights:
- block-FP8 (dequant_tile): e4m3 values, one fp32 scale per QROWS weight rows x 128 columns. Shared by the GEMV
  (gemv.py) and the MoE kernels (moe.py, capacity.py).
- mxfp4 (mx_dot): two e2m1 codes a byte (low nibble: the even column), one e8m0 scale byte per 32 columns of a row.
  The MoE kernels (moe.py, capacity.py). bf16 activations: Triton's tl.dot_scaled (on Hopper the compiler upcasts the
  e2m1 operand to bf16 times its scale, exact, in the MMA's operand layout: 1.6x the register decode's speed, measured
  by experiments/bench_mx_tile.py); other dtypes: the register decode (mx_tile), then tl.dot. One row a program
  (batch 1, block_m 1): mx_row_mac on the CUDA cores, which reads the packed rows as int32 words of 8 codes and
  decodes two codes a shift and mask (about 5 SASS instructions a weight in the MoE loops, where the tl.dot_scaled
  tiles take 17 and a code at a time 19: at decode sizes these kernels are bound by their instructions, not bytes).

fp8_dynamic activations (A8, moecg.models.formats.act_quant, with block-FP8 weights; the input tile of a K step:
a8_tile): the GEMM input comes quantized once, by the kernel that produced it (store_act_quant_tile beside its output:
the norms, the attention, SiLU-mul) or on the tensor cores by quantize_rows (its kernel arguments: a8_inputs); on
the tensor cores each K step of 128 columns is an FP8 MMA of the e4m3 values times both scales (fp8_mma); on the CUDA
cores an input that came unquantized is quantized per row and 128 columns at each K step (act_q8, the reference's
arithmetic: IEEE quotients, round to nearest even e4m3), then fp32 products of the values times their scales
(act_values), the weight side as without A8.

Also the product every GEMM tile loop shares (mac, mac_sum): on the tensor cores (tl.dot, 16 rows or more) or, for
fewer rows (batch 1), as fp32 products on the CUDA cores, with no padded rows and no change of the weight tile's layout.

Dims: BLOCK_M activation rows, BLOCK_N weight rows of the tile, BLOCK_K columns (block-FP8: a divisor or a multiple of
128; mxfp4: a multiple of 32), NS scale columns a tile spans.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moecg.kernels.launch import launch, p2, pdl_args, pdl_enter


@triton.jit
def w_tile(w_ptr, n, nm, k0, k_hi, s_wn, s_wk, BLOCK_K: tl.constexpr, KN: tl.constexpr = 0):
    """A weight tile [BLOCK_N, BLOCK_K] as stored (values only; any format): rows n, columns k0 .. (masked past k_hi,
    and on the rows where nm is false). The GEMV's (gemv.py) and the MoE down kernel's (moe.py: w_ptr at its expert)
    loads, also issued before their PDL wait (moecg.kernels.launch.PRELOAD). KN: the same values as [BLOCK_K, BLOCK_N]
    (tl.dot's own operand orientation, for mac's KN), for weights whose N dim is the contiguous one: a tl.dot operand
    loaded [N, K] from such a weight and transposed compiles without the pipelined (async-copy) loads."""
    k = k0 + tl.arange(0, BLOCK_K)
    if KN:
        w = tl.load(w_ptr + k[:, None] * s_wk + n[None, :] * s_wn, mask=(k < k_hi)[:, None] & nm[None, :], other=0.0)
    else:
        w = tl.load(w_ptr + n[:, None] * s_wn + k[None, :] * s_wk, mask=nm[:, None] & (k < k_hi)[None, :], other=0.0)
    return w


@triton.jit
def mac_init(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
             ROW: tl.constexpr = 0, A8: tl.constexpr = 0, MX: tl.constexpr = 0):
    """The accumulator mac adds into: [BLOCK_M, BLOCK_N] fp32 for tl.dot ([BLOCK_N, BLOCK_M] for fp8_mma: A8, its
    MMA's own orientation); on the CUDA cores each column's products
    kept apart until mac_sum, so the loop is one FMA per weight: [BLOCK_M, BLOCK_N, BLOCK_K], or with ROW (one row,
    fp8_row_mac's products) [BLOCK_N, BLOCK_K], the weight tile's own shape, so its values stay in the registers they
    were loaded into (on an H100 that layout made the bf16 one-row step 4% slower: bf16 keeps the 3-d one); mxfp4 (MX)
    in one row: [BLOCK_N, BLOCK_K / 32], mx_row_mac's sum per 32-column scale group."""
    if DOT and A8:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif MX and BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K // 32], dtype=tl.float32)
    elif ROW:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    return acc


@triton.jit
def mac(x, w, acc, DOT: tl.constexpr, KN: tl.constexpr = 0):
    """acc + x [BLOCK_M, BLOCK_K] times w [BLOCK_N, BLOCK_K] (x @ w^T). DOT: tl.dot (BLOCK_M >= 16); with KN, w is
    [BLOCK_K, BLOCK_N] (w_tile's KN) and goes to tl.dot as it is. Else fp32 products x * w (exact for bf16 operands,
    as the MMA's) added per column into mac_init's accumulator (one row: x [1, BLOCK_K] broadcast over w's rows)."""
    if DOT and KN:
        out = tl.dot(x, w, acc)
    elif DOT:
        out = tl.dot(x, tl.trans(w), acc)
    elif len(acc.shape) == 2:
        out = acc + x.to(tl.float32) * w.to(tl.float32)
    else:
        out = acc + x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return out


@triton.jit
def mac_sum(acc, DOT: tl.constexpr, A8: tl.constexpr = 0):
    """mac's accumulator -> [BLOCK_M, BLOCK_N] fp32 sums (the CUDA-core path adds its columns here; fp8_mma's is
    transposed once, here)."""
    if DOT and A8:
        out = tl.trans(acc)
    elif DOT:
        out = acc
    elif len(acc.shape) == 2:
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = tl.sum(acc, axis=2)
    return out


@triton.jit
def dequant_tile(w, srow_ptr, k0, K, s_sk, nmask, dt: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """w [BLOCK_N, BLOCK_K] e4m3 (columns k0 ..) -> the same tile in dt, each value times its block's scale in fp32
    and rounded once, as the reference (moecg.models.formats.dequantize). srow_ptr [BLOCK_N]: each row's scale row."""
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


@triton.jit
def fp8_row_mac(x, w, acc, s_ptr, k0, K, s_sk, BLOCK_K: tl.constexpr):
    """mac's one-row CUDA-core product for an e4m3 tile w [BLOCK_N, BLOCK_K] (columns k0 ..) whose rows share one
    scale row (s_ptr: its scale of columns 0 .. 127, s_sk per 128 columns): the scale moves from each weight to the
    activation, x [1, BLOCK_K] times its column's scale in fp32, then acc + that times the e4m3 values in fp32 (mac's
    accumulator). Two conversions and an FMA per weight, where dequant_tile's round trip through the compute dtype
    costs five and bounds a one-row step by its arithmetic; the products then differ from the reference's (weights
    rounded to the compute dtype) within that rounding. The caller checks that the rows share a scale row
    (one activation row, QROWS a multiple of BLOCK_N, the tile's first row a multiple of BLOCK_N)."""
    if BLOCK_K <= 128:  # one scale column (k0 is a multiple of BLOCK_K)
        xs = x.to(tl.float32) * tl.load(s_ptr + (k0 // 128) * s_sk)
    else:
        NS: tl.constexpr = BLOCK_K // 128
        j = k0 // 128 + tl.arange(0, NS)
        s = tl.load(s_ptr + j * s_sk, mask=j * 128 < K, other=0.0)
        xs = tl.reshape(tl.reshape(x.to(tl.float32), (NS, 128)) * s[:, None], (1, BLOCK_K))
    return acc + xs * w.to(tl.float32)


@triton.jit
def e4m3_round(y):
    """fp32 y (|y| <= 448) -> the nearest e4m3 value (ties to even), in fp32: adding and taking back 2^(e + 20) (e:
    y's exponent, at least -6, the subnormal step's) leaves y rounded to 3 mantissa bits by the fp32 adder's own
    rounding. Exact arithmetic, so the interpreter (whose fp32 -> e4m3 cast differs from torch's) and the GPU agree.
    y's sign goes back on as a bit (a negative value that rounds to zero stays -0, as torch's cast gives it; a
    negation here may be compiled as 0 - r, which is +0)."""
    yb = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    e = tl.maximum((yb >> 23) & 255, 121)  # biased exponent, 121: 2^-6
    c = ((e + 20) << 23).to(tl.float32, bitcast=True)
    r = (a + c) - c
    return (r.to(tl.int32, bitcast=True) | ((yb >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def act_q8(x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] (columns from a multiple of 128, BLOCK_K a multiple of 128; masked columns loaded as 0)
    -> (q [BLOCK_M, BLOCK_K] fp32 holding e4m3 values, s [BLOCK_M, BLOCK_K / 128] fp32 scales), as
    moecg.models.formats.act_quant: per row and 128 columns, s = amax / 448, q = x * (448 / amax) rounded to e4m3."""
    NS: tl.constexpr = BLOCK_K // 128
    xf = tl.reshape(x.to(tl.float32), (BLOCK_M, NS, 128))
    amax = tl.max(tl.abs(xf), axis=2)  # [BLOCK_M, NS]
    nz = amax > 0
    s = tl.where(nz, tl.math.div_rn(amax, 448.0), 1.0)
    inv = tl.where(nz, tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), tl.where(nz, amax, 1.0)), 1.0)
    y = tl.minimum(tl.maximum(xf * inv[:, :, None], -448.0), 448.0)
    return tl.reshape(e4m3_round(y), (BLOCK_M, BLOCK_K)), s


@triton.jit
def act_values(q, s, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """act_q8's values times their scales, in fp32 (not rounded): the x the CUDA-core products take under A8."""
    NS: tl.constexpr = BLOCK_K // 128
    return tl.reshape(tl.reshape(q, (BLOCK_M, NS, 128)) * s[:, :, None], (BLOCK_M, BLOCK_K))


@triton.jit
def fp8_mma(q, s, w, sw, acc, BLOCK_M: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (mac_init's with A8: transposed) + (w [BLOCK_N, 128] (e4m3 as stored) @ q [BLOCK_M,
    128]^T (act_q8's e4m3 values)) on an FP8 MMA with the weight rows as its M (64+ rows take wgmma), times each weight
    row's block scale sw [BLOCK_N] and each activation row's scale s [BLOCK_M, 1] (both fp8_scales')."""
    d = tl.dot(w, tl.trans(q.to(w.dtype)))  # [BLOCK_N, BLOCK_M]
    return acc + d * sw[:, None] * tl.reshape(s, (BLOCK_M,))[None, :]


@triton.jit
def fp8_scales(qs_ptr, rows, rmask, s_qs, srow_ptr, nmask, s_sk, k0, k_hi):
    """An FP8 MMA step's two scales, columns k0 .. k0 + 127: each input row's [rows, 1] (quantize_rows' layout, s_qs a
    row's stride) and each weight row's [BLOCK_N] (srow_ptr: its scale row, s_sk per 128 columns); a step from k_hi on
    loads none (1 and 0). The A8 loops load the next step's here, beside this step's MMA (fp8_scales_ahead): loaded in
    their own step, the scaling after the MMA waited on them, an L2 or HBM round trip on every step's critical path."""
    live_r = tl.full(rmask.shape, k0, tl.int32) < k_hi
    live_n = tl.full(nmask.shape, k0, tl.int32) < k_hi
    s = tl.load(qs_ptr + rows * s_qs + k0 // 128, mask=rmask & live_r, other=1.0)[:, None]
    sw = tl.load(srow_ptr + (k0 // 128) * s_sk, mask=nmask & live_n, other=0.0)
    return s, sw


@triton.jit
def fp8_scales_ahead(PRE: tl.constexpr, qs_ptr, rows, rmask, s_qs, srow_ptr, nmask, s_sk, k0, k_hi):
    """fp8_scales where PRE (A8 on the tensor cores: a loop that loads each step's scales a step ahead), else 0.0s
    the loop does not read."""
    if PRE:
        s, sw = fp8_scales(qs_ptr, rows, rmask, s_qs, srow_ptr, nmask, s_sk, k0, k_hi)
    else:
        s = 0.0
        sw = 0.0
    return s, sw


@triton.jit
def a8_tile(x_ptr, rows, rmask, s_xt, k0, k_hi, q_ptr, qs_ptr, s_qt, s_qs, A8: tl.constexpr, DOT: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """A GEMM's input tile, rows `rows` (masked by rmask) at columns k0 .. (none from k_hi on) -> (x, xq): x for
    the CUDA-core products (mac, fp8_row_mac), xq the e4m3 values for fp8_mma (its scales: fp8_scales). A8 with the
    input quantized already (q_ptr, qs_ptr: quantize_rows' or its producer's output, a8_inputs): loaded, and on the CUDA
    cores x their values times their scales; A8 on the CUDA cores without them: x quantized here (act_q8), the same
    values; no A8: x as stored (xq unused)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    km = kk < k_hi
    if A8 and DOT:
        xq = tl.load(q_ptr + rows[:, None] * s_qt + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
        x = xq
    elif A8 and q_ptr is not None:
        NS: tl.constexpr = BLOCK_K // 128
        xq = tl.load(q_ptr + rows[:, None] * s_qt + kk[None, :], mask=rmask[:, None] & km[None, :],
                     other=0.0).to(tl.float32)
        j = k0 // 128 + tl.arange(0, NS)
        xs = tl.load(qs_ptr + rows[:, None] * s_qs + j[None, :], mask=rmask[:, None] & (j * 128 < k_hi)[None, :],
                     other=1.0)  # [rows, NS]: no scale column past the row (a K step may end past it)
        x = act_values(xq, xs, rows.shape[0], BLOCK_K)
    else:
        x = tl.load(x_ptr + rows[:, None] * s_xt + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
        if A8:
            xq, xs = act_q8(x, rows.shape[0], BLOCK_K)
            x = act_values(xq, xs, rows.shape[0], BLOCK_K)
        else:
            xq = x
    return x, xq


ROWS_BLOCK = 512  # columns one quantize_rows program takes (4 scale blocks)


@triton.jit(do_not_specialize=["T"])
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, T, K, s_xt, s_qt, s_st, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = 0):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + t * s_xt + k, mask=k < K, other=0.0)[None, :]
    q, sc = act_q8(x, 1, BLOCK)
    tl.store(q_ptr + t * s_qt + k[None, :], q.to(q_ptr.dtype.element_ty), mask=(k < K)[None, :])
    j = tl.program_id(1) * (BLOCK // 128) + tl.arange(0, BLOCK // 128)
    tl.store(s_ptr + t * s_st + j[None, :], sc, mask=(j * 128 < K)[None, :])


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q [T, K] e4m3, s [T, ceil(K / 128)] fp32): moecg.models.formats.act_quant on the GPU, once per
    GEMM input, so the tensor-core A8 tiles load e4m3 values and scales (fp8_mma) instead of each program quantizing
    every row it reads again."""
    T, K = x.shape
    assert x.stride(1) == 1
    q = torch.empty(T, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(T, triton.cdiv(K, 128), dtype=torch.float32, device=x.device)
    launch(_quantize_rows_kernel, (T, triton.cdiv(K, ROWS_BLOCK)), x, q, s, T, K, x.stride(0), q.stride(0),
           s.stride(0), BLOCK=ROWS_BLOCK, num_warps=4, **pdl_args(x.device))
    return q, s


@triton.jit
def store_act_quant(h, t, c0, D, q_ptr, qs_ptr, s_qt, s_qs, BLOCK_D: tl.constexpr):
    """Row t's values h [BLOCK_D] at columns c0 .. (c0 a multiple of 128; BLOCK_D a multiple of 128; columns from D on
    not stored) as moecg.models.formats.act_quant: store_act_quant_tile's one segment."""
    col0 = c0 + tl.zeros([1], dtype=tl.int32)
    store_act_quant_tile(h[None, :], t, col0, col0 >= 0, q_ptr, qs_ptr, s_qt, s_qs, BLOCK_D, D)


@triton.jit
def store_act_quant_tile(v, t, col0, rm, q_ptr, qs_ptr, s_qt, s_qs, W: tl.constexpr, D=None):
    """Row t's values v [R, W] (R segments of W columns, segment r from column col0[r], a multiple of 128; rm [R]
    masks segments; D: columns from D on are not stored; W a multiple of 128) as moecg.models.formats.act_quant:
    e4m3 values at q_ptr + t * s_qt + column, one fp32 scale per 128 columns at qs_ptr + t * s_qs + column / 128
    (act_q8, the arithmetic the GEMM kernels use when they quantize an input themselves). Every producer's `quant`
    stores through it: a norm's or silu_mul's row (store_act_quant), the attention's heads (attention.store_out)."""
    q, s = act_q8(v.to(tl.float32), v.shape[0], W)
    c = col0[:, None] + tl.arange(0, W)[None, :]
    j = col0[:, None] // 128 + tl.arange(0, W // 128)[None, :]
    cm = rm[:, None]  # (broadcast over the segment's columns by the stores)
    jm = rm[:, None]
    if D is not None:
        cm = cm & (c < D)
        jm = jm & (j * 128 < D)
    tl.store(q_ptr + t * s_qt + c, q.to(q_ptr.dtype.element_ty), mask=cm)
    tl.store(qs_ptr + t * s_qs + j, s, mask=jm)


def act_quant_out(T: int, D: int, device, quant: bool, names=("q_ptr", "qs_ptr", "s_qt", "s_qs")) -> tuple:
    """(((q [T, D] e4m3, s [T, ceil(D / 128)] fp32),), its kernel arguments under `names`: values, scales, their row
    strides) for a producer's `quant` output, or ((), {}) without quant."""
    if not quant:
        return (), {}
    q = torch.empty(T, D, dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty(T, triton.cdiv(D, 128), dtype=torch.float32, device=device)
    return ((q, s),), dict(zip(names, (q, s, q.stride(0), s.stride(0))))


def quant_block(D: int, quant: bool) -> int:
    """A one-row-a-program kernel's BLOCK_D: the row's power of two, with quant at least one 128-column block."""
    return max(p2(D), 128) if quant else p2(D)


def a8_inputs(x: torch.Tensor, a8: int, rows: int, xq=None) -> dict:
    """The kernel arguments of a GEMM input x [T, K] for a8_tile (A8): its e4m3 values and scales, xq = (q [T, K],
    s [T, ceil(K / 128)]) where its producer quantized it already (act_quant's values: add_rmsnorm's or norm_route's
    `quant`), else on the tensor cores (rows >= 16 a program) quantized once here (quantize_rows); else none (the
    CUDA-core tiles quantize themselves)."""
    if not a8 or (xq is None and rows < 16):
        return {}
    q, s = xq if xq is not None else quantize_rows(x)
    assert q.shape == x.shape and q.stride(1) == 1 and s.shape == (x.shape[0], triton.cdiv(x.shape[1], 128)), \
        "a8_inputs: xq is not act_quant(x)'s shape"
    return {"q_ptr": q, "qs_ptr": s, "s_qt": q.stride(0), "s_qs": s.stride(0)}


def check_block_k(block_k: int) -> int:
    """A quantized GEMM's K step: a divisor of 128 (inside one scale column) or a multiple of it (whole columns)."""
    if not (128 % block_k == 0 or block_k % 128 == 0):
        raise ValueError(f"BLOCK_K={block_k}: a block-FP8 GEMM steps by a divisor or a multiple of 128")
    return block_k


@triton.jit
def _e2m1(c):
    """e2m1 codes (int32, 0..15: sign, 2 exponent bits, 1 mantissa bit) -> their fp32 values, built bit by bit:
    exponent 0 is 0 or 0.5 (0x3F000000), else 2^(e-1) * (1 + m/2)."""
    e = (c >> 1) & 3
    m = c & 1
    mag = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (mag | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def mx_tile(wrow_ptr, srow_ptr, k0, K, s_wk, s_sk, nmask, dt: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of BLOCK_N mxfp4 weight rows -> [BLOCK_N, BLOCK_K] in dt, as the reference
    (moecg.models.formats.mx_dequantize). wrow_ptr [BLOCK_N, 1]: each row's packed bytes (stride s_wk a byte pair
    of columns), srow_ptr [BLOCK_N]: its scale bytes (stride s_sk per 32 columns); columns from K on read as zeros."""
    HALF: tl.constexpr = BLOCK_K // 2
    NS: tl.constexpr = BLOCK_K // 32
    kb = k0 // 2 + tl.arange(0, HALF)
    b = tl.load(wrow_ptr + kb[None, :] * s_wk, mask=nmask[:, None] & (kb < K // 2)[None, :],
                other=0).to(tl.int32)
    v = tl.reshape(tl.join(_e2m1(b & 15), _e2m1(b >> 4)), (BLOCK_N, BLOCK_K))  # column 2j: the low nibble
    j = k0 // 32 + tl.arange(0, NS)
    sc = tl.load(srow_ptr[:, None] + j[None, :] * s_sk, mask=nmask[:, None] & (j < K // 32)[None, :],
                 other=127).to(tl.int32)
    sf = tl.where(sc == 0, 0x00400000, sc << 23).to(tl.float32, bitcast=True)  # 2^(s - 127); s = 0: 2^-127
    return tl.reshape(tl.reshape(v, (BLOCK_N, NS, 32)) * sf[:, :, None], (BLOCK_N, BLOCK_K)).to(dt)


@triton.jit
def _h2(a):
    """An int32 holding two fp16 bit patterns -> (its low half's value, its high half's) in fp32, exactly."""
    lo = (a & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (a >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _e2m1_word(w):
    """int32 words of 8 e2m1 codes (code j at bits 4j .. 4j + 3: column j of the word's 8) -> [.., 2, 2, 2] (row
    major, [.., 8]: column j at 4 j2 + 2 j1 + j0) their values times 2^-14 in fp32, exactly. Codes j and j + 4 sit 16
    bits apart, so one shift and two masks place both as the fp16 halves of one int32: each code's exponent and
    mantissa bits as an fp16's lowest exponent bits and its mantissa's top, its sign as the fp16's sign (exponent 0,
    the codes 0 and 0.5, lands on fp16's subnormals: no select), then the exact fp16 -> fp32 conversion: about three
    instructions a value where a code at a time takes six."""
    MAG: tl.constexpr = 0x0E000E00
    SIGN: tl.constexpr = -0x7FFF8000  # 0x80008000 as an int32
    v0, v4 = _h2(((w << 9) & MAG) | ((w << 12) & SIGN))
    v1, v5 = _h2(((w << 5) & MAG) | ((w << 8) & SIGN))
    v2, v6 = _h2(((w << 1) & MAG) | ((w << 4) & SIGN))
    v3, v7 = _h2(((w >> 3) & MAG) | (w & SIGN))
    # tl.join adds its pair as the last dim: [.., j2, j1, j0] is column 4 j2 + 2 j1 + j0
    return tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))


@triton.jit
def mx_row_mac(x, acc, wrow_ptr, srow_ptr, k0, K, s_sk, nmask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """mac's one-row CUDA-core product for mxfp4 weights: acc [BLOCK_N, BLOCK_K / 32] (mac_init's with MX, one sum per
    32-column scale group of the K step, added over the steps) + x [1, BLOCK_K] times columns k0 .. k0 +
    BLOCK_K of BLOCK_N weight rows (wrow_ptr [BLOCK_N, 1]: each row's packed bytes, contiguous along K and 4-byte
    aligned, read as int32 words of 8 codes; srow_ptr and the mask as mx_tile's). The codes decode to their values
    times 2^-14 (_e2m1_word); x times them is exact for bf16 x (8 significant bits times 2: within fp32's 24; an fp32
    x rounds once, as the reference's product does); each group's 32 products are summed in fp32, then scaled once by
    2^(s - 127) times 2^14, one exponent, s + 14 (scale bytes above 240, blocks of 6 x 2^113 and more, are refused
    where weights are quantized or loaded: formats.MX_SCALE_MAX). For bf16 x the result differs from the
    dequantize-then-matmul reference only in the order of its fp32 sums."""
    W: tl.constexpr = BLOCK_K // 8
    NS: tl.constexpr = BLOCK_K // 32
    kw = k0 // 8 + tl.arange(0, W)
    # K // 8 written as (K // 32) * 4 (K is whole scale groups): the mask then holds over runs of 4 words, which the
    # compiler sees, so each thread loads 16 bytes at once (K // 8 proves only 2: 8-byte loads)
    w = tl.load(wrow_ptr.to(tl.pointer_type(tl.int32)) + kw[None, :],
                mask=nmask[:, None] & (kw < (K // 32) * 4)[None, :], other=0)  # [BLOCK_N, W]
    v = tl.reshape(_e2m1_word(w), (BLOCK_N, NS, 32))
    j = k0 // 32 + tl.arange(0, NS)
    sc = tl.load(srow_ptr[:, None] + j[None, :] * s_sk, mask=nmask[:, None] & (j < K // 32)[None, :],
                 other=127).to(tl.int32)  # [BLOCK_N, NS]
    sf = ((sc + 14) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127) * 2^14, a normal fp32 for every s <= 240
    x3 = tl.reshape(x.to(tl.float32), (1, NS, 32))
    return acc + tl.sum(x3 * v, axis=2) * sf


def act_k(block_k: int, rows: int) -> int:
    """An A8 GEMM's K step: 128 on the tensor cores (rows >= 16: fp8_mma scales each MMA's sum), else whole
    128-column blocks (act_q8), at least one."""
    check_block_k(block_k)
    return 128 if rows >= 16 or block_k < 128 else block_k


def check_mx_k(block_k: int) -> int:
    """An mxfp4 GEMM's K step (a power of two): whole 32-column scale groups, at least one."""
    if block_k & (block_k - 1):
        raise ValueError(f"BLOCK_K={block_k}: a GEMM's K step is a power of two")
    return max(block_k, 32)


@triton.jit
def mx_dot(x, acc, w_ptr, rows, s_wj, s_wk, s_ptr, s_sj, s_sk, k0, K, nmask, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, DOT: tl.constexpr = 1):
    """acc + x [BLOCK_M, BLOCK_K] @ W[rows, k0 : k0 + BLOCK_K]^T for mxfp4 W: packed bytes at w_ptr + row * s_wj +
    (column / 2) * s_wk, scales at s_ptr + row * s_sj + (column / 32) * s_sk; rows [BLOCK_N], masked by nmask.
    DOT 0: mac's CUDA-core products on the register decode (acc: mac_init's); one row (BLOCK_M 1): mx_row_mac's (acc:
    mac_init's with MX, one sum per 32-column scale group of a step)."""
    if not DOT and x.shape[0] == 1:
        out = mx_row_mac(x, acc, w_ptr + rows[:, None] * s_wj, s_ptr + rows * s_sj, k0, K, s_sk, nmask, BLOCK_N,
                         BLOCK_K)
    elif not DOT:
        w = mx_tile(w_ptr + rows[:, None] * s_wj, s_ptr + rows * s_sj, k0, K, s_wk, s_sk, nmask, x.dtype, BLOCK_N,
                    BLOCK_K)
        out = mac(x, w, acc, DOT)
    elif x.dtype == tl.bfloat16:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        wq = tl.load(w_ptr + rows[None, :] * s_wj + kb[:, None] * s_wk,
                     mask=nmask[None, :] & (kb < K // 2)[:, None], other=0)  # [BLOCK_K / 2, BLOCK_N]
        j = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        sc = tl.load(s_ptr + rows[:, None] * s_sj + j[None, :] * s_sk,
                     mask=nmask[:, None] & (j < K // 32)[None, :], other=127)  # [BLOCK_N, BLOCK_K / 32]
        # fast_math: no NaN propagation for scale byte 255 (the quantizer never writes it; load refuses it)
        out = tl.dot_scaled(x, None, "bf16", wq, sc, "e2m1", acc, fast_math=True)
    else:
        w = mx_tile(w_ptr + rows[:, None] * s_wj, s_ptr + rows * s_sj, k0, K, s_wk, s_sk, nmask, x.dtype, BLOCK_N,
                    BLOCK_K)
        out = tl.dot(x, tl.trans(w), acc)
    return out
