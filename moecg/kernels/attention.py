"""Triton kernels of the fused decode step's attention: one query token per row against its KV cache, the context
split over programs and merged inside the kernel (or, past MERGE_INLINE_MAX splits, by a merge kernel after it).
Same signature as `moecg.kernels.ref.attn_decode`, plus the split choices a benchmark may pass.

Dims as in ref.py: T tokens, Hq / Hkv query / key-value heads, G = Hq / Hkv query heads per kv head (GP: padded to a
power of two >= 16, the rows of a tensor-core tile), Dh head dim, L cache slots.
Every kernel is graph-safe: no host syncs, device-side positions and counters, fixed launch grids per batch size
(programs with no work exit at once); integer sizes that change with the batch are not specialised
(`do_not_specialize`), so one compilation serves every bucket. Rounding follows HF's modules: bf16 after each
elementwise op that HF runs in bf16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moecg.kernels.launch import (dry_zeros, last_arrival, launch, p2, pdl_args, pdl_enter, pos_stride,
                                   split_sems)
from moecg.kernels.quant import act_quant_out, store_act_quant_tile


# decode attention: one program per (row, kv head, split of the context); the query heads of a kv group
# form the rows of a tensor-core tile. Splits > 1 write partial (max, sum, acc); the split of a (row, kv head)
# that finishes last (an arrival counter) merges them in split order, in the same kernel, so the result does not
# depend on which split ends last (MERGE 1), or _attn_merge_kernel does, after it (MERGE 2). Attention sinks
# (GPT-OSS) are one more logit per head with no value: they start the running (max, sum) at (sink, 1) -- in the
# merge when the context is split -- and never touch the accumulator.
# EAGER rounds the scores as HF's eager attention does (model dtype after QK and after the scaling); with sinks it
# also rounds the max-subtracted logits, which needs the final max first: TWO_PASS reads K twice (max, then the
# softmax with that max fixed), in one split.
@triton.jit
def _scores(q, k, scaling, dt: tl.constexpr, EAGER: tl.constexpr):
    s = tl.dot(q, tl.trans(k))  # [GP, BLOCK_L] fp32
    if EAGER:
        return (s.to(dt).to(tl.float32) * scaling).to(dt).to(tl.float32)
    return s * scaling


@triton.jit(do_not_specialize=["T", "chunk", "window"])
def _attn_decode_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, sink_ptr, o_ptr, m_ptr, l_ptr, acc_ptr, sem_ptr,
                        T, scaling, window, chunk, s_pos, s_qt, s_qh, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_ot,
                        G: tl.constexpr, GP: tl.constexpr, DH: tl.constexpr, BLOCK_L: tl.constexpr,
                        SPLIT: tl.constexpr, HAS_SINK: tl.constexpr, EAGER: tl.constexpr,
                        TWO_PASS: tl.constexpr, SUB_ROUND: tl.constexpr, SB: tl.constexpr = 1,
                        USE_PDL: tl.constexpr = 0, MERGE: tl.constexpr = 1, oq_ptr=None, os_ptr=None, s_oqt=0,
                        s_ost=0):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    pos = tl.load(pos_ptr + t * s_pos)  # s_pos 0: one position for every row; 1: each row's own
    n = pos + 1
    lo = tl.where(window > 0, tl.maximum(n - window, 0), 0)
    start = lo + sp * chunk
    stop = tl.minimum(start + chunk, n)
    gi = tl.arange(0, GP)
    d = tl.arange(0, DH)
    gm = gi < G
    q = tl.load(q_ptr + t * s_qt + (hk * G + gi)[:, None] * s_qh + d[None, :], mask=gm[:, None], other=0.0)
    dt = q_ptr.dtype.element_ty
    kb = k_ptr + t * s_kb + hk * s_kh
    vb = v_ptr + t * s_vb + hk * s_vh
    if TWO_PASS:  # HF eager with sinks: softmax(round(cat(scores, sink) - max)), the max over keys and sink
        sk = tl.load(sink_ptr + hk * G + gi, mask=gm, other=0.0).to(tl.float32)
        m = sk
        for s0 in range(start, stop, BLOCK_L):
            sl = s0 + tl.arange(0, BLOCK_L)
            lm = sl < stop
            k = tl.load(kb + sl[:, None] * s_kl + d[None, :], mask=lm[:, None], other=0.0)
            s = tl.where(lm[None, :], _scores(q, k, scaling, dt, EAGER), float("-inf"))
            m = tl.maximum(m, tl.max(s, axis=1))
        xs = sk - m
        if SUB_ROUND:
            xs = xs.to(dt).to(tl.float32)
        l_i = tl.exp(xs)
        acc = tl.zeros([GP, DH], dtype=tl.float32)
        for s0 in range(start, stop, BLOCK_L):
            sl = s0 + tl.arange(0, BLOCK_L)
            lm = sl < stop
            k = tl.load(kb + sl[:, None] * s_kl + d[None, :], mask=lm[:, None], other=0.0)
            x = _scores(q, k, scaling, dt, EAGER) - m[:, None]
            if SUB_ROUND:
                x = x.to(dt).to(tl.float32)
            p = tl.where(lm[None, :], tl.exp(x), 0.0)
            l_i += tl.sum(p, axis=1)
            v = tl.load(vb + sl[:, None] * s_vl + d[None, :], mask=lm[:, None], other=0.0)
            acc += tl.dot(p.to(v.dtype), v)
        out = acc / l_i[:, None]
        store_out(o_ptr, out, t, s_ot, hk * G + gi, gm, d, DH, oq_ptr, os_ptr, s_oqt, s_ost)
    else:
        # SPLIT: only the splits that hold keys at this step's position run (n_act of them, device-side: the grid is
        # fixed by the cache's capacity); when one does (a short span), it writes the output itself, no merge
        n_act = 1
        if SPLIT:
            n_act = tl.cdiv(n - lo, chunk)
        direct = n_act == 1
        if sp < n_act:
            if HAS_SINK:
                sk = tl.load(sink_ptr + hk * G + gi, mask=gm, other=0.0).to(tl.float32)
                m_i = tl.where(direct, sk, float("-inf"))  # (the merge adds the sink otherwise)
                l_i = tl.where(direct, 1.0, 0.0) + tl.zeros([GP], dtype=tl.float32)
            else:
                m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
                l_i = tl.zeros([GP], dtype=tl.float32)
            acc = tl.zeros([GP, DH], dtype=tl.float32)
            for s0 in range(start, stop, BLOCK_L):
                sl = s0 + tl.arange(0, BLOCK_L)
                lm = sl < stop
                k = tl.load(kb + sl[:, None] * s_kl + d[None, :], mask=lm[:, None], other=0.0)
                s = _scores(q, k, scaling, dt, EAGER)  # [GP, BLOCK_L]
                s = tl.where(lm[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(vb + sl[:, None] * s_vl + d[None, :], mask=lm[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            if direct:
                out = acc / l_i[:, None]
                store_out(o_ptr, out, t, s_ot, hk * G + gi, gm, d, DH, oq_ptr, os_ptr, s_oqt, s_ost)
            else:  # store this split's partials; the last active split of the (row, kv head) merges them all
                head = t * tl.num_programs(1) + hk
                row0 = head * tl.num_programs(2)
                tl.store(m_ptr + (row0 + sp) * GP + gi, m_i)
                tl.store(l_ptr + (row0 + sp) * GP + gi, l_i)
                tl.store(acc_ptr + ((row0 + sp) * GP + gi)[:, None] * DH + d[None, :], acc, mask=gm[:, None])
                if MERGE == 1:  # else _attn_merge_kernel, launched after this kernel, merges
                    if last_arrival(sem_ptr, head, n_act):  # the others' partials are visible
                        _attn_merge(o_ptr, m_ptr, l_ptr, acc_ptr, sink_ptr, s_ot, t, hk, row0, n_act, G, GP, DH,
                                    HAS_SINK, SB, oq_ptr, os_ptr, s_oqt, s_ost)
                        tl.store(sem_ptr + head, 0)  # zero again for the next call (and graph replay)


@triton.jit
def _attn_merge(o_ptr, m_ptr, l_ptr, acc_ptr, sink_ptr, s_ot, t, hk, row0, splits, G: tl.constexpr,
                GP: tl.constexpr, DH: tl.constexpr, HAS_SINK: tl.constexpr, SB: tl.constexpr, oq_ptr=None,
                os_ptr=None, s_oqt=0, s_ost=0):
    """Merge the `splits` partial (max, sum, acc) of one (row, kv head), in split order, into its output heads.
    Run by the split that finishes last; its loads go to L2 (.cg), where the other splits' stores are. SB splits'
    loads are unrolled together (issued before their adds: fewer serial L2 round trips); the adds stay in order."""
    gi = tl.arange(0, GP)
    gm = gi < G
    d = tl.arange(0, DH)
    m = tl.full([GP], float("-inf"), dtype=tl.float32)
    if HAS_SINK:
        sink = tl.load(sink_ptr + hk * G + gi, mask=gm, other=0.0).to(tl.float32)
        m = sink
    for s0 in range(0, splits, SB):
        for j in tl.static_range(SB):
            ok = gm & (gi * 0 + s0 + j < splits)  # [GP]
            m = tl.maximum(m, tl.load(m_ptr + (row0 + s0 + j) * GP + gi, mask=ok, other=float("-inf"),
                                      cache_modifier=".cg"))
    m = tl.where(gm, m, 0.0)  # pad heads: finite (no inf - inf below); not stored
    l_tot = tl.zeros([GP], dtype=tl.float32)
    if HAS_SINK:
        l_tot = tl.exp(sink - m)
    acc = tl.zeros([GP, DH], dtype=tl.float32)
    for s0 in range(0, splits, SB):
        for j in tl.static_range(SB):
            ok = gm & (gi * 0 + s0 + j < splits)
            r = row0 + s0 + j
            ms = tl.load(m_ptr + r * GP + gi, mask=ok, other=float("-inf"), cache_modifier=".cg")
            sc = tl.where(ms == float("-inf"), 0.0, tl.exp(ms - m))
            l_tot += tl.load(l_ptr + r * GP + gi, mask=ok, other=0.0, cache_modifier=".cg") * sc
            acc += tl.load(acc_ptr + (r * GP + gi)[:, None] * DH + d[None, :], mask=ok[:, None], other=0.0,
                           cache_modifier=".cg") * sc[:, None]
    out = acc / tl.where(gm, l_tot, 1.0)[:, None]
    store_out(o_ptr, out, t, s_ot, hk * G + gi, gm, d, DH, oq_ptr, os_ptr, s_oqt, s_ost)


@triton.jit
def store_out(o_ptr, out, t, s_ot, hh, hm, d, DH: tl.constexpr, oq_ptr, os_ptr, s_oqt, s_ost):
    """Row t's outputs out [H, DH] (fp32) of heads hh [H] (masked by hm) in o's dtype; with oq_ptr (quant) also
    their act_quant, per head's 128-column blocks (DH a multiple of 128; quant.store_act_quant_tile, a head a
    segment)."""
    o = out.to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + t * s_ot + hh[:, None] * DH + d[None, :], o, mask=hm[:, None])
    if oq_ptr is not None:
        store_act_quant_tile(o, t, hh * DH, hm, oq_ptr, os_ptr, s_oqt, s_ost, DH)


@triton.jit(do_not_specialize=["T", "window", "chunk"])
def _attn_merge_kernel(pos_ptr, sink_ptr, o_ptr, m_ptr, l_ptr, acc_ptr, T, window, chunk, s_pos, s_ot,
                       G: tl.constexpr, DH: tl.constexpr, GP: tl.constexpr, HAS_SINK: tl.constexpr,
                       SPLITS: tl.constexpr, SP: tl.constexpr, SB: tl.constexpr, USE_PDL: tl.constexpr = 0,
                       oq_ptr=None, os_ptr=None, s_oqt=0, s_ost=0):
    """Merge 2: one program per (row, query head) merges its kv head's split partials (nothing where one split was
    active, which wrote its output itself). It reads the head's [splits] max and sum at once and its [splits, DH]
    partial values SB splits a load, so the splits' loads are in flight together, where the in-kernel merge (merge 1)
    of the last split waits on L2 once per SB splits, for all G heads of its kv head in one program."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(pos_ptr + t * s_pos) + 1
    lo = tl.where(window > 0, tl.maximum(n - window, 0), 0)
    n_act = tl.cdiv(n - lo, chunk)
    if n_act > 1:
        hk = h // G
        row0 = (t * tl.cdiv(tl.num_programs(1), G) + hk) * SPLITS
        d = tl.arange(0, DH)
        sink = 0.0
        if HAS_SINK:
            sink = tl.load(sink_ptr + h).to(tl.float32)
        out = merge_splits(m_ptr, l_ptr, acc_ptr, row0, n_act, h % G, d, d < DH, sink, GP, DH, SP, SB, HAS_SINK)
        hh = h + tl.arange(0, 1)
        store_out(o_ptr, out[None, :], t, s_ot, hh, hh >= 0, d, DH, oq_ptr, os_ptr, s_oqt, s_ost)


