"""Triton kernels of the fused decode step's dense projections: the small-batch GEMV (the qkv and o projections,
where its table picks it over cuBLAS) and the SiLU-mul between a dense MLP's (or shared expert's) GEMMs. Same
signatures as `moecg.kernels.ref`'s linear and silu_mul.

Dims as in ref.py: T tokens, N output columns, K inner dim, I intermediate.
Every kernel is graph-safe: no host syncs, device-side positions and counters, fixed launch grids per batch size
(programs with no work exit at once); integer sizes that change with the batch are not specialised
(`do_not_specialize`), so one compilation serves every bucket. Rounding follows HF's modules: bf16 after each
elementwise op that HF runs in bf16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moecg.kernels import tiles as _tiles
from moecg.kernels.launch import dry_zeros, k_split, launch, pdl_args, pdl_enter
from moecg.kernels.quant import (a8_inputs, a8_tile, act_k, act_quant_out, check_block_k, dequant_tile, fp8_mma,
                                 fp8_row_mac, fp8_scales_ahead, mac, mac_init, mac_sum, store_act_quant, w_tile)
from moecg.models.formats import BlockFp8, fp8_input


# ------------------------------------------------------------------------------------------------------------
# silu(gate) * up of a dense MLP or shared expert, [T, 2I] -> [T, I], one program per (row, 1024 columns)
@triton.jit(do_not_specialize=["T"])
def _silu_mul_kernel(gu_ptr, h_ptr, T, I, s_gt, s_ht, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = 0, q_ptr=None,
                     qs_ptr=None, s_qt=0, s_qs=0):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    dt = h_ptr.dtype.element_ty
    g = tl.load(gu_ptr + t * s_gt + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * s_gt + I + offs, mask=m, other=0.0).to(tl.float32)
    a = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
    h = (a * u).to(dt)
    tl.store(h_ptr + t * s_ht + offs, h, mask=m)
    if q_ptr is not None:  # quant: its act_quant too, for the fp8_dynamic down projection after it
        store_act_quant(h, t, tl.program_id(1) * BLOCK, I, q_ptr, qs_ptr, s_qt, s_qs, BLOCK)


@dry_zeros
def silu_mul(gu, inter: int, quant: bool = False):
    """As ref.silu_mul; quant: the output's act_quant too, second (each program's 1024 columns are 8 whole blocks)."""
    T = gu.shape[0]
    assert gu.stride(1) == 1
    h = torch.empty(T, inter, dtype=gu.dtype, device=gu.device)
    extra, qargs = act_quant_out(T, inter, gu.device, quant)
    launch(_silu_mul_kernel, (T, triton.cdiv(inter, 1024)), gu, h, T, inter, gu.stride(0), h.stride(0),
            BLOCK=1024, num_warps=4, **qargs, **pdl_args(gu.device))
    return (h, *extra) if quant else h


# ------------------------------------------------------------------------------------------------------------
# small-batch linear y [T, N] = x [T, K] @ w [N, K]^T (+ bias): one program per BLOCK_N output columns streams its
# rows of W once for all T rows (T <= 16: one tl.dot row block; GemvTiles.rows < 16: that many rows a program, their
# products on the CUDA cores, for batch 1), fp32 accumulation, bias added before the one
# rounding (as cuBLAS's epilogue). cuBLAS runs some of these decode shapes as a split-K GEMM plus a reduce kernel;
# this is one kernel with no workspace. Which shapes take it: moecg.kernels.tiles.gemv_tiles (a table from bench_gemv.py).
# The same kernel serves per-head projections (head_linear: program_id(1) is the head, with its strides; W may be a
# strided view, s_wk its K stride); the plain linear has one head and s_wk 1.
# A block-FP8 weight (QROWS > 0: e4m3 values, fp32 scales ws [N / QROWS, K / 128], moecg.models.formats) is
# dequantized in registers as the reference does (moecg.kernels.quant.dequant_tile) before the same tl.dot;
# program_id(2) then takes BLOCK_T rows each, so any T runs it. A8 (fp8_dynamic activations): x's e4m3 values and
# scales (moecg.kernels.quant.a8_tile), then an FP8 MMA (fp8_mma) or fp32 products of its values.
# Split-K (linear_partials, GemvTiles.split_k = S > 1): program_id(1) takes one of S column ranges of K (a whole
# number of K steps each) and stores its fp32 partial row; the consumer (add_rmsnorm, norm_route) adds the S
# partials in order and rounds once, so the projection's output is rounded once as in linear, from the same fp32
# products summed in another order. S times the programs for projections whose N alone gives too few (o: N = D).
# PRELOAD (moecg.kernels.launch.PRELOAD): each program loads its first K step's weight tile before its PDL wait, so
# the programs resident while the predecessor (a norm, the attention) runs have their first tile in flight or in
# registers when it ends; the arithmetic and its order are unchanged (the loop's first step peeled).
@triton.jit
def _gemv_step(x_ptr, t, tm, s_xt, w, acc, k0, k_hi, K, ws_ptr, n, nm, s_sn, s_sk, QROWS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr, ROW_SCALE: tl.constexpr,
               A8: tl.constexpr, q_ptr, qs_ptr, s_qt, s_qs, xs8, sw8, KND: tl.constexpr = 0):
    """acc + the rows t of x at columns k0 .. times the weight tile w of those columns (dequantized as its format;
    KND: w is k-major, quant.w_tile's KN).
    A8: x's e4m3 values as quant.a8_tile gives them (from q_ptr / qs_ptr where the input came quantized); on the
    tensor cores the step's scales xs8 / sw8, loaded a step ahead (quant.fp8_scales_ahead)."""
    x, xq = a8_tile(x_ptr, t, tm, s_xt, k0, k_hi, q_ptr, qs_ptr, s_qt, s_qs, A8, DOT, BLOCK_K)
    if A8 and DOT:
        acc = fp8_mma(xq, xs8, w, sw8, acc, t.shape[0])
    elif ROW_SCALE:
        acc = fp8_row_mac(x, w, acc, ws_ptr + (tl.program_id(0) * BLOCK_N // QROWS) * s_sn, k0, K, s_sk, BLOCK_K)
    else:
        if QROWS:
            w = dequant_tile(w, ws_ptr + (n // QROWS) * s_sn, k0, K, s_sk, nm, x.dtype, BLOCK_N, BLOCK_K)
        acc = mac(x, w, acc, DOT, KND)
    return acc


@triton.jit(do_not_specialize=["T", "ksteps"])
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, T, N, K, s_xt, s_wn, s_yt, HAS_BIAS: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = 0,
                 s_xh=0, s_wh=0, s_yh=0, s_wk=1, ws_ptr=None, s_sn=0, s_sk=0, QROWS: tl.constexpr = 0,
                 SPLIT: tl.constexpr = 1, ksteps=0, s_ys=0, PRELOAD: tl.constexpr = 0, A8: tl.constexpr = 0,
                 q_ptr=None, qs_ptr=None, s_qt=0, s_qs=0, KN: tl.constexpr = 0):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    DOT: tl.constexpr = BLOCK_T >= 16  # else the products on the CUDA cores (moecg.kernels.quant.mac)
    KND: tl.constexpr = KN and DOT and QROWS == 0  # k-major weight tiles: W's N dim contiguous (head_linear's W_UK)
    if SPLIT > 1:  # program_id(1) is the K split (one head): ksteps K steps of columns from sp * ksteps * BLOCK_K
        sp = tl.program_id(1)
        k_lo = sp * ksteps * BLOCK_K  # a multiple of BLOCK_K the compiler sees: aligned, vectorised weight loads
        k_hi = tl.minimum(K, k_lo + ksteps * BLOCK_K)
        y_ptr += sp * s_ys
    else:
        hd = tl.program_id(1)
        x_ptr += hd * s_xh
        w_ptr += hd * s_wh
        y_ptr += hd * s_yh
        k_lo = 0
        k_hi = K
    nm = n < N
    # the PDL wait before the first K step's weights, or with PRELOAD after them (no kernel writes weights: they then
    # load while the predecessor runs); one of the two calls waits, the other is mode 0 (nothing)
    pdl_enter(USE_PDL * (1 - PRELOAD))
    w = w_tile(w_ptr, n, nm, k_lo, k_hi, s_wn, s_wk, BLOCK_K, KND)
    pdl_enter(USE_PDL * PRELOAD)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    ROW_SCALE: tl.constexpr = (BLOCK_T == 1) & (QROWS > 0) & (QROWS % BLOCK_N == 0)  # one row: x scaled (fp8_row_mac)
    acc = mac_init(BLOCK_T, BLOCK_N, BLOCK_K, DOT, ROW_SCALE, A8)
    PRE: tl.constexpr = A8 and DOT  # each step's scales loaded a step ahead, beside the MMA before (fp8_scales_ahead)
    srow = ws_ptr + (n // QROWS) * s_sn if PRE else ws_ptr
    xs8, sw8 = fp8_scales_ahead(PRE, qs_ptr, t, tm, s_qs, srow, nm, s_sk, k_lo, k_hi)
    xs9, sw9 = fp8_scales_ahead(PRE, qs_ptr, t, tm, s_qs, srow, nm, s_sk, k_lo + BLOCK_K, k_hi)
    acc = _gemv_step(x_ptr, t, tm, s_xt, w, acc, k_lo, k_hi, K, ws_ptr, n, nm, s_sn, s_sk, QROWS, BLOCK_N, BLOCK_K,
                     DOT, ROW_SCALE, A8, q_ptr, qs_ptr, s_qt, s_qs, xs8, sw8,
                     KND)  # every split has columns (linear_partials): the first step always runs
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        w = w_tile(w_ptr, n, nm, k0, k_hi, s_wn, s_wk, BLOCK_K, KND)
        xs8, sw8 = xs9, sw9
        xs9, sw9 = fp8_scales_ahead(PRE, qs_ptr, t, tm, s_qs, srow, nm, s_sk, k0 + BLOCK_K, k_hi)
        acc = _gemv_step(x_ptr, t, tm, s_xt, w, acc, k0, k_hi, K, ws_ptr, n, nm, s_sn, s_sk, QROWS, BLOCK_N,
                         BLOCK_K, DOT, ROW_SCALE, A8, q_ptr, qs_ptr, s_qt, s_qs, xs8, sw8, KND)
    acc = mac_sum(acc, DOT, A8)
    if HAS_BIAS:  # split: once, in the first split's partial
        b = tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
        if SPLIT > 1:
            b = tl.where(sp == 0, b, 0.0)
        acc += b[None, :]
    tl.store(y_ptr + t[:, None] * s_yt + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=tm[:, None] & nm[None, :])


GEMV_MAX_T = 16  # rows one program's tl.dot block holds
FP8_MAX_ROWS = 64  # the block-FP8 GEMV's (any T): up to 64 rows a program, so up to 64 rows read the weights once


def _rows(t, fp8: bool) -> int:
    """Rows of x one program takes (grid dim 2 runs ceil(T / rows) of them, each reading every weight again)."""
    return min(t.rows, FP8_MAX_ROWS if fp8 else GEMV_MAX_T)


@dry_zeros
def linear(x, w, bias=None, tiles=None, xq=None):
    """As ref.linear. tiles: a moecg.kernels.tiles.GemvTiles (the Triton GEMV) or None: the table's choice for this
    shape (gemv_tiles), which is cuBLAS (F.linear) where no rule holds. A block-FP8 weight (BlockFp8) always runs the
    Triton GEMV, on its values and scales, any T (BLOCK_T rows per program along grid dim 2). xq: x quantized already
    (act_quant's (q, s), from its producer), which a weight taking fp8_dynamic inputs reads instead of quantizing x."""
    if isinstance(w, BlockFp8):
        return _linear_fp8(x, w, bias, tiles, xq)
    T, K = x.shape
    N = w.shape[0]
    t = tiles or _tiles.gemv_tiles(T, N, K)
    if t is None or T > GEMV_MAX_T or x.stride(1) != 1 or w.stride(1) != 1 or (bias is not None and
                                                                                bias.stride(0) != 1):
        return F.linear(x, w, bias)
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    rows = _rows(t, False)
    launch(_gemv_kernel, (triton.cdiv(N, t.block_n), 1, triton.cdiv(T, rows)), x, w, bias if bias is not None else y,
            y, T, N, K, x.stride(0), w.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_T=rows,
            BLOCK_N=t.block_n,
            BLOCK_K=t.block_k, num_warps=t.warps, num_stages=t.stages,
            **pdl_args(x.device, t.pdl_trigger, preload=True))
    return y


@dry_zeros
def router_logits(h, w, tiles=None):
    """As ref.router_logits: fp32 logits [T, E] of h [T, D] @ w [E, D]^T, on the GEMV kernel's CUDA-core path (one
    row a program: exact fp32 products of h's values and w's, fp32 sums; the bits can differ from cuBLAS's fp32 GEMM
    in the last places, its sums run in another order). tiles: GemvTiles (rows 1), None: the table's
    (moecg.kernels.tiles.router_tiles); F.linear where that says None."""
    T, K = h.shape
    E = w.shape[0]
    t = tiles or _tiles.router_tiles(T, E, K)
    if t is None or h.stride(1) != 1 or w.stride(1) != 1:
        return F.linear(h.float(), w.float())
    assert t.rows == 1, "router_logits: fp32 products on the CUDA cores (rows 1); tl.dot would round them to tf32"
    y = torch.empty(T, E, dtype=torch.float32, device=h.device)
    launch(_gemv_kernel, (triton.cdiv(E, t.block_n), 1, T), h, w, y, y, T, E, K, h.stride(0), w.stride(0),
           y.stride(0), HAS_BIAS=False, BLOCK_T=1, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.warps,
           num_stages=t.stages, **pdl_args(h.device, t.pdl_trigger, preload=True))
    return y


def table_tiles(x, w):
    """The tile table's GemvTiles for x [T, K] @ w^T: fp8_gemv_tiles for a block-FP8 weight (always some), gemv_tiles
    otherwise (None: cuBLAS)."""
    T, K = x.shape
    if isinstance(w, BlockFp8):
        return _tiles.fp8_gemv_tiles(T, w.q.shape[0], K, bool(_a8(w)))
    return _tiles.gemv_tiles(T, w.shape[0], K)


@dry_zeros
def linear_partials(x, w, bias=None, tiles=None, xq=None):
    """As ref.linear_partials: [T, S, N], the projection's S split-K partial rows (fp32) or, unsplit, linear's
    output as one partial row (S = 1). tiles: GemvTiles, or None: the table's (fp8_gemv_tiles for a block-FP8
    weight, gemv_tiles otherwise); split only where they say split_k > 1 (and T <= GEMV_MAX_T for a dense w)."""
    fp8 = isinstance(w, BlockFp8)
    T, K = x.shape
    N = w.q.shape[0] if fp8 else w.shape[0]
    t = tiles or table_tiles(x, w)
    if t is None or t.split_k <= 1 or (not fp8 and (T > GEMV_MAX_T or w.stride(1) != 1)) or x.stride(1) != 1 \
            or (bias is not None and bias.stride(0) != 1):
        return linear(x, w, bias, tiles, xq)[:, None]
    rows = _rows(t, fp8)
    bk = _fp8_k(t.block_k, w, rows) if fp8 else t.block_k
    ksteps, S = k_split(K, t.split_k, bk)  # whole K steps a split (and whole 128-column scales)
    y = torch.empty(S, T, N, dtype=torch.float32, device=x.device)
    q, extra = (w.q, {"ws_ptr": w.scale, "s_sn": w.scale.stride(0), "s_sk": w.scale.stride(1), "QROWS": w.rows,
                      "A8": _a8(w), **a8_inputs(x, _a8(w), rows, xq)}) if fp8 else (w, {})
    launch(_gemv_kernel, (triton.cdiv(N, t.block_n), S, triton.cdiv(T, rows)), x, q,
           bias if bias is not None else y, y, T, N, K, x.stride(0), q.stride(0), y.stride(1),
           HAS_BIAS=bias is not None, BLOCK_T=rows, BLOCK_N=t.block_n, BLOCK_K=bk, num_warps=t.warps,
           num_stages=t.stages, SPLIT=S, ksteps=ksteps, s_ys=y.stride(0), **extra,
           **pdl_args(x.device, t.pdl_trigger, preload=True))
    return y.transpose(0, 1)  # [T, S, N]


def _a8(w: BlockFp8) -> int:
    """The kernels' A8 constexpr: w takes fp8_dynamic inputs."""
    return int(fp8_input(w))


def _fp8_k(block_k: int, w: BlockFp8, rows: int) -> int:
    """A block-FP8 GEMV's K step: check_block_k's, or with fp8_dynamic activations act_k's."""
    return act_k(block_k, rows) if _a8(w) else check_block_k(block_k)


def _linear_fp8(x, w, bias, tiles, xq=None):
    T, K = x.shape
    N = w.q.shape[0]
    t = tiles or table_tiles(x, w)
    assert x.stride(1) == 1 and w.q.stride(1) == 1 and (bias is None or bias.stride(0) == 1)
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    s = w.scale
    rows = _rows(t, True)
    launch(_gemv_kernel, (triton.cdiv(N, t.block_n), 1, triton.cdiv(T, rows)), x, w.q,
           bias if bias is not None else y, y, T, N, K, x.stride(0), w.q.stride(0), y.stride(0),
           HAS_BIAS=bias is not None, BLOCK_T=rows, BLOCK_N=t.block_n, BLOCK_K=_fp8_k(t.block_k, w, rows),
           num_warps=t.warps, num_stages=t.stages, ws_ptr=s, s_sn=s.stride(0), s_sk=s.stride(1), QROWS=w.rows,
           A8=_a8(w), **a8_inputs(x, _a8(w), rows, xq),
           **pdl_args(x.device, t.pdl_trigger, preload=True))
    return y


@dry_zeros
def head_linear(x, w, tiles=None):
    """As ref.head_linear: x [T, H, K] (K contiguous) @ w[h] [N, K]^T per head -> [T, H, N], on the GEMV kernel with
    one program per (BLOCK_N columns, head, GemvTiles.rows rows), up to GEMV_MAX_T rows; more rows: torch.bmm.
    tiles (GemvTiles): None is the table's (moecg.kernels.tiles.head_tiles)."""
    T, H, K = x.shape
    N = w.shape[1]
    if T > GEMV_MAX_T or x.stride(2) != 1:
        return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)
    t = tiles or _tiles.head_tiles(T, N, K, w.stride(1) == 1)
    rows = _rows(t, False)
    y = torch.empty(T, H, N, dtype=x.dtype, device=x.device)
    launch(_gemv_kernel, (triton.cdiv(N, t.block_n), H, triton.cdiv(T, rows)), x, w, y, y, T, N, K, x.stride(0),
           w.stride(1), y.stride(0), HAS_BIAS=False, BLOCK_T=rows, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
           num_warps=t.warps, num_stages=t.stages, s_xh=x.stride(1), s_wh=w.stride(0), s_yh=y.stride(1),
           s_wk=w.stride(2), KN=int(w.stride(1) == 1 and w.stride(2) != 1),
           **pdl_args(x.device, t.pdl_trigger, preload=True))
    return y
