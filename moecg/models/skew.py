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

from moecg.models.adapter import adapter_for


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


def _skewed_softmax_group(self, hidden_states):
    # Mirrors HF's DeepseekV2TopkRouter.forward (router kind softmax_group), plus the bias on the fp32 logits.
    hidden_states = hidden_states.view(-1, self.hidden_dim)  # [T, D]
    router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32)) \
        + self._moecg_skew  # [T, E]
    scores = router_logits.softmax(dim=-1, dtype=torch.float32)  # [T, E]
    if self.topk_method == "greedy":
        topk_weights, topk_indices = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)  # [T, K]
    elif self.topk_method == "group_limited_greedy":
        group_scores = scores.view(-1, self.num_group, self.num_experts // self.num_group).max(dim=-1).values  # [T, G]
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (group_mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group)
                      .reshape(-1, self.num_experts))  # [T, E]
        scores = scores.masked_fill(~score_mask.bool(), 0.0)
        topk_weights, topk_indices = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
    else:
        raise ValueError(f"router skew: DeepSeek-V2 topk_method={self.topk_method!r} is not mirrored; "
                         "use model.router_skew=0")
    topk_weights = topk_weights * self.routed_scaling_factor
    return router_logits, topk_weights, topk_indices


def _skewed_sigmoid_group(self, hidden_states):
    # Mirrors HF's DeepseekV3TopkRouter / Glm4MoeTopkRouter.forward (router kind sigmoid_group), plus the bias on the
    # fp32 logits before the sigmoid: it moves both the choice and the weights, as a trained router's logits would.
    hidden_states = hidden_states.view(-1, self.hidden_dim)  # [T, D]
    router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32)) \
        + self._moecg_skew  # [T, E]
    scores = router_logits.sigmoid()  # [T, E]
    scores_for_choice = scores + self.e_score_correction_bias
    group_scores = (scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group)
                    .topk(2, dim=-1)[0].sum(dim=-1))  # [T, G]
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (group_mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group)
                  .reshape(-1, self.num_experts))  # [T, E]
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]  # [T, K]
    topk_weights = scores.gather(1, topk_indices)  # [T, K] the unbiased scores
    if self.norm_topk_prob:
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
    topk_weights = topk_weights * self.routed_scaling_factor
    return router_logits, topk_weights, topk_indices


def _skewed_topk_softmax(self, hidden_states):
    # Mirrors HF's GptOssTopKRouter.forward (router kind topk_softmax), plus the bias on the logits.
    router_logits = F.linear(hidden_states, self.weight, self.bias) + self._moecg_skew.to(hidden_states.dtype)  # [T, E]
    router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=-1)  # [T, K]
    router_scores = torch.nn.functional.softmax(router_top_value, dim=1, dtype=router_top_value.dtype)  # [T, K]
    return router_logits, router_scores, router_indices


# one skewed forward per router kind (moecg.models.adapter.ROUTER_KINDS): the bias always acts on the logits
SKEWED_FORWARDS = {"softmax_topk": _skewed_softmax_topk, "softmax_group": _skewed_softmax_group,
                   "sigmoid_group": _skewed_sigmoid_group, "topk_softmax": _skewed_topk_softmax}


def apply_router_skew(model, skew: float, seed: int = 0) -> None:
    """Bias every router of `model` (0 = off, HF's router unchanged). Undo with `remove_router_skew`."""
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
    adapter = adapter_for(model)
    for layer in adapter.layers(model):
        router = adapter.router_of(layer)
        if router is not None:
            for attr in ("forward", "_moecg_skew", "_moecg_spec"):
                router.__dict__.pop(attr, None)
