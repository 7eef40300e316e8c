"""The GEMM tiles of the MoE kernels and the layout arguments they take, shared by the dropless kernels
(moecg.kernels.moe) and the capacity kernels (moecg.kernels.capacity), which pick their rows differently: up_tile
(up_sums, then up_act: the gate/up GEMM and its activation), down_tile (the down GEMM, rounded and biased as HF), and
ExpertArgs (strides, formats and flags read off the weights and the adapter's ExpertSpec).

Weights are addressed by strides, so one tile covers [E, 2I, D] / [E, D, I] and HF's transposed [E, D, 2I] /
[E, I, D] (GPT-OSS), with gate/up as two halves or interleaved columns (j = JM*n + JG for gate column n, + JU for
up); biases are added after each GEMM's rounding, as HF adds them; ACT 0 is SiLU, 1 GPT-OSS's clamped SwiGLU.
Dims as in ref.py: E experts, D hidden, I expert intermediate.
"""
from __future__ import annotations

import triton
import triton.language as tl

from moecg.kernels.quant import (a8_tile, act_k, check_block_k, check_mx_k, dequant_tile, fp8_mma, fp8_row_mac,
                                 fp8_scales_ahead, mac, mac_init, mac_sum, mx_dot, w_tile)
from moecg.models.formats import BlockFp8, Mxfp4, fp8_input


@triton.jit
def up_tile(x_ptr, rows, rmask, e, nb, w_ptr, b_ptr, D, I, s_xt, s_we, s_wj, s_wk, s_be, alpha, limit,
             dt: tl.constexpr, K: tl.constexpr, JM: tl.constexpr, JU: tl.constexpr, HAS_BIAS: tl.constexpr,
             ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             ws_ptr, s_se, s_sj, s_sk, QROWS: tl.constexpr, MX: tl.constexpr, PAIRED: tl.constexpr = 0,
             A8: tl.constexpr = 0, q_ptr=None, qs_ptr=None, s_qt=0, s_qs=0, KN: tl.constexpr = 0):
    """act(gate, up) of assignments `rows` [BLOCK_M] (token = row // K) for expert e's columns block nb
    -> ([BLOCK_M, BLOCK_N] fp32 holding dt-rounded values, column ids [BLOCK_N], column mask): up_sums over all of
    D, then up_act."""
    acc_g, acc_u, n, nm = up_sums(x_ptr, rows, rmask, e, nb, w_ptr, D, I, s_xt, s_we, s_wj, s_wk, 0, D, dt, K, JM, JU,
                                  BLOCK_M, BLOCK_N, BLOCK_K, ws_ptr, s_se, s_sj, s_sk, QROWS, MX, PAIRED, A8, q_ptr,
                                  qs_ptr, s_qt, s_qs, KN)
    return up_act(acc_g, acc_u, e, n, nm, b_ptr, s_be, alpha, limit, dt, JM, JU, HAS_BIAS, ACT), n, nm


