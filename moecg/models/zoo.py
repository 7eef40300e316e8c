"""Model presets: HF config kwargs per family, tiny (CPU) and real shapes (random weights).

A preset is a plain dict, as in gpt-fast's `transformer_configs`; `build_model` turns it into an HF model.
"""
from __future__ import annotations

from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

FAMILIES = {
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
    "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM),
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
    # MLA with a q LoRA, layer 0 dense, 1 shared expert, 16 experts in 4 groups of which the best 2 groups are
    # searched (so the group limit matters), scaled weights, as DeepSeek-V3 (the shape of deepseek_v3 below)
    "deepseek_v3_tiny": dict(
        family="deepseek_v3", vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, max_position_embeddings=1024, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    ),
    # MLA without a q LoRA, softmax router with greedy top-k, 2 shared experts, layer 0 dense (DeepSeek-V2-Lite)
    "deepseek_v2_tiny": dict(
        family="deepseek_v2", vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=16,
        num_experts_per_tok=4, topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, max_position_embeddings=1024, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    ),
    # sigmoid router with correction bias, 1 shared expert, layer 0 dense, rotary on half of each head, q/k/v bias
    # (GLM-4.5-Air)
    "glm4_moe_tiny": dict(
        family="glm4_moe", vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_shared_experts=1,
        n_routed_experts=16, num_experts_per_tok=4, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=True, first_k_dense_replace=1, attention_bias=True, use_qk_norm=False,
        max_position_embeddings=1024, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                       "partial_rotary_factor": 0.5},
    ),
    # q/k RMSNorm over the whole projection, softmax top-k without renormalising (OLMoE-1B-7B)
    "olmoe_tiny": dict(
        family="olmoe", vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False,
        max_position_embeddings=1024, rope_parameters={"rope_type": "default", "rope_theta": 1e4}, eos_token_id=None,
    ),
    # layer 0 slides (window 4, shorter than a test prompt), layer 1 full; sinks; biased router and experts with the
    # clamped SwiGLU; yarn as gpt-oss-20b (factor 32 over 32 original positions)
    "gpt_oss_tiny": dict(
        family="gpt_oss", vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=4, attention_bias=True, max_position_embeddings=1024,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32},
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
    # Qwen/Qwen3-235B-A22B (235B, 22B active): 94 layers, 128 experts of 1536, 8 active, 64 q / 4 kv heads of 128;
    # 470 GB in bf16, so on one GPU only a cut builds (moecg.parallel builds the whole model on every rank, then shards)
    "qwen3_235b_a22b": dict(
        family="qwen3_moe", vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, use_sliding_window=False,
    ),
    # deepseek-ai/DeepSeek-V3 (671B, 37B active; the MTP layer is not built): 61 layers, 3 dense, 256 experts in 8
    # groups (4 searched), 8 active + 1 shared, MLA (q LoRA 1536, KV latent 512 + 64 rotary), yarn x40
    "deepseek_v3": dict(
        family="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        norm_topk_prob=True, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
    # moonshotai/Kimi-K2-Instruct (1.04T, 32B active; its config.json of the July 2025 release, model_type kimi_k2 on
    # DeepseekV3ForCausalLM): DeepSeek-V3's architecture with 384 experts (8 active + 1 shared, one group: no group
    # limit, scaled by 2.827), 64 heads, 1 dense layer of 61, MLA as V3 (q LoRA 1536, KV latent 512 + 64 rotary), yarn
    # x32 over 4096 positions with beta_fast 1 and rope_theta 50000
    "kimi_k2": dict(
        family="deepseek_v3", vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
        n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=2.827,
        norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
    # zai-org/GLM-4.5-Air (106B, 12B active): 46 layers, 1 dense, 128 experts, 8 active + 1 shared, 96 q / 8 kv heads
    # of 128, half-rotary, q/k/v bias, no q/k norm
    "glm4_5_air": dict(
        family="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_shared_experts=1,
        n_routed_experts=128, num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=True, first_k_dense_replace=1, attention_bias=True, use_qk_norm=False,
        max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
    ),
    # deepseek-ai/DeepSeek-V2-Lite (15.7B, 2.4B active): 27 layers, 1 dense, 64 experts, 6 active + 2 shared, greedy
    # softmax top-k, MLA without q LoRA (KV latent 512 + 64 rotary), yarn x40
    "deepseek_v2_lite": dict(
        family="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
        num_experts_per_tok=6, topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 0.707, "mscale_all_dim": 0.707},
    ),
    # allenai/OLMoE-1B-7B-0924 (6.9B, 1.3B active): 16 layers, 64 experts of 1024, 8 active, no renormalising
    "olmoe_1b_7b": dict(
        family="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    ),
    # openai/gpt-oss-20b (21B, 3.6B active): 24 layers alternating sliding (128) and full, 32 experts, 4 active, 64 q /
    # 8 kv heads of 64 with sinks, yarn x32
    "gpt_oss_20b": dict(
        family="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, attention_bias=True, max_position_embeddings=131072, rms_norm_eps=1e-5,
        swiglu_limit=7.0, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                           "original_max_position_embeddings": 4096},
    ),
    # openai/gpt-oss-120b (117B, 5.1B active): gpt-oss-20b's layers, 36 of them with 128 experts; fits one H200 only in
    # its published mxfp4 experts (model.weights=mxfp4: 65 GB)
    "gpt_oss_120b": dict(
        family="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4,
        sliding_window=128, attention_bias=True, max_position_embeddings=131072, rms_norm_eps=1e-5,
        swiglu_limit=7.0, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                           "original_max_position_embeddings": 4096},
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
    # DeepSeek-V3 style (MLA, layer 0 dense, 8 routed experts in 4 groups of which 2 are searched, top-2 + 1 shared,
    # sigmoid scores scaled by 2.5), balanced without an aux loss by the e_score_correction_bias update
    "deepseek_v3_stdlib": dict(
        family="deepseek_v3", vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=64,
        v_head_dim=64, max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        num_mtp_layers=0, router_aux_loss_coef=0.0,
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
# the tiny presets of the families added with MLA, group-limited and sigmoid routers, biased experts and sinks
FAMILY_PRESETS = ["deepseek_v3_tiny", "deepseek_v2_tiny", "glm4_moe_tiny", "olmoe_tiny", "gpt_oss_tiny"]
VARIANT_PRESETS = ["mixtral_tiny_swa", "qwen2_moe_tiny_swa", "qwen3_moe_tiny_swa", "qwen3_moe_tiny_dense",
                   "qwen3_moe_tiny_tied"]
SLIDING_PRESETS = ["mixtral_tiny_swa", "qwen2_moe_tiny_swa", "qwen3_moe_tiny_swa"]


def family_of_config(config) -> str:
    for family, (config_cls, _) in FAMILIES.items():
        if isinstance(config, config_cls):
            return family
    raise ValueError(
        f"model type {type(config).__name__} is not supported: moecg knows {sorted(FAMILIES)} "
        "(Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, GLM-4-MoE, OLMoE, GPT-OSS checkpoints)"
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
