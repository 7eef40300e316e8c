"""Family adapter: where each HF MoE family keeps attention, the MoE block, router, experts and shared expert.

Everything else in moecg asks the adapter, so no other file hard-codes a family's attribute names.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from moecg.models.weights import stored
from moecg.models.zoo import family_of_config

KERNELS = ("hf", "fused")
# rotary types whose cos/sin depend only on the position: FastDecode's one table from HF's own rotary module is
# exact. "dynamic" and "longrope" pick their frequencies from the current sequence length at every call.
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "proportional")


class UnsupportedConfigError(ValueError):
    """A model config field moecg cannot run faithfully; the message names the field and the fix."""


def rope_type(config) -> str:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return "default"
    return rope.get("rope_type", rope.get("type", "default")) or "default"


# Router kinds: how a family's router turns logits into (top-k ids, combine weights). Each kind has one HF-exact
# implementation per path: moecg.kernels.ref (fused step) and moecg.models.skew (router skew on HF's modules).
ROUTER_KINDS = {
    "softmax_topk": "softmax over all experts in fp32, top-k, optionally renormalised (Mixtral, Qwen2/3-MoE, OLMoE)",
    "softmax_group": "fp32 logits, softmax over all experts, greedy or group-limited (best expert per group) top-k, "
                     "times routed_scaling_factor, never renormalised (DeepSeek-V2)",
    "sigmoid_group": "fp32 logits, sigmoid; e_score_correction_bias added to pick topk_group of n_group groups (sum of "
                     "each group's best two) and the top-k in them; weights the unbiased sigmoids, optionally "
                     "renormalised, times routed_scaling_factor (DeepSeek-V3, GLM-4-MoE)",
    "topk_softmax": "top-k of the logits (linear with bias), softmax over those k in the logits' dtype (GPT-OSS)",
}

# Attention kinds: what a decoder layer's attention computes and what its KV cache holds (`kv_shapes`).
ATTENTION_KINDS = {
    "standard": "q/k/v/o projections (optional per-head q/k RMSNorm), rotary on q/k; the cache holds per-head K and V",
    "mla": "multi-head latent attention (DeepSeek-V2/V3): the cache holds the normalised KV latent [1, kv_lora_rank] and "
           "the shared rotary key [1, qk_rope_head_dim] per token, expanded to every head's K and V at each step",
}
# How a family's modeling code picks each layer's attention window (FamilyAdapter.attention_windows).
WINDOW_RULES = ("all", "layer_types", "none")
# Decode-math features beyond standard attention and SiLU-gated bias-free experts (FamilyAdapter.features). HF's
# modules run them all; the fused step (moecg.fast) runs a family only when each of its features is in
# FUSED_FEATURES and its router kind in FUSED_ROUTER_KINDS, below: declared beside the family facts (the fused step
# reads them from here), so new support is moecg.fast's code plus one entry here.
FEATURES = {
    "qk_norm_full": "q/k RMSNorm over the whole q/k projection, before the head split (OLMoE)",
    "partial_rotary": "rotary on the first partial_rotary_factor * head_dim dims of each head, the rest passed "
                      "through (GLM-4-MoE)",
    "attention_sinks": "a learned per-head sink logit joins each attention softmax (GPT-OSS)",
    "clamped_swiglu_experts": "experts with biases, [E, D, 2I] / [E, I, D] weights, gate/up interleaved, clamped "
                              "SwiGLU (up + 1) * gate * sigmoid(alpha * gate) (GPT-OSS)",
    "rmsnorm_cast_last": "RMSNorm multiplies the fp32 normalised x by the weight, then casts (GPT-OSS; Llama-style "
                         "norms cast first, then multiply)",
}
# router kinds (ROUTER_KINDS) the fused step routes with its own ops
FUSED_ROUTER_KINDS = ("softmax_topk", "sigmoid_group", "topk_softmax", "softmax_group")
# attention kinds (ATTENTION_KINDS) the fused step computes (mla: absorbed, moecg.latent)
FUSED_ATTENTION_KINDS = ("standard", "mla")
# decode-math features (FEATURES) the fused step computes
FUSED_FEATURES = ("qk_norm_full", "partial_rotary", "attention_sinks", "clamped_swiglu_experts", "rmsnorm_cast_last")
# Router kinds whose logits GEMM runs in fp32 (hidden states and weight cast to fp32, as HF's router forward does).
ROUTER_LOGITS_FP32 = ("softmax_group", "sigmoid_group")


@dataclass(frozen=True)
class RouterSpec:
    """What a router computes, read off the built module: everything a path that routes by itself needs."""

    kind: str  # a key of ROUTER_KINDS
    num_experts: int
    top_k: int
    normalize: bool  # renormalise the top-k weights to sum 1
    weights_fp32: bool  # the combine weights stay fp32 (Mixtral) instead of the logits' dtype
    scaling: float = 1.0  # routed scaling factor applied to the combine weights
    n_group: int = 1  # group-limited routing: experts in n_group groups, top topk_group groups kept
    topk_group: int = 1
    logits_fp32: bool = False  # the logits GEMM runs in fp32 (ROUTER_LOGITS_FP32), whatever the weight's dtype


@dataclass(frozen=True)
class ExpertSpec:
    """How a layer's routed experts compute, read off the built module (HF declares layout and bias on it)."""

    act: str  # "silu": silu(gate) * up; "swiglu_clamp": GPT-OSS's (up.clamp(+-limit) + 1) * g * sigmoid(alpha * g),
    #           g = gate.clamp(max=limit)
    interleaved: bool  # gate/up columns alternate g0 u0 g1 u1 ... (HF is_concatenated=False) instead of two halves
    transposed: bool  # [E, D, 2I] / [E, I, D] weights (HF is_transposed) instead of [E, 2I, D] / [E, D, I]
    has_bias: bool  # gate_up_proj_bias [E, 2I] and down_proj_bias [E, D]
    alpha: float = 1.0
    limit: float = float("inf")


