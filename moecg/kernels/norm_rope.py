"""Triton kernels of the fused decode step: residual add + RMSNorm, and q/k norm + rotary + KV-cache write.
Same signatures as `moecg.kernels.ref`'s add_rmsnorm and rope_cache.

Dims as in ref.py: T tokens, KK partial outputs summed, D hidden, Hq / Hkv query / key-value heads, Dh head dim,
R rotary dims, L cache slots.
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
from moecg.kernels.launch import dry_zeros, launch, pdl_args, pdl_enter, pos_stride
from moecg.kernels.quant import act_quant_out, quant_block, store_act_quant


# ------------------------------------------------------------------------------------------------------------
# residual add (+ routed partial sums, + gated shared expert) + RMSNorm
@triton.jit(do_not_specialize=["T"])
def _add_rmsnorm_kernel(y_ptr, res_ptr, w_ptr, sh_ptr, sg_ptr, valid_ptr, out_res_ptr, out_ptr,
                        T, D, eps, s_yt, s_yk, s_rt, s_sht, s_sgt, s_ort, s_ot,
                        KK: tl.constexpr, HAS_RES: tl.constexpr, HAS_SHARED: tl.constexpr,
                        HAS_SGATE: tl.constexpr, HAS_VALID: tl.constexpr, CAST_LAST: tl.constexpr,
                        BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = 0, PRELOAD: tl.constexpr = 0,
                        q_ptr=None, qs_ptr=None, s_qt=0, s_qs=0):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    # the PDL wait before the norm weight, or with PRELOAD after it (as moecg.kernels.gemv's kernel does)
    pdl_enter(USE_PDL * (1 - PRELOAD))
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL * PRELOAD)
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
    yn = out * tl.rsqrt(var + eps)
    if not CAST_LAST:  # Llama-style: the normalised x is rounded before the weight multiplies it
        yn = yn.to(dt).to(tl.float32)
    h = (w * yn).to(dt)
    tl.store(out_ptr + t * s_ot + offs, h, mask=m)
    if q_ptr is not None:  # quant: the row's act_quant too, for the fp8_dynamic GEMMs after it
        store_act_quant(h, t, 0, D, q_ptr, qs_ptr, s_qt, s_qs, BLOCK_D)


@dry_zeros
def add_rmsnorm(y, residual, weight, eps: float, shared=None, shared_gate=None, valid=None, cast_last: bool = False,
                out_dtype=None, quant: bool = False):
    """As ref.add_rmsnorm; quant: the normed rows' act_quant from the same program (store_act_quant), third."""
    T, KK, D = y.shape
    dt = (out_dtype or weight.dtype) if residual is None else residual.dtype
    new_res = torch.empty(T, D, dtype=dt, device=y.device)
    normed = torch.empty(T, D, dtype=dt, device=y.device)
    assert y.stride(2) == 1 and (residual is None or residual.stride(1) == 1)
    dummy = new_res
    extra, qargs = act_quant_out(T, D, y.device, quant)
    launch(_add_rmsnorm_kernel, (T,),
        y, residual if residual is not None else dummy, weight,
        shared if shared is not None else dummy, shared_gate if shared_gate is not None else dummy,
        valid if valid is not None else dummy, new_res, normed,
        T, D, eps, y.stride(0), y.stride(1), residual.stride(0) if residual is not None else 0,
        shared.stride(0) if shared is not None else 0, shared_gate.stride(0) if shared_gate is not None else 0,
        new_res.stride(0), normed.stride(0),
        KK=KK, HAS_RES=residual is not None, HAS_SHARED=shared is not None, HAS_SGATE=shared_gate is not None,
        HAS_VALID=valid is not None, CAST_LAST=cast_last, BLOCK_D=quant_block(D, quant),
        num_warps=_tiles.norm_warps(T, D, KK), **qargs, **pdl_args(y.device, preload=True))
    return (new_res, normed, *extra)