@triton.jit
def merge_splits(m_ptr, l_ptr, acc_ptr, row0, n_act, r, c, cm, sink, RS: tl.constexpr, AS: tl.constexpr,
                 SP: tl.constexpr, SB: tl.constexpr, HAS_SINK: tl.constexpr):
    """One head's merged output [c] from the partials of its n_act splits: split j's max and sum at
    (row0 + j) * RS + r, its values at that row times AS plus c (cm: the real columns). The [SP] maxes and sums in one
    load, the values SB splits a load, the splits of a load summed at once (the decode attention's and MLA's merge
    kernels, MERGE 2). HAS_SINK: one more logit (sink) with no value, in the max and the sum."""
    j = tl.arange(0, SP)
    ms = tl.load(m_ptr + (row0 + j) * RS + r, mask=j < n_act, other=float("-inf"), cache_modifier=".cg")  # [SP]
    m = tl.max(ms, axis=0)
    if HAS_SINK:
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    sc = tl.where(ms == float("-inf"), 0.0, tl.exp(ms - m))
    l_tot = tl.sum(tl.load(l_ptr + (row0 + j) * RS + r, mask=j < n_act, other=0.0, cache_modifier=".cg") * sc, axis=0)
    if HAS_SINK:
        l_tot += tl.exp(sink - m)
    acc = tl.zeros(c.shape, dtype=tl.float32)
    for s0 in range(0, n_act, SB):
        jb = s0 + tl.arange(0, SB)
        jm = jb < n_act
        mb = tl.load(m_ptr + (row0 + jb) * RS + r, mask=jm, other=float("-inf"), cache_modifier=".cg")  # [SB]
        sb = tl.where(mb == float("-inf"), 0.0, tl.exp(mb - m))
        a = tl.load(acc_ptr + ((row0 + jb) * RS + r)[:, None] * AS + c[None, :], mask=jm[:, None] & cm[None, :],
                    other=0.0, cache_modifier=".cg")  # [SB, C]
        acc += tl.sum(a * sb[:, None], axis=0)
    return acc / tl.where(l_tot > 0, l_tot, 1.0)


