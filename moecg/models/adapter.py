"""Family adapter: where each HF MoE family keeps attention, the MoE block, router, experts and shared expert.

Everything else in moecg asks the adapter, so no other file hard-codes a family's attribute names.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from moecg.models.zoo import family_of_config


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
    shared_expert_gate: str | None = None

    # -- model level ------------------------------------------------------------------------------
    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.model.layers

    def num_experts(self, config) -> int:
        return getattr(config, "num_local_experts", None) or config.num_experts

    def top_k(self, config) -> int:
        return config.num_experts_per_tok

    # -- layer level ------------------------------------------------------------------------------
    def moe_block(self, layer: nn.Module) -> nn.Module | None:
        """The sparse MoE block of a decoder layer, or None for a dense layer (Qwen `mlp_only_layers`)."""
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

    def moe_layers(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        """(layer index, experts module) for every decoder layer that has routed experts."""
        out = []
        for i, layer in enumerate(self.layers(model)):
            experts = self.experts_of(layer)
            if experts is not None:
                out.append((i, experts))
        return out


ADAPTERS = {
    "mixtral": FamilyAdapter("mixtral"),
    "qwen2_moe": FamilyAdapter("qwen2_moe", shared_expert="shared_expert", shared_expert_gate="shared_expert_gate"),
    "qwen3_moe": FamilyAdapter("qwen3_moe"),
}


def adapter_for(model_or_config) -> FamilyAdapter:
    config = getattr(model_or_config, "config", model_or_config)
    return ADAPTERS[family_of_config(config)]
