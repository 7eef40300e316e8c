"""Which rows a program of the dropless MoE kernels (moecg.kernels.moe) runs, on each of their grids, found on the
device from the step's [S] expert ids (S = T*K assignments, K top-k), with no sort or prefix-sum kernel before them:
  expert grid  program p is expert p; its row blocks mb of BLOCK_M of the expert's assignments (_rows_for);
  slot grid    program p is assignment p; its expert's row blocks, run by the expert's first valid assignment
               (_expert_of), when the assignments are fewer than the experts;
  row grid     program p is assignment p and runs its own row (one-row tiles, MoeTiles.block_m 1).
A row's K ids are distinct experts (as every top-k router gives them): an expert's row blocks are sized by the tokens.
"""
from __future__ import annotations

import triton
import triton.language as tl


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


@triton.jit
def _expert_of(idx_ptr, valid_ptr, p, S, by_slot, K: tl.constexpr, HAS_VALID: tl.constexpr,
               BLOCK_S: tl.constexpr):
    """-> (the expert program p runs, whether it runs it). Expert grid (by_slot 0): program p is expert p. Slot
    grid (by_slot 1, used when the S assignments are fewer than the experts, so most expert programs would only
    exit): program p is assignment p, and runs its expert iff p is that expert's first valid assignment."""
    e = p
    lead = p >= 0
    if by_slot:
        e = tl.load(idx_ptr + p).to(tl.int32)
        first = S
        for s0 in range(0, S, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            hit = tl.load(idx_ptr + s, mask=s < S, other=-1) == e
            if HAS_VALID:
                hit = hit & (tl.load(valid_ptr + s // K, mask=s < S, other=0) != 0)
            first = tl.minimum(first, tl.min(tl.where(hit, s, S), axis=0))
        lead = first == p
    return e, lead


@triton.jit
def work(idx_ptr, valid_ptr, p, mb, S, by_slot, K: tl.constexpr, HAS_VALID: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_S: tl.constexpr, BY_ROW: tl.constexpr):
    """Program (p, mb)'s work -> (expert e, lead: e's first valid assignment or expert program, rows [BLOCK_M], row
    mask, go: it has rows to run). Row grid (BY_ROW, one-row tiles, by_slot 1): its row is assignment p itself, run
    where p is a real token's; else the rows of e's row block mb (_rows_for), run by the lead."""
    e, lead = _expert_of(idx_ptr, valid_ptr, p, S, by_slot, K, HAS_VALID, BLOCK_S)
    if BY_ROW:
        rows = p + tl.arange(0, 1)
        rmask = rows < S
        if HAS_VALID:
            rmask = rmask & (tl.load(valid_ptr + rows // K, mask=rows < S, other=0) != 0)
        go = tl.max(rmask.to(tl.int32), axis=0) > 0
    else:
        cnt, rows, rmask = _rows_for(idx_ptr, valid_ptr, e, mb, S, K, HAS_VALID, BLOCK_M, BLOCK_S)
        go = lead & (cnt > mb * BLOCK_M)
    return e, lead, rows, rmask, go