MERGE_TILE = 4096  # partial values per load of _attn_merge_kernel (SB splits x DH, fp32)
# Splits above which the merge kernel merges (merge 2), else the last split in the kernel (merge 1). Measured at 64
# splits: Qwen3-30B-A3B 12 layers, one row at a 30k-token context, 1.433 -> 1.322 ms a step (H100,
# experiments/results/step_variants/variants_qwen3_long_am.md); 17-32 splits (Mixtral's one row) not measured.
MERGE_INLINE_MAX = 32


LONG_SPAN = 4096  # slots above which attn_splits aims at more programs (long contexts)


def attn_splits(T: int, Hkv: int, span: int) -> int:
    """How many programs share one (row, kv head)'s context: enough programs to keep the SMs busy when rows x kv
    heads are few, at least 64 slots each. Up to LONG_SPAN slots: ~128 programs, at most 16 splits (the choice
    every short-context table was measured with). Longer: ~256 programs, at most 128 splits. Chosen from
    experiments/bench_attn_splits.py on the H200 (experiments/results/attn_splits/attn_splits.md; 32k
    slots at position 30000, T 1 and 8, 4-16 kv heads, one uncaptured call per timing): the best split count or
    within 2% of it in five of the six cases, where the short rule was 1.00-1.23x slower; Qwen3-30B-A3B at T=1
    (4 kv heads) 0.116 ms against the best 0.092 (128 splits) and the short rule's 0.129. Inside the captured step
    that does not hold: aiming a single row at ~512 programs (128 splits there) made the 30k-token step slower,
    1.32 -> 1.55 ms on Qwen3-30B-A3B (12 layers) and 2.13 -> 2.25 ms on Mixtral (8 layers) (commit dca50e9,
    experiments/results/long_context/history/dca50e9/), so the rule stays at ~256."""
    if span > LONG_SPAN:
        return max(1, min(256 // max(1, T * Hkv), span // 64, 128))
    return short_splits(T, Hkv, span)


def short_splits(T: int, groups: int, span: int) -> int:
    """attn_splits' rule up to LONG_SPAN slots: ~128 programs over T rows x `groups` (kv heads, or MLA's head
    blocks), at least 64 slots each, at most 16 splits."""
    return max(1, min(128 // max(1, T * groups), span // 64, 16))


def attn_merge_block(GP: int, Dh: int) -> int:
    """Splits whose loads the merge unrolls together (SB; the adds stay one split at a time, in order): 4, fewer where
    4 [GP, Dh] fp32 tiles would pass 8192 elements (64 registers a thread at 4 warps). On the H200, Qwen3-30B-A3B 12
    layers at a 30k-token context (64 splits), the step went 1.261 -> 1.241 (2) -> 1.228 ms (4), the same bits
    (bench_step_variants.py at 64 splits); one [SB, GP, Dh] tile loaded at once was 1.7x slower
    (experiments/results/step_variants/history/7fee360/variants_qwen3_long.md)."""
    return max(1, min(4, 8192 // (GP * Dh)))


@dry_zeros
def attn_decode(q, keys, values, pos, scaling: float, window: int = 0, sinks=None, eager: bool = False,
                quant: bool = False, splits: int | None = None, merge_block: int | None = None,
                merge: int | None = None):
    """splits: programs per (row, kv head) context (None: attn_splits' choice; benchmarks pass their own).
    merge_block: splits per load of the in-kernel merge (None: attn_merge_block's choice). merge: 1 the last split
    merges in the kernel, 2 _attn_merge_kernel after it (None: 2 above MERGE_INLINE_MAX splits). quant: the output's
    act_quant too, second (as ref.attn_decode's), from the programs that write the output (store_out)."""
    if merge not in (None, 1, 2):
        raise ValueError(f"attn_decode merge={merge!r}: 1 (in the kernel) or 2 (the merge kernel)")
    T, Hq, Dh = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    GP = max(16, p2(G))
    span = min(L, window) if window else L
    splits = max(1, min(splits or attn_splits(T, Hkv, span), max(1, span // 64)))
    chunk = triton.cdiv(span, splits)
    chunk = triton.cdiv(chunk, 64) * 64
    splits = triton.cdiv(span, chunk)
    two_pass = eager and sinks is not None
    if two_pass:
        splits, chunk = 1, span
    merge = merge or (2 if splits > MERGE_INLINE_MAX else 1)
    o = torch.empty(T, Hq * Dh, dtype=q.dtype, device=q.device)
    assert not quant or Dh % 128 == 0, "attn_decode quant: per head, a head dim that is a multiple of 128"
    extra, qargs = act_quant_out(T, Hq * Dh, q.device, quant, ("oq_ptr", "os_ptr", "s_oqt", "s_ost"))
    if splits > 1:
        m = torch.empty(T * Hkv * splits, GP, dtype=torch.float32, device=q.device)
        l_ = torch.empty_like(m)
        acc = torch.empty(T * Hkv * splits, GP, Dh, dtype=torch.float32, device=q.device)
    else:
        m = l_ = acc = o
    sk = sinks if sinks is not None else o
    assert sinks is None or (sinks.is_contiguous() and sinks.numel() == Hq)
    sems = split_sems(q.device, T * Hkv, "attn") if splits > 1 and merge == 1 else o
    launch(_attn_decode_kernel, (T, Hkv, splits),
        q, keys, values, pos, sk, o, m, l_, acc, sems, T, scaling, window, chunk, pos_stride(pos, T), q.stride(0),
        q.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        o.stride(0), G=G, GP=GP, DH=Dh, BLOCK_L=64, SPLIT=splits > 1, HAS_SINK=sinks is not None, EAGER=eager,
        TWO_PASS=two_pass, SUB_ROUND=two_pass and sinks.dtype == q.dtype,
        SB=merge_block or attn_merge_block(GP, Dh), MERGE=merge, num_warps=4, **qargs, **pdl_args(q.device))
    if splits > 1 and merge == 2:
        SP = p2(splits)
        launch(_attn_merge_kernel, (T, Hq), pos, sk, o, m, l_, acc, T, window, chunk, pos_stride(pos, T), o.stride(0),
               G=G, DH=Dh, GP=GP, HAS_SINK=sinks is not None, SPLITS=splits, SP=SP,
               SB=min(SP, max(1, MERGE_TILE // Dh)), num_warps=4, **qargs, **pdl_args(q.device))
    return (o, *extra) if quant else o
