"""Triton kernels of the `capacity` dispatcher on the fused decode step: slots chosen on the device, drop counters in
the kernels, the expert GEMMs on the kept assignments. Reference: `moecg.kernels.ref.capacity_experts`.

Dims: T tokens (rows run: a padded bucket), K top-k (KP: next power of two), S = T*K assignments, E experts,
C slots per expert (the bucket's capacity: the buffers), D hidden, I expert intermediate.
Three launches, no sort, no prefix-sum kernel, no host sync:
  slots [E]:            each program ranks its expert's tokens: under `probs` by combine weight, equal weights to the
                        earlier token (the dispatcher's stable sort), under `position` by token order. The first
                        `cap` keep a slot (slot r = rank r), where cap is Megatron's capacity of the real (valid)
                        tokens, computed in the kernel from the row mask with capacity_on_device's float64 ops.
                        It writes the slot table [E, C], the kept count [E], a keep flag per assignment, zeroes the
                        output rows it drops (and pad rows), and adds its expert's counters (and C applied, tokens).
  up   [E, C/BM, I/BN]: the dropless kernels' GEMM tile (moe_gemm.up_tile) on the slot table's rows, at the tiles the
                        table gives C rows in the weights' format (tiles.capacity_tiles; at decode sizes C is 1-4: one
                        row a program on the CUDA cores where the format's rules say so); program
                        (0, 0, 0) counts the tokens that lost all K (every expert's keep flags are written by then).
  down [E, C/BM, D/BN]: moe_gemm.down_tile, times the combine weight (renormalised over the token's kept
                        assignments if asked, from the keep flags).
The first slot block of every expert runs even when nothing was kept: every expert's weights are read once per call,
what capacity's padded GEMM costs (`reads_all_experts`, so the floor counts all E). Further slot blocks run only when
their slots are filled. Ranking is T x T comparisons per expert in BLOCK_T chunks: nothing at decode sizes.
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from moecg.moe_math import DROP_POLICIES, capacity
from moecg.kernels.launch import dry_zeros, launch, p2
from moecg.kernels.moe_gemm import ExpertArgs, down_tile, quant_k, up_tile
from moecg.kernels.quant import a8_inputs
from moecg.kernels.tiles import capacity_tiles

BLOCK_T = 64  # tokens per ranking chunk: one chunk at every decode bucket up to 64


def capacity_factor_bits(capacity_factor: float) -> int:
    """The capacity factor's float64 bits as an int64 kernel argument (Triton passes a Python float as fp32)."""
    return struct.unpack("<q", struct.pack("<d", float(capacity_factor)))[0]


