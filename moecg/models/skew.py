"""Router skew: a fixed per-expert bias on router logits, so random routers load experts unevenly.

Dims: T tokens, E experts, K top-k, D hidden.
Bias b_e = -skew * ln(1 + rank_e) with a seeded random rank per layer, i.e. each expert's prior odds scale as
(1 + rank)^-skew (Zipf-like). What it models: a stable preference for a few hot experts per layer, as trained
routers show. What it does not: token-dependent specialisation, correlation across layers, or load that
shifts with the prompt; the hot experts are hot for every token. `skew=0` restores HF's router exactly.
The router modules are not edited: a forward hook (SkewHook) adds the bias to the logits HF's router returns and
routes them again as HF's forward does; `remove_router_skew` removes the hooks.
"""
from __future__ import annotations

import math

import torch

from moecg.models.adapter import adapter_for


def skew_bias(num_experts: int, skew: float, generator: torch.Generator) -> torch.Tensor:
    rank = torch.randperm(num_experts, generator=generator)  # [E]
    return -skew * torch.log1p(rank.double()).float()  # [E]


# Each of these takes a router and its HF logits with the skew already added ([T, E], as HF's forward returned them
# plus the bias) and routes them exactly as HF's forward of that router kind does after its logits GEMM: the same
# ops in the same order and dtypes, so with a zero bias the result is HF's, bit for bit.
def _route_softmax_topk(router, logits, spec):
    # HF's TopKRouter.forward (router kind softmax_topk) after its F.linear
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    top_v, top_i = torch.topk(probs, router.top_k, dim=-1)  # [T, K]
    if spec.normalize:
        top_v = top_v / top_v.sum(dim=-1, keepdim=True)
    if not spec.weights_fp32:
        top_v = top_v.to(logits.dtype)
    return logits, top_v, top_i