@dataclass(frozen=True)
class FamilyAdapter:
    family: str
    attn: str = "self_attn"
    input_norm: str = "input_layernorm"
    post_norm: str = "post_attention_layernorm"
    moe: str = "mlp"
    router: str = "gate"
    experts: str = "experts"
    shared_expert: str | None = None
    shared_expert_gate: str | None = None  # a [1, D] linear whose sigmoid scales the shared expert (Qwen2-MoE)
    # attention projections and the (shared / dense) MLP's projections, by attribute name
    q_proj: str = "q_proj"
    k_proj: str = "k_proj"
    v_proj: str = "v_proj"
    o_proj: str = "o_proj"
    mlp_projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    router_kind: str = "softmax_topk"
    router_weights_fp32: bool = False  # Mixtral's router returns fp32 combine weights; the others the logits' dtype
    router_normalize_default: bool = True  # when the router has no norm_topk_prob attribute
    attention: str = "standard"  # a key of ATTENTION_KINDS
    windows: str = "all"  # a WINDOW_RULES entry: how the modeling code picks each layer's window
    moe_returns_tuple: bool = False  # the MoE block returns (hidden, router scores) (GPT-OSS), not hidden
    static_features: tuple[str, ...] = ()  # FEATURES keys every model of the family has
    partial_rotary: bool = False  # the attention rotates only partial_rotary_factor of each head (GLM-4-MoE)
    transposed_experts: bool = False  # experts stored [E, D, 2I] / [E, I, D] (HF is_transposed; GPT-OSS)

    # -- model level ------------------------------------------------------------------------------
    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.model.layers

    def num_experts(self, config) -> int:
        return getattr(config, "num_local_experts", None) or config.num_experts

    def top_k(self, config) -> int:
        return config.num_experts_per_tok

    def expert_intermediate(self, config) -> int:
        """I, a routed expert's intermediate size (moe_intermediate_size where the family has a dense one beside it)."""
        return getattr(config, "moe_intermediate_size", None) or config.intermediate_size

    def head_dim(self, config) -> int:
        """Per-head size of q and k as the family's attention module computes it (MLA: qk_nope + qk_rope, the size the
        softmax scale is taken of; its V heads are v_head_dim)."""
        if self.attention == "mla":  # DeepseekV2/V3Attention.qk_head_dim (config.head_dim is the rotary part only)
            return config.qk_nope_head_dim + config.qk_rope_head_dim
        if self.family == "qwen2_moe":  # Qwen2MoeAttention: getattr(config, "head_dim", hidden // heads)
            return getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def features(self, config) -> tuple[str, ...]:
        """The FEATURES this config's decode step has."""
        out = list(self.static_features)
        if self.partial_rotary and _partial_rotary_factor(config) < 1.0:
            out.append("partial_rotary")
        return tuple(out)

    def kv_shapes(self, config) -> tuple[tuple[int, int], tuple[int, int]]:
        """((heads, dim) of a cached key, (heads, dim) of a cached value) per token and layer, as the family's attention
        writes them with cache.update. MLA (transformers 5.24) caches the latent, not per-head K/V: the normalised KV
        latent as "keys" [1, kv_lora_rank] and the rotary key shared by all heads as "values" [1, qk_rope_head_dim]."""
        if self.attention == "mla":
            return (1, config.kv_lora_rank), (1, config.qk_rope_head_dim)
        kv = (config.num_key_value_heads, self.head_dim(config))
        return kv, kv

    def mla_rope_layout(self, config) -> str:
        """How an MLA family's rotary pairs its dims (moecg.kernels.ref.ROPE_LAYOUTS): DeepSeek-V2 rotates interleaved
        pairs as complex numbers and keeps them interleaved; DeepSeek-V3 rotates interleaved pairs into rotate_half
        halves (rope_interleave, its default) or rotate_half halves alike (rope_interleave false)."""
        if self.family == "deepseek_v2":
            return "pairs"
        return "pairs_to_halves" if getattr(config, "rope_interleave", True) else "halves"

    def kv_elems_per_token(self, config) -> int:
        """Cached elements one token adds to one layer (keys + values)."""
        (hk, dk), (hv, dv) = self.kv_shapes(config)
        return hk * dk + hv * dv

    def attention_windows(self, config) -> list[int]:
        """The attention window of each decoder layer, 0 = full causal attention; a query at position p sees keys
        at positions k with p - window < k <= p (HF's sliding_window_causal_mask_function).

        Exactly as each family's modeling code (transformers 5.24) picks a layer's mask:
          Mixtral, Qwen3-MoE: every layer slides iff config.sliding_window is not None (Qwen3MoeConfig sets it to None
            unless use_sliding_window; neither family reads layer_types or max_window_layers);
          Qwen2-MoE, GPT-OSS: layer i slides iff config.layer_types[i] == "sliding_attention" (Qwen2MoeConfig derives
            layer_types from use_sliding_window and max_window_layers: even i < max_window_layers; GptOssConfig
            alternates sliding, full, ...), window config.sliding_window;
          DeepSeek-V2/V3, GLM-4-MoE, OLMoE: no layer slides (their models build a causal mask only).
        """
        n = config.num_hidden_layers
        sw = getattr(config, "sliding_window", None)
        if self.windows == "none":
            return [0] * n
        if self.windows == "layer_types":
            types = getattr(config, "layer_types", None) or ["full_attention"] * n
            return [int(sw or 0) if t == "sliding_attention" else 0 for t in types[:n]]
        return [int(sw) if sw is not None else 0] * n

    def min_layers(self, config) -> int:
        """The fewest decoder layers a cut can keep and still have a routed layer (DeepSeek/GLM: dense first layers)."""
        return (getattr(config, "first_k_dense_replace", None) or 0) + 1

    def check_supported(self, config, kernels: str = "hf", *, step_graph: bool = False, model=None,
                        attn_implementation: str | None = None) -> None:
        """Raise UnsupportedConfigError, before any work, for a config field moecg would run wrongly.

        kernels: "hf" (HF's modules: the engine and every capture strategy) or "fused" (moecg.fast.FastDecode).
        step_graph: a whole decode step (rotary embedding included) is captured (strategy=full/capacity).
        model: also check the built modules (expert biases), for kernels=fused.
        attn_implementation: HF's attention the model runs (model.attn_implementation); None: the config's own.
        """
        if kernels not in KERNELS:
            raise UnsupportedConfigError(f"capture.kernels={kernels!r}: choose one of {KERNELS}")

        def refuse(field, why, fix):
            raise UnsupportedConfigError(f"{type(config).__name__}.{field}: {why}; {fix}")

        if getattr(config, "is_heterogeneous", False):
            refuse("per_layer_config", "per-layer config overrides are not supported (moecg, and this family's HF "
                   "modeling code, read one config for every layer)", "remove per_layer_config")
        if getattr(config, "is_causal", True) is False:
            refuse("is_causal", "is_causal=False makes HF build bidirectional masks, which over a static KV cache "
                   "attend to unwritten slots", "remove is_causal (decoding is causal)")
        sw = getattr(config, "sliding_window", None)
        n = config.num_hidden_layers
        if self.windows == "layer_types":
            # a longer list is a checkpoint cut with model.num_layers: layer i still reads layer_types[i]
            types = list(getattr(config, "layer_types", None) or [])[:n]
            if len(types) != n or any(t not in ("full_attention", "sliding_attention") for t in types):
                refuse("layer_types", f"{types} must name full_attention or sliding_attention for each of the {n} "
                       "layers", "fix layer_types, or leave it unset to derive it from use_sliding_window and "
                       "max_window_layers")
            if "sliding_attention" in types and not (isinstance(sw, int) and sw > 0):
                refuse("sliding_window", f"layer_types has sliding_attention layers but sliding_window={sw!r} "
                       "(Qwen2MoeConfig sets it to 0 unless use_sliding_window)",
                       "set use_sliding_window=True and sliding_window > 0, or make every layer full_attention")
        elif self.windows == "all" and sw is not None and not (isinstance(sw, int) and sw > 0):
            refuse("sliding_window", f"sliding_window={sw!r} masks every key", "set sliding_window > 0 or None")
        rt = rope_type(config)
        if step_graph and kernels == "hf" and rt == "dynamic":
            refuse("rope_parameters", "rope_type=dynamic recomputes the rotary frequencies on the host when the "
                   "sequence outgrows them, which a captured decode step cannot do",
                   "use strategy=layer or partial (the rotary embedding runs eagerly there) or strategy=eager")
        if self.attention == "mla":
            impl = attn_implementation or getattr(config, "_attn_implementation", None)
            self._check_mla_heads(config, impl, refuse)
        if hasattr(config, "first_k_dense_replace") and not isinstance(config.first_k_dense_replace, int):
            refuse("first_k_dense_replace", f"first_k_dense_replace={config.first_k_dense_replace!r}: HF's decoder "
                   "layers compare their index with it to pick a dense MLP or a MoE block",
                   "set it to the number of dense first layers (0 for none)")
        dense = self.min_layers(config) - 1
        if dense >= n:  # DeepSeek, GLM: layers below first_k_dense_replace are dense MLPs
            refuse("num_hidden_layers", f"the first first_k_dense_replace={dense} layers are dense, so {n} layers have "
                   "no MoE layer to measure", f"keep more layers (model.num_layers={dense + 1} or more)")
        if self.router_kind in ("sigmoid_group", "softmax_group"):
            self._check_groups(config, refuse)
        if kernels == "hf":
            return
        # -- kernels=fused: moecg.fast.FastDecode recomputes the decode step from the parameters
        if self.attention not in FUSED_ATTENTION_KINDS:
            refuse("model_type", f"capture.kernels=fused has no kernels for {self.attention} attention "
                   f"({ATTENTION_KINDS[self.attention]}; it has {', '.join(FUSED_ATTENTION_KINDS)})",
                   "use capture.kernels=hf")
        if self.router_kind not in FUSED_ROUTER_KINDS:
            refuse("model_type", f"capture.kernels=fused has no router kernel for router kind {self.router_kind!r} "
                   f"({ROUTER_KINDS[self.router_kind]}; it has {', '.join(FUSED_ROUTER_KINDS)})",
                   "use capture.kernels=hf")
        missing = [f for f in self.features(config) if f not in FUSED_FEATURES]
        if missing:
            refuse("model_type", "capture.kernels=fused does not compute " +
                   "; ".join(f"{f} ({FEATURES[f]})" for f in missing) + " (moecg.fast.FUSED_FEATURES)",
                   "use capture.kernels=hf")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            refuse("hidden_act", f"capture.kernels=fused needs SiLU experts (hidden_act={act})",
                   "use capture.kernels=hf")
        if rt not in STATIC_ROPE_TYPES:
            refuse("rope_parameters", f"capture.kernels=fused supports rotary types whose tables depend on the "
                   f"position only, {STATIC_ROPE_TYPES} (rope_type={rt} picks its frequencies from the current "
                   "sequence length)", "use capture.kernels=hf")
        hd = self.head_dim(config)
        if self.attention == "mla":
            if config.qk_rope_head_dim % 2:
                refuse("qk_rope_head_dim", f"rotary dims pair up, so qk_rope_head_dim must be even (got "
                       f"{config.qk_rope_head_dim})", "use capture.kernels=hf")
        elif hd & (hd - 1):
            refuse("head_dim", f"capture.kernels=fused needs a power-of-two head_dim (got {hd})",
                   "use capture.kernels=hf")
        if model is not None:
            for layer in self.layers(model):
                if self.moe_block(layer) is not None and getattr(self.experts_of(layer), "has_bias", False) \
                        and "clamped_swiglu_experts" not in self.features(config):  # that feature has biases
                    refuse("experts", "capture.kernels=fused: experts with bias are not supported",
                           "use capture.kernels=hf")

    def _check_mla_heads(self, config, impl: str | None, refuse) -> None:
        """MLA expands its cached latent through kv_b_proj to K and V for all num_attention_heads heads, so no weight
        depends on num_key_value_heads; HF's attention still repeats K/V by num_attention_heads // num_key_value_heads
        (num_key_value_groups). A ratio > 1 breaks eager's repeat_kv always and sdpa's pack_gqa / repeat_kv on every
        masked call (HF's generate runs it only through sdpa's enable_gqa, with no mask and qk_head_dim == v_head_dim,
        where the heads already match); a ratio of 0 (more KV heads than heads) leaves eager's repeat_kv no heads."""
        h, kv = config.num_attention_heads, config.num_key_value_heads
        if kv == h:
            return
        groups = h // kv
        if groups == 0 and impl != "eager":
            return  # sdpa (and the flash kernels) take the heads from the tensors: below 1 the ratio is never read
        where = ("eager attention's repeat_kv, which leaves no heads" if groups == 0 else
                 "eager attention and in sdpa with a mask (repeat_kv, pack_gqa), which every moecg cache passes")
        refuse("num_key_value_heads", f"num_key_value_heads={kv} with num_attention_heads={h}: MLA expands its latent "
               f"to K and V for all {h} heads (no weight depends on num_key_value_heads), but HF's attention repeats "
               f"them by num_attention_heads // num_key_value_heads = {groups}, which fails in {where}",
               f"set num_key_value_heads={h} in the config (config.json): the same weights, and the outputs HF's sdpa "
               "computes where it runs this config")

    def _check_groups(self, config, refuse) -> None:
        """Group-limited routing views the experts as [n_group, E / n_group]: refuse what HF's router would crash on."""
        E, k = self.num_experts(config), self.top_k(config)
        if self.router_kind == "softmax_group":
            method = getattr(config, "topk_method", "greedy")
            if method not in ("greedy", "group_limited_greedy"):  # DeepseekV2TopkRouter has no other branch
                refuse("topk_method", f"topk_method={method!r}: DeepSeek-V2's router implements greedy and "
                       "group_limited_greedy only (HF's router fails on any other)",
                       "set topk_method=greedy (DeepSeek-V2-Lite) or group_limited_greedy (DeepSeek-V2)")
            if method == "greedy":
                return  # DeepSeek-V2's greedy top-k ignores the groups
        g, tg = getattr(config, "n_group", None), getattr(config, "topk_group", None)
        if not (isinstance(g, int) and isinstance(tg, int) and g >= 1):
            refuse("n_group", f"group-limited routing splits the experts into n_group groups and keeps topk_group of "
                   f"them (n_group={g!r}, topk_group={tg!r}; HF's router divides the experts by n_group)",
                   "set both to integers (n_group=1, topk_group=1: no group limit)")
        if E % g or not 1 <= tg <= g:
            refuse("n_group", f"group-limited routing needs n_group to divide the {E} experts and 1 <= topk_group <= "
                   f"n_group (n_group={g}, topk_group={tg})", "fix n_group / topk_group")
        if self.router_kind == "sigmoid_group" and E // g < 2:
            refuse("n_group", f"sigmoid_group routing scores each group by its best two experts, so groups need at "
                   f"least 2 experts ({E} experts in {g} groups)", "lower n_group")
        if k > E // g * tg:
            refuse("num_experts_per_tok", f"top-{k} of the {E // g * tg} experts in the topk_group={tg} kept groups "
                   "would pick masked experts", "raise topk_group or lower num_experts_per_tok")

    # -- layer level ------------------------------------------------------------------------------
    def moe_block(self, layer: nn.Module) -> nn.Module | None:
        """The sparse MoE block of a decoder layer, or None for a dense layer (Qwen `mlp_only_layers`, DeepSeek and
        GLM's first_k_dense_replace layers): a block without routed experts and a router is never counted as routed."""
        block = getattr(layer, self.moe)
        return block if hasattr(block, self.experts) and hasattr(block, self.router) else None

    def router_of(self, layer: nn.Module) -> nn.Module | None:
        block = self.moe_block(layer)
        return None if block is None else getattr(block, self.router)

    def experts_of(self, layer: nn.Module) -> nn.Module | None:
        block = self.moe_block(layer)
        return None if block is None else getattr(block, self.experts)

    def shared_expert_of(self, layer: nn.Module) -> nn.Module | None:
        block = self.moe_block(layer)
        return None if block is None or self.shared_expert is None else getattr(block, self.shared_expert)

    def router_spec(self, router: nn.Module) -> RouterSpec:
        # DeepSeek-V2's topk_method=greedy ignores n_group/topk_group: the spec records what the router computes
        grouped = getattr(router, "topk_method", "group_limited") != "greedy"
        return RouterSpec(self.router_kind, int(router.weight.shape[0]), int(router.top_k),
                          bool(getattr(router, "norm_topk_prob", self.router_normalize_default)),
                          self.router_weights_fp32,
                          float(getattr(router, "routed_scaling_factor", 1.0) or 1.0),
                          int(getattr(router, "num_group", 1) or 1) if grouped else 1,
                          int(getattr(router, "topk_group", 1) or 1) if grouped else 1,
                          logits_fp32=self.router_kind in ROUTER_LOGITS_FP32)

    def router_biases(self, router: nn.Module) -> tuple:
        """(bias the router's linear adds to its logits (GPT-OSS), bias added to the scores for the choice only
        (DeepSeek-V3 / GLM-4-MoE e_score_correction_bias)); None where the router has none."""
        return getattr(router, "bias", None), getattr(router, "e_score_correction_bias", None)

    def expert_spec(self, experts: nn.Module) -> ExpertSpec:
        if "clamped_swiglu_experts" in self.static_features:  # GptOssExperts._apply_gate
            return ExpertSpec("swiglu_clamp", not getattr(experts, "is_concatenated", True),
                              bool(getattr(experts, "is_transposed", False)), bool(getattr(experts, "has_bias", False)),
                              float(experts.alpha), float(experts.limit))
        # HF's default gate chunks [gate | up] halves, whatever is_concatenated says
        return ExpertSpec("silu", False, bool(getattr(experts, "is_transposed", False)),
                          bool(getattr(experts, "has_bias", False)))

    def rotary_dim(self, config) -> int:
        """Dims of each q/k head the rotary embedding turns (the first ones; partial_rotary_factor, GLM-4-MoE)."""
        hd = self.head_dim(config)
        return int(hd * _partial_rotary_factor(config)) if self.partial_rotary else hd

    def moe_output(self, out):
        """The hidden states of a MoE block's (or dense MLP's) output: GPT-OSS's block also returns router scores."""
        return out[0] if self.moe_returns_tuple and isinstance(out, tuple) else out

    def qkv_of(self, attn: nn.Module) -> tuple[list, list]:
        """([q, k, v] weights as stored (moecg.models.weights.stored), [q, k, v] biases or None each) of a standard
        attention module."""
        mods = [getattr(attn, n) for n in (self.q_proj, self.k_proj, self.v_proj)]
        return [stored(m) for m in mods], [m.bias for m in mods]

    def o_of(self, attn: nn.Module) -> nn.Module:
        return getattr(attn, self.o_proj)

    def mlp_weights(self, mlp: nn.Module) -> tuple:
        """(gate [I, D], up [I, D], down [D, I]) weights of a gated MLP (shared expert or dense layer), as stored."""
        return tuple(stored(getattr(mlp, n)) for n in self.mlp_projs)

    def shared_gate_of(self, layer: nn.Module) -> nn.Module | None:
        block = self.moe_block(layer)
        return None if block is None or self.shared_expert_gate is None else getattr(block, self.shared_expert_gate)

    def moe_layers(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        """(layer index, experts module) for every decoder layer that has routed experts."""
        out = []
        for i, layer in enumerate(self.layers(model)):
            experts = self.experts_of(layer)
            if experts is not None:
                out.append((i, experts))
        return out


def _partial_rotary_factor(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)


ADAPTERS = {
    "mixtral": FamilyAdapter("mixtral", router_weights_fp32=True),
    "qwen2_moe": FamilyAdapter("qwen2_moe", shared_expert="shared_expert", shared_expert_gate="shared_expert_gate",
                               windows="layer_types"),
    "qwen3_moe": FamilyAdapter("qwen3_moe"),
    # MLA, dense first_k_dense_replace layers, ungated shared experts; the router runs in fp32
    "deepseek_v3": FamilyAdapter("deepseek_v3", shared_expert="shared_experts", router_kind="sigmoid_group",
                                 router_weights_fp32=True, attention="mla", windows="none"),
    "deepseek_v2": FamilyAdapter("deepseek_v2", shared_expert="shared_experts", router_kind="softmax_group",
                                 router_weights_fp32=True, router_normalize_default=False, attention="mla",
                                 windows="none"),
    "glm4_moe": FamilyAdapter("glm4_moe", shared_expert="shared_experts", router_kind="sigmoid_group",
                              router_weights_fp32=True, windows="none", partial_rotary=True),
    "olmoe": FamilyAdapter("olmoe", windows="none", static_features=("qk_norm_full",)),
    "gpt_oss": FamilyAdapter("gpt_oss", router="router", router_kind="topk_softmax", windows="layer_types",
                             moe_returns_tuple=True, transposed_experts=True, static_features=("attention_sinks", "clamped_swiglu_experts",
                                                                      "rmsnorm_cast_last")),
}


def adapter_for(model_or_config) -> FamilyAdapter:
    config = getattr(model_or_config, "config", model_or_config)
    return ADAPTERS[family_of_config(config)]
