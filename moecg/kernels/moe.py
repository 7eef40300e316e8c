"""Triton kernels of the dropless routed experts at decode sizes (`dispatch=fused`): two launches, no sort. Same
signature as `moecg.kernels.ref.moe_experts`. The GEMM tiles (up_tile, down_tile) and the layout arguments
(ExpertArgs) are shared with the capacity kernels (moecg.kernels.capacity), which pick their rows differently.

Dims as in ref.py: T tokens, K top-k, S = T*K assignments, E experts, D hidden, I expert intermediate.
Every kernel is graph-safe: no host syncs, device-side positions and counters, fixed launch grids per batch size
(programs with no work exit at once); integer sizes that change with the batch are not specialised
(`do_not_specialize`), so one compilation serves every bucket. Rounding follows HF's modules: bf16 after each
elementwise op that HF runs in bf16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moecg.kernels import tiles as _tiles
from moecg.kernels.launch import dry_zeros, launch, pdl_args, pdl_enter, split_sems
from moecg.kernels.moe_grid import work
from moecg.kernels.quant import (a8_inputs, a8_tile, act_k, check_block_k, check_mx_k, dequant_tile, fp8_mma,
                                 fp8_row_mac, fp8_scales_ahead, mac, mac_init, mac_sum, mx_dot, w_tile)
from moecg.models.formats import BlockFp8, Mxfp4, fp8_input


# dropless MoE for small token counts (decode): grid (expert, row block, column block). Each program finds the
# assignments routed to its expert by scanning the [S] expert ids (S = T*K, small at decode), so there is no
# sort or prefix-sum kernel before it; experts nobody picked exit after the scan. Weights are read once per
# (expert, row block): the GEMM tile's rows are that expert's tokens. One-row tiles (block_m 1) run on a row grid
# instead (assignment, column block): each program its own assignment's row, so no program of an empty row block is
# launched; an expert with several rows reads its weights once per row. The grids: moecg.kernels.moe_grid.
# Weights are addressed by strides, so one kernel covers [E, 2I, D] / [E, D, I] and HF's transposed [E, D, 2I] /
# [E, I, D] (GPT-OSS), with gate/up as two halves or interleaved columns (j = JM*n + JG for gate column n, + JU for
# up); biases are added after each GEMM's rounding, as HF adds them; ACT 0 is SiLU, 1 GPT-OSS's clamped SwiGLU.
# The GEMM tiles (up_tile, down_tile) are shared with the capacity kernels (moecg.kernels.capacity), which
# pick their rows differently.
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
    hs8 / sw8, loaded a step ahead by _down_acc). KND: k-major weight tiles (up_sums' KN)."""
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
def _down_acc(h_ptr, rows, rmask, e, nb, w_ptr, D, I, k_lo, k_hi, s_hs, s_we, s_wn, s_wk,
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
def _down_round(acc, e, n, nm, b_ptr, s_be, dt: tl.constexpr, HAS_BIAS: tl.constexpr):
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
    acc, n, nm = _down_acc(h_ptr, rows, rmask, e, nb, w_ptr, D, I, 0, I, s_hs, s_we, s_wn, s_wk,
                           BLOCK_M, BLOCK_N, BLOCK_K, ws_ptr, s_se, s_sj, s_sk, QROWS, MX, A8=A8, q_ptr=q_ptr,
                           qs_ptr=qs_ptr, s_qt=s_qt, s_qs=s_qs, KN=KN)
    return _down_round(acc, e, n, nm, b_ptr, s_be, dt, HAS_BIAS), n, nm


@triton.jit(do_not_specialize=["S", "by_slot", "k_steps"])
def _moe_up_kernel(x_ptr, idx_ptr, valid_ptr, tw_ptr, w_ptr, b_ptr, h_ptr, cnt_ptr, mass_ptr, tok_ptr,
                   S, by_slot, D, I, s_xt, s_we, s_wj, s_wk, s_be, s_hs, alpha, limit,
                   K: tl.constexpr, HAS_VALID: tl.constexpr, COUNT: tl.constexpr, JM: tl.constexpr,
                   JU: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                   USE_PDL: tl.constexpr, ws_ptr, s_se, s_sj, s_sk, QROWS: tl.constexpr, MX: tl.constexpr,
                   PAIRED: tl.constexpr = 0, A8: tl.constexpr = 0, q_ptr=None, qs_ptr=None, s_qt=0, s_qs=0,
                   BY_ROW: tl.constexpr = 0, SPLIT: tl.constexpr = 1, part_ptr=None, sem_ptr=None, k_steps=0,
                   KN: tl.constexpr = 0):
    """BY_ROW (one-row tiles, with by_slot 1): program p runs assignment p's row, each real one, so no program of a
    row block holds nothing; the expert's first assignment (lead) still keeps its counters (moe_grid.work).
    SPLIT > 1 (split-K over D, bf16 / fp32 weights, for batch-1 steps whose column blocks alone leave SMs idle): as
    the down kernel's, each of a tile's SPLIT programs stores its fp32 gate and up sums (part: [SPLIT, S, 2, I]) and
    the last to finish adds them in split order, then rounds and applies the activation once."""
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    mb = tl.program_id(1)
    nb = tl.program_id(2) // SPLIT
    ks = tl.program_id(2) % SPLIT
    e, lead, rows, rmask, go = work(idx_ptr, valid_ptr, p, mb, S, by_slot, K, HAS_VALID, BLOCK_M, BLOCK_S, BY_ROW)
    if COUNT:
        if (mb == 0) & (nb == 0) & (ks == 0):  # this expert's counters belong to this program alone: no atomics
            if lead:
                wsum = tl.zeros([BLOCK_S], dtype=tl.float32)
                nsum = tl.zeros([BLOCK_S], dtype=tl.int32)
                for s0 in range(0, S, BLOCK_S):
                    s = s0 + tl.arange(0, BLOCK_S)
                    hit = tl.load(idx_ptr + s, mask=s < S, other=-1) == e
                    if HAS_VALID:
                        hit = hit & (tl.load(valid_ptr + s // K, mask=s < S, other=0) != 0)
                    wsum += tl.where(hit, tl.load(tw_ptr + s, mask=s < S, other=0.0).to(tl.float32), 0.0)
                    nsum += hit.to(tl.int32)
                tl.store(cnt_ptr + e, tl.load(cnt_ptr + e) + tl.sum(nsum, axis=0))  # its valid assignments
                tl.store(mass_ptr + e, tl.load(mass_ptr + e) + tl.sum(wsum, axis=0))
            if p == 0:
                n_tok = S // K
                if HAS_VALID:
                    acc_v = tl.zeros([BLOCK_S], dtype=tl.int32)
                    for t0 in range(0, S // K, BLOCK_S):
                        tt = t0 + tl.arange(0, BLOCK_S)
                        acc_v += (tl.load(valid_ptr + tt, mask=tt < S // K, other=0) != 0).to(tl.int32)
                    n_tok = tl.sum(acc_v, axis=0)
                tl.store(tok_ptr, tl.load(tok_ptr) + n_tok)
    if go:
        dt = h_ptr.dtype.element_ty
        if SPLIT == 1:
            hv, n, nm = up_tile(x_ptr, rows, rmask, e, nb, w_ptr, b_ptr, D, I, s_xt, s_we, s_wj, s_wk, s_be, alpha,
                                limit, dt, K, JM, JU, HAS_BIAS, ACT, BLOCK_M, BLOCK_N, BLOCK_K, ws_ptr, s_se, s_sj,
                                s_sk, QROWS, MX, PAIRED, A8, q_ptr, qs_ptr, s_qt, s_qs, KN)
            tl.store(h_ptr + rows[:, None] * s_hs + n[None, :], hv.to(dt), mask=rmask[:, None] & nm[None, :])
        else:
            k_lo = ks * k_steps * BLOCK_K  # a multiple of BLOCK_K the compiler sees (aligned, pipelined loads)
            k_hi = tl.minimum(k_lo + k_steps * BLOCK_K, D)
            acc_g, acc_u, n, nm = up_sums(x_ptr, rows, rmask, e, nb, w_ptr, D, I, s_xt, s_we, s_wj, s_wk, k_lo, k_hi,
                                          dt, K, JM, JU, BLOCK_M, BLOCK_N, BLOCK_K, ws_ptr, s_se, s_sj, s_sk, QROWS,
                                          MX, PAIRED, KN=KN)
            om = rmask[:, None] & nm[None, :]
            off = rows[:, None] * (2 * I) + n[None, :]  # gate sums at off, up sums at off + I
            tl.store(part_ptr + ks * S * 2 * I + off, acc_g, mask=om)
            tl.store(part_ptr + ks * S * 2 * I + I + off, acc_u, mask=om)
            tl.debug_barrier()
            tile = (p * tl.num_programs(1) + mb) * (tl.num_programs(2) // SPLIT) + nb
            done = tl.atomic_add(sem_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT - 1:  # the tile's last program: the other partials are visible (acquire)
                g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for j in tl.static_range(SPLIT):
                    g += tl.load(part_ptr + j * S * 2 * I + off, mask=om, other=0.0, cache_modifier=".cg")
                    u += tl.load(part_ptr + j * S * 2 * I + I + off, mask=om, other=0.0, cache_modifier=".cg")
                hv = up_act(g, u, e, n, nm, b_ptr, s_be, alpha, limit, dt, JM, JU, HAS_BIAS, ACT)
                tl.store(h_ptr + rows[:, None] * s_hs + n[None, :], hv.to(dt), mask=om)
                tl.store(sem_ptr + tile, 0)  # zero again for the next call (and graph replay)


@triton.jit(do_not_specialize=["S", "by_slot", "k_steps"])
def _moe_down_kernel(h_ptr, idx_ptr, valid_ptr, tw_ptr, w_ptr, b_ptr, y_ptr, part_ptr, sem_ptr, S, by_slot, D, I,
                     k_steps, s_hs, s_we, s_wn, s_wk, s_be, s_ys, K: tl.constexpr, HAS_VALID: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr, ws_ptr, s_se, s_sj, s_sk,
                     QROWS: tl.constexpr, MX: tl.constexpr, PRELOAD: tl.constexpr = 0, A8: tl.constexpr = 0,
                     q_ptr=None, qs_ptr=None, s_qt=0, s_qs=0, BY_ROW: tl.constexpr = 0, KN: tl.constexpr = 0):
    """SPLIT > 1 (split-K over I, for batch-1 steps whose column blocks alone are too few programs): each of a
    tile's SPLIT programs stores its fp32 partial sum, and the last to finish (a per-tile counter) adds the
    partials in split order, so the result is deterministic and rounded once, as without splits; it then
    zeroes the counter for the next call (and graph replay).
    PRELOAD (not mxfp4): the program finds its expert and loads its first K step's weight tile before its PDL wait.
    Its predecessor is the up kernel, which writes h only: the routing it reads (idx, and valid, written before the
    step) comes from the router kernel, complete before the up kernel's programs passed their own wait and let this
    kernel launch.
    BY_ROW: as the up kernel's; a pad row's programs write its zeros."""
    p = tl.program_id(0)
    mb = tl.program_id(1)
    nb = tl.program_id(2) // SPLIT
    ks = tl.program_id(2) % SPLIT
    PRE: tl.constexpr = PRELOAD and (BLOCK_M == 1) and not MX  # measured: the batch-1 tiles gain, FP8 tl.dot ones lose
    if PRE:
        e, lead, rows, rmask, go = work(idx_ptr, valid_ptr, p, mb, S, by_slot, K, HAS_VALID, BLOCK_M, BLOCK_S,
                                        BY_ROW)
        n0 = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_run = tl.where(go, D, 0)  # rows to load: none where the program will not run
        k_lo0 = ks * k_steps * BLOCK_K  # unsplit: ks 0 and k_steps * BLOCK_K >= I
        w0 = w_tile(w_ptr + e.to(tl.int64) * s_we, n0, n0 < n_run, k_lo0, tl.minimum(k_lo0 + k_steps * BLOCK_K, I),
                    s_wn, s_wk, BLOCK_K)
    pdl_enter(USE_PDL)
    if HAS_VALID and BY_ROW:  # pad rows get zeros here (no kernel writes them otherwise): their own programs
        if ks == 0:
            rp = p + tl.arange(0, 1)
            pad = (rp < S) & (tl.load(valid_ptr + rp // K, mask=rp < S, other=1) == 0)
            nz = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(y_ptr + rp[:, None] * s_ys + nz[None, :], tl.zeros([1, BLOCK_N], dtype=tl.float32),
                     mask=pad[:, None] & (nz < D)[None, :])
    elif HAS_VALID:  # the same, program 0 of each tile column
        if (p == 0) & (ks == 0):
            tt = mb * BLOCK_M + tl.arange(0, BLOCK_M)
            pad = (tt < S // K) & (tl.load(valid_ptr + tt, mask=tt < S // K, other=1) == 0)
            nz = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            for k in tl.static_range(K):
                tl.store(y_ptr + (tt * K + k)[:, None] * s_ys + nz[None, :],
                         tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), mask=pad[:, None] & (nz < D)[None, :])
    if not PRE:
        e, lead, rows, rmask, go = work(idx_ptr, valid_ptr, p, mb, S, by_slot, K, HAS_VALID, BLOCK_M, BLOCK_S,
                                        BY_ROW)
        w0 = rmask  # unused
    if go:
        dt = h_ptr.dtype.element_ty
        if SPLIT == 1:
            acc, n, nm = _down_acc(h_ptr, rows, rmask, e, nb, w_ptr, D, I, 0, I, s_hs, s_we, s_wn, s_wk,
                                   BLOCK_M, BLOCK_N, BLOCK_K, ws_ptr, s_se, s_sj, s_sk, QROWS, MX, w0, PRE, A8,
                                   q_ptr, qs_ptr, s_qt, s_qs, KN)
            o = _down_round(acc, e, n, nm, b_ptr, s_be, dt, HAS_BIAS)
            tw = tl.load(tw_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            tl.store(y_ptr + rows[:, None] * s_ys + n[None, :], o * tw[:, None], mask=rmask[:, None] & nm[None, :])
        else:
            k_lo = ks * k_steps * BLOCK_K  # a multiple of BLOCK_K the compiler sees (aligned, pipelined loads)
            k_hi = tl.minimum(k_lo + k_steps * BLOCK_K, I)
            acc, n, nm = _down_acc(h_ptr, rows, rmask, e, nb, w_ptr, D, I, k_lo, k_hi,
                                   s_hs, s_we, s_wn, s_wk, BLOCK_M, BLOCK_N, BLOCK_K, ws_ptr, s_se, s_sj, s_sk, QROWS,
                                   MX, w0, PRE, A8, q_ptr, qs_ptr, s_qt, s_qs, KN)
            om = rmask[:, None] & nm[None, :]
            tile_off = rows[:, None] * D + n[None, :]  # part: [SPLIT, S, D] fp32
            tl.store(part_ptr + ks * S * D + tile_off, acc, mask=om)
            tl.debug_barrier()
            tile = (p * tl.num_programs(1) + mb) * (tl.num_programs(2) // SPLIT) + nb
            done = tl.atomic_add(sem_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT - 1:  # the tile's last program: the other partials are visible (acquire)
                tot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for j in tl.static_range(SPLIT):
                    tot += tl.load(part_ptr + j * S * D + tile_off, mask=om, other=0.0, cache_modifier=".cg")
                o = _down_round(tot, e, n, nm, b_ptr, s_be, dt, HAS_BIAS)
                tw = tl.load(tw_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
                tl.store(y_ptr + rows[:, None] * s_ys + n[None, :], o * tw[:, None], mask=om)
                tl.store(sem_ptr + tile, 0)


def _scale_args(w, transposed: bool):
    """(scale kernel arguments: ptr, its three strides, QROWS (block-FP8's rows per scale row; 0: not block-FP8) and
    MX (mxfp4) as a dict, the values tensor)."""
    if isinstance(w, Mxfp4):
        q, s = w.q, w.scale
        if q.stride(-1) != 1 or q.stride(-2) % 4 or q.data_ptr() % 4:  # the one-row tiles read int32 words
            raise ValueError("mxfp4 experts: the packed values must be contiguous along K with 4-byte aligned rows")
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


@dry_zeros
def moe_experts(x, idx, w, gate_up, down, valid=None, counters=None, *, spec=None, gate_up_bias=None,
                down_bias=None, tiles=None, xq=None, grid: str = "auto"):
    """tiles: a moecg.kernels.tiles.MoeTiles; None: the table's choice for this shape (moe_tiles). xq: x's act_quant
    from its producer, which experts taking fp8_dynamic inputs read instead of quantizing x (quant.a8_inputs).
    grid: "expert" (a program per expert), "slot" (a program per assignment, the expert's first one runs it), "row"
    (one-row tiles, MoeTiles.block_m 1: a program per assignment, each running its own row) or "auto": row on one-row
    tiles, else slot when the assignments are fewer than the experts (decode at small batches), else expert. On the
    expert and slot grids one-row tiles give an expert T row blocks, most of them empty programs."""
    T, K = idx.shape
    D = x.shape[1]
    a = ExpertArgs(gate_up, down, spec, gate_up_bias, down_bias)
    gate_up, down = a.gate_up, a.down
    E, inter = a.num_experts, a.inter
    S = T * K
    assert x.stride(1) == 1 and idx.is_contiguous()
    if grid not in ("auto", "expert", "slot", "row"):
        raise ValueError(f"grid={grid!r}: choose auto, expert, slot or row")
    t = tiles or _tiles.moe_tiles(T, D, inter, E, a.weights, a.activations)
    split = t.down_split if down_bias is None else 1  # a biased down projection keeps one pass (bias before round)
    bm = t.block_m
    by_row = grid == "row" or (grid == "auto" and bm == 1)
    if by_row and bm != 1:
        raise ValueError(f"grid='row' runs one-row tiles (MoeTiles.block_m 1), not block_m {bm}")
    by_slot = by_row or grid == "slot" or (grid == "auto" and S < E)
    P = S if by_slot else E
    m_blocks = 1 if by_row else triton.cdiv(T, bm)  # an expert gets at most one assignment per token
    h = torch.empty(S, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(T, K, D, dtype=torch.float32, device=x.device)  # pad rows: zeroed by the down kernel
    wc = w.contiguous()
    c = counters
    up_blocks = triton.cdiv(inter, t.up_n)
    up_k = quant_k(t.up_k, a.up_scale, bm)
    up_split, up_steps, up_part, up_sems = 1, triton.cdiv(D, up_k), None, None
    if t.up_split > 1:
        if a.weights != "full":
            raise ValueError(f"MoeTiles.up_split={t.up_split}: the up kernel splits bf16 / fp32 experts only, not "
                             f"{a.weights} ones; use up_split=1")
        up_steps = triton.cdiv(triton.cdiv(D, t.up_split), up_k)  # K steps a split
        up_split = triton.cdiv(D, up_steps * up_k)
    if up_split > 1:
        up_part = torch.empty(up_split, S, 2 * inter, dtype=torch.float32, device=x.device)
        up_sems = split_sems(x.device, P * m_blocks * up_blocks, "moe_up")
    launch(_moe_up_kernel, (P, m_blocks, up_blocks * up_split),
        x, idx, valid if valid is not None else idx, wc, gate_up, gate_up_bias if gate_up_bias is not None else h,
        h, c.routed if c is not None else h, c.routed_mass if c is not None else h,
        c.tokens if c is not None else h, S, int(by_slot), D, inter, x.stride(0), gate_up.stride(0), a.s_wj, a.s_wk,
        gate_up_bias.stride(0) if gate_up_bias is not None else 0, h.stride(0), a.alpha, a.limit,
        K=K, HAS_VALID=valid is not None, COUNT=c is not None, JM=a.jm, JU=a.ju, PAIRED=a.paired(t),
        HAS_BIAS=gate_up_bias is not None, ACT=a.act,
        BLOCK_M=bm, BLOCK_N=t.up_n, BLOCK_K=up_k, BLOCK_S=64, num_warps=t.warps,
        num_stages=t.stages, **a.up_scale, **a8_inputs(x, a.up_scale["A8"], bm, xq),
        **pdl_args(x.device, t.pdl_trigger), BY_ROW=int(by_row), SPLIT=up_split, part_ptr=up_part, sem_ptr=up_sems,
        k_steps=up_steps, KN=a.kn)
    n_blocks = triton.cdiv(D, t.down_n)
    down_k = quant_k(t.down_k, a.down_scale, bm)
    if split > 1:
        k_steps = triton.cdiv(triton.cdiv(inter, split), down_k)  # K steps a split
        split = triton.cdiv(inter, k_steps * down_k)
    else:
        k_steps = triton.cdiv(inter, down_k)
    part = torch.empty(split, S, D, dtype=torch.float32, device=x.device) if split > 1 else y
    sems = split_sems(x.device, P * m_blocks * n_blocks, "moe_down") if split > 1 else idx
    launch(_moe_down_kernel, (P, m_blocks, n_blocks * split),
        h, idx, valid if valid is not None else idx, wc, down, down_bias if down_bias is not None else h, y, part,
        sems, S, int(by_slot), D, inter, k_steps, h.stride(0), down.stride(0), a.s_dn, a.s_dk,
        down_bias.stride(0) if down_bias is not None else 0, y.stride(1), K=K, HAS_VALID=valid is not None,
        HAS_BIAS=down_bias is not None, SPLIT=split, BLOCK_M=bm, BLOCK_N=t.down_n, BLOCK_K=down_k, BLOCK_S=64,
        num_warps=t.warps, num_stages=t.stages, **a.down_scale, **a8_inputs(h, a.down_scale["A8"], bm),
        **pdl_args(x.device, t.pdl_trigger, preload=True), BY_ROW=int(by_row), KN=a.kn)
    return y