@triton.jit
def _capacity(valid_ptr, T, E, cf_bits, min_cap, K: tl.constexpr, HAS_VALID: tl.constexpr, BLOCK_T: tl.constexpr):
    """-> (real tokens n, C of n): capacity_on_device's float64 ops in its order, so the same C for every n."""
    if HAS_VALID:
        acc = tl.zeros([BLOCK_T], dtype=tl.int32)
        for t0 in range(0, T, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            acc += (tl.load(valid_ptr + t, mask=t < T, other=0) != 0).to(tl.int32)
        n = tl.sum(acc, axis=0)
    else:
        n = T + 0
    cf = cf_bits.to(tl.int64).to(tl.float64, bitcast=True)  # a Python float arrives as fp32: passed as its bits
    nf = n.to(tl.float64)
    c = tl.ceil(nf * K / E * cf)
    c = tl.minimum(tl.maximum(c, min_cap.to(tl.float64)), nf)
    return n, tl.maximum(c, 1.0).to(tl.int32)


@triton.jit
def _scores(idx_ptr, w_ptr, valid_ptr, e, t, T, K: tl.constexpr, KP: tl.constexpr, POSITION: tl.constexpr,
            HAS_VALID: tl.constexpr):
    """Tokens t [BLOCK_T] against expert e -> (hit: t routes to e, pad rows too; routed: hit by a real token;
    s: the assignment id t*K + k; weight fp32; score: the policy's ranking key, higher first)."""
    k = tl.arange(0, KP)
    m = (t < T)[:, None] & (k < K)[None, :]
    a = t[:, None] * K + k[None, :]  # [BLOCK_T, KP]
    on = (tl.load(idx_ptr + a, mask=m, other=-1) == e) & m
    hit = tl.max(on.to(tl.int32), axis=1) > 0
    s = tl.sum(tl.where(on, a, 0), axis=1)
    wt = tl.sum(tl.where(on, tl.load(w_ptr + a, mask=m, other=0.0).to(tl.float32), 0.0), axis=1)
    routed = hit
    if HAS_VALID:
        routed = routed & (tl.load(valid_ptr + t, mask=t < T, other=0) != 0)
    if POSITION:
        score = (T - t).to(tl.float32)
    else:
        score = wt
    return hit, routed, s, wt, score


@triton.jit
def _ranks(idx_ptr, w_ptr, valid_ptr, e, t, T, K: tl.constexpr, KP: tl.constexpr, POSITION: tl.constexpr,
           HAS_VALID: tl.constexpr, BLOCK_T: tl.constexpr):
    """Tokens t [BLOCK_T] -> (hit, routed, s, weight, rank): rank among expert e's routed tokens, higher score
    first, equal scores to the earlier token (a stable descending sort's order)."""
    hit, routed, s, wt, score = _scores(idx_ptr, w_ptr, valid_ptr, e, t, T, K, KP, POSITION, HAS_VALID)
    if T <= BLOCK_T:  # every decode bucket: the chunk is all the tokens, compare it with itself
        before = (score[None, :] > score[:, None]) | ((score[None, :] == score[:, None]) & (t[None, :] < t[:, None]))
        rank = tl.sum((routed[None, :] & before).to(tl.int32), axis=1)  # [BLOCK_T, BLOCK_T] -> [BLOCK_T]
    else:
        rank = tl.zeros([BLOCK_T], dtype=tl.int32)
        for j0 in range(0, T, BLOCK_T):
            tj = j0 + tl.arange(0, BLOCK_T)
            _, rj, _, _, sj = _scores(idx_ptr, w_ptr, valid_ptr, e, tj, T, K, KP, POSITION, HAS_VALID)
            before = (sj[None, :] > score[:, None]) | ((sj[None, :] == score[:, None]) & (tj[None, :] < t[:, None]))
            rank += tl.sum((rj[None, :] & before).to(tl.int32), axis=1)
    return hit, routed, s, wt, rank


@triton.jit(do_not_specialize=["T", "C", "cf_bits", "min_cap"])
def _cap_slots_kernel(idx_ptr, valid_ptr, tw_ptr, slot_ptr, nk_ptr, keep_ptr, y_ptr,
                      cnt_ptr, drop_ptr, mass_ptr, dmass_ptr, cap_ptr, calls_ptr, tok_ptr,
                      T, E, C, cf_bits, min_cap, D, s_ys, K: tl.constexpr, KP: tl.constexpr, POSITION: tl.constexpr,
                      HAS_VALID: tl.constexpr, COUNT: tl.constexpr, COUNT_CAP: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    e = tl.program_id(0)  # this expert's slots, flags and counters belong to this program alone: no atomics
    n_valid, cap = _capacity(valid_ptr, T, E, cf_bits, min_cap, K, HAS_VALID, BLOCK_T)
    n_r = tl.zeros([BLOCK_T], dtype=tl.int32)
    n_d = tl.zeros([BLOCK_T], dtype=tl.int32)
    m_r = tl.zeros([BLOCK_T], dtype=tl.float32)
    m_d = tl.zeros([BLOCK_T], dtype=tl.float32)
    for i0 in range(0, T, BLOCK_T):
        t = i0 + tl.arange(0, BLOCK_T)
        hit, routed, s, wt, rank = _ranks(idx_ptr, tw_ptr, valid_ptr, e, t, T, K, KP, POSITION, HAS_VALID, BLOCK_T)
        kept = routed & (rank < cap)  # cap <= C: in the table
        tl.store(slot_ptr + e * C + rank, s, mask=kept)
        tl.store(keep_ptr + s, kept.to(tl.int8), mask=hit)
        gone = hit & ~kept  # dropped, or a pad row: the down kernel never writes these rows
        if tl.sum(gone.to(tl.int32), axis=0) > 0:
            for d0 in range(0, D, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                tl.store(y_ptr + s[:, None] * s_ys + d[None, :], tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32),
                         mask=gone[:, None] & (d < D)[None, :])
        dropped = routed & ~kept
        n_r += routed.to(tl.int32)
        n_d += dropped.to(tl.int32)
        m_r += tl.where(routed, wt, 0.0)
        m_d += tl.where(dropped, wt, 0.0)
    n_routed = tl.sum(n_r, axis=0)
    tl.store(nk_ptr + e, tl.minimum(n_routed, cap))
    if COUNT:
        tl.store(cnt_ptr + e, tl.load(cnt_ptr + e) + n_routed)
        tl.store(drop_ptr + e, tl.load(drop_ptr + e) + tl.sum(n_d, axis=0))
        tl.store(mass_ptr + e, tl.load(mass_ptr + e) + tl.sum(m_r, axis=0))
        tl.store(dmass_ptr + e, tl.load(dmass_ptr + e) + tl.sum(m_d, axis=0))
        if e == 0:
            tl.store(tok_ptr, tl.load(tok_ptr) + n_valid)
            if COUNT_CAP:
                tl.store(cap_ptr, tl.load(cap_ptr) + cap)
                tl.store(calls_ptr, tl.load(calls_ptr) + 1)


@triton.jit
def _slot_rows(slot_ptr, nk_ptr, e, mb, C, BLOCK_M: tl.constexpr):
    """-> (assignments expert e keeps, the ids in its slots [mb*BLOCK_M, (mb+1)*BLOCK_M), row mask)."""
    n_kept = tl.load(nk_ptr + e)
    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < n_kept
    return n_kept, tl.load(slot_ptr + e * C + r, mask=rmask, other=0), rmask


@triton.jit(do_not_specialize=["T", "C"])
def _cap_up_kernel(x_ptr, valid_ptr, w_ptr, b_ptr, h_ptr, slot_ptr, nk_ptr, keep_ptr, lost_ptr,
                   T, C, D, I, s_xt, s_we, s_wj, s_wk, s_be, s_hs, alpha, limit,
                   K: tl.constexpr, KP: tl.constexpr, HAS_VALID: tl.constexpr, COUNT: tl.constexpr,
                   JM: tl.constexpr, JU: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                   ws_ptr, s_se, s_sj, s_sk, QROWS: tl.constexpr, MX: tl.constexpr,
                   PAIRED: tl.constexpr = 0, A8: tl.constexpr = 0, q_ptr=None, qs_ptr=None, s_qt=0, s_qs=0,
                   KN: tl.constexpr = 0):
    e = tl.program_id(0)
    mb = tl.program_id(1)
    nb = tl.program_id(2)
    if COUNT:
        if (e == 0) & (mb == 0) & (nb == 0):  # every expert's keep flags are written (the slots kernel ran)
            k = tl.arange(0, KP)
            lost = tl.zeros([BLOCK_T], dtype=tl.int32)
            for t0 in range(0, T, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                m = (t < T)[:, None] & (k < K)[None, :]
                flags = tl.load(keep_ptr + t[:, None] * K + k[None, :], mask=m, other=0).to(tl.int32)
                real = t < T
                if HAS_VALID:
                    real = real & (tl.load(valid_ptr + t, mask=t < T, other=0) != 0)
                lost += (real & (tl.sum(flags, axis=1) == 0)).to(tl.int32)
            tl.store(lost_ptr, tl.load(lost_ptr) + tl.sum(lost, axis=0))
    n_kept, rows, rmask = _slot_rows(slot_ptr, nk_ptr, e, mb, C, BLOCK_M)
    # slot block 0 runs with no row kept too: every expert's weights once, as a padded GEMM reads them
    if (mb == 0) | (n_kept > mb * BLOCK_M):
        dt = h_ptr.dtype.element_ty
        hv, n, nm = up_tile(x_ptr, rows, rmask, e, nb, w_ptr, b_ptr, D, I, s_xt, s_we, s_wj, s_wk, s_be, alpha,
                             limit, dt, K, JM, JU, HAS_BIAS, ACT, BLOCK_M, BLOCK_N, BLOCK_K, ws_ptr, s_se, s_sj, s_sk,
                             QROWS, MX, PAIRED, A8, q_ptr, qs_ptr, s_qt, s_qs, KN)
        tl.store(h_ptr + rows[:, None] * s_hs + n[None, :], hv.to(dt), mask=rmask[:, None] & nm[None, :])


@triton.jit(do_not_specialize=["C"])
def _cap_down_kernel(h_ptr, tw_ptr, w_ptr, b_ptr, y_ptr, slot_ptr, nk_ptr, keep_ptr,
                     C, D, I, s_hs, s_we, s_wn, s_wk, s_be, s_ys, K: tl.constexpr, KP: tl.constexpr,
                     RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, ws_ptr, s_se, s_sj, s_sk, QROWS: tl.constexpr, MX: tl.constexpr,
                     A8: tl.constexpr = 0, q_ptr=None, qs_ptr=None, s_qt=0, s_qs=0, KN: tl.constexpr = 0):
    e = tl.program_id(0)
    mb = tl.program_id(1)
    nb = tl.program_id(2)
    n_kept, rows, rmask = _slot_rows(slot_ptr, nk_ptr, e, mb, C, BLOCK_M)
    if (mb == 0) | (n_kept > mb * BLOCK_M):
        o, n, nm = down_tile(h_ptr, rows, rmask, e, nb, w_ptr, b_ptr, D, I, s_hs, s_we, s_wn, s_wk, s_be,
                              h_ptr.dtype.element_ty, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, ws_ptr, s_se, s_sj, s_sk,
                              QROWS, MX, A8, q_ptr, qs_ptr, s_qt, s_qs, KN)
        tw = tl.load(tw_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        if RENORM:  # rescaled to the token's original total over its kept assignments, from the keep flags
            k = tl.arange(0, KP)
            a = (rows // K)[:, None] * K + k[None, :]  # [BLOCK_M, KP]
            m = rmask[:, None] & (k < K)[None, :]
            wk = tl.load(tw_ptr + a, mask=m, other=0.0).to(tl.float32)
            kk = tl.load(keep_ptr + a, mask=m, other=0) != 0
            kept_sum = tl.sum(tl.where(kk, wk, 0.0), axis=1)
            tw = tw * tl.math.div_rn(tl.sum(wk, axis=1), tl.maximum(kept_sum, 1e-20))
        tl.store(y_ptr + rows[:, None] * s_ys + n[None, :], o * tw[:, None], mask=rmask[:, None] & nm[None, :])


@dry_zeros
def capacity_experts(x, idx, w, gate_up, down, valid=None, counters=None, *, capacity_factor: float,
                     drop_policy: str = "probs", min_capacity: int = 1, renormalize: bool = False, spec=None,
                     gate_up_bias=None, down_bias=None, tiles=None, xq=None):
    """As ref.capacity_experts: [T, K, D] fp32 (dropped assignments and pad rows zero); counters updated in place. xq:
    as moe.moe_experts'."""
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy={drop_policy!r}: choose one of {DROP_POLICIES}")
    T, K = idx.shape
    D = x.shape[1]
    a = ExpertArgs(gate_up, down, spec, gate_up_bias, down_bias)
    gate_up, down = a.gate_up, a.down
    E, inter = a.num_experts, a.inter
    S = T * K
    assert x.stride(1) == 1 and idx.is_contiguous()
    C = capacity(T, K, E, capacity_factor, min_capacity)  # buffer slots: the padded shape's C bounds every threshold
    # a slot block holds at most C rows: the table's tiles for C
    t = tiles or capacity_tiles(C, D, inter, E, a.weights, a.activations)
    m_blocks = triton.cdiv(C, t.block_m)
    h = torch.empty(S, inter, dtype=x.dtype, device=x.device)  # [S, I] rows of kept assignments only
    y = torch.empty(T, K, D, dtype=torch.float32, device=x.device)  # every row written: kept by down, rest by slots
    keep = torch.empty(S, dtype=torch.int8, device=x.device)  # [S] 1: holds a slot (written for every assignment)
    slots = torch.empty(E, C, dtype=torch.int32, device=x.device)  # [E, C] assignment in slot c, c < n_kept[e]
    n_kept = torch.empty(E, dtype=torch.int32, device=x.device)  # [E]
    wc = w.contiguous()
    c = counters
    cnt = c is not None
    count_cap = cnt and c.capacity is not None
    v = valid if valid is not None else idx
    has_valid = valid is not None
    KP = p2(K)
    launch(_cap_slots_kernel, (E,),
        idx, v, wc, slots, n_kept, keep, y, c.routed if cnt else h, c.dropped if cnt else h,
        c.routed_mass if cnt else h, c.dropped_mass if cnt else h, c.capacity if count_cap else h,
        c.calls if count_cap else h, c.tokens if cnt else h,
        T, E, C, capacity_factor_bits(capacity_factor), int(min_capacity), D, y.stride(1), K=K, KP=KP,
        POSITION=drop_policy == "position", HAS_VALID=has_valid, COUNT=cnt, COUNT_CAP=count_cap,
        BLOCK_T=BLOCK_T, BLOCK_D=128, num_warps=4)
    launch(_cap_up_kernel, (E, m_blocks, triton.cdiv(inter, t.up_n)),
        x, v, gate_up, gate_up_bias if gate_up_bias is not None else h, h, slots, n_kept, keep,
        c.lost_all if cnt else h, T, C, D, inter, x.stride(0), gate_up.stride(0), a.s_wj, a.s_wk,
        gate_up_bias.stride(0) if gate_up_bias is not None else 0, h.stride(0), a.alpha, a.limit,
        K=K, KP=KP, HAS_VALID=has_valid, COUNT=cnt, JM=a.jm, JU=a.ju, PAIRED=a.paired(t),
        HAS_BIAS=gate_up_bias is not None, ACT=a.act,
        BLOCK_M=t.block_m, BLOCK_N=t.up_n, BLOCK_K=quant_k(t.up_k, a.up_scale, t.block_m), BLOCK_T=BLOCK_T,
        num_warps=t.warps, num_stages=t.stages, **a.up_scale, **a8_inputs(x, a.up_scale["A8"], t.block_m, xq), KN=a.kn)
    launch(_cap_down_kernel, (E, m_blocks, triton.cdiv(D, t.down_n)),
        h, wc, down, down_bias if down_bias is not None else h, y, slots, n_kept, keep,
        C, D, inter, h.stride(0), down.stride(0), a.s_dn, a.s_dk,
        down_bias.stride(0) if down_bias is not None else 0, y.stride(1), K=K, KP=KP, RENORM=bool(renormalize),
        HAS_BIAS=down_bias is not None, BLOCK_M=t.block_m, BLOCK_N=t.down_n,
        BLOCK_K=quant_k(t.down_k, a.down_scale, t.block_m),
        num_warps=t.warps, num_stages=t.stages, **a.down_scale, **a8_inputs(h, a.down_scale["A8"], t.block_m),
        KN=a.kn)
    return y
