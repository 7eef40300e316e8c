"""`capacity`: fixed [E, C, D] expert buffers, overflow dropped (Megatron's capacity factor + pad-to-capacity).

Dims: T tokens, K top-k, E experts, C capacity per expert, D hidden, I expert intermediate.
Every shape depends only on (T, K, E, capacity_factor), so the whole layer captures. The price: one batched
GEMM reads all E experts' weights every step, even at batch 1 where dropless reads only K of them.

Buffers are sized for the T tokens run (a padded bucket), but the drop threshold is Megatron's capacity of the
*real* tokens, computed on the device from the row mask: the same workload keeps the same assignments whether it
runs eagerly at its own batch size or padded up to a captured bucket.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moecg.dispatch.base import Dispatcher, count_valid, expert_mlp_padded, register

DROP_POLICIES = ("probs", "position")


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


@register
@dataclass
class Capacity(Dispatcher):
    name = "capacity"
    graph_safe = True
    drops = True
    reads_all_experts = True
    capacity_factor: float = 1.25
    drop_policy: str = "probs"
    min_capacity: int = 1
    renormalize: bool = False

    def __post_init__(self):
        if not self.capacity_factor > 0:
            raise ValueError(f"dispatch.capacity_factor={self.capacity_factor}: must be > 0 (1.0-2.0 is typical)")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"dispatch.drop_policy={self.drop_policy!r}: choose one of {DROP_POLICIES}")
        if self.min_capacity < 1:
            raise ValueError(f"dispatch.min_capacity={self.min_capacity}: must be >= 1")

    def describe(self) -> dict:
        return {"dispatch": self.name, "capacity_factor": self.capacity_factor, "drop_policy": self.drop_policy}

    def capacity_for(self, num_tokens: int, top_k: int, num_experts: int) -> int:
        return capacity(num_tokens, top_k, num_experts, self.capacity_factor, self.min_capacity)

    def forward(self, experts, hidden, idx, w, valid, counters):
        T, K = idx.shape
        E = experts.num_experts
        C = self.capacity_for(T, K, E)  # buffer slots: a function of the (padded) shape only
        n_valid = count_valid(valid, T, hidden.device)  # []
        # the drop threshold: Megatron's capacity of the real tokens (pad rows never count)
        cap_used = None if valid is None else \
            capacity_on_device(n_valid, K, E, self.capacity_factor, self.min_capacity)
        slot_token, slot_ok, routed, kept, probs = capacity_slots(idx, w, valid, E, C, self.drop_policy, cap_used)
        x = hidden[slot_token]  # [E, C, D]
        y = self.experts_padded(experts, x.to(experts.gate_up_proj.dtype))  # [E, C, D]
        # Where each kept (token, expert) sits: slot_of[t, e] = c.
        slot_of = torch.zeros(T, E, dtype=torch.int64, device=idx.device)
        slots = torch.arange(C, device=idx.device).expand(E, C)  # [E, C]
        slot_of.scatter_(0, slot_token.t(), slots.t())  # [T, E]
        e_k = idx.clamp(max=E - 1)  # [T, K]
        keep_k = kept.gather(1, e_k)  # [T, K]
        if valid is not None:
            keep_k = keep_k & valid[:, None]
        w_k = torch.where(keep_k, w.float(), 0.0)  # [T, K]
        if self.renormalize:
            # surviving weights rescaled to the token's original total (1 when the router normalises top-k)
            w_k = w_k * (w.float().sum(1, keepdim=True) / w_k.sum(1, keepdim=True).clamp(min=1e-20))
        flat = e_k * C + slot_of.gather(1, e_k)  # [T, K] row in y.view(E*C, D)
        out_k = y.reshape(E * C, -1)[flat]  # [T, K, D]
        out = torch.where(keep_k[..., None], out_k.float() * w_k[..., None], 0.0).sum(1)  # [T, D]
        if counters is not None:
            routed_e = routed.sum(0)  # [E]
            dropped = routed & ~kept  # [T, E]
            lost = (routed.any(1) & ~kept.any(1)).sum()
            counters.add(routed_e, dropped.sum(0), (probs * routed).sum(0), (probs * dropped).sum(0), n_valid, lost)
            counters.add_capacity(C if cap_used is None else cap_used)
        return out.to(hidden.dtype)

    def experts_padded(self, experts, x):
        """x [E, C, D] slot buffers -> [E, C, D] expert outputs: the one step expert parallelism replaces (an
        all-to-all to the experts' ranks and back, moecg.parallel.dispatch), selection and combine staying as here."""
        return expert_mlp_padded(experts, x)
