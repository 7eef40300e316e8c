"""Config fields that change the decode math (Mixtral, Qwen2-MoE, Qwen3-MoE in transformers 5.24): each one is
either handled, and proven here, or refused before any work by FamilyAdapter.check_supported with the field named.

Handled on HF's modules: the engine's greedy tokens equal HF `model.generate`'s. Handled by the fused step
(capture.kernels=fused, torch references): teacher-forced agreement with HF's modules on CPU, as tests/test_fast.py.
"""
import pytest
import torch
import transformers.models.mixtral.modeling_mixtral as modeling_mixtral
from hydra import compose, initialize_config_dir

from moecg.capture import Capture
from moecg.dispatch import attach, detach, make_dispatcher
from moecg.engine import DecodeEngine
from moecg.fast import FastDecode, FastPathError
from moecg.models import build_model, make_config
from moecg.models.adapter import UnsupportedConfigError, adapter_for
from moecg.models.zoo import PRESETS, VARIANT_PRESETS

S, NEW, L = 8, 10, 32


def _rope(rope_type, **kw):
    return {"rope_parameters": {"rope_type": rope_type, "rope_theta": 1e6, **kw}, "head_dim": 16}


# (preset, config overrides): every field a supported decode-math field of the three families
BOTH = {  # handled by HF's modules and by the fused step
    "rope_linear": ("mixtral_tiny", _rope("linear", factor=2.0)),
    "rope_yarn": ("qwen3_moe_tiny", _rope("yarn", factor=4.0, original_max_position_embeddings=256)),
    "rope_llama3": ("qwen2_moe_tiny", _rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                            original_max_position_embeddings=256)),
    "rope_proportional": ("mixtral_tiny", _rope("proportional", partial_rotary_factor=0.5)),
    "qkv_bias_false": ("qwen2_moe_tiny", {"qkv_bias": False}),
    "qkv_bias": ("qwen2_moe_tiny", {"qkv_bias": True}),  # the Qwen2-MoE default
    "attention_bias": ("qwen3_moe_tiny", {"attention_bias": True}),  # q/k/v and o_proj biases
    "head_dim_qwen2": ("qwen2_moe_tiny", {"head_dim": 32}),  # != hidden / heads
    "head_dim_mixtral": ("mixtral_tiny", {"head_dim": 32}),
    "mha_qwen3": ("qwen3_moe_tiny", {"num_key_value_heads": 4}),
    "norm_topk_prob_qwen2": ("qwen2_moe_tiny", {"norm_topk_prob": True}),
    "norm_topk_prob_qwen3": ("qwen3_moe_tiny", {"norm_topk_prob": False}),
    "top_k_3": ("qwen3_moe_tiny", {"num_experts_per_tok": 3}),
    "shared_expert_size": ("qwen2_moe_tiny", {"shared_expert_intermediate_size": 64}),
    "decoder_sparse_step": ("qwen2_moe_tiny", {"decoder_sparse_step": 2, "num_hidden_layers": 4}),
    "mlp_only_layers": ("qwen3_moe_tiny_dense", {}),
    "tie_word_embeddings": ("qwen3_moe_tiny_tied", {}),
    "rms_norm_eps": ("mixtral_tiny", {"rms_norm_eps": 1e-2}),
    # training-only: no effect in eval mode (build_model returns eval models)
    "router_jitter_noise": ("mixtral_tiny", {"router_jitter_noise": 0.5, "attention_dropout": 0.5}),
    "attention_dropout": ("qwen2_moe_tiny", {"attention_dropout": 0.5}),
    # the engine passes output_router_logits=False: no aux loss per step (test below)
    "output_router_logits": ("qwen3_moe_tiny", {"output_router_logits": True}),
}
HF_ONLY = {  # handled by HF's modules, refused by the fused step (test_refusals)
    "hidden_act_gelu": ("mixtral_tiny", {"hidden_act": "gelu"}),
    "hidden_act_relu_qwen2": ("qwen2_moe_tiny", {"hidden_act": "relu"}),
    # dynamic NTK grows its frequencies past max_position_embeddings (12 < prompt + new tokens)
    "rope_dynamic": ("qwen3_moe_tiny", {**_rope("dynamic", factor=2.0), "max_position_embeddings": 12}),
    # longrope switches to the long factors past original_max_position_embeddings (12)
    "rope_longrope": ("mixtral_tiny", _rope("longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                                            original_max_position_embeddings=12)),
    "head_dim_24": ("qwen3_moe_tiny", {"head_dim": 24}),
}


def _build(preset, overrides, seed=0):
    """HF initialises linear biases to zero, which would hide a dropped bias: give every bias random values."""
    b = build_model(preset, dtype="fp32", device="cpu", seed=seed, config_overrides=overrides)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in b.model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return b


def _prompts(n=3):
    return torch.randint(0, 512, (n, S), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case", list(BOTH) + list(HF_ONLY))
def test_hf_modules_match_hf_generate(case):
    preset, ov = {**BOTH, **HF_ONLY}[case]
    b = _build(preset, ov)
    prompts = _prompts()
    hf = b.model.generate(prompts, max_new_tokens=NEW, do_sample=False, pad_token_id=0)[:, S:]
    attach(b.model, make_dispatcher("dropless"), max_rows=4)
    try:
        eng = DecodeEngine(b.model, L, 4)
        assert torch.equal(eng.generate(prompts, NEW, timing=False).tokens, hf)
        assert torch.equal(eng.generate(prompts[:2], NEW, timing=False).tokens, hf[:2])
    finally:
        detach(b.model)


@pytest.mark.parametrize("case", list(BOTH))
def test_fused_step_agrees_with_hf_modules(case):
    preset, ov = BOTH[case]
    b = _build(preset, ov)
    prompts = _prompts()
    attach(b.model, make_dispatcher("dropless"), max_rows=4)
    try:
        eng = DecodeEngine(b.model, L, 4)
        want = eng.generate(prompts, NEW, keep_logits=True, timing=False)
        cap = Capture(eng, "full", buckets=[1, 2, 4], backend="emulate", kernels="fused",
                      kernel_backend="torch").apply()
        got = eng.generate(prompts, NEW, keep_logits=True, timing=False, force_tokens=want.tokens)
        cap.unwrap()
    finally:
        detach(b.model)
    assert float((got.tokens == want.tokens).float().mean()) >= 0.99
    assert max(float((x - y).abs().max()) for x, y in zip(got.logits, want.logits)) < 1e-3


def test_tied_and_dense_variants_are_what_they_say():
    tied = _build("qwen3_moe_tiny_tied", {}).model
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    dense = _build("qwen3_moe_tiny_dense", {})
    assert [i for i, _ in dense.adapter.moe_layers(dense.model)] == [1]


def test_engine_asks_for_no_router_logits(monkeypatch):
    """output_router_logits=True in the config: HF would compute the aux loss every step; the engine opts out."""
    b = _build("mixtral_tiny", {"output_router_logits": True})
    calls = []
    real = modeling_mixtral.load_balancing_loss_func
    monkeypatch.setattr(modeling_mixtral, "load_balancing_loss_func", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        b.model(_prompts(1))
    assert calls  # the config really asks for it
    calls.clear()
    attach(b.model, make_dispatcher("dropless"), max_rows=2)
    try:
        DecodeEngine(b.model, L, 2).generate(_prompts(2), 4, timing=False)
    finally:
        detach(b.model)
    assert not calls


# -- refusals: before any work, the field and the fix named --------------------------------------------------------
def _config(preset, **ov):
    return make_config(preset, overrides=ov)


REFUSED = [  # (config, kernels, step_graph, field named)
    (lambda: _config("mixtral_tiny", per_layer_config={1: {"sliding_window": 4}}), "hf", False, "per_layer_config"),
    (lambda: _config("qwen3_moe_tiny", is_causal=False), "hf", False, "is_causal"),
    (lambda: _config("mixtral_tiny", sliding_window=0), "hf", False, "sliding_window"),
    (lambda: _config("qwen3_moe_tiny", use_sliding_window=True, sliding_window=0), "hf", False, "sliding_window"),
    # Qwen2-MoE: sliding layer_types while use_sliding_window=False (sliding_window becomes 0: every key masked)
    (lambda: _config("qwen2_moe_tiny", layer_types=["sliding_attention", "full_attention", "full_attention"]),
     "hf", False, "sliding_window"),
    (lambda: _config("qwen2_moe_tiny", use_sliding_window=True, sliding_window=None, max_window_layers=2),
     "hf", False, "sliding_window"),
    (lambda: _config("qwen3_moe_tiny", **_rope("dynamic", factor=2.0)), "hf", True, "rope_parameters"),
    (lambda: _config("mixtral_tiny", hidden_act="gelu"), "fused", False, "hidden_act"),
    (lambda: _config("qwen3_moe_tiny", **_rope("dynamic", factor=2.0)), "fused", False, "rope_parameters"),
    (lambda: _config("mixtral_tiny", **_rope("longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                                             original_max_position_embeddings=12)), "fused", False, "rope_parameters"),
    (lambda: _config("qwen3_moe_tiny", head_dim=24), "fused", False, "head_dim"),
]


@pytest.mark.parametrize("i", range(len(REFUSED)))
def test_refusals_name_the_field(i):
    make, kernels, step_graph, field = REFUSED[i]
    cfg = make()
    with pytest.raises(UnsupportedConfigError, match=rf"\.{field}: .*; "):
        adapter_for(cfg).check_supported(cfg, kernels, step_graph=step_graph)
    if kernels == "fused":  # the HF-module path runs it
        adapter_for(cfg).check_supported(cfg, "hf")


def test_qwen2_layer_types_must_be_known():
    cfg = _config("qwen2_moe_tiny")
    cfg.layer_types = ["chunked_attention", "full_attention", "full_attention"]
    with pytest.raises(UnsupportedConfigError, match=r"\.layer_types: "):
        adapter_for(cfg).check_supported(cfg, "hf")


def test_refused_before_any_work():
    """DecodeEngine refuses before allocating its cache; Capture(kernels=fused) / FastDecode before touching weights."""
    b = _build("mixtral_tiny", {})
    b.model.config.sliding_window = 0
    with pytest.raises(UnsupportedConfigError, match="sliding_window"):
        DecodeEngine(b.model, L, 2)
    b.model.config.sliding_window = None
    b.model.config.hidden_act = "gelu"
    eng = DecodeEngine(b.model, L, 2)
    attach(b.model, make_dispatcher("dropless"), max_rows=2)
    q = b.model.model.layers[0].self_attn.q_proj.weight
    ptr = q.data_ptr()
    try:
        with pytest.raises(FastPathError, match=r"hidden_act.*use capture.kernels=hf"):
            Capture(eng, "full", backend="emulate", kernels="fused", kernel_backend="torch")
    finally:
        detach(b.model)
    assert q.data_ptr() == ptr  # weights not yet moved into concatenated buffers
    experts = b.adapter.experts_of(b.model.model.layers[0])
    b.model.config.hidden_act = "silu"
    experts.has_bias = True
    with pytest.raises(FastPathError, match="experts with bias"):
        FastDecode(b.model, "torch")
    with pytest.raises(UnsupportedConfigError, match="capture.kernels"):
        b.adapter.check_supported(b.model.config, "bogus")


def test_fused_step_refuses_a_ring_buffer_cache():
    """HF's own StaticCache gives sliding layers a ring buffer; the fused step needs slot = position."""
    from transformers import StaticCache

    b = _build("mixtral_tiny_swa", {})
    fast = FastDecode(b.model, "torch")
    cache = StaticCache(config=b.model.config, max_cache_len=L)
    with torch.no_grad():
        b.model(_prompts(1), cache=cache, use_cache=True)
    with pytest.raises(FastPathError, match="linear KV cache"):
        fast(torch.zeros(1, 1, dtype=torch.long), cache)


def test_variant_presets_compose_as_model_options():
    from pathlib import Path

    import moecg
    import moecg.config  # noqa: F401  (registers the config groups: model=<preset> for every zoo preset)

    assert set(VARIANT_PRESETS) <= set(PRESETS)
    with initialize_config_dir(config_dir=str(Path(moecg.__file__).parent / "conf"), version_base="1.3"):
        for name in VARIANT_PRESETS:
            assert compose(config_name="config", overrides=[f"model={name}"]).model.preset == name