# ------------------------------------------------------------------------------------------------------------
# (q/k RMSNorm) + rotary embedding (full or partial) + (clip) + KV-cache write at the device-side position.
# One program per (row, head). Each program loads its whole head and, for the rotary dims, each element's
# rotate_half partner (a second gather of the same cache lines), so a rotary part narrower than the head (partial
# rotary) needs no power-of-two split. A norm over the whole projection (OLMoE) sums the squares of every head of
# the projection in each program: Hq*Dh elements, a few KB, re-read from L1/L2.
@triton.jit(do_not_specialize=["T"])
def _rope_cache_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, q_ptr, qn_ptr, kn_ptr,
                       T, eps, clip, s_pos, s_qkv, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_qt, s_qh,
                       HQ: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr, R: tl.constexpr,
                       HAS_QKN: tl.constexpr, NORM_FULL: tl.constexpr, HAS_CLIP: tl.constexpr,
                       USE_PDL: tl.constexpr = 0):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)  # [0, HQ): q heads, [HQ, HQ+HKV): k heads, then v heads
    d = tl.arange(0, DH)
    pos = tl.load(pos_ptr + t * s_pos)  # s_pos 0: one position for every row; 1: each row's own
    dt = q_ptr.dtype.element_ty
    row = qkv_ptr + t * s_qkv
    x = tl.load(row + h * DH + d).to(tl.float32)
    if h >= HQ + HKV:  # v: (clip and) copy into the cache
        if HAS_CLIP:
            x = tl.minimum(tl.maximum(x, -clip), clip)
        hv = h - HQ - HKV
        tl.store(v_ptr + t * s_vb + hv * s_vh + pos * s_vl + d, x.to(v_ptr.dtype.element_ty))
    else:
        half: tl.constexpr = R // 2
        rot = d < R
        partner = tl.where(d < half, d + half, d - half)  # rotate_half(x)[d] = -x[d + R/2] | x[d - R/2]
        xp = tl.load(row + h * DH + partner, mask=rot, other=0.0).to(tl.float32)
        if HAS_QKN:
            isq = h < HQ
            hl = tl.where(isq, h, h - HQ)  # head index within its projection
            if NORM_FULL:
                nh = tl.where(isq, HQ, HKV)
                p0 = tl.where(isq, 0, HQ)  # first head of this projection
                ss = tl.zeros([DH], dtype=tl.float32)
                for j in range(0, nh):
                    xj = tl.load(row + (p0 + j) * DH + d).to(tl.float32)
                    ss += xj * xj
                var = tl.sum(ss, axis=0) / (nh * DH)
                wo = hl * DH
            else:
                var = tl.sum(x * x, axis=0) / DH
                wo = 0
            r = tl.rsqrt(var + eps)
            # masked loads select the q or k weight: an unmasked load of the other one could run past its end
            mq = (h + d * 0) < HQ  # [DH]
            nw = (tl.load(qn_ptr + wo + d, mask=mq, other=0.0).to(tl.float32)
                  + tl.load(kn_ptr + wo + d, mask=~mq, other=0.0).to(tl.float32))
            nwp = (tl.load(qn_ptr + wo + partner, mask=mq & rot, other=0.0).to(tl.float32)
                   + tl.load(kn_ptr + wo + partner, mask=~mq & rot, other=0.0).to(tl.float32))
            x = (nw * (x * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xp = (nwp * (xp * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        if HAS_CLIP:
            x = tl.minimum(tl.maximum(x, -clip), clip)
            xp = tl.minimum(tl.maximum(xp, -clip), clip)
        c = tl.load(cos_ptr + pos * R + d, mask=rot, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * R + d, mask=rot, other=0.0).to(tl.float32)
        xr = tl.where(d < half, -xp, xp)
        # (x * cos) + (rotate_half(x) * sin); bf16 after each op as HF; dims past R pass through
        o = ((x * c).to(dt).to(tl.float32) + (xr * s).to(dt).to(tl.float32)).to(dt)
        o = tl.where(rot, o, x.to(dt))
        if h < HQ:
            dst = q_ptr + t * s_qt + h * s_qh
        else:
            dst = k_ptr + t * s_kb + (h - HQ) * s_kh + pos * s_kl
        tl.store(dst + d, o)


@dry_zeros
def rope_cache(qkv, pos, cos, sin, keys, values, n_q: int, n_kv: int, head_dim: int,
               q_norm=None, k_norm=None, eps: float = 1e-6, clip: float | None = None):
    T = qkv.shape[0]
    R = cos.shape[-1]
    assert qkv.stride(1) == 1 and keys.stride(3) == 1 and values.stride(3) == 1 and cos.is_contiguous()
    assert R % 2 == 0 and R <= head_dim and sin.shape == cos.shape
    q = torch.empty(T, n_q, head_dim, dtype=qkv.dtype, device=qkv.device)
    full = q_norm is not None and q_norm.numel() != head_dim
    launch(_rope_cache_kernel, (T, n_q + 2 * n_kv),
        qkv, pos, cos, sin, keys, values, q, q_norm if q_norm is not None else q,
        k_norm if k_norm is not None else q, T, eps, float(clip or 0.0), pos_stride(pos, T), qkv.stride(0),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        q.stride(0), q.stride(1), HQ=n_q, HKV=n_kv, DH=head_dim, R=R, HAS_QKN=q_norm is not None,
        NORM_FULL=full, HAS_CLIP=clip is not None, num_warps=1,
        **pdl_args(qkv.device))
    return q
