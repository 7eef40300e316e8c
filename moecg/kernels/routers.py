"""Triton kernels of the fused decode step's routers, one per router kind (moecg.models.adapter.ROUTER_KINDS), and
residual add + RMSNorm + router GEMV + softmax_topk as one kernel (norm_route). Same signatures as
`moecg.kernels.ref`'s route, norm_route, route_sigmoid_group, route_softmax_group and route_topk_softmax.

Dims as in ref.py: T tokens, D hidden, E experts, G expert groups, K top-k (KP: next power of two).
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
from moecg.kernels.launch import dry_zeros, last_arrival, launch, p2, pdl_args, pdl_enter, split_sems
from moecg.kernels.quant import act_quant_out, quant_block, store_act_quant
from moecg.kernels.ref import NORM_ROUTE_KINDS


# router: softmax (fp32) + top-k + optional renormalisation, one program per token
_KEY_NONE = tl.constexpr(-(2**63))  # below every _order_key: a lane out of the choice


@triton.jit
def _order_key(x, e, BLOCK_E: tl.constexpr):
    """An int64 per lane ordered as x (fp32, any sign; -0.0 as +0.0), ties to the lower lane e: one max reduction
    then finds the largest value and its first lane at once (two reductions otherwise, each a cross-warp sync)."""
    b = (x + 0.0).to(tl.int32, bitcast=True)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)  # fp32 bits -> a signed int of the same order
    return (b.to(tl.int64) << 32) | (BLOCK_E - 1 - e).to(tl.int64)


@triton.jit
def _key_value(key):
    """The fp32 value an _order_key holds."""
    b = (key >> 32).to(tl.int32)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _topk_keys(key, e, K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr):
    """The K largest of the lanes' keys (_order_key; _KEY_NONE: out of the choice), largest first, ties to the lower
    lane -> (lanes [KP] int64, keys [KP]; past K: 0 and _KEY_NONE). Shared by every Triton router."""
    kk = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int64)
    best = tl.full([KP], _KEY_NONE, dtype=tl.int64)
    for k in tl.static_range(K):
        b = tl.max(key, axis=0)
        i = BLOCK_E - 1 - (b & 0xFFFFFFFF)
        ids = tl.where(kk == k, i, ids)
        best = tl.where(kk == k, b, best)
        key = tl.where(e == i, _KEY_NONE, key)
    return ids, best


@triton.jit
def _softmax_topk(x, e, em, K: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr):
    """softmax_topk of one row of logits x [BLOCK_E] (fp32; lanes past E masked by em) -> (ids [K], weights [K])."""
    x = tl.where(em, x, float("-inf"))
    x = x - tl.max(x, axis=0)
    p = tl.exp(x)
    p = p / tl.sum(p, axis=0)
    ids, best = _topk_keys(tl.where(em, _order_key(p, e, BLOCK_E), _KEY_NONE), e, K, K, BLOCK_E)
    vals = _key_value(best)
    if NORM:
        vals = vals / tl.sum(vals, axis=0)
    return ids, vals


@triton.jit
def _topk_keys_rows(key, e, K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr):
    """_topk_keys of every row of key [W, BLOCK_E] (e [BLOCK_E]: the lanes) -> (lanes [W, KP], keys [W, KP])."""
    kk = tl.arange(0, KP)[None, :]
    ids = tl.zeros([key.shape[0], KP], dtype=tl.int64)
    best = tl.full([key.shape[0], KP], _KEY_NONE, dtype=tl.int64)
    for k in tl.static_range(K):
        b = tl.max(key, axis=1)[:, None]
        i = BLOCK_E - 1 - (b & 0xFFFFFFFF)
        ids = tl.where(kk == k, i, ids)
        best = tl.where(kk == k, b, best)
        key = tl.where(e[None, :] == i, _KEY_NONE, key)
    return ids, best


@triton.jit
def _softmax_topk_rows(x, e, em, K: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr):
    """_softmax_topk of every row of x [W, BLOCK_E] -> (ids [W, K], weights [W, K])."""
    x = tl.where(em[None, :], x, float("-inf"))
    x = x - tl.max(x, axis=1)[:, None]
    p = tl.exp(x)
    p = p / tl.sum(p, axis=1)[:, None]
    key = tl.where(em[None, :], _order_key(p, e[None, :], BLOCK_E), _KEY_NONE)
    ids, best = _topk_keys_rows(key, e, K, K, BLOCK_E)
    vals = _key_value(best)
    if NORM:
        vals = vals / tl.sum(vals, axis=1)[:, None]
    return ids, vals


@triton.jit
def _topk_softmax_rows(x, e, em, K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr):
    """_topk_softmax of every row of x [W, BLOCK_E] -> (ids [W, KP], weights [W, KP])."""
    kk = tl.arange(0, KP)[None, :]
    key = tl.where(em[None, :], _order_key(x, e[None, :], BLOCK_E), _KEY_NONE)
    ids, best = _topk_keys_rows(key, e, K, KP, BLOCK_E)
    vals = tl.where(kk < K, _key_value(best), float("-inf"))
    p = tl.exp(vals - tl.max(vals, axis=1)[:, None])
    return ids, p / tl.sum(p, axis=1)[:, None]


@triton.jit(do_not_specialize=["T"])
def _route_kernel(lg_ptr, idx_ptr, w_ptr, T, E, s_lt, K: tl.constexpr, NORM: tl.constexpr,
                  BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr = 0):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    x = tl.load(lg_ptr + t * s_lt + e, mask=em, other=float("-inf")).to(tl.float32)
    ids, vals = _softmax_topk(x, e, em, K, NORM, BLOCK_E)
    kk = tl.arange(0, K)
    tl.store(idx_ptr + t * K + kk, ids)
    tl.store(w_ptr + t * K + kk, vals.to(w_ptr.dtype.element_ty))


@dry_zeros
def route(logits, top_k: int, normalize: bool, out_dtype):
    T, E = logits.shape
    assert logits.stride(1) == 1 and top_k & (top_k - 1) == 0, "top_k must be a power of two for the Triton router"
    idx = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(T, top_k, dtype=out_dtype, device=logits.device)
    launch(_route_kernel, (T,), logits, idx, w, T, E, logits.stride(0), K=top_k, NORM=normalize, BLOCK_E=p2(E),
            num_warps=1, **pdl_args(logits.device))
    return idx, w


# residual add + RMSNorm + router GEMV + the router's choice in one kernel, for a layer whose router is its own linear
# (Mixtral, Qwen3-MoE, OLMoE: softmax_topk; GPT-OSS's with its bias: topk_softmax, TOPK_FIRST). Grid (row, block of
# experts): every program loads the whole row and its experts' weight rows at once, recomputes the row's norm and dots
# it with them (+ the router's bias in fp32; rounded to the model dtype, as the router linear's output); program 0 of
# the row writes the new residual and the normed row; the row's last program to finish (an arrival counter) runs the
# softmax/top-k (or top-k/softmax) over the row's logits, as the router kernels do. A first version looped over D in
# 256-wide chunks, two passes: 12.2 us per call at Qwen3-30B-A3B's shape, bs 1, on the H200, slower than the three
# kernels it replaced (latency of 16 dependent load rounds).
@triton.jit(do_not_specialize=["T"])
def _norm_route_kernel(a_ptr, res_ptr, nw_ptr, rw_ptr, sb_ptr, lg_ptr, sem_ptr, out_res_ptr, out_ptr, idx_ptr,
                       w_ptr, T, D, E, eps, s_at, s_rt, s_rwe, s_ort, s_ot, K: tl.constexpr, NORM: tl.constexpr,
                       HAS_SKEW: tl.constexpr, CAST_LAST: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_EP: tl.constexpr, USE_PDL: tl.constexpr = 0, KK: tl.constexpr = 1,
                       s_ak=0, PRELOAD: tl.constexpr = 0, q_ptr=None, qs_ptr=None, s_qt=0, s_qs=0, rb_ptr=None,
                       TOPK_FIRST: tl.constexpr = 0, WROWS: tl.constexpr = 1):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    dt = out_ptr.dtype.element_ty
    kk = tl.arange(0, BLOCK_D)  # the whole row at once: every load is issued together (latency, not bandwidth)
    km = kk < D
    e = nb * BLOCK_E + tl.arange(0, BLOCK_E)
    em = e < E
    # the PDL wait before the router rows and the norm weight, or with PRELOAD after them (as gemv's kernel does)
    pdl_enter(USE_PDL * (1 - PRELOAD))
    wr = tl.load(rw_ptr + e[:, None] * s_rwe + kk[None, :], mask=em[:, None] & km[None, :], other=0.0)
    nw = tl.load(nw_ptr + kk, mask=km, other=0.0).to(tl.float32)
    if rb_ptr is not None:
        rb = tl.load(rb_ptr + e, mask=em, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL * PRELOAD)
    a = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(KK):  # the projection's split-K partial rows (one: its output), added in order
        a += tl.load(a_ptr + t * s_at + j * s_ak + kk, mask=km, other=0.0).to(tl.float32)
    a = a.to(dt).to(tl.float32)  # the projection's output, rounded once
    r = tl.load(res_ptr + t * s_rt + kk, mask=km, other=0.0).to(tl.float32)
    out = (r + a).to(dt).to(tl.float32)  # the new residual: res + round(a), rounded
    yn = out * tl.rsqrt(tl.sum(out * out, axis=0) / D + eps)
    if not CAST_LAST:
        yn = yn.to(dt).to(tl.float32)
    h = (nw * yn).to(dt)
    if nb == 0:
        tl.store(out_res_ptr + t * s_ort + kk, out.to(dt), mask=km)
        tl.store(out_ptr + t * s_ot + kk, h, mask=km)
        if q_ptr is not None:  # quant: h's act_quant too, for the experts' fp8_dynamic GEMMs
            store_act_quant(h, t, 0, D, q_ptr, qs_ptr, s_qt, s_qs, BLOCK_D)
    lg = tl.sum(wr.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
    if rb_ptr is not None:
        lg += rb
    lg = lg.to(dt).to(tl.float32)  # the router linear's output dtype
    if HAS_SKEW:
        lg = (lg + tl.load(sb_ptr + e, mask=em, other=0.0).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    tl.store(lg_ptr + t * E + e, lg, mask=em)
    if last_arrival(sem_ptr, t, tl.num_programs(1)):  # the row's other logits are visible
        ea = tl.arange(0, BLOCK_EP)
        eam = ea < E
        kk2 = tl.arange(0, K)
        if WROWS > 1:  # every warp a copy of the row's logits: reductions inside a warp, no block barrier
            wr_ = tl.arange(0, WROWS)[:, None]
            x = tl.load(lg_ptr + t * E + wr_ * 0 + ea[None, :], mask=eam[None, :], other=float("-inf"),
                        cache_modifier=".cg")  # [WROWS, BLOCK_EP]
            if TOPK_FIRST:
                ids, vals = _topk_softmax_rows(x, ea, eam, K, K, BLOCK_EP)
            else:
                ids, vals = _softmax_topk_rows(x, ea, eam, K, NORM, BLOCK_EP)
            tl.store(idx_ptr + t * K + wr_ * 0 + kk2[None, :], ids, mask=wr_ == 0)
            tl.store(w_ptr + t * K + wr_ * 0 + kk2[None, :], vals.to(w_ptr.dtype.element_ty), mask=wr_ == 0)
        else:
            x = tl.load(lg_ptr + t * E + ea, mask=eam, other=float("-inf"), cache_modifier=".cg")
            if TOPK_FIRST:
                ids, vals = _topk_softmax(x, ea, eam, K, K, BLOCK_EP)
            else:
                ids, vals = _softmax_topk(x, ea, eam, K, NORM, BLOCK_EP)
            tl.store(idx_ptr + t * K + kk2, ids)
            tl.store(w_ptr + t * K + kk2, vals.to(w_ptr.dtype.element_ty))
        tl.store(sem_ptr + t, 0)  # zero again for the next call (and graph replay)


@dry_zeros
def norm_route(a, residual, weight, eps: float, router_w, top_k: int, normalize: bool, out_dtype, logit_bias=None,
               cast_last: bool = False, quant: bool = False, router_b=None, kind: str = "softmax_topk"):
    """As ref.norm_route; quant: h's act_quant too, last (quant.store_act_quant, from the first router block's
    programs)."""
    if a.dim() == 2:
        a = a[:, None]
    T, KK, D = a.shape  # KK partial rows (linear_partials) or one
    E = router_w.shape[0]
    assert a.stride(2) == 1 and residual.stride(1) == 1 and router_w.stride(1) == 1 and weight.is_contiguous()
    assert top_k & (top_k - 1) == 0, "top_k must be a power of two for the Triton router"
    assert logit_bias is None or logit_bias.is_contiguous()
    assert router_b is None or (router_b.is_contiguous() and router_b.shape == (E,))
    assert kind in NORM_ROUTE_KINDS, kind
    dt = residual.dtype
    new_res = torch.empty(T, D, dtype=dt, device=a.device)
    normed = torch.empty(T, D, dtype=dt, device=a.device)
    lg = torch.empty(T, E, dtype=torch.float32, device=a.device)
    idx = torch.empty(T, top_k, dtype=torch.int64, device=a.device)
    w = torch.empty(T, top_k, dtype=dt if kind == "topk_softmax" else out_dtype, device=a.device)  # as ref's
    tiles = _tiles.norm_route_tiles(T, E, D)
    be, warps = tiles.block_e, tiles.warps
    nb = triton.cdiv(E, be)
    sems = split_sems(a.device, T, "norm_route")
    extra, qargs = act_quant_out(T, D, a.device, quant)
    launch(_norm_route_kernel, (T, nb),
        a, residual, weight, router_w, logit_bias if logit_bias is not None else lg, lg, sems, new_res, normed, idx, w,
        T, D, E, eps, a.stride(0), residual.stride(0), router_w.stride(0), new_res.stride(0), normed.stride(0),
        K=top_k, NORM=normalize, HAS_SKEW=logit_bias is not None, CAST_LAST=cast_last, BLOCK_D=quant_block(D, quant),
        BLOCK_E=be, BLOCK_EP=p2(E), num_warps=warps, KK=KK, s_ak=a.stride(1), **qargs, rb_ptr=router_b,
        TOPK_FIRST=int(kind == "topk_softmax"), WROWS=warps if tiles.warp_topk and 64 <= p2(E) <= 128 else 1,
        **pdl_args(a.device, preload=True))
    return (new_res, normed, idx, w, *extra)


# group-limited routers, one program per token. sigmoid_group (DeepSeek-V3, GLM-4-MoE): sigmoid, a biased
# group-limited choice (group score: the sum of its two best biased scores), unbiased weights. softmax_group
# (DeepSeek-V2): softmax over all experts (fp32), groups scored by their best expert, never renormalised (NORM False).
# Every top-k is an argmax loop over the row in registers (E <= a few hundred), ties to the lowest index; the K
# columns come out in descending order of the (biased) score (HF's are unsorted).
@triton.jit(do_not_specialize=["T"])
def _route_group_kernel(lg_ptr, b_ptr, idx_ptr, w_ptr, T, E, s_lt, scaling,
                        K: tl.constexpr, KP: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr,
                        TOPKG: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_E: tl.constexpr, SOFTMAX: tl.constexpr = 0, USE_PDL: tl.constexpr = 0):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    x = tl.load(lg_ptr + t * s_lt + e, mask=em, other=0.0).to(tl.float32)
    if SOFTMAX:
        x = tl.where(em, x, float("-inf"))
        p = tl.exp(x - tl.max(x, axis=0))
        sc = p / tl.sum(p, axis=0)  # [E] probabilities (0 past E)
    else:
        sc = tl.sigmoid(x)  # [E] unbiased scores
    ch = sc
    if HAS_BIAS:
        ch = sc + tl.load(b_ptr + e, mask=em, other=0.0).to(tl.float32)
    ch = tl.where(em, ch, float("-inf"))
    if NG > 1:
        grp = e // (E // NG)
        gi = tl.arange(0, NGP)
        gs = tl.full([NGP], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(NG):  # group score: its best score (softmax) or the sum of its two best (sigmoid)
            cg = tl.where(em & (grp == g), ch, float("-inf"))
            m1 = tl.max(cg, axis=0)
            if SOFTMAX:
                gs = tl.where(gi == g, m1, gs)
            else:
                i1 = tl.min(tl.where(cg == m1, e, BLOCK_E), axis=0)
                m2 = tl.max(tl.where(e == i1, float("-inf"), cg), axis=0)
                gs = tl.where(gi == g, m1 + m2, gs)
        gav = gi < NG
        keep = e < 0
        for _ in tl.static_range(TOPKG):
            gm = tl.max(tl.where(gav, gs, float("-inf")), axis=0)
            gsel = tl.min(tl.where(gav & (gs == gm), gi, NGP), axis=0)
            keep = keep | (grp == gsel)
            gav = gav & (gi != gsel)
        # softmax: HF zeroes the other groups' probabilities (masked_fill 0.0), so they stay choosable after the
        # kept groups' experts; sigmoid: they are out
        ch = tl.where(keep & em, ch, 0.0 if SOFTMAX else float("-inf"))
    kk = tl.arange(0, KP)
    ids, _ = _topk_keys(tl.where(em, _order_key(ch, e, BLOCK_E), _KEY_NONE), e, K, KP, BLOCK_E)
    # the unbiased scores of the chosen lanes (past K: 0; softmax: a masked group's expert weighs 0, as in HF)
    wsrc = ch if SOFTMAX else sc
    ws = tl.sum(tl.where((e[None, :] == ids[:, None]) & (kk < K)[:, None], wsrc[None, :], 0.0), axis=1)
    if NORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    ws = ws * scaling
    tl.store(idx_ptr + t * K + kk, ids, mask=kk < K)
    tl.store(w_ptr + t * K + kk, ws, mask=kk < K)


def _route_group(logits, choice_bias, top_k: int, n_group: int, topk_group: int, normalize: bool, scaling: float,
                 softmax: bool):
    T, E = logits.shape
    assert logits.stride(1) == 1 and logits.dtype == torch.float32 and E % n_group == 0
    assert choice_bias is None or choice_bias.is_contiguous()
    idx = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    launch(_route_group_kernel, (T,),
        logits, choice_bias if choice_bias is not None else logits, idx, w, T, E, logits.stride(0), float(scaling),
        K=top_k, KP=p2(top_k), NG=n_group, NGP=p2(n_group), TOPKG=topk_group, NORM=normalize,
        HAS_BIAS=choice_bias is not None, BLOCK_E=p2(E), SOFTMAX=int(softmax), num_warps=1 if E <= 256 else 4,
        **pdl_args(logits.device))
    return idx, w


@dry_zeros
def route_sigmoid_group(logits, choice_bias, top_k: int, n_group: int, topk_group: int, normalize: bool,
                        scaling: float):
    return _route_group(logits, choice_bias, top_k, n_group, topk_group, normalize, scaling, softmax=False)


@dry_zeros
def route_softmax_group(logits, top_k: int, n_group: int, topk_group: int, scaling: float):
    return _route_group(logits, None, top_k, n_group, topk_group, False, scaling, softmax=True)


# topk_softmax router (GPT-OSS): top-k of the logits, softmax over those k (fp32, rounded once to the logits' dtype)
@triton.jit
def _topk_softmax(x, e, em, K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr):
    """topk_softmax of one row of logits x [BLOCK_E] (fp32; lanes past E masked by em) -> (ids [KP], weights [KP] fp32;
    past K: 0 and 0)."""
    kk = tl.arange(0, KP)
    ids, best = _topk_keys(tl.where(em, _order_key(x, e, BLOCK_E), _KEY_NONE), e, K, KP, BLOCK_E)
    vals = tl.where(kk < K, _key_value(best), float("-inf"))
    p = tl.exp(vals - tl.max(vals, axis=0))
    return ids, p / tl.sum(p, axis=0)


@triton.jit(do_not_specialize=["T"])
def _route_topk_softmax_kernel(lg_ptr, idx_ptr, w_ptr, T, E, s_lt, K: tl.constexpr, KP: tl.constexpr,
                               BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr = 0):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    x = tl.load(lg_ptr + t * s_lt + e, mask=em, other=float("-inf")).to(tl.float32)
    kk = tl.arange(0, KP)
    ids, p = _topk_softmax(x, e, em, K, KP, BLOCK_E)
    tl.store(idx_ptr + t * K + kk, ids, mask=kk < K)
    tl.store(w_ptr + t * K + kk, p.to(w_ptr.dtype.element_ty), mask=kk < K)


@dry_zeros
def route_topk_softmax(logits, top_k: int):
    T, E = logits.shape
    assert logits.stride(1) == 1
    idx = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    launch(_route_topk_softmax_kernel, (T,), logits, idx, w, T, E, logits.stride(0), K=top_k, KP=p2(top_k),
            BLOCK_E=p2(E), num_warps=1 if E <= 256 else 4, **pdl_args(logits.device))
    return idx, w
