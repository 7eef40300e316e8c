"""Triton kernels of the dropless routed experts at decode sizes (`dispatch=fused`): two launches, no sort. Same
signature as `moecg.kernels.ref.moe_experts`. The GEMM tiles (up_tile, up_sums / up_act, down_sums /
down_round) and the layout arguments (ExpertArgs) live in moecg.kernels.moe_gemm, shared with the capacity kernels.

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
from moecg.kernels.launch import dry_zeros, k_split, last_arrival, launch, pdl_args, pdl_enter, split_sems
from moecg.kernels.moe_gemm import ExpertArgs, down_round, down_sums, quant_k, up_act, up_sums, up_tile
from moecg.kernels.moe_grid import work
from moecg.kernels.quant import a8_inputs, w_tile


# dropless MoE for small token counts (decode): grid (expert, row block, column block). Each program finds the
# assignments routed to its expert by scanning the [S] expert ids (S = T*K, small at decode), so there is no
# sort or prefix-sum kernel before it; experts nobody picked exit after the scan. Weights are read once per
# (expert, row block): the GEMM tile's rows are that expert's tokens. One-row tiles (block_m 1) run on a row grid
# instead (assignment, column block): each program its own assignment's row, so no program of an empty row block is
# launched; an expert with several rows reads its weights once per row. The grids: moecg.kernels.moe_grid; the GEMM
# tiles, every weight layout and format: moecg.kernels.moe_gemm.
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
            tile = (p * tl.num_programs(1) + mb) * (tl.num_programs(2) // SPLIT) + nb
            if last_arrival(sem_ptr, tile, SPLIT):  # the tile's last program: the other partials are visible
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
            acc, n, nm = down_sums(h_ptr, rows, rmask, e, nb, w_ptr, D, I, 0, I, s_hs, s_we, s_wn, s_wk,
                                   BLOCK_M, BLOCK_N, BLOCK_K, ws_ptr, s_se, s_sj, s_sk, QROWS, MX, w0, PRE, A8,
                                   q_ptr, qs_ptr, s_qt, s_qs, KN)
            o = down_round(acc, e, n, nm, b_ptr, s_be, dt, HAS_BIAS)
            tw = tl.load(tw_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            tl.store(y_ptr + rows[:, None] * s_ys + n[None, :], o * tw[:, None], mask=rmask[:, None] & nm[None, :])
        else:
            k_lo = ks * k_steps * BLOCK_K  # a multiple of BLOCK_K the compiler sees (aligned, pipelined loads)
            k_hi = tl.minimum(k_lo + k_steps * BLOCK_K, I)
            acc, n, nm = down_sums(h_ptr, rows, rmask, e, nb, w_ptr, D, I, k_lo, k_hi,
                                   s_hs, s_we, s_wn, s_wk, BLOCK_M, BLOCK_N, BLOCK_K, ws_ptr, s_se, s_sj, s_sk, QROWS,
                                   MX, w0, PRE, A8, q_ptr, qs_ptr, s_qt, s_qs, KN)
            om = rmask[:, None] & nm[None, :]
            tile_off = rows[:, None] * D + n[None, :]  # part: [SPLIT, S, D] fp32
            tl.store(part_ptr + ks * S * D + tile_off, acc, mask=om)
            tile = (p * tl.num_programs(1) + mb) * (tl.num_programs(2) // SPLIT) + nb
            if last_arrival(sem_ptr, tile, SPLIT):  # the tile's last program: the other partials are visible
                tot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for j in tl.static_range(SPLIT):
                    tot += tl.load(part_ptr + j * S * D + tile_off, mask=om, other=0.0, cache_modifier=".cg")
                o = down_round(tot, e, n, nm, b_ptr, s_be, dt, HAS_BIAS)
                tw = tl.load(tw_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
                tl.store(y_ptr + rows[:, None] * s_ys + n[None, :], o * tw[:, None], mask=om)
                tl.store(sem_ptr + tile, 0)


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
    if t.up_split > 1 and a.weights != "full":
        raise ValueError(f"MoeTiles.up_split={t.up_split}: the up kernel splits bf16 / fp32 experts only, not "
                         f"{a.weights} ones; use up_split=1")
    up_steps, up_split = k_split(D, t.up_split, up_k)  # K steps a split, splits
    up_part = up_sems = None
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
    k_steps, split = k_split(inter, split, down_k)  # K steps a split, splits
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
