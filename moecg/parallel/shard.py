"""Give each expert-parallel rank its E/R experts: slice the [E, ...] parameters of HF's experts modules.

Every rank builds the whole model from the same seed (so attention, routers and embeddings are identical everywhere),
then keeps only its experts. The model stays an HF model; its experts modules hold El = E/R experts while
`num_experts` (the router's range) stays E, so only moecg's expert-parallel dispatchers can run it (HF's own
experts loop would index past the slice). Peak memory is the whole model once, at build time, on every rank.
"""
from __future__ import annotations

import torch
from torch import nn

from moecg.models.adapter import adapter_for


def shard_experts(model, group) -> tuple[int, int] | None:
    """Keep experts [lo, hi) of `group.rank` in every MoE layer; returns (lo, hi), None on one rank (nothing to do)."""
    if group.size == 1:
        return None
    span = None
    for _, experts in adapter_for(model).moe_layers(model):
        E = experts.num_experts
        if E % group.size:
            raise ValueError(f"{E} experts do not split over {group.size} ranks (the run plan checks this)")
        lo, hi = span = group.experts(E)
        for name, p in list(experts.named_parameters(recurse=False)):
            if p.shape[0] == E:  # gate_up_proj, down_proj and, where the family has them, their biases
                setattr(experts, name, nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad))
        experts._moecg_experts = (lo, hi)
    dev = next(model.parameters()).device
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the other ranks' experts were freed: give the memory back to the caching allocator
    return span
