"""Triton kernels for moecg's fused decode path; same signatures as `moecg.kernels.ref`.

Dims as in ref.py. Every kernel is graph-safe: no host syncs, device-side positions and counters, fixed
launch grids per batch size (programs with no work exit at once). Integer sizes that change with the batch
are not specialised (`do_not_specialize`), so one compilation serves every bucket.
Rounding follows HF's modules: bf16 after each elementwise op that HF runs in bf16.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _p2(n: int) -> int:
    return triton.next_power_of_2(int(n))


# ------------------------------------------------------------------------------------------------------------
# residual add (+ routed partial sums, + gated shared expert) + RMSNorm
@triton.jit(do_not_specialize=["T"])
def _add_rmsnorm_kernel(y_ptr, res_ptr, w_ptr, sh_ptr, sg_ptr, valid_ptr, out_res_ptr, out_ptr,
                        T, D, eps, s_yt, s_yk, s_rt, s_sht, s_sgt, s_ort, s_ot,
                        KK: tl.constexpr, HAS_RES: tl.constexpr, HAS_SHARED: tl.constexpr,
                        HAS_SGATE: tl.constexpr, HAS_VALID: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(KK):
        acc += tl.load(y_ptr + t * s_yt + k * s_yk + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_VALID:
        ok = tl.load(valid_ptr + t).to(tl.int1)
        acc = tl.where(ok, acc, 0.0)
    out = acc.to(dt).to(tl.float32)
    if HAS_SHARED:
        sh = tl.load(sh_ptr + t * s_sht + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_SGATE:
            g = tl.load(sg_ptr + t * s_sgt).to(tl.float32)
            g = tl.sigmoid(g).to(dt).to(tl.float32)
            sh = (g * sh).to(dt).to(tl.float32)
        out = (out + sh).to(dt).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + t * s_rt + offs, mask=m, other=0.0).to(tl.float32)
        out = (r + out).to(dt).to(tl.float32)
    tl.store(out_res_ptr + t * s_ort + offs, out.to(dt), mask=m)
    var = tl.sum(out * out, axis=0) / D
    yn = (out * tl.rsqrt(var + eps)).to(dt).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * s_ot + offs, (w * yn).to(dt), mask=m)


def add_rmsnorm(y, residual, weight, eps: float, shared=None, shared_gate=None, valid=None):
    T, KK, D = y.shape
    dt = weight.dtype if residual is None else residual.dtype
    new_res = torch.empty(T, D, dtype=dt, device=y.device)
    normed = torch.empty(T, D, dtype=dt, device=y.device)
    assert y.stride(2) == 1 and (residual is None or residual.stride(1) == 1)
    dummy = new_res
    _add_rmsnorm_kernel[(T,)](
        y, residual if residual is not None else dummy, weight,
        shared if shared is not None else dummy, shared_gate if shared_gate is not None else dummy,
        valid if valid is not None else dummy, new_res, normed,
        T, D, eps, y.stride(0), y.stride(1), residual.stride(0) if residual is not None else 0,
        shared.stride(0) if shared is not None else 0, shared_gate.stride(0) if shared_gate is not None else 0,
        new_res.stride(0), normed.stride(0),
        KK=KK, HAS_RES=residual is not None, HAS_SHARED=shared is not None, HAS_SGATE=shared_gate is not None,
        HAS_VALID=valid is not None, BLOCK_D=_p2(D), num_warps=4 if D <= 4096 else 8)
    return new_res, normed


# ------------------------------------------------------------------------------------------------------------
# (q/k RMSNorm) + rotary embedding + KV-cache write at the device-side position
@triton.jit(do_not_specialize=["T"])
def _rope_cache_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, q_ptr, qn_ptr, kn_ptr,
                       T, eps, s_qkv, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_qt, s_qh,
                       HQ: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr, HAS_QKN: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)  # [0, HQ): q heads, [HQ, HQ+HKV): k heads, then v heads
    half: tl.constexpr = DH // 2
    offs = tl.arange(0, half)
    pos = tl.load(pos_ptr)
    dt = q_ptr.dtype.element_ty
    base = qkv_ptr + t * s_qkv + h * DH
    x1 = tl.load(base + offs).to(tl.float32)
    x2 = tl.load(base + half + offs).to(tl.float32)
    if h >= HQ + HKV:  # v: copy into the cache
        hv = h - HQ - HKV
        dst = v_ptr + t * s_vb + hv * s_vh + pos * s_vl
        tl.store(dst + offs, x1.to(v_ptr.dtype.element_ty))
        tl.store(dst + half + offs, x2.to(v_ptr.dtype.element_ty))
    else:
        if HAS_QKN:
            isq = h < HQ
            nw1 = tl.where(isq, tl.load(qn_ptr + offs), tl.load(kn_ptr + offs)).to(tl.float32)
            nw2 = tl.where(isq, tl.load(qn_ptr + half + offs), tl.load(kn_ptr + half + offs)).to(tl.float32)
            var = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / DH
            r = tl.rsqrt(var + eps)
            x1 = (nw1 * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            x2 = (nw2 * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        c1 = tl.load(cos_ptr + pos * DH + offs).to(tl.float32)
        c2 = tl.load(cos_ptr + pos * DH + half + offs).to(tl.float32)
        s1 = tl.load(sin_ptr + pos * DH + offs).to(tl.float32)
        s2 = tl.load(sin_ptr + pos * DH + half + offs).to(tl.float32)
        # (x * cos) + (rotate_half(x) * sin), rotate_half(x) = (-x2, x1); bf16 after each op as HF
        o1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
        if h < HQ:
            dst = q_ptr + t * s_qt + h * s_qh
        else:
            dst = k_ptr + t * s_kb + (h - HQ) * s_kh + pos * s_kl
        tl.store(dst + offs, o1)
        tl.store(dst + half + offs, o2)


def rope_cache(qkv, pos, cos, sin, keys, values, n_q: int, n_kv: int, head_dim: int,
               q_norm=None, k_norm=None, eps: float = 1e-6):
    T = qkv.shape[0]
    assert qkv.stride(1) == 1 and keys.stride(3) == 1 and values.stride(3) == 1 and cos.is_contiguous()
    q = torch.empty(T, n_q, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_cache_kernel[(T, n_q + 2 * n_kv)](
        qkv, pos, cos, sin, keys, values, q, q_norm if q_norm is not None else q,
        k_norm if k_norm is not None else q, T, eps, qkv.stride(0),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        q.stride(0), q.stride(1), HQ=n_q, HKV=n_kv, DH=head_dim, HAS_QKN=q_norm is not None, num_warps=1)
    return q


# ------------------------------------------------------------------------------------------------------------
# decode attention: one program per (row, kv head, split of the context); the query heads of a kv group
# form the rows of a tensor-core tile. Splits > 1 write partial (max, sum, acc) merged by a second kernel.
@triton.jit(do_not_specialize=["T", "chunk", "window"])
def _attn_decode_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, m_ptr, l_ptr, acc_ptr,
                        T, scaling, window, chunk, s_qt, s_qh, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_ot,
                        G: tl.constexpr, GP: tl.constexpr, DH: tl.constexpr, BLOCK_L: tl.constexpr,
                        SPLIT: tl.constexpr):
    t = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    pos = tl.load(pos_ptr)
    n = pos + 1
    lo = tl.where(window > 0, tl.maximum(n - window, 0), 0)
    start = lo + sp * chunk
    stop = tl.minimum(start + chunk, n)
    gi = tl.arange(0, GP)
    d = tl.arange(0, DH)
    gm = gi < G
    q = tl.load(q_ptr + t * s_qt + (hk * G + gi)[:, None] * s_qh + d[None, :], mask=gm[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, DH], dtype=tl.float32)
    kb = k_ptr + t * s_kb + hk * s_kh
    vb = v_ptr + t * s_vb + hk * s_vh
    for s0 in range(start, stop, BLOCK_L):
        sl = s0 + tl.arange(0, BLOCK_L)
        lm = sl < stop
        k = tl.load(kb + sl[:, None] * s_kl + d[None, :], mask=lm[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scaling  # [GP, BLOCK_L]
        s = tl.where(lm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vb + sl[:, None] * s_vl + d[None, :], mask=lm[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if not SPLIT:
        out = acc / l_i[:, None]
        tl.store(o_ptr + t * s_ot + (hk * G + gi)[:, None] * DH + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=gm[:, None])
    else:
        row = (t * tl.num_programs(1) + hk) * tl.num_programs(2) + sp
        tl.store(m_ptr + row * GP + gi, m_i)
        tl.store(l_ptr + row * GP + gi, l_i)
        tl.store(acc_ptr + (row * GP + gi)[:, None] * DH + d[None, :], acc)


@triton.jit(do_not_specialize=["splits"])
def _attn_merge_kernel(o_ptr, m_ptr, l_ptr, acc_ptr, s_ot, splits, G: tl.constexpr, GP: tl.constexpr,
                       DH: tl.constexpr):
    t = tl.program_id(0)
    hk = tl.program_id(1)
    gi = tl.arange(0, GP)
    d = tl.arange(0, DH)
    row0 = (t * tl.num_programs(1) + hk) * splits
    m = tl.full([GP], float("-inf"), dtype=tl.float32)
    for sp in range(splits):
        m = tl.maximum(m, tl.load(m_ptr + (row0 + sp) * GP + gi))
    l_tot = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, DH], dtype=tl.float32)
    for sp in range(splits):
        ms = tl.load(m_ptr + (row0 + sp) * GP + gi)
        sc = tl.where(ms == float("-inf"), 0.0, tl.exp(ms - m))
        l_tot += tl.load(l_ptr + (row0 + sp) * GP + gi) * sc
        acc += tl.load(acc_ptr + ((row0 + sp) * GP + gi)[:, None] * DH + d[None, :]) * sc[:, None]
    out = acc / l_tot[:, None]
    tl.store(o_ptr + t * s_ot + (hk * G + gi)[:, None] * DH + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(gi < G)[:, None])


def attn_decode(q, keys, values, pos, scaling: float, window: int = 0):
    T, Hq, Dh = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    GP = max(16, _p2(G))
    span = min(L, window) if window else L
    # enough programs to keep the SMs busy: split the context when rows x kv heads are few
    splits = max(1, min(int(os.environ.get("MOECG_ATTN_SPLITS", 0)) or (128 // max(1, T * Hkv)), span // 64, 16))
    chunk = triton.cdiv(span, splits)
    chunk = triton.cdiv(chunk, 64) * 64
    splits = triton.cdiv(span, chunk)
    o = torch.empty(T, Hq * Dh, dtype=q.dtype, device=q.device)
    if splits > 1:
        m = torch.empty(T * Hkv * splits, GP, dtype=torch.float32, device=q.device)
        l_ = torch.empty_like(m)
        acc = torch.empty(T * Hkv * splits, GP, Dh, dtype=torch.float32, device=q.device)
    else:
        m = l_ = acc = o
    _attn_decode_kernel[(T, Hkv, splits)](
        q, keys, values, pos, o, m, l_, acc, T, scaling, window, chunk, q.stride(0), q.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        o.stride(0), G=G, GP=GP, DH=Dh, BLOCK_L=64, SPLIT=splits > 1, num_warps=4)
    if splits > 1:
        _attn_merge_kernel[(T, Hkv)](o, m, l_, acc, o.stride(0), splits, G=G, GP=GP, DH=Dh, num_warps=4)
    return o


# ------------------------------------------------------------------------------------------------------------
# router: softmax (fp32) + top-k + optional renormalisation, one program per token
@triton.jit(do_not_specialize=["T"])
def _route_kernel(lg_ptr, idx_ptr, w_ptr, T, E, s_lt, K: tl.constexpr, NORM: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    x = tl.load(lg_ptr + t * s_lt + e, mask=em, other=float("-inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)
    p = tl.exp(x)
    p = p / tl.sum(p, axis=0)
    p = tl.where(em, p, -1.0)
    kk = tl.arange(0, K)
    vals = tl.zeros([K], dtype=tl.float32)
    ids = tl.zeros([K], dtype=tl.int64)
    for k in tl.static_range(K):
        v = tl.max(p, axis=0)
        i = tl.min(tl.where(p == v, e, BLOCK_E), axis=0)
        vals = tl.where(kk == k, v, vals)
        ids = tl.where(kk == k, i.to(tl.int64), ids)
        p = tl.where(e == i, -2.0, p)
    if NORM:
        vals = vals / tl.sum(vals, axis=0)
    tl.store(idx_ptr + t * K + kk, ids)
    tl.store(w_ptr + t * K + kk, vals.to(w_ptr.dtype.element_ty))


def route(logits, top_k: int, normalize: bool, out_dtype):
    T, E = logits.shape
    assert logits.stride(1) == 1 and top_k & (top_k - 1) == 0, "top_k must be a power of two for the Triton router"
    idx = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(T, top_k, dtype=out_dtype, device=logits.device)
    _route_kernel[(T,)](logits, idx, w, T, E, logits.stride(0), K=top_k, NORM=normalize, BLOCK_E=_p2(E),
                        num_warps=1)
    return idx, w


# ------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["T"])
def _silu_mul_kernel(gu_ptr, h_ptr, T, I, s_gt, s_ht, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    dt = h_ptr.dtype.element_ty
    g = tl.load(gu_ptr + t * s_gt + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * s_gt + I + offs, mask=m, other=0.0).to(tl.float32)
    a = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
    tl.store(h_ptr + t * s_ht + offs, (a * u).to(dt), mask=m)


def silu_mul(gu, inter: int):
    T = gu.shape[0]
    assert gu.stride(1) == 1
    h = torch.empty(T, inter, dtype=gu.dtype, device=gu.device)
    _silu_mul_kernel[(T, triton.cdiv(inter, 1024))](gu, h, T, inter, gu.stride(0), h.stride(0), BLOCK=1024,
                                                     num_warps=4)
    return h


# ------------------------------------------------------------------------------------------------------------
# dropless MoE for small token counts (decode): grid (expert, row block, column block). Each program finds the
# assignments routed to its expert by scanning the [S] expert ids (S = T*K, small at decode), so there is no
# sort or prefix-sum kernel before it; experts nobody picked exit after the scan. Weights are read once per
# (expert, row block): the GEMM tile's rows are that expert's tokens.
@triton.jit
def _rows_for(idx_ptr, valid_ptr, e, mb, S, K: tl.constexpr, HAS_VALID: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """-> (count of valid assignments to expert e, their assignment ids for rank block mb [BLOCK_M], row mask)."""
    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.zeros([BLOCK_M], dtype=tl.int32)
    base = 0
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ids = tl.load(idx_ptr + s, mask=s < S, other=-1)
        hit = ids == e
        if HAS_VALID:
            hit = hit & (tl.load(valid_ptr + s // K, mask=s < S, other=0) != 0)
        hi = hit.to(tl.int32)
        rank = tl.cumsum(hi, axis=0) - 1 + base
        sel = hit[None, :] & (rank[None, :] == r[:, None])  # [BLOCK_M, BLOCK_S]
        rows += tl.sum(tl.where(sel, s[None, :], 0), axis=1)
        base += tl.sum(hi, axis=0)
    return base, rows, r < base


@triton.jit(do_not_specialize=["S"])
def _moe_up_kernel(x_ptr, idx_ptr, valid_ptr, tw_ptr, w_ptr, h_ptr, cnt_ptr, mass_ptr, tok_ptr,
                   S, D, I, s_xt, s_we, s_wn, s_hs,
                   K: tl.constexpr, HAS_VALID: tl.constexpr, COUNT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr):
    e = tl.program_id(0)
    mb = tl.program_id(1)
    nb = tl.program_id(2)
    cnt, rows, rmask = _rows_for(idx_ptr, valid_ptr, e, mb, S, K, HAS_VALID, BLOCK_M, BLOCK_S)
    if COUNT:
        if (mb == 0) & (nb == 0):  # this expert's counters belong to this program alone: no atomics
            wsum = tl.zeros([BLOCK_S], dtype=tl.float32)
            for s0 in range(0, S, BLOCK_S):
                s = s0 + tl.arange(0, BLOCK_S)
                hit = tl.load(idx_ptr + s, mask=s < S, other=-1) == e
                if HAS_VALID:
                    hit = hit & (tl.load(valid_ptr + s // K, mask=s < S, other=0) != 0)
                wsum += tl.where(hit, tl.load(tw_ptr + s, mask=s < S, other=0.0).to(tl.float32), 0.0)
            tl.store(cnt_ptr + e, tl.load(cnt_ptr + e) + cnt)
            tl.store(mass_ptr + e, tl.load(mass_ptr + e) + tl.sum(wsum, axis=0))
            if e == 0:
                n_tok = S // K
                if HAS_VALID:
                    acc_v = tl.zeros([BLOCK_S], dtype=tl.int32)
                    for t0 in range(0, S // K, BLOCK_S):
                        tt = t0 + tl.arange(0, BLOCK_S)
                        acc_v += (tl.load(valid_ptr + tt, mask=tt < S // K, other=0) != 0).to(tl.int32)
                    n_tok = tl.sum(acc_v, axis=0)
                tl.store(tok_ptr, tl.load(tok_ptr) + n_tok)
    if cnt > mb * BLOCK_M:
        tok = rows // K
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < I
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        wg = w_ptr + e.to(tl.int64) * s_we + n[:, None] * s_wn
        wu = w_ptr + e.to(tl.int64) * s_we + (I + n)[:, None] * s_wn
        for k0 in range(0, D, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < D
            x = tl.load(x_ptr + tok[:, None] * s_xt + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
            g = tl.load(wg + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            u = tl.load(wu + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc_g = tl.dot(x, tl.trans(g), acc_g)
            acc_u = tl.dot(x, tl.trans(u), acc_u)
        dt = h_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        a = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        tl.store(h_ptr + rows[:, None] * s_hs + n[None, :], (a * u).to(dt), mask=rmask[:, None] & nm[None, :])


@triton.jit(do_not_specialize=["S"])
def _moe_down_kernel(h_ptr, idx_ptr, valid_ptr, tw_ptr, w_ptr, y_ptr, S, D, I, s_hs, s_we, s_wn, s_ys,
                     K: tl.constexpr, HAS_VALID: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr):
    e = tl.program_id(0)
    mb = tl.program_id(1)
    nb = tl.program_id(2)
    cnt, rows, rmask = _rows_for(idx_ptr, valid_ptr, e, mb, S, K, HAS_VALID, BLOCK_M, BLOCK_S)
    if cnt > mb * BLOCK_M:
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < D
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        wd = w_ptr + e.to(tl.int64) * s_we + n[:, None] * s_wn
        for k0 in range(0, I, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < I
            h = tl.load(h_ptr + rows[:, None] * s_hs + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
            w = tl.load(wd + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc = tl.dot(h, tl.trans(w), acc)
        tw = tl.load(tw_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        y = acc.to(h_ptr.dtype.element_ty).to(tl.float32) * tw[:, None]
        tl.store(y_ptr + rows[:, None] * s_ys + n[None, :], y, mask=rmask[:, None] & nm[None, :])


def _cfg(name: str, default: int) -> int:
    return int(os.environ.get(f"MOECG_MOE_{name}", default))


def moe_experts(x, idx, w, gate_up, down, valid=None, counters=None):
    T, K = idx.shape
    E, two_i, D = gate_up.shape
    inter = two_i // 2
    S = T * K
    assert x.stride(1) == 1 and gate_up.stride(2) == 1 and down.stride(2) == 1 and idx.is_contiguous()
    bm = _cfg("BLOCK_M", 16)
    m_blocks = triton.cdiv(T, bm)  # an expert gets at most one assignment per token
    h = torch.empty(S, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(T, K, D, dtype=torch.float32, device=x.device)
    if valid is not None:
        y.zero_()  # pad rows are never written by the kernels
    wc = w.contiguous()
    c = counters
    # Tiles from experiments/bench_kernels.py on an H200 (results/h200/kernels_*.md): 64x128, 4 warps, 4 stages
    # is best or within 3% for the Qwen shapes at bs 1-32; Mixtral-sized experts (I*D >= 32M) prefer 32x256.
    big = inter * D >= 32 * 2**20
    bn_up, bk_up = _cfg("UP_BLOCK_N", 32 if big else 64), _cfg("UP_BLOCK_K", 256 if big else 128)
    bn_dn, bk_dn = _cfg("DOWN_BLOCK_N", 32 if big else 64), _cfg("DOWN_BLOCK_K", 256 if big else 128)
    warps, stages = _cfg("WARPS", 4), _cfg("STAGES", 3 if big else 4)
    _moe_up_kernel[(E, m_blocks, triton.cdiv(inter, bn_up))](
        x, idx, valid if valid is not None else idx, wc, gate_up, h,
        c.routed if c is not None else h, c.routed_mass if c is not None else h, c.tokens if c is not None else h,
        S, D, inter, x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        K=K, HAS_VALID=valid is not None, COUNT=c is not None,
        BLOCK_M=bm, BLOCK_N=bn_up, BLOCK_K=bk_up, BLOCK_S=64, num_warps=warps, num_stages=stages)
    _moe_down_kernel[(E, m_blocks, triton.cdiv(D, bn_dn))](
        h, idx, valid if valid is not None else idx, wc, down, y, S, D, inter,
        h.stride(0), down.stride(0), down.stride(1), y.stride(1),
        K=K, HAS_VALID=valid is not None,
        BLOCK_M=bm, BLOCK_N=bn_dn, BLOCK_K=bk_dn, BLOCK_S=64, num_warps=warps, num_stages=stages)
    return y