def _route_softmax_group(router, router_logits, spec):
    # HF's DeepseekV2TopkRouter.forward (router kind softmax_group) after its fp32 F.linear
    scores = router_logits.softmax(dim=-1, dtype=torch.float32)  # [T, E]
    if router.topk_method == "greedy":
        topk_weights, topk_indices = torch.topk(scores, k=router.top_k, dim=-1, sorted=False)  # [T, K]
    elif router.topk_method == "group_limited_greedy":
        g, e = router.num_group, router.num_experts
        group_scores = scores.view(-1, g, e // g).max(dim=-1).values  # [T, G]
        group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, g, e // g).reshape(-1, e)  # [T, E]
        scores = scores.masked_fill(~score_mask.bool(), 0.0)
        topk_weights, topk_indices = torch.topk(scores, k=router.top_k, dim=-1, sorted=False)
    else:
        raise ValueError(f"router skew: DeepSeek-V2 topk_method={router.topk_method!r} is not mirrored; "
                         "use model.router_skew=0")
    topk_weights = topk_weights * router.routed_scaling_factor
    return router_logits, topk_weights, topk_indices


def _route_sigmoid_group(router, router_logits, spec):
    # HF's DeepseekV3TopkRouter / Glm4MoeTopkRouter.forward (router kind sigmoid_group) after its fp32 F.linear: the
    # bias sits on the logits before the sigmoid, so it moves both the choice and the weights, as a trained router's
    # logits would
    g, e = router.num_group, router.num_experts
    scores = router_logits.sigmoid()  # [T, E]
    scores_for_choice = scores + router.e_score_correction_bias
    group_scores = scores_for_choice.view(-1, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, g, e // g).reshape(-1, e)  # [T, E]
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=router.top_k, dim=-1, sorted=False)[1]  # [T, K]
    topk_weights = scores.gather(1, topk_indices)  # [T, K] the unbiased scores
    if router.norm_topk_prob:
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
    topk_weights = topk_weights * router.routed_scaling_factor
    return router_logits, topk_weights, topk_indices


def _route_topk_softmax(router, router_logits, spec):
    # HF's GptOssTopKRouter.forward (router kind topk_softmax) after its F.linear (with the router's bias)
    router_top_value, router_indices = torch.topk(router_logits, router.top_k, dim=-1)  # [T, K]
    router_scores = torch.nn.functional.softmax(router_top_value, dim=1, dtype=router_top_value.dtype)  # [T, K]
    return router_logits, router_scores, router_indices


# one routing from logits per router kind (moecg.models.adapter.ROUTER_KINDS): the bias always acts on the logits
ROUTES_FROM_LOGITS = {"softmax_topk": _route_softmax_topk, "softmax_group": _route_softmax_group,
                      "sigmoid_group": _route_sigmoid_group, "topk_softmax": _route_topk_softmax}


class SkewHook:
    """A forward hook on one router: HF's router runs as it is; its logits (output[0]) get the bias, and the routing
    (weights, ids) is redone from them by the router kind's ROUTES_FROM_LOGITS. Registered first among the router's
    hooks, so HF's own output recorders see the biased logits, as a trained router's would be.
    Cost: HF's softmax / top-k run once more per router call (a few small kernels); the numbers are those of a router
    whose logits carry the bias."""

    def __init__(self, kind: str, bias: torch.Tensor, spec):
        self.kind, self.bias, self.spec = kind, bias, spec  # bias [E]
        self.handle = None

    def __call__(self, router, args, output):
        logits = output[0]  # [T, E] HF's logits (fp32 for the group routers)
        return ROUTES_FROM_LOGITS[self.kind](router, logits + self.bias.to(logits.dtype), self.spec)


def _skew_hooks(router) -> list[SkewHook]:
    return [h for h in router._forward_hooks.values() if isinstance(h, SkewHook)]


def apply_router_skew(model, skew: float, seed: int = 0) -> None:
    """Bias every router of `model` (0 = off, HF's router unchanged). Undo with `remove_router_skew`.

    The routers are not edited: each gets a forward hook (SkewHook) that `remove_router_skew` removes."""
    if skew < 0 or not math.isfinite(skew):
        raise ValueError(f"model.router_skew={skew}: must be a finite number >= 0 (0 = off; on random-weight routers 0.05-0.3 spans mild to saturated)")
    remove_router_skew(model)
    if skew == 0:
        return
    adapter = adapter_for(model)
    gen = torch.Generator().manual_seed(seed + 7919)
    if adapter.router_kind not in ROUTES_FROM_LOGITS:
        raise ValueError(f"model.router_skew: no skewed router for router kind {adapter.router_kind!r} "
                         f"({adapter.family}); use model.router_skew=0")
    routers = [r for r in map(adapter.router_of, adapter.layers(model)) if r is not None]
    for router in routers:  # refused before any router is hooked (HF's forward itself fails on these)
        method = getattr(router, "topk_method", "greedy") if adapter.router_kind == "softmax_group" else "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"router skew: DeepSeek-V2 topk_method={method!r} is not mirrored; "
                             "use model.router_skew=0")
    for router in routers:
        hook = SkewHook(adapter.router_kind, skew_bias(router.num_experts, skew, gen).to(router.weight.device),
                        adapter.router_spec(router))
        hook.handle = router.register_forward_hook(hook, prepend=True)


def router_logit_bias(router) -> torch.Tensor | None:
    """The [E] bias `apply_router_skew` put on this router's logits, or None. A path that computes the router's
    logits itself (the fused decode step) adds it, so router skew acts on every path.

    Raises if the router's forward was replaced on the instance: a path that bypasses it would silently ignore it.
    """
    if "forward" in router.__dict__:
        raise ValueError(f"{type(router).__name__}.forward is patched by something other than moecg's router skew: "
                         "the fused decode step cannot honour it; use capture.kernels=hf")
    hooks = _skew_hooks(router)
    return hooks[0].bias if hooks else None


def remove_router_skew(model) -> None:
    adapter = adapter_for(model)
    for layer in adapter.layers(model):
        router = adapter.router_of(layer)
        if router is not None:
            for hook in _skew_hooks(router):
                hook.handle.remove()
