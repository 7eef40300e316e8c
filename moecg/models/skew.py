"""Router skew: a fixed per-expert bias on router logits, so random routers load experts unevenly.

Dims: T tokens, E experts, K top-k, D hidden.
Bias b_e = -skew * ln(1 + rank_e) with a seeded random rank per layer, i.e. each expert's prior odds scale as
(1 + rank)^-skew (Zipf-like). What it models: a stable preference for a few hot experts per layer, as trained
routers show. What it does not: token-dependent specialisation, correlation across layers, or load that
shifts with the prompt; the hot experts are hot for every token. `skew=0` restores HF's router exactly.
"""
from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F


def skew_bias(num_experts: int, skew: float, generator: torch.Generator) -> torch.Tensor:
    rank = torch.randperm(num_experts, generator=generator)  # [E]
    return -skew * torch.log1p(rank.double()).float()  # [E]


def _skewed_softmax_topk(self, hidden_states):
    # Mirrors HF's TopKRouter.forward for router kind softmax_topk, plus the bias on the logits.
    spec = self._moecg_spec
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)  # [T, D]
    logits = F.linear(hidden_states, self.weight) + self._moecg_skew.to(hidden_states.dtype)  # [T, E]
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    top_v, top_i = torch.topk(probs, self.top_k, dim=-1)  # [T, K]
    if spec.normalize:
        top_v = top_v / top_v.sum(dim=-1, keepdim=True)
    if not spec.weights_fp32:
        top_v = top_v.to(logits.dtype)
    return logits, top_v, top_i


# one skewed forward per router kind (moecg.models.adapter.ROUTER_KINDS): the bias always acts on the logits
SKEWED_FORWARDS = {"softmax_topk": _skewed_softmax_topk}


def apply_router_skew(model, skew: float, seed: int = 0) -> None:
    """Bias every router of `model` (0 = off, HF's router unchanged). Undo with `remove_router_skew`."""
    from moecg.models.adapter import adapter_for

    if skew < 0 or not math.isfinite(skew):
        raise ValueError(f"model.router_skew={skew}: must be a finite number >= 0 (0 = off; on random-weight routers 0.05-0.3 spans mild to saturated)")
    remove_router_skew(model)
    if skew == 0:
        return
    adapter = adapter_for(model)
    gen = torch.Generator().manual_seed(seed + 7919)
    if adapter.router_kind not in SKEWED_FORWARDS:
        raise ValueError(f"model.router_skew: no skewed router for router kind {adapter.router_kind!r} "
                         f"({adapter.family}); use model.router_skew=0")
    for layer in adapter.layers(model):
        router = adapter.router_of(layer)
        if router is None:
            continue
        router._moecg_skew = skew_bias(router.num_experts, skew, gen).to(router.weight.device)
        router._moecg_spec = adapter.router_spec(router)
        router.forward = types.MethodType(SKEWED_FORWARDS[adapter.router_kind], router)


def router_logit_bias(router) -> torch.Tensor | None:
    """The [E] bias `apply_router_skew` put on this router's logits, or None. A path that computes the router's
    logits itself (the fused decode step) adds it, so router skew acts on every path.

    Raises if the router's forward was replaced by anything else: a path that bypasses it would silently ignore it.
    """
    fwd = router.__dict__.get("forward")
    if fwd is not None and getattr(fwd, "__func__", None) not in SKEWED_FORWARDS.values():
        raise ValueError(f"{type(router).__name__}.forward is patched by something other than moecg's router skew: "
                         "the fused decode step cannot honour it; use capture.kernels=hf")
    return router.__dict__.get("_moecg_skew")


def remove_router_skew(model) -> None:
    from moecg.models.adapter import adapter_for

    adapter = adapter_for(model)
    for layer in adapter.layers(model):
        router = adapter.router_of(layer)
        if router is not None:
            for attr in ("forward", "_moecg_skew", "_moecg_spec"):
                router.__dict__.pop(attr, None)
