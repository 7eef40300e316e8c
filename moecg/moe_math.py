"""MoE arithmetic that the dispatchers (moecg.dispatch) and the fused-step kernels (moecg.kernels) share: the capacity
formula, slot assignment, kept weights and the drop-counter updates. Pure device ops, no host sync, no imports of
either side (Megatron keeps the same pieces in moe_utils.py, below both its router and its dispatcher).

Dims: T tokens, K top-k, E experts, C capacity per expert.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

DROP_POLICIES = ("probs", "position")


# -- routing counts ------------------------------------------------------------------------------------------------
def route_counts(idx, valid, num_experts: int):
    """idx [T, K] -> (masked idx [T, K] with pad rows sent to sentinel E, per-expert counts [E] int64)."""
    if valid is not None:
        idx = torch.where(valid[:, None], idx, torch.full_like(idx, num_experts))  # [T, K]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=idx.device)
    # scatter_add instead of bincount/one_hot: both of those sync with the host on CUDA.
    counts.scatter_add_(0, idx.reshape(-1), torch.ones_like(idx.reshape(-1)))
    return idx, counts[:num_experts]  # [T, K], [E]


def routed_mass(idx_masked, w, num_experts: int):
    mass = torch.zeros(num_experts + 1, dtype=torch.float32, device=w.device)
    mass.scatter_add_(0, idx_masked.reshape(-1), w.reshape(-1).float())
    return mass[:num_experts]  # [E]


def count_valid(valid, num_tokens: int, device):
    if valid is None:
        # a fill kernel, not torch.tensor(): a host-to-device copy cannot be captured
        return torch.full((), num_tokens, dtype=torch.int64, device=device)
    return valid.sum()


# -- capacity --------------------------------------------------------------------------------------------------------
def capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float, min_capacity: int = 1) -> int:
    """C = ceil(T*K*cf / E) (Megatron's get_capacity on T*K assignments), clamped to [min_capacity, T]."""
    c = math.ceil(num_tokens * top_k / num_experts * capacity_factor)
    return max(1, min(max(c, min_capacity), num_tokens))


def capacity_on_device(n_valid: torch.Tensor, top_k: int, num_experts: int, capacity_factor: float,
                       min_capacity: int = 1) -> torch.Tensor:
    """`capacity` of a device scalar token count, without a host sync: the same float64 ops in the same order as
    the host formula, so both give the same C for every n (tested)."""
    c = torch.ceil(n_valid.to(torch.float64) * top_k / num_experts * capacity_factor)
    c = torch.maximum(c, torch.full_like(c, float(min_capacity)))
    c = torch.minimum(c, n_valid.to(torch.float64))
    return torch.clamp(c, min=1.0).to(torch.int64)  # []


def capacity_slots(idx, w, valid, num_experts: int, cap: int, drop_policy: str, cap_used: torch.Tensor | None = None):
    """Which assignments keep a slot.

    idx [T, K], w [T, K], valid [T] | None -> (slot_token [E, C] token index per slot, slot_ok [E, C] bool,
    routed [T, E] bool, kept [T, E] bool, probs [T, E] fp32). Pure device ops: a sort and a static slice.
    cap: the buffer's slots per expert; cap_used (device scalar <= cap, default cap): how many of them may be
    filled, i.e. the capacity of the real tokens when the batch is padded.
    """
    T = idx.shape[0]
    routed = torch.zeros(T, num_experts + 1, dtype=torch.bool, device=idx.device)
    routed.scatter_(1, idx, True)
    routed = routed[:, :num_experts]  # [T, E]
    if valid is not None:
        routed = routed & valid[:, None]
    probs = torch.zeros(T, num_experts, dtype=torch.float32, device=idx.device)
    probs.scatter_(1, idx.clamp(max=num_experts - 1), w.float())  # [T, E] (sentinel ids never used below)
    if drop_policy == "probs":
        score = probs  # keep each expert's highest-probability tokens (Megatron's "probs")
    elif drop_policy == "position":
        # earliest token first: a descending score T - t
        score = (T - torch.arange(T, device=idx.device, dtype=torch.float32))[:, None].expand(T, num_experts)
    else:
        raise ValueError(f"dispatch.drop_policy={drop_policy!r}: choose one of {DROP_POLICIES}")
    score = torch.where(routed, score, -1.0)  # [T, E]; unrouted and pad rows rank last
    # A stable sort, not topk: equal weights (identical rows, e.g. a sliding window over repeated tokens) go to the
    # earlier token, so a tie is broken the same way whether or not pad rows follow (topk's order for ties is not).
    top, slot_token = torch.sort(score, dim=0, descending=True, stable=True)  # [T, E]
    top, slot_token = top[:cap], slot_token[:cap]  # [C, E]
    slot_ok = top >= 0  # [C, E]
    if cap_used is not None:
        # sorted descending, so the first cap_used slots hold exactly the real batch's top-C choice
        slot_ok = slot_ok & (torch.arange(cap, device=idx.device)[:, None] < cap_used)  # [C, E]
    kept = torch.zeros(T, num_experts, dtype=torch.bool, device=idx.device)
    kept.scatter_(0, slot_token, slot_ok)  # [T, E]
    return slot_token.t(), slot_ok.t(), routed, kept, probs


class Slots(NamedTuple):
    """One call's slot assignment (`assign_slots`)."""

    buffer: int  # C: slots per expert the buffers hold, from the (padded) token count
    n_valid: torch.Tensor  # [] int64 real tokens
    cap: int | torch.Tensor  # the drop threshold: C, or the real tokens' capacity (device scalar) when padded
    slot_token: torch.Tensor  # [E, C]
    slot_ok: torch.Tensor  # [E, C] bool
    routed: torch.Tensor  # [T, E] bool
    kept: torch.Tensor  # [T, E] bool
    probs: torch.Tensor  # [T, E] fp32


def assign_slots(idx, w, valid, num_experts: int, capacity_factor: float, min_capacity: int, drop_policy: str) -> Slots:
    """Megatron's capacity on the tokens run (buffer) and on the real ones (threshold), then `capacity_slots`."""
    T, K = idx.shape
    C = capacity(T, K, num_experts, capacity_factor, min_capacity)  # buffer slots: a function of the shape only
    n_valid = count_valid(valid, T, idx.device)  # []
    # the drop threshold: Megatron's capacity of the real tokens (pad rows never count)
    cap_used = None if valid is None else capacity_on_device(n_valid, K, num_experts, capacity_factor, min_capacity)
    slot_token, slot_ok, routed, kept, probs = capacity_slots(idx, w, valid, num_experts, C, drop_policy, cap_used)
    return Slots(C, n_valid, C if cap_used is None else cap_used, slot_token, slot_ok, routed, kept, probs)


def kept_weights(idx, w, kept, valid, renormalize: bool):
    """-> (keep_k [T, K] bool, w_k [T, K] fp32): which of each token's K assignments hold a slot, and their combine
    weights (0 where dropped; renormalize: the survivors rescaled to the token's original total)."""
    E = kept.shape[1]
    keep_k = kept.gather(1, idx.clamp(max=E - 1))  # [T, K]
    if valid is not None:
        keep_k = keep_k & valid[:, None]
    w_k = torch.where(keep_k, w.float(), 0.0)  # [T, K]
    if renormalize:
        # surviving weights rescaled to the token's original total (1 when the router normalises top-k)
        w_k = w_k * (w.float().sum(1, keepdim=True) / w_k.sum(1, keepdim=True).clamp(min=1e-20))
    return keep_k, w_k


def add_counters(counters, slots: Slots) -> None:
    """The drop counters of one call (counters: a moecg.dispatch.state.LayerCounters): routed, dropped, their weight,
    real tokens, tokens that lost all K, C applied."""
    routed, kept, probs = slots.routed, slots.kept, slots.probs
    dropped = routed & ~kept  # [T, E]
    lost = (routed.any(1) & ~kept.any(1)).sum()
    counters.add(routed.sum(0), dropped.sum(0), (probs * routed).sum(0), (probs * dropped).sum(0), slots.n_valid, lost)
    counters.add_capacity(slots.cap)
