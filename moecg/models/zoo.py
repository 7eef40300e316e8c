"""Model presets: HF config kwargs per family, tiny (CPU) and real shapes (random weights).

A preset is a plain dict, as in gpt-fast's `transformer_configs`; `build_model` turns it into an HF model.
"""
from __future__ import annotations

from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

FAMILIES = {
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
}

PRESETS: dict[str, dict] = {
    # Tiny shapes: every dim a multiple of 4 floats so grouped_mm's 16-byte stride rule holds on CPU.
    "mixtral_tiny": dict(
        family="mixtral", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=1024, rope_theta=1e6, sliding_window=None,
    ),
    "qwen2_moe_tiny": dict(
        family="qwen2_moe", vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=1024, rope_theta=1e6, use_sliding_window=False,
    ),
    "qwen3_moe_tiny": dict(
        family="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=1024, rope_theta=1e6, use_sliding_window=False,
    ),
    # Real shapes (random weights): mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen1.5-MoE-A2.7B, Qwen/Qwen3-30B-A3B.
    "mixtral_8x7b": dict(
        family="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rope_theta=1e6, sliding_window=None, rms_norm_eps=1e-5,
    ),
    "qwen1_5_moe_a2_7b": dict(
        family="qwen2_moe", vocab_size=151936, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        num_experts=60, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=8192, rope_theta=1e6, use_sliding_window=False,
    ),
    "qwen3_30b_a3b": dict(
        family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=40960, rope_theta=1e6, use_sliding_window=False,
    ),
    # Byte-level models trained by experiments/train_stdlib.py; the weights ship in moecg/checkpoints/<name>.
    "mixtral_stdlib": dict(
        family="mixtral", vocab_size=256, hidden_size=256, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=4096, rope_theta=1e4, sliding_window=None, router_aux_loss_coef=0.01,
    ),
    "qwen2_moe_stdlib": dict(
        family="qwen2_moe", vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        shared_expert_intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=4096, rope_theta=1e4, use_sliding_window=False, router_aux_loss_coef=0.01,
    ),
}

# Tiny variants of the tiny presets, one config feature each (sliding windows shorter than a test's prompt, a dense
# layer, tied embeddings): the test matrix runs every strategy on them.
PRESETS.update({
    # every layer slides (Mixtral reads config.sliding_window for all layers)
    "mixtral_tiny_swa": dict(PRESETS["mixtral_tiny"], sliding_window=6),
    # layer_types from use_sliding_window + max_window_layers: [sliding, full, full] (even layers < 2 slide)
    "qwen2_moe_tiny_swa": dict(PRESETS["qwen2_moe_tiny"], use_sliding_window=True, sliding_window=6,
                               max_window_layers=2),
    # every layer slides (Qwen3-MoE has no max_window_layers)
    "qwen3_moe_tiny_swa": dict(PRESETS["qwen3_moe_tiny"], use_sliding_window=True, sliding_window=6),
    # layer 0 a dense MLP (mlp_only_layers), layer 1 MoE
    "qwen3_moe_tiny_dense": dict(PRESETS["qwen3_moe_tiny"], mlp_only_layers=[0]),
    # lm_head shares the embedding matrix
    "qwen3_moe_tiny_tied": dict(PRESETS["qwen3_moe_tiny"], tie_word_embeddings=True),
})
VARIANT_PRESETS = ["mixtral_tiny_swa", "qwen2_moe_tiny_swa", "qwen3_moe_tiny_swa", "qwen3_moe_tiny_dense",
                   "qwen3_moe_tiny_tied"]
SLIDING_PRESETS = ["mixtral_tiny_swa", "qwen2_moe_tiny_swa", "qwen3_moe_tiny_swa"]


def family_of_config(config) -> str:
    for family, (config_cls, _) in FAMILIES.items():
        if isinstance(config, config_cls):
            return family
    raise ValueError(
        f"model type {type(config).__name__} is not supported: moecg knows {sorted(FAMILIES)} "
        "(Mixtral, Qwen2-MoE, Qwen3-MoE checkpoints)"
    )


def make_config(preset: str, num_layers: int | None = None, overrides: dict | None = None):
    """HF config for a preset; `num_layers` cuts the depth, `overrides` sets any HF config field."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}: choose one of {sorted(PRESETS)}")
    kwargs = dict(PRESETS[preset])
    family = kwargs.pop("family")
    kwargs.update(overrides or {})
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"model.num_layers={num_layers}: must be >= 1 (or null for the preset's depth)")
        kwargs["num_hidden_layers"] = num_layers
    config_cls, _ = FAMILIES[family]
    return config_cls(**kwargs)