@triton.jit
def up_sums(x_ptr, rows, rmask, e, nb, w_ptr, D, I, s_xt, s_we, s_wj, s_wk, k_lo, k_hi, dt: tl.constexpr,
            K: tl.constexpr, JM: tl.constexpr, JU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, ws_ptr, s_se, s_sj, s_sk, QROWS: tl.constexpr, MX: tl.constexpr,
            PAIRED: tl.constexpr = 0, A8: tl.constexpr = 0, q_ptr=None, qs_ptr=None, s_qt=0, s_qs=0,
            KN: tl.constexpr = 0):
    """The unrounded fp32 gate and up sums over D in [k_lo, k_hi) of assignments `rows` for expert e's columns block
    nb -> (gate [BLOCK_M, BLOCK_N], up [BLOCK_M, BLOCK_N], column ids [BLOCK_N], column mask).
    QROWS > 0: the weights are e4m3 with block scales ws [E, 2I / QROWS, D / 128] (moecg.models.formats), each tile
    dequantized in registers as the reference does (moecg.kernels.quant.dequant_tile) before the same tl.dot.
    A8 (block-FP8 weights, fp8_dynamic activations): x's e4m3 values and scales (quant.a8_tile: from q_ptr / qs_ptr
    where the input came quantized, by its producer or quant.quantize_rows, else quantized here), each K step an FP8
    MMA (fp8_mma) on the tensor cores, or fp32 products of its values on the CUDA cores.
    MX: the weights are mxfp4, packed [E, 2I, D / 2] (s_wk: a byte's stride) with scales ws [E, 2I, D / 32]
    (moecg.kernels.quant.mx_dot).
    PAIRED (interleaved gate/up, JM 2 JU 1; bf16 / fp32 weights): the 2 x BLOCK_N columns g0 u0 g1 u1 .. as one
    tile, one GEMM into [BLOCK_M, 2 x BLOCK_N] split into gate and up after the loop (the same products and sums per
    column), so a transposed [E, D, 2I] weight (GPT-OSS) loads contiguous columns instead of two stride-2 halves.
    KN (bf16 / fp32 weights whose 2I dim is contiguous: HF's transposed [E, D, 2I]): the tensor-core tiles load the
    weights [BLOCK_K, columns], tl.dot's operand as it is (quant.w_tile's KN), so the loads pipeline."""
    tok = rows // K
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < I
    DOT: tl.constexpr = BLOCK_M >= 16  # else the products on the CUDA cores (moecg.kernels.quant.mac)
    KND: tl.constexpr = KN and DOT and QROWS == 0 and not MX  # k-major weight tiles (unquantized, tl.dot)
    # block-FP8, one row: the scale on x (fp8_row_mac) where the tile's gate rows (and its up rows) share a scale row
    QR: tl.constexpr = QROWS + (QROWS == 0)  # a divisor: QROWS, 1 where not block-FP8
    ROW_SCALE: tl.constexpr = (BLOCK_M == 1) & (QROWS > 0) & (QR % (BLOCK_N * JM) == 0) & (JU % QR == 0)
    jg = n * JM  # gate column of output n in the 2I dim
    ju = n * JM + JU
    sb = ws_ptr + e.to(tl.int64) * s_se
    if PAIRED:
        j2 = nb * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)  # gate and up columns of outputs n, alternating
        jm2 = j2 < 2 * I
        acc = mac_init(BLOCK_M, 2 * BLOCK_N, BLOCK_K, DOT)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < k_hi
            x = tl.load(x_ptr + tok[:, None] * s_xt + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
            w = w_tile(w_ptr + e.to(tl.int64) * s_we, j2, jm2, k0, k_hi, s_wj, s_wk, BLOCK_K, KND)
            acc = mac(x, w, acc, DOT, KND)
        acc_g, acc_u = tl.split(tl.reshape(mac_sum(acc, DOT), [BLOCK_M, BLOCK_N, 2]))
    else:
        acc_g = mac_init(BLOCK_M, BLOCK_N, BLOCK_K, DOT, ROW_SCALE, A8, MX)
        acc_u = mac_init(BLOCK_M, BLOCK_N, BLOCK_K, DOT, ROW_SCALE, A8, MX)
        # A8 on the tensor cores: each step's scales loaded a step ahead (quant.fp8_scales), the up rows' as the gate's
        # (the input rows' scales of the up call are the gate call's: the compiler loads them once)
        PRE: tl.constexpr = A8 and DOT
        sg_row = sb + (jg // QR) * s_sj  # the gate rows' block-scale rows, the up rows'
        su_row = sb + (ju // QR) * s_sj
        xs9, sg9 = fp8_scales_ahead(PRE, qs_ptr, tok, rmask, s_qs, sg_row, nm, s_sk, k_lo, k_hi)
        _, su9 = fp8_scales_ahead(PRE, qs_ptr, tok, rmask, s_qs, su_row, nm, s_sk, k_lo, k_hi)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < k_hi
            xs8, sg8, su8 = xs9, sg9, su9
            xs9, sg9 = fp8_scales_ahead(PRE, qs_ptr, tok, rmask, s_qs, sg_row, nm, s_sk, k0 + BLOCK_K, k_hi)
            _, su9 = fp8_scales_ahead(PRE, qs_ptr, tok, rmask, s_qs, su_row, nm, s_sk, k0 + BLOCK_K, k_hi)
            x, xq = a8_tile(x_ptr, tok, rmask, s_xt, k0, k_hi, q_ptr, qs_ptr, s_qt, s_qs, A8, DOT, BLOCK_K)
            if MX:
                we = w_ptr + e.to(tl.int64) * s_we
                acc_g = mx_dot(x, acc_g, we, jg, s_wj, s_wk, sb, s_sj, s_sk, k0, k_hi, nm, BLOCK_N, BLOCK_K, DOT)
                acc_u = mx_dot(x, acc_u, we, ju, s_wj, s_wk, sb, s_sj, s_sk, k0, k_hi, nm, BLOCK_N, BLOCK_K, DOT)
            else:
                g = w_tile(w_ptr + e.to(tl.int64) * s_we, jg, nm, k0, k_hi, s_wj, s_wk, BLOCK_K, KND)
                u = w_tile(w_ptr + e.to(tl.int64) * s_we, ju, nm, k0, k_hi, s_wj, s_wk, BLOCK_K, KND)
                if A8 and DOT:
                    acc_g = fp8_mma(xq, xs8, g, sg8, acc_g, BLOCK_M)
                    acc_u = fp8_mma(xq, xs8, u, su8, acc_u, BLOCK_M)
                elif ROW_SCALE:  # one row: the scale on x (the tile's gate rows share a scale row, as its up rows)
                    j0 = nb * BLOCK_N * JM
                    acc_g = fp8_row_mac(x, g, acc_g, sb + (j0 // QROWS) * s_sj, k0, k_hi, s_sk, BLOCK_K)
                    acc_u = fp8_row_mac(x, u, acc_u, sb + ((j0 + JU) // QROWS) * s_sj, k0, k_hi, s_sk, BLOCK_K)
                else:
                    if QROWS:
                        g = dequant_tile(g, sb + (jg // QROWS) * s_sj, k0, k_hi, s_sk, nm, dt, BLOCK_N, BLOCK_K)
                        u = dequant_tile(u, sb + (ju // QROWS) * s_sj, k0, k_hi, s_sk, nm, dt, BLOCK_N, BLOCK_K)
                    acc_g = mac(x, g, acc_g, DOT, KND)
                    acc_u = mac(x, u, acc_u, DOT, KND)
        acc_g = mac_sum(acc_g, DOT, A8)
        acc_u = mac_sum(acc_u, DOT, A8)
    return acc_g, acc_u, n, nm


@triton.jit
def up_act(acc_g, acc_u, e, n, nm, b_ptr, s_be, alpha, limit, dt: tl.constexpr, JM: tl.constexpr, JU: tl.constexpr,
           HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    """act(gate, up) of up_sums' fp32 sums, each GEMM output rounded to dt (and biased) as HF -> [BLOCK_M, BLOCK_N]
    fp32 holding dt-rounded values."""
    jg = n * JM
    ju = n * JM + JU
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    if HAS_BIAS:
        bb = b_ptr + e.to(tl.int64) * s_be
        g = (g + tl.load(bb + jg, mask=nm, other=0.0).to(tl.float32)[None, :]).to(dt).to(tl.float32)
        u = (u + tl.load(bb + ju, mask=nm, other=0.0).to(tl.float32)[None, :]).to(dt).to(tl.float32)
    if ACT == 0:  # silu(gate) * up
        a = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        hv = a * u
    else:  # GPT-OSS: (clamp(up) + 1) * gate * sigmoid(alpha * gate), gate clamped from above
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        sg = tl.sigmoid((g * alpha).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        glu = (g * sg).to(dt).to(tl.float32)
        hv = (u + 1.0).to(dt).to(tl.float32) * glu
    return hv


@triton.jit
def _down_step(h_ptr, rows, rmask, w, acc, e, nb, n, nm, w_ptr, k0, k_hi, s_hs, s_we, s_wn, s_wk,
               BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, ROW_SCALE: tl.constexpr,
               ws_ptr, s_se, s_sj, s_sk, QROWS: tl.constexpr, MX: tl.constexpr, HAS_W: tl.constexpr,
               A8: tl.constexpr, q_ptr, qs_ptr, s_qt, s_qs, hs8, sw8, KND: tl.constexpr = 0):
    """acc + h rows `rows` at columns k0 .. of I times the weights of those columns: w (HAS_W, loaded by the caller)
    or loaded here after h (mxfp4: mx_dot loads its own). A8: as up_tile's (on the tensor cores the step's scales
    hs8 / sw8, loaded a step ahead by down_sums). KND: k-major weight tiles (up_sums' KN)."""
    h, hq = a8_tile(h_ptr, rows, rmask, s_hs, k0, k_hi, q_ptr, qs_ptr, s_qt, s_qs, A8, DOT, BLOCK_K)
    if MX:
        acc = mx_dot(h, acc, w_ptr + e.to(tl.int64) * s_we, n, s_wn, s_wk, ws_ptr + e.to(tl.int64) * s_se, s_sj,
                     s_sk, k0, k_hi, nm, BLOCK_N, BLOCK_K, DOT)
    else:
        if not HAS_W:
            w = w_tile(w_ptr + e.to(tl.int64) * s_we, n, nm, k0, k_hi, s_wn, s_wk, BLOCK_K, KND)
        if A8 and DOT:
            acc = fp8_mma(hq, hs8, w, sw8, acc, rows.shape[0])
        elif ROW_SCALE:
            acc = fp8_row_mac(h, w, acc, ws_ptr + e.to(tl.int64) * s_se + (nb * BLOCK_N // QROWS) * s_sj, k0,
                              k_hi, s_sk, BLOCK_K)
        else:
            if QROWS:
                w = dequant_tile(w, ws_ptr + e.to(tl.int64) * s_se + (n // QROWS) * s_sj, k0, k_hi, s_sk, nm,
                                 h.dtype, BLOCK_N, BLOCK_K)
            acc = mac(h, w, acc, DOT, KND)
    return acc


@triton.jit
def down_sums(h_ptr, rows, rmask, e, nb, w_ptr, D, I, k_lo, k_hi, s_hs, s_we, s_wn, s_wk,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              ws_ptr, s_se, s_sj, s_sk, QROWS: tl.constexpr, MX: tl.constexpr, w0=None, HAS_W0: tl.constexpr = 0,
              A8: tl.constexpr = 0, q_ptr=None, qs_ptr=None, s_qt=0, s_qs=0, KN: tl.constexpr = 0):
    """The unrounded fp32 down-projection sum over I in [k_lo, k_hi) (never empty) of h rows `rows` for output
    columns block nb -> ([BLOCK_M, BLOCK_N] fp32, column ids [BLOCK_N], column mask). QROWS > 0: e4m3 weights, MX:
    mxfp4 ones ([E, D, I / 2]), as up_tile's. HAS_W0: w0 is the first K step's weight tile (quant.w_tile), loaded by the
    caller (before its PDL wait), its step peeled from the loop: the same products in the same order. KN: as up_sums'
    (HF's transposed [E, I, D], D contiguous)."""
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < D
    DOT: tl.constexpr = BLOCK_M >= 16  # as up_tile's
    KND: tl.constexpr = KN and DOT and QROWS == 0 and not MX  # as up_sums'
    tl.static_assert(not (KND and HAS_W0), "a preloaded first tile (batch-1 tiles) is [N, K]")
    ROW_SCALE: tl.constexpr = (BLOCK_M == 1) & (QROWS > 0) & (QROWS % BLOCK_N == 0)  # as up_tile's
    acc = mac_init(BLOCK_M, BLOCK_N, BLOCK_K, DOT, ROW_SCALE, A8, MX)
    PRE: tl.constexpr = A8 and DOT  # the scales a step ahead, as up_tile's
    srow = ws_ptr + e.to(tl.int64) * s_se + (n // QROWS) * s_sj if PRE else ws_ptr  # the rows' block-scale rows
    hs9, sw9 = fp8_scales_ahead(PRE, qs_ptr, rows, rmask, s_qs, srow, nm, s_sk, k_lo, k_hi)
    k_first = k_lo
    if HAS_W0:  # the first step peeled (only here: the tl.dot tiles keep the plain loop, measured faster)
        hs8, sw8 = hs9, sw9
        hs9, sw9 = fp8_scales_ahead(PRE, qs_ptr, rows, rmask, s_qs, srow, nm, s_sk, k_lo + BLOCK_K, k_hi)
        acc = _down_step(h_ptr, rows, rmask, w0, acc, e, nb, n, nm, w_ptr, k_lo, k_hi, s_hs, s_we, s_wn, s_wk,
                         BLOCK_K, BLOCK_N, DOT, ROW_SCALE, ws_ptr, s_se, s_sj, s_sk, QROWS, MX, True, A8, q_ptr, qs_ptr,
                         s_qt, s_qs, hs8, sw8)
        k_first = k_lo + BLOCK_K
    for k0 in range(k_first, k_hi, BLOCK_K):
        hs8, sw8 = hs9, sw9
        hs9, sw9 = fp8_scales_ahead(PRE, qs_ptr, rows, rmask, s_qs, srow, nm, s_sk, k0 + BLOCK_K, k_hi)
        acc = _down_step(h_ptr, rows, rmask, nm, acc, e, nb, n, nm, w_ptr, k0, k_hi, s_hs, s_we, s_wn, s_wk, BLOCK_K,
                         BLOCK_N, DOT, ROW_SCALE, ws_ptr, s_se, s_sj, s_sk, QROWS, MX, False, A8, q_ptr, qs_ptr,
                         s_qt, s_qs, hs8, sw8, KND)
    acc = mac_sum(acc, DOT, A8)
    return acc, n, nm


@triton.jit
def down_round(acc, e, n, nm, b_ptr, s_be, dt: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The down projection's fp32 sum rounded (and biased) as HF: dt after the GEMM, dt after the bias."""
    o = acc.to(dt).to(tl.float32)
    if HAS_BIAS:
        o = (o + tl.load(b_ptr + e.to(tl.int64) * s_be + n, mask=nm, other=0.0).to(tl.float32)[None, :])
        o = o.to(dt).to(tl.float32)
    return o


@triton.jit
def down_tile(h_ptr, rows, rmask, e, nb, w_ptr, b_ptr, D, I, s_hs, s_we, s_wn, s_wk, s_be,
               dt: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, ws_ptr, s_se, s_sj, s_sk, QROWS: tl.constexpr, MX: tl.constexpr,
               A8: tl.constexpr = 0, q_ptr=None, qs_ptr=None, s_qt=0, s_qs=0, KN: tl.constexpr = 0):
    """Expert e's down projection of h rows `rows` for output columns block nb, rounded (and biased) as HF
    -> ([BLOCK_M, BLOCK_N] fp32, column ids [BLOCK_N], column mask); the caller applies the routing weight."""
    acc, n, nm = down_sums(h_ptr, rows, rmask, e, nb, w_ptr, D, I, 0, I, s_hs, s_we, s_wn, s_wk,
                           BLOCK_M, BLOCK_N, BLOCK_K, ws_ptr, s_se, s_sj, s_sk, QROWS, MX, A8=A8, q_ptr=q_ptr,
                           qs_ptr=qs_ptr, s_qt=s_qt, s_qs=s_qs, KN=KN)
    return down_round(acc, e, n, nm, b_ptr, s_be, dt, HAS_BIAS), n, nm


def _scale_args(w, transposed: bool):
    """(scale kernel arguments: ptr, its three strides, QROWS (block-FP8's rows per scale row; 0: not block-FP8) and
    MX (mxfp4) as a dict, the values tensor)."""
    if isinstance(w, Mxfp4):
        q, s = w.q, w.scale
        if q.stride(-1) != 1 or q.stride(-2) % 4 or q.data_ptr() % 4:  # the one-row tiles read int32 words
            raise ValueError("mxfp4 experts: the packed values must be contiguous along K with 4-byte aligned rows")
        if q.shape[-1] % 16 or s.shape[-1] * 16 != q.shape[-1]:  # quant.mx_row_mac's mask counts whole groups
            raise ValueError(f"mxfp4 experts: K ({2 * q.shape[-1]}) must be whole 32-column scale groups, one scale "
                             f"byte each (scales hold {s.shape[-1]})")
        return {"ws_ptr": s, "s_se": s.stride(0), "s_sj": s.stride(1), "s_sk": s.stride(2), "QROWS": 0, "MX": 1,
                "A8": 0}, q
    if not isinstance(w, BlockFp8):
        return {"ws_ptr": w, "s_se": 0, "s_sj": 0, "s_sk": 0, "QROWS": 0, "MX": 0, "A8": 0}, w
    if transposed:
        raise ValueError("block-FP8 experts in the transposed layout ([E, D, 2I]) have no kernel")
    s = w.scale
    return {"ws_ptr": s, "s_se": s.stride(0), "s_sj": s.stride(1), "s_sk": s.stride(2), "QROWS": w.rows, "MX": 0,
            "A8": int(fp8_input(w))}, w.q


def quant_k(block_k: int, scale: dict, rows: int) -> int:
    """The K step of a GEMM of `rows` rows a program, checked where its weights are block-FP8
    (moecg.kernels.quant.check_block_k; with fp8_dynamic activations act_k's) and made whole 32-column groups where
    they are mxfp4 (check_mx_k)."""
    if scale["MX"]:
        return check_mx_k(block_k)
    if scale["A8"]:
        return act_k(block_k, rows)
    return check_block_k(block_k) if scale["QROWS"] else block_k


class ExpertArgs:
    """The layout arguments both MoE kernel families take, read off the weights and the adapter's ExpertSpec."""

    def __init__(self, gate_up, down, spec=None, gate_up_bias=None, down_bias=None):
        transposed = spec is not None and spec.transposed
        # block-FP8 weights (moecg.models.formats.BlockFp8): the kernels read values and scales, (ptr, strides, rows);
        # mxfp4 ones (Mxfp4) are output-row major whatever the module's layout
        self.up_scale, gate_up = _scale_args(gate_up, transposed)
        self.down_scale, down = _scale_args(down, transposed)
        if self.up_scale["MX"] != self.down_scale["MX"]:
            raise ValueError("mxfp4 experts: gate_up_proj and down_proj are both mxfp4 or neither")
        if self.up_scale["MX"]:
            transposed = False
        self.weights = "mxfp4" if self.up_scale["MX"] else "fp8_block" if self.up_scale["QROWS"] else "full"
        self.activations = "fp8_dynamic" if self.up_scale["A8"] else "full"  # model.activations, for the tile rules
        self.act = 0 if spec is None or spec.act == "silu" else 1
        if self.act and spec.act != "swiglu_clamp":
            raise ValueError(f"expert activation {spec.act!r}: the MoE kernel knows silu and swiglu_clamp")
        self.gate_up, self.down = gate_up, down
        self.num_experts = gate_up.shape[0]
        # strides along the 2I / I dim (j) and the D dim (k) of the up weights, along D (n) and I (k) of the down ones
        self.s_wj, self.s_wk = (gate_up.stride(2), gate_up.stride(1)) if transposed else (gate_up.stride(1),
                                                                                         gate_up.stride(2))
        self.s_dn, self.s_dk = (down.stride(2), down.stride(1)) if transposed else (down.stride(1), down.stride(2))
        self.inter = gate_up.shape[2 if transposed else 1] // 2
        interleaved = spec is not None and spec.interleaved
        self.jm, self.ju = (2, 1) if interleaved else (1, self.inter)
        self.alpha = float(spec.alpha) if self.act else 1.0
        self.limit = float(spec.limit) if self.act else 0.0
        assert gate_up_bias is None or gate_up_bias.stride(1) == 1
        assert down_bias is None or down_bias.stride(1) == 1
        self.gate_up_bias, self.down_bias = gate_up_bias, down_bias
        # the tensor-core tiles load such weights k-major (quant.w_tile's KN): transposed bf16 / fp32 ones (GPT-OSS's
        # [E, D, 2I] and [E, I, D]), whose output dim is the contiguous one
        self.kn = int(transposed and self.weights == "full")

    def paired(self, tiles) -> int:
        """up_tile's PAIRED: interleaved gate/up read as one tile where the tiles say so (MoeTiles.paired); unquantized
        weights only (mxfp4's packed rows load contiguously either way; block-FP8 has no interleaved family)."""
        return int(self.jm == 2 and self.weights == "full" and tiles.paired)
