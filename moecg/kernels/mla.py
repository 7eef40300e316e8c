"""Triton kernels of the fused decode step's multi-head latent attention (DeepSeek-V2/V3), in the absorbed form:
the latent written once per token, the scores and the values read in the latent space. Same signatures as
`moecg.kernels.ref.mla_rope_cache` / `mla_attn_decode` (plus the split choice a benchmark may pass).

Dims: T tokens (one per row), H heads (HB of them per program, HP = HB padded rows of a tensor-core tile), C latent
dims (kv_lora_rank; CP padded to a power of two), R rotary dims (qk_rope_head_dim; RP padded), Dn the non-rotary
q dims, L cache slots. The cache holds the normalised latent [C] ("keys") and the roped shared key [R] ("values")
per token, as transformers' MLA writes them, so the HF prefill and this decode share one cache.
Graph-safe as the other kernels: device-side positions (one for every row, or each row's own), fixed grids per
batch size, programs with no work exit at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moecg.kernels import tiles as _tiles
from moecg.kernels.attention import merge_splits, short_splits
from moecg.kernels.launch import (dry_zeros, last_arrival, launch, p2, pdl_args, pdl_enter, pos_stride,
                                   split_sems)

_LAYOUT = {"halves": 0, "pairs_to_halves": 1, "pairs": 2}


# ------------------------------------------------------------------------------------------------------------
# latent RMSNorm + rotary of the shared key and of every head's q_pe + cache write. One program per (row, job):
# job < H ropes q_pe of head `job`; job H normalises the latent, ropes the shared key and writes both to the cache.
# Rotary in the tables' dtype (ROUND: bf16 tables, each product and sum rounded as HF's bf16 rotary does; fp32
# tables: DeepSeek-V2's complex product in fp32, rounded once).
@triton.jit
def _rotate(x_ptr, c, s, i, LAYOUT: tl.constexpr, RH: tl.constexpr, ROUND: tl.constexpr, tdt: tl.constexpr):
    """(first, second) output halves of one rotary vector at x_ptr, i = arange(RHP) masked to RH frequencies."""
    m = i < RH
    if LAYOUT == 0:
        x1 = tl.load(x_ptr + i, mask=m, other=0.0)
        x2 = tl.load(x_ptr + RH + i, mask=m, other=0.0)
    else:
        x1 = tl.load(x_ptr + 2 * i, mask=m, other=0.0)
        x2 = tl.load(x_ptr + 2 * i + 1, mask=m, other=0.0)
    x1 = x1.to(tdt).to(tl.float32)
    x2 = x2.to(tdt).to(tl.float32)
    if ROUND:
        a = ((x1 * c).to(tdt).to(tl.float32) - (x2 * s).to(tdt).to(tl.float32)).to(tdt).to(tl.float32)
        b = ((x2 * c).to(tdt).to(tl.float32) + (x1 * s).to(tdt).to(tl.float32)).to(tdt).to(tl.float32)
    else:
        a = x1 * c - x2 * s
        b = x2 * c + x1 * s
    return a, b


@triton.jit
def _store_rotated(o_ptr, a, b, i, LAYOUT: tl.constexpr, RH: tl.constexpr):
    m = i < RH
    dt = o_ptr.dtype.element_ty
    if LAYOUT == 2:
        tl.store(o_ptr + 2 * i, a.to(dt), mask=m)
        tl.store(o_ptr + 2 * i + 1, b.to(dt), mask=m)
    else:
        tl.store(o_ptr + i, a.to(dt), mask=m)
        tl.store(o_ptr + RH + i, b.to(dt), mask=m)


@triton.jit(do_not_specialize=["T"])
def _mla_rope_cache_kernel(kv_ptr, q_ptr, pos_ptr, cos_ptr, sin_ptr, lat_ptr, kr_ptr, w_ptr, qpe_ptr, T, eps,
                           s_pos, s_kvt, s_qt, s_lb, s_ll, s_rb, s_rl, s_pt, s_ph,
                           H: tl.constexpr, DN: tl.constexpr, C: tl.constexpr, CP: tl.constexpr,
                           RH: tl.constexpr, RHP: tl.constexpr, LAYOUT: tl.constexpr, ROUND: tl.constexpr,
                           USE_PDL: tl.constexpr = 0):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    j = tl.program_id(1)
    pos = tl.load(pos_ptr + t * s_pos)
    i = tl.arange(0, RHP)
    tdt = cos_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos * RH + i, mask=i < RH, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * RH + i, mask=i < RH, other=0.0).to(tl.float32)
    if j < H:  # q_pe of head j: q[t, j*(DN + 2RH) + DN:]
        a, b = _rotate(q_ptr + t * s_qt + j * (DN + 2 * RH) + DN, c, s, i, LAYOUT, RH, ROUND, tdt)
        _store_rotated(qpe_ptr + t * s_pt + j * s_ph, a, b, i, LAYOUT, RH)
    else:  # the latent (RMSNorm, as HF's: fp32 statistics, cast, times the weight) and the shared key
        d = tl.arange(0, CP)
        dm = d < C
        x = tl.load(kv_ptr + t * s_kvt + d, mask=dm, other=0.0)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / C
        y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(w_ptr + d, mask=dm, other=0.0)
        lat = (w * y).to(lat_ptr.dtype.element_ty)
        tl.store(lat_ptr + t * s_lb + pos * s_ll + d, lat, mask=dm)
        a, b = _rotate(kv_ptr + t * s_kvt + C, c, s, i, LAYOUT, RH, ROUND, tdt)
        _store_rotated(kr_ptr + t * s_rb + pos * s_rl, a, b, i, LAYOUT, RH)


@dry_zeros
def mla_rope_cache(kv, q, pos, cos, sin, latents, rope_keys, kv_norm, eps: float, n_heads: int, nope: int,
                   layout: str):
    T = kv.shape[0]
    C, R = latents.shape[-1], rope_keys.shape[-1]
    assert kv.stride(1) == 1 and q.stride(1) == 1 and latents.stride(3) == 1 and rope_keys.stride(3) == 1
    assert cos.is_contiguous() and sin.shape == cos.shape and cos.shape[-1] * 2 == R and kv_norm.is_contiguous()
    q_pe = torch.empty(T, n_heads, R, dtype=q.dtype, device=q.device)
    launch(_mla_rope_cache_kernel, (T, n_heads + 1),
        kv, q, pos, cos, sin, latents, rope_keys, kv_norm, q_pe, T, eps, pos_stride(pos, T), kv.stride(0),
        q.stride(0), latents.stride(0), latents.stride(2), rope_keys.stride(0), rope_keys.stride(2),
        q_pe.stride(0), q_pe.stride(1), H=n_heads, DN=nope, C=C, CP=p2(C), RH=R // 2, RHP=max(2, p2(R // 2)),
        LAYOUT=_LAYOUT[layout], ROUND=cos.dtype != torch.float32, num_warps=1, **pdl_args(kv.device))
    return q_pe


# ------------------------------------------------------------------------------------------------------------
# absorbed MLA decode attention: one program per (row, block of HB heads, split of the context). Every head
# reads the same latent rows (one shared "kv head" of C + R dims), so a block of heads is the rows of the
# tensor-core tiles: scores [HP, BLOCK_L] = q_lat . latent^T + q_pe . rope_key^T, then acc [HP, CP] += p . latent.
# Splits > 1 store partial (max, sum, acc). MERGE 1: the split of a (row, head block) that finishes last (an arrival
# counter) merges them in split order, in the same kernel, as the standard decode attention does. MERGE 2: the
# partials are merged by _mla_merge_kernel, one program per (row, head, MC latent dims): the merge reads
# splits x HP x CP fp32, too much for one program when the splits are many.
@triton.jit(do_not_specialize=["T", "chunk"])
def _mla_attn_kernel(ql_ptr, qp_ptr, lat_ptr, kr_ptr, pos_ptr, o_ptr, m_ptr, l_ptr, acc_ptr, sem_ptr,
                     T, scaling, chunk, s_pos, s_qlt, s_qlh, s_qpt, s_qph, s_lb, s_ll, s_rb, s_rl, s_ot, s_oh,
                     H: tl.constexpr, HB: tl.constexpr, HP: tl.constexpr, C: tl.constexpr, CP: tl.constexpr,
                     R: tl.constexpr, RP: tl.constexpr, BLOCK_L: tl.constexpr, SPLIT: tl.constexpr,
                     USE_PDL: tl.constexpr = 0, MERGE: tl.constexpr = 1):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(pos_ptr + t * s_pos) + 1
    start = sp * chunk
    stop = tl.minimum(start + chunk, n)
    n_act = 1
    if SPLIT:
        n_act = tl.cdiv(n, chunk)
    if sp < n_act:
        hi = tl.arange(0, HP)
        h = hb * HB + hi
        hm = (hi < HB) & (h < H)
        c = tl.arange(0, CP)
        cm = c < C
        r = tl.arange(0, RP)
        rm = r < R
        ql = tl.load(ql_ptr + t * s_qlt + h[:, None] * s_qlh + c[None, :], mask=hm[:, None] & cm[None, :], other=0.0)
        qp = tl.load(qp_ptr + t * s_qpt + h[:, None] * s_qph + r[None, :], mask=hm[:, None] & rm[None, :], other=0.0)
        lb = lat_ptr + t * s_lb
        rb = kr_ptr + t * s_rb
        m_i = tl.full([HP], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([HP], dtype=tl.float32)
        acc = tl.zeros([HP, CP], dtype=tl.float32)
        for s0 in range(start, stop, BLOCK_L):
            sl = s0 + tl.arange(0, BLOCK_L)
            lm = sl < stop
            lat = tl.load(lb + sl[:, None] * s_ll + c[None, :], mask=lm[:, None] & cm[None, :], other=0.0)
            kr = tl.load(rb + sl[:, None] * s_rl + r[None, :], mask=lm[:, None] & rm[None, :], other=0.0)
            s = (tl.dot(ql, tl.trans(lat)) + tl.dot(qp, tl.trans(kr))) * scaling  # [HP, BLOCK_L] fp32
            s = tl.where(lm[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat)
            m_i = m_new
        om = hm[:, None] & cm[None, :]
        if n_act == 1:
            out = acc / l_i[:, None]
            tl.store(o_ptr + t * s_ot + h[:, None] * s_oh + c[None, :], out.to(o_ptr.dtype.element_ty), mask=om)
        else:
            blk = t * tl.num_programs(1) + hb
            row0 = blk * tl.num_programs(2)
            tl.store(m_ptr + (row0 + sp) * HP + hi, m_i)
            tl.store(l_ptr + (row0 + sp) * HP + hi, l_i)
            tl.store(acc_ptr + ((row0 + sp) * HP + hi)[:, None] * CP + c[None, :], acc)
            if MERGE == 1:
                if last_arrival(sem_ptr, blk, n_act):  # every other split's partials are visible; merge in split order
                    _mla_merge(m_ptr, l_ptr, acc_ptr, o_ptr + t * s_ot, row0, n_act, h, hi, hm, c, cm, s_oh, HP, CP, CP)
                    tl.store(sem_ptr + blk, 0)  # zero again for the next call (and graph replay)


@triton.jit
def _mla_merge(m_ptr, l_ptr, acc_ptr, o_ptr, row0, n_act, h, hi, hm, c, cm, s_oh, HP: tl.constexpr,
               CP: tl.constexpr, NC: tl.constexpr):
    """Merge n_act splits' partials (rows row0.., [HP] max and sum, [HP, CP] acc; c: the latent dims this program
    writes, NC of them) in split order into o [H, C] (row stride s_oh)."""
    m = tl.full([HP], float("-inf"), dtype=tl.float32)
    for j in range(0, n_act):
        m = tl.maximum(m, tl.load(m_ptr + (row0 + j) * HP + hi, cache_modifier=".cg"))
    m = tl.where(m == float("-inf"), 0.0, m)
    l_tot = tl.zeros([HP], dtype=tl.float32)
    acc = tl.zeros([HP, NC], dtype=tl.float32)
    for j in range(0, n_act):
        ms = tl.load(m_ptr + (row0 + j) * HP + hi, cache_modifier=".cg")
        sc = tl.where(ms == float("-inf"), 0.0, tl.exp(ms - m))
        l_tot += tl.load(l_ptr + (row0 + j) * HP + hi, cache_modifier=".cg") * sc
        acc += tl.load(acc_ptr + ((row0 + j) * HP + hi)[:, None] * CP + c[None, :], cache_modifier=".cg") * sc[:, None]
    out = acc / tl.where(l_tot > 0, l_tot, 1.0)[:, None]
    tl.store(o_ptr + h[:, None] * s_oh + c[None, :], out.to(o_ptr.dtype.element_ty), mask=hm[:, None] & cm[None, :])


@triton.jit(do_not_specialize=["T", "chunk"])
def _mla_merge_kernel(pos_ptr, o_ptr, m_ptr, l_ptr, acc_ptr, T, chunk, s_pos, s_ot, s_oh, H: tl.constexpr,
                      HB: tl.constexpr, HP: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, MC: tl.constexpr,
                      SPLITS: tl.constexpr, SP: tl.constexpr, SB: tl.constexpr, USE_PDL: tl.constexpr = 0):
    """One program per (row, head, MC latent dims): the merge of MERGE 2 (nothing where one split was active, which
    wrote its output itself). Each program reads its head's [splits] max and sum at once and its [splits, MC] partial
    values SB splits a load (every split at once up to MlaTiles.merge_tile values), so the splits' loads are in
    flight together: a loop of one split a load waits on L2 once per split, which at 64 splits took 15 of the 48 us
    of V2-Lite's one-row call at 30k slots (H100, results/mla_attn/)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    n_act = tl.cdiv(tl.load(pos_ptr + t * s_pos) + 1, chunk)
    if n_act > 1:
        row0 = (t * tl.cdiv(H, HB) + h // HB) * SPLITS
        c = tl.program_id(2) * MC + tl.arange(0, MC)
        cm = c < C
        out = merge_splits(m_ptr, l_ptr, acc_ptr, row0, n_act, h % HB, c, cm, 0.0, HP, CP, SP, SB, False)
        tl.store(o_ptr + t * s_ot + h * s_oh + c, out.to(o_ptr.dtype.element_ty), mask=cm)


SHORT_SPAN = 256
MERGE_INLINE_MAX = 8  # splits up to which the last split merges in the kernel (MERGE 1); more: _mla_merge_kernel


def mla_splits(T: int, head_blocks: int, span: int) -> int:
    """Programs per (row, head block) context. Up to SHORT_SPAN slots, the standard decode attention's short rule
    (~128 programs, >= 64 slots each, <= 16 splits). Longer, >= 128 slots a split, at most 128 splits, over ~128
    programs while rows x head blocks are under 8, else ~256. With the merge kernel one program a head, each split's
    partials cost a [heads, C] fp32 write and read, so where one head block reads the latent (V2-Lite, 16 heads) one
    program an SM beat two: from experiments/bench_mla_attn.py on an H100 (results/mla_attn/), V2-Lite at 30k slots,
    the best of 16-256 splits at T 1 / 2 / 4 was 128 / 64 / 32. At T 8 the kernel alone was 5% faster at 16 splits
    than 32, but the captured 27-layer step 6% slower (10.23 against 9.64 ms, PDL's early launches beside 128
    programs; results/long_mla/), so from 8 rows x head blocks ~256 as before."""
    if span <= SHORT_SPAN:
        return short_splits(T, head_blocks, span)
    work = max(1, T * head_blocks)
    return max(1, min((128 if work < 8 else 256) // work, span // 128, 128))


@dry_zeros
def mla_attn_decode(q_lat, q_pe, latents, rope_keys, pos, scaling: float, splits: int | None = None,
                    tiles=None, merge: int | None = None):
    """splits: programs per (row, head block) context (None: mla_splits' choice). tiles: a MlaTiles (None:
    tiles.mla_tiles' choice). merge: 1 in the kernel, 2 a merge kernel (None: 1 up to MERGE_INLINE_MAX splits)."""
    T, H, C = q_lat.shape
    R, L = rope_keys.shape[-1], latents.shape[2]
    assert q_lat.stride(2) == 1 and q_pe.stride(2) == 1 and latents.stride(3) == 1 and rope_keys.stride(3) == 1
    tl_ = tiles or _tiles.mla_tiles(T, H, C, L)
    HB = min(tl_.heads, p2(H))
    HP = max(16, HB)
    n_hb = triton.cdiv(H, HB)
    splits = max(1, min(splits or mla_splits(T, n_hb, L), max(1, L // 64)))
    chunk = triton.cdiv(triton.cdiv(L, splits), 64) * 64
    splits = triton.cdiv(L, chunk)
    if merge not in (None, 1, 2):
        raise ValueError(f"mla_attn_decode merge={merge!r}: 1 (in the kernel) or 2 (the merge kernel)")
    merge = merge or (1 if splits <= MERGE_INLINE_MAX else 2)
    CP = p2(C)
    o = torch.empty(T, H, C, dtype=q_lat.dtype, device=q_lat.device)
    if splits > 1:
        m = torch.empty(T * n_hb * splits, HP, dtype=torch.float32, device=q_lat.device)
        l_ = torch.empty_like(m)
        acc = torch.empty(T * n_hb * splits, HP, CP, dtype=torch.float32, device=q_lat.device)
        sems = split_sems(q_lat.device, T * n_hb, "mla") if merge == 1 else m
    else:
        m = l_ = acc = sems = o
    launch(_mla_attn_kernel, (T, n_hb, splits),
        q_lat, q_pe, latents, rope_keys, pos, o, m, l_, acc, sems, T, scaling, chunk, pos_stride(pos, T),
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), latents.stride(0), latents.stride(2),
        rope_keys.stride(0), rope_keys.stride(2), o.stride(0), o.stride(1),
        H=H, HB=HB, HP=HP, C=C, CP=CP, R=R, RP=max(16, p2(R)), BLOCK_L=tl_.block_l, SPLIT=splits > 1,
        MERGE=merge, num_warps=tl_.warps, num_stages=tl_.stages, **pdl_args(q_lat.device, tl_.pdl_trigger))
    if splits > 1 and merge == 2:
        SP = p2(splits)
        SB = min(SP, max(1, tl_.merge_tile // 16))  # every split in one load up to merge_tile // 16 of them
        MC = min(CP, max(16, tl_.merge_tile // SB))
        launch(_mla_merge_kernel, (T, H, CP // MC), pos, o, m, l_, acc, T, chunk, pos_stride(pos, T),
               o.stride(0), o.stride(1), H=H, HB=HB, HP=HP, C=C, CP=CP, MC=MC, SPLITS=splits, SP=SP, SB=SB,
               num_warps=tl_.merge_warps, **pdl_args(q_lat.device))
    return o
